"""When a leading master must stop acknowledging (DESIGN.md §8, Fencing). Pure logic on
the master's monotonic clock; the server asks it before every change it would acknowledge.

Why lease timing is safe: :class:`~protocol.etcd.LeaseClock` ``renewed_at`` is when the
last *successful* lease refresh was sent, so etcd cannot expire the leadership lease
before ``renewed_at + ttl`` (it restarts the TTL when it receives the refresh, which is
later; an etcd leader change only extends leases). A standby can create the ``leader`` key
only after that expiry, and then still reads etcd and asks every store node for its table
(which also tells the node the new term) before it answers anyone. A leader stops at
``renewed_at + FRACTION × ttl``, so two leaders never acknowledge at once, and whatever was
acknowledged here is in the nodes' tables when the standby reads them: the margin,
``(1 - FRACTION) × ttl`` (1.5 s at the default 3 s node_ttl), covers commit notices in
flight and a request being answered as the fence closes. Clock *rate* differences between
hosts are far below it (clock steps do not matter: only monotonic durations are compared).
A longer stall of the leader process itself (a pause past the margin between the check
and the send) is what terms are for: store nodes refuse a term's notices and grants once
they know a newer one (:mod:`protocol.terms`). The refresher renews every TTL/4 and
retries 0.1 s after a failure, so one lost refresh does not fence a healthy leader.
"""
from __future__ import annotations

import logging

from kvpool.protocol.etcd import LeaseClock

log = logging.getLogger("kvpool.master")

FRACTION = 0.5
"""A leader acknowledges no change once its lease is older than this fraction of its TTL."""


class Fence:
    """One master's fence. ``clock``: the leadership lease's renewals (replaced per
    campaign); ``deposed``: a store node refused this term (a newer leader exists), which
    fences until the next leadership."""

    def __init__(self) -> None:
        self.clock = LeaseClock()
        self.term = 0
        self.deposed = False
        self._was = False  # fenced at the last check (for logging the changes)

    def lead(self, term: int, clock: LeaseClock) -> None:
        """A new leadership of ``term`` whose lease ``clock`` keeps."""
        self.term, self.clock, self.deposed, self._was = term, clock, False, False

    def fenced(self, now: float | None = None) -> bool:
        """True while no change may be acknowledged: deposed, or the lease was last renewed
        more than ``FRACTION`` × its TTL seconds before ``now`` (monotonic seconds)."""
        return self.deposed or self.clock.age(now) > self.clock.ttl_s * FRACTION

    def check(self, now: float) -> bool:
        """:meth:`fenced`, logging each change between fenced and not."""
        f = self.fenced(now)
        if f != self._was:
            self._was = f
            if f:
                log.warning("master: leadership lease not renewed for %.2fs (TTL %gs)%s: acknowledging no change "
                            "until it is renewed or a new leader is elected", self.clock.age(now), self.clock.ttl_s,
                            "; a store node saw a newer term" if self.deposed else "")
            else:
                log.warning("master: leadership lease renewed; acknowledging again (term %d)", self.term)
        return f
