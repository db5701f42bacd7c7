"""Which blocks of which cache group a vLLM prefix hit needs (pure logic, no vLLM import).

vLLM's hybrid KV cache manager keeps one block table per cache group, all indexed by
the same block positions (``block_size`` tokens each). After a hit at boundary ``b``
(``b * block_size`` computed tokens) each group's table holds real blocks only where
its manager needs them and the null block (id 0) elsewhere:

* full attention and MLA: every block ``[0, b)``;
* sliding window of ``w`` tokens: the blocks holding the ``w - 1`` tokens before the
  boundary, ``[b - ceil((w - 1) / block_size), b)``; earlier ones are skipped
  (``SlidingWindowManager.get_num_skipped_tokens`` in ``vllm/v1/core/
  single_type_kv_cache_manager.py``);
* Mamba / gated delta net / KDA state in ``align`` mode: only block ``b - 1``, which
  holds the recurrent state after exactly ``b`` blocks of tokens
  (``MambaManager.get_num_skipped_tokens``: all but the last computed token's state).

So a hit at ``b`` is restorable from kvpool when, beyond the engine's local hit at
``start`` blocks, every group has what its rule needs; :func:`find_hit` returns the
largest such ``b`` (the common boundary, DESIGN.md §9) and :func:`needed` the block
positions to load per group. A state slot at ``b`` is keyed by the chained hash of
block ``b - 1`` (which names the whole prefix) plus ``@<tokens>``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

PAGED = ("full_attention", "mla")
WINDOWED = "sliding_window"
STATE = "mamba"
RULE_KINDS = (*PAGED, WINDOWED, STATE)
NULL_BLOCK = 0  # vLLM's BlockPool hands out block 0 as the shared null block


@dataclass(frozen=True)
class GroupRule:
    """How one cache group is restored: ``kind`` in RULE_KINDS and, for sliding window,
    ``window_blocks``: how many blocks before a boundary the window reaches."""

    kind: str
    window_blocks: int = 0

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"group rule kind {self.kind!r}; accepted: {', '.join(RULE_KINDS)}")
        if self.kind == WINDOWED and self.window_blocks <= 0:
            raise ValueError("a sliding-window rule needs window_blocks > 0")

    @property
    def is_state(self) -> bool:
        return self.kind == STATE


def window_blocks(sliding_window_tokens: int, block_size: int) -> int:
    """Blocks a sliding window of ``sliding_window_tokens`` needs before a boundary:
    ``ceil((w - 1) / block_size)``, at least 1 (vLLM's
    ``SlidingWindowManager._contiguous_blocks_for_hit`` without the EAGLE block)."""
    return max(1, -(-(int(sliding_window_tokens) - 1) // int(block_size)))


def needed(rule: GroupRule, start: int, boundary: int) -> list[int]:
    """Block positions of one group to load for a hit at ``boundary`` blocks when the
    engine already holds ``start`` blocks locally. For a state group the one position is
    ``boundary - 1``: the slot holding the state after ``boundary`` blocks."""
    if boundary <= start:
        return []
    if rule.kind in PAGED:
        return list(range(start, boundary))
    if rule.kind == WINDOWED:
        return list(range(max(start, boundary - rule.window_blocks), boundary))
    return [boundary - 1]


def find_hit(rules: Sequence[GroupRule], have: Sequence[Callable[[int], bool]], start: int,
             max_boundary: int) -> int:
    """The largest boundary ``b`` in ``(start, max_boundary]`` at which every group can be
    restored, or ``start`` when there is none.

    ``have[g](i)``: whether group ``g``'s block (or, for a state group, state slot) at
    position ``i`` is stored. The boundary is never past ``max_boundary``, which the caller
    sets to ``(num_tokens - 1) // block_size``: vLLM computes at least one token itself, and
    a recurrent state restored past it would be applied twice.
    """
    top = max_boundary
    for rule, has in zip(rules, have, strict=True):
        if rule.kind in PAGED:  # contiguous run from start caps every candidate
            run = start
            while run < top and has(run):
                run += 1
            top = run
    for b in range(top, start, -1):
        if all(all(has(i) for i in needed(rule, start, b)) for rule, has in zip(rules, have, strict=True)):
            return b
    return start

