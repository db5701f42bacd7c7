"""Hand-off holds of the master state (DESIGN.md §7): records, holds, ack/release/expiry.

:class:`Handoffs` is a part owned by :class:`master.state.MasterState` (its ``hand``),
built with the index and the helpers it acts through; it does no I/O. A hold lasts the
record's ``ttl_s`` seconds, counted on the master's monotonic clock (every ``now`` here)
from its publish, or from the rebuild that restored it.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.protocol import errors as E
from kvpool.protocol.messages import HandoffRecord

# upper bounds (seconds) of the hold-time histogram (kvpool_handoff_hold_seconds; +Inf added):
# a consumer acks within its first step, an unused hold lasts until the deadline (60 s by default)
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class Handoff:
    record: HandoffRecord
    deadline: float  # when the hold ends, on this master's monotonic clock (seconds)
    status: str = "open"  # open | acked | released | expired
    held_since: float = 0.0  # when this master started the hold (publish or rebuild), monotonic seconds


class Handoffs:
    """Publish, claim, ack/release and deadline expiry of hand-off records. ``objects``: the
    index (key -> Obj); ``waiting_holds``: holds of keys away with a store node (key ->
    request ids); ``counters``: the state's counters; ``lru_add`` / ``lru_remove``: put an
    object on, or take it off, its eviction lists (a held object is never evicted);
    ``maybe_repair(obj)``: queue re-replication if it lacks replicas; ``max_ttl()``: the
    cluster's ``max_handoff_ttl`` (seconds); ``clock()``: the time of the state's latest
    event (monotonic seconds)."""

    def __init__(self, objects: dict, waiting_holds: dict[str, set[str]], counters: dict[str, int],
                 lru_add: Callable, lru_remove: Callable, maybe_repair: Callable,
                 max_ttl: Callable[[], float], clock: Callable[[], float]) -> None:
        self.records: dict[str, Handoff] = {}  # request id -> its record and hold
        self.objects, self.waiting_holds, self.counters = objects, waiting_holds, counters
        self._lru_add, self._lru_remove, self._maybe_repair = lru_add, lru_remove, maybe_repair
        self._max_ttl, self._clock = max_ttl, clock
        self._holds: dict[str, tuple[list[int], list[float]]] = {}  # outcome -> (bucket counts, [sum])

    def publish(self, rec: HandoffRecord, now: float) -> HandoffRecord:
        """Hold every object of ``rec`` until ack/release or ``rec.ttl_s`` seconds after
        ``now`` (monotonic). Idempotent by request id: a repeat while the record is open
        returns it and leaves its deadline as it is. Raises InvalidRequest for a ttl that is
        not finite, not > 0 or above the cluster's max_handoff_ttl, NotFound naming missing
        keys (nothing is held then)."""
        h = self.records.get(rec.request_id)
        if h is not None and h.status == "open":
            return h.record
        longest = self._max_ttl()  # cluster setting: how long a producer may hold blocks
        if not (math.isfinite(rec.ttl_s) and 0 < rec.ttl_s <= longest):
            raise E.InvalidRequest(f"hand-off {rec.request_id!r}: ttl must be finite, > 0 and at most "
                                   f"{longest:g}s, the cluster's max_handoff_ttl (got {rec.ttl_s:g}s)")
        missing = [k for ks in rec.keys.values() for k in ks if k not in self.objects]
        if missing:
            raise E.NotFound(f"hand-off {rec.request_id!r}: {len(missing)} block(s) are not stored "
                             f"(first: {missing[0]!r}); put them before publishing",
                             request_id=rec.request_id, missing=missing[:16])
        self.records[rec.request_id] = Handoff(rec, now + rec.ttl_s, held_since=now)
        for ks in rec.keys.values():
            for k in ks:
                obj = self.objects[k]
                self._lru_remove(obj)
                obj.add_holds([rec.request_id])
                self._maybe_repair(obj)
        self.counters["handoffs_published"] += 1
        return rec

    def claim(self, request_id: str, now: float) -> HandoffRecord:
        """The open record of ``request_id`` at ``now`` (monotonic). Raises HandoffNotFound
        (none, or already acked/released) or HandoffExpired (its hold ended)."""
        h = self.records.get(request_id)
        if h is None:
            raise E.HandoffNotFound(f"no hand-off record for request {request_id!r}; was it published "
                                    "to this cluster?", request_id=request_id)
        if h.status == "expired" or (h.status == "open" and h.deadline <= now):
            raise E.HandoffExpired(f"hand-off {request_id!r} passed its deadline; its blocks are plain "
                                   "cache entries now and may be evicted", request_id=request_id)
        if h.status != "open":
            raise E.HandoffNotFound(f"hand-off {request_id!r} was already {h.status}", request_id=request_id)
        return h.record

    def finish(self, request_id: str, status: str, now: float | None = None) -> bool:
        """Ack or release (idempotent) at ``now`` (monotonic; default: the latest event's
        time). Returns True when a live record was closed now."""
        h = self.records.get(request_id)
        if h is None or h.status != "open":
            return False
        self.release(h, status, now)
        return True

    def hold_histogram(self) -> dict[str, tuple[list[int], float]]:
        """Hold times of the hand-offs closed so far, by outcome (acked, released,
        expired): per-bucket counts (HOLD_BUCKETS, then +Inf) and their sum in seconds."""
        return {k: (list(c), t[0]) for k, (c, t) in self._holds.items()}

    def _observe_hold(self, status: str, seconds: float) -> None:
        holds = self._holds
        h = holds.get(status)
        if h is None:
            h = holds[status] = ([0] * (len(HOLD_BUCKETS) + 1), [0.0])
        h[0][bisect_left(HOLD_BUCKETS, seconds)] += 1
        h[1][0] += seconds

    def release(self, h: Handoff, status: str, now: float | None = None) -> None:
        """End hold ``h`` with ``status`` (acked, released, expired) at ``now`` (default: the
        latest event's time)."""
        self._observe_hold(status, max(0.0, (self._clock() if now is None else now) - h.held_since))
        h.status = status
        rid = h.record.request_id
        for ks in h.record.keys.values():
            for k in ks:
                obj = self.objects.get(k)
                if obj is not None and rid in obj.holds:
                    obj.discard_hold(rid)
                    self._lru_add(obj)
                waiting = self.waiting_holds.get(k)
                if waiting is not None:
                    waiting.discard(rid)
                    if not waiting:
                        del self.waiting_holds[k]
        self.counters[f"handoffs_{status}"] += 1

    def restore(self, rec: HandoffRecord, now: float) -> None:
        """Rebuild after failover from the durable etcd record: hold for the full
        ``rec.ttl_s`` from ``now`` (monotonic). How much of the hold passed before the
        failover is unknown here, and a hold is never shortened, so it may outlive its ttl
        by up to one ttl."""
        self.records[rec.request_id] = Handoff(rec, now + rec.ttl_s, held_since=now)
        for ks in rec.keys.values():
            for k in ks:
                obj = self.objects.get(k)
                if obj is not None:
                    self._lru_remove(obj)
                    obj.add_holds([rec.request_id])
                else:  # on a node not joined yet: held once its extent comes back
                    self.waiting_holds.setdefault(k, set()).add(rec.request_id)
