"""Leader terms: what fences a deposed master (DESIGN.md §8, Fencing).

A **term** names one leadership: the etcd revision at which that master created the
``leader`` key (the key's ``create_revision``). etcd revisions only grow, so a later
election always has a larger term, and every process can read the current one from etcd
without trusting the leader.

Where a term travels:

* every master → store node notice (:class:`~protocol.messages.NodeCommit`, ``NodeFree``,
  ``NodeCopy``, ``NodeList``) carries the sender's term; a node that has seen a larger
  term refuses the notice with :class:`~protocol.errors.StaleTerm`;
* every write grant carries its term inside the allocation generation: a leader of term
  ``t`` grants generations from :func:`first_gen` ``(t)`` up, so :func:`gen_term` of a
  grant names the leadership that made it, under the node's grant token (a client cannot
  forge it). A node refuses a write, ``written`` or commit copy of a grant older than the
  term it knows, before any byte lands;
* every master reply carries the term (``Reply.term``, 0 from a standby or a process
  that has none); a client refuses an answer older than a term it has seen and looks
  the leader up again in etcd.

Generations keep their older meaning too (a larger one supersedes a smaller one at an
offset), since the term occupies the high bits.
"""
from __future__ import annotations

TERM_SHIFT = 32
"""Bits of a generation below its term: 2**32 grants per node per leadership."""


def first_gen(term: int) -> int:
    """The smallest generation a leader of ``term`` grants (1 for term 0: no term)."""
    return max(1, term << TERM_SHIFT)


def gen_term(gen: int) -> int:
    """The term of the leadership that granted generation ``gen`` (0 for a generation
    granted without a term)."""
    return gen >> TERM_SHIFT
