"""What the kvpool vLLM connector counts per request, on the scheduler's side.

A lookup is counted once per request when its answer is taken: ``lookups``,
``miss_tokens`` (tokens looked up that kvpool does not hold), for models with state
groups ``state_lookups`` and, per state group, whether the group held a checkpoint the
lookup could restore (``group/<g>/state_lookups``, ``group/<g>/state_hits``: the group
with the lowest rate is the one that limits hits).

Hits are counted when the load is *reported*, never at the lookup: ``hit_tokens`` (and
per group ``group/<g>/hit_tokens``) are the tokens that landed; ``recomputed_tokens``
those kvpool held but whose load failed, which vLLM computes itself; ``state_hits`` the
loads that restored a recurrent state. The load's report says how many of its blocks
failed (:class:`~connector.vllm.meta.KVPoolWorkerMetadata`); with one cache group vLLM
recomputes from the first failed block, with several the whole load
(:func:`loaded_tokens`). The same correction goes into vLLM's own per-request prefill
stats (``RequestOutput.num_cached_tokens``, the OpenAI usage's cached tokens and
``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``), which vLLM fills in
when it admits the request, before any load.

``partial_tail_tokens``: for every request whose prompt this engine computed, the tokens
past its last full block (kvpool stores full blocks only: the next engine recomputes
them).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvpool.connector.vllm.meta import GroupLayout, KVPoolConnectorStats, loaded_tokens
from kvpool.connector.vllm.plan import needed

log = logging.getLogger("kvpool.vllm")


@dataclass
class LoadOut:
    """A load sent to the workers: blocks ``[start, boundary)`` of the prompt, ``tokens``
    external tokens vLLM was told about."""

    start: int
    boundary: int
    tokens: int


class LoadAccounting:
    """The scheduler's counters of lookups and loads (see the module docstring);
    scheduler thread only."""

    def __init__(self, groups: list[GroupLayout], block_size: int) -> None:
        self.groups = groups
        self.block_size = block_size
        self.has_state = any(g.is_state for g in groups)
        self.multi_group = len(groups) > 1
        self.out: dict[str, LoadOut] = {}  # loads sent whose report has not come back

    def lookup(self, stats: KVPoolConnectorStats, hit_blocks: int, miss_tokens: int,
               state_found: dict[int, bool]) -> None:
        """One request's lookup answer: ``hit_blocks`` found, ``miss_tokens`` not held;
        ``state_found``: per state group id, whether it held a usable checkpoint."""
        stats.add("lookups")
        stats.add("miss_tokens", max(0, miss_tokens))
        if self.has_state:
            stats.add("state_lookups")
            for gid, found in state_found.items():
                stats.add_group(gid, "state_lookups", 1)
                stats.add_group(gid, "state_hits", int(found))

    def sent(self, req_id: str, start: int, boundary: int, tokens: int) -> None:
        """A load of blocks ``[start, boundary)`` (``tokens`` tokens) went to the workers."""
        self.out[req_id] = LoadOut(start, boundary, tokens)

    def reported(self, stats: KVPoolConnectorStats, req_id: str, n_failed: int, request: Any | None) -> None:
        """The workers' report of ``req_id``'s load: ``n_failed`` blocks did not load.
        ``request``: vLLM's Request, whose prefill stats are corrected (None: gone)."""
        out = self.out.pop(req_id, None)
        if out is None:
            return
        bs = self.block_size
        got = loaded_tokens(out.tokens, n_failed, bs, self.multi_group)
        stats.add("hit_tokens", got)
        stats.add("recomputed_tokens", out.tokens - got)
        end = out.start + got // bs
        for g in self.groups:
            stats.add_group(g.group_id, "hit_tokens", len(needed(g.rule, out.start, end)) * bs)
        if self.has_state and got:
            stats.add("state_hits")
        if got < out.tokens and request is not None:
            _uncount(request, out.tokens - got)

    def forget(self, req_id: str) -> None:
        """``req_id`` will get no report (its load was never sent)."""
        self.out.pop(req_id, None)

    def finished(self, stats: KVPoolConnectorStats, num_prompt_tokens: int) -> None:
        """A request whose prompt this engine computed ended: its partial tail."""
        stats.observe("partial_tail_tokens", num_prompt_tokens % self.block_size)


def _uncount(request: Any, tokens: int) -> None:
    """Take ``tokens`` external tokens that were recomputed out of vLLM's prefill stats of
    ``request`` (filled in at admission; read when the request's first token is out)."""
    ps = getattr(request, "prefill_stats", None)
    if ps is None or not hasattr(ps, "set"):
        return
    ext = max(0, int(ps.num_external_cached_tokens) - tokens)
    ps.set(num_prompt_tokens=ps.num_prompt_tokens, num_local_cached_tokens=ps.num_local_cached_tokens,
           num_external_cached_tokens=ext)
