"""Reliable prefill→decode hand-off (DESIGN.md §7) on top of :class:`KVPoolClient`.

Producer: :meth:`HandoffProducer.publish` writes (or finds already stored) every block of
every transfer group, then creates the durable hand-off record; from then on the store,
not the producer, keeps the KV alive (objects are *held* until ack, release or the
deadline). It returns the transfer params the router passes to the consumer.

Consumer: :meth:`HandoffConsumer.claim` finds the record (waiting up to a deadline for a
producer that has not published yet), :meth:`~HandoffConsumer.load` reads the blocks it
lacks — matched by position from the *tail* when it already holds the first ``k`` — and
:meth:`~HandoffConsumer.ack` / :meth:`~HandoffConsumer.release` end the hold. Every wait
has a deadline and raises a typed error.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.protocol.errors import HandoffLoadFailed, HandoffNotFound, InvalidRequest, Timeout
from kvpool.protocol.layout import LayoutSpec
from kvpool.protocol.messages import HandoffRecord

POLICIES = ("fail", "recompute")


@dataclass
class LoadResult:
    """Per group: block positions (in the record's order) loaded and failed."""

    loaded: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    bytes_loaded: int = 0


class HandoffProducer:
    def __init__(self, client, ttl_s: float = 60.0) -> None:
        self.client = client
        self.ttl_s = ttl_s

    def publish(self, request_id: str, groups: dict[str, tuple[LayoutSpec, Sequence[str], Sequence[Any]]],
                num_tokens: int = 0, extra: dict | None = None) -> dict:
        """Store every group's blocks (``groups[gid] = (layout, keys, blocks)``) and publish the
        record. Returns transfer params ``{request_id, keys, layouts, num_tokens}`` (plain
        data for the router). Raises the first put error (nothing is held then)."""
        for gid, (layout, keys, blocks) in groups.items():
            if len(keys) != len(blocks):
                raise InvalidRequest(f"group {gid}: {len(keys)} keys but {len(blocks)} blocks")
            for key, err in zip(keys, self.client.put_batch(list(keys), list(blocks), layout)):
                if err is not None:
                    raise err
        rec = self.client.handoff_publish(request_id, {g: list(v[1]) for g, v in groups.items()},
                                          {g: v[0] for g, v in groups.items()}, self.ttl_s, num_tokens, extra)
        return {"request_id": rec.request_id, "keys": rec.keys, "num_tokens": rec.num_tokens,
                "layouts": {g: lay.fingerprint() for g, lay in rec.layouts.items()}}


class HandoffConsumer:
    """``policy``: "fail" raises HandoffLoadFailed naming the failed keys; "recompute"
    returns them so the engine recomputes only those tokens."""

    def __init__(self, client, policy: str = "fail", timeout_s: float = 30.0) -> None:
        if policy not in POLICIES:
            raise InvalidRequest(f"load failure policy {policy!r}; accepted: fail, recompute")
        self.client = client
        self.policy = policy
        self.timeout_s = timeout_s

    def claim(self, request_id: str, wait_s: float = 0.0) -> HandoffRecord:
        """The record; waits up to ``wait_s`` seconds for it to be published. Raises
        HandoffNotFound, HandoffExpired, or Timeout."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.client.handoff_claim(request_id)
            except HandoffNotFound:
                if time.monotonic() >= deadline:
                    if wait_s:
                        raise Timeout(f"hand-off {request_id!r} was not published within {wait_s:g}s; is the "
                                      "producer alive and pointed at this cluster?", request_id=request_id) from None
                    raise
                time.sleep(0.02)

    def load(self, record: HandoffRecord, group: str, outs: Sequence[Any], local_blocks: int = 0,
             layout: LayoutSpec | None = None) -> LoadResult:
        """Read blocks ``local_blocks..n-1`` of ``group`` into ``outs`` (len n - local_blocks),
        checking ``layout`` (default: the record's). Positions in the result are indices into
        the record's key list."""
        keys = record.keys.get(group)
        if keys is None:
            raise InvalidRequest(f"hand-off {record.request_id!r} has no group {group!r}; groups: "
                                 f"{', '.join(record.keys)}")
        want = keys[local_blocks:]
        if len(outs) != len(want):
            raise InvalidRequest(f"group {group}: {len(want)} blocks to load after {local_blocks} local ones, "
                                 f"got {len(outs)} buffers")
        lay = layout or record.layouts.get(group)
        res = LoadResult()
        for pos, r in zip(range(local_blocks, len(keys)), self.client.get_into_batch(want, list(outs), lay)):
            if isinstance(r, int):
                res.loaded.append(pos)
                res.bytes_loaded += r
            else:
                res.failed.append(pos)
        if res.failed and self.policy == "fail":
            failed = [keys[p] for p in res.failed]
            raise HandoffLoadFailed(f"request {record.request_id!r}: {len(failed)} of {len(want)} blocks of group "
                                    f"{group} could not be loaded (first {failed[0]!r}); rerun the prefill or use "
                                    "policy 'recompute'", request_id=record.request_id, failed=failed[:16])
        return res

    def ack(self, request_id: str) -> None:
        self.client.handoff_ack(request_id)

    def release(self, request_id: str) -> None:
        self.client.handoff_release(request_id)


