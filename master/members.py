"""The master's records of its store nodes (pure data, no I/O): :class:`Node`, one per
registered node incarnation (its descriptor, allocator, LRU lists and generation
counter), and :class:`DiskTier`, a node's disk tier as the master tracks it
(master/tiers.py decides its demotions and promotions). Every part of the master state
(master/state.py, lru.py, eviction.py, placement.py, repair.py, reservations.py, tiers.py)
reads them from here, so none imports the state back."""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from kvpool.master.allocator import RangeAllocator
from kvpool.protocol.messages import NodeDesc


@dataclass(eq=False, slots=True)
class DiskTier:
    """The master's record of one node's disk tier: bytes (payload), watermarks
    (fractions of ``capacity``), LRU lists of its disk-resident objects and the tier moves
    in flight; counters of what it did."""

    capacity: int
    high: float
    low: float
    used: int = 0  # bytes of indexed files (retired ones included until deleted)
    lru: OrderedDict = field(default_factory=OrderedDict)
    soft_lru: OrderedDict = field(default_factory=OrderedDict)
    demoting: int = 0  # bytes of demotions in flight
    jobs: int = 0  # demotions in flight
    promoting: int = 0  # promotions in flight
    paused_until: float = 0.0  # a demotion failed: evict instead until then (monotonic)
    retire: list = field(default_factory=list)  # (lease ends, disk id, size): promoted files kept for readers
    gone: set[str] | None = field(default_factory=set)  # keys dropped while an earlier incarnation was away
    demotions: int = 0
    demotion_s: float = 0.0
    promotions: int = 0
    promotion_s: float = 0.0

    def keys(self) -> list[str]:
        return [*self.lru, *self.soft_lru]


@dataclass(eq=False, slots=True)
class Node:
    desc: NodeDesc
    alloc: RangeAllocator
    # every key with a replica here is in exactly one of: lru (plain), soft_lru (soft-pinned)
    # or fixed (pending, held, hard-pinned, or between two LRU moves); see all_keys()
    lru: OrderedDict = field(default_factory=OrderedDict)
    soft_lru: OrderedDict = field(default_factory=OrderedDict)
    fixed: set[str] = field(default_factory=set)
    quarantine: list[tuple[float, int, int]] = field(default_factory=list)
    draining: bool = False
    suspect_until: float = 0.0
    reserved: int = 0  # bytes of extents reserved ahead of need here (master/reservations.py)
    next_gen: itertools.count = field(default_factory=lambda: itertools.count(1))
    # keys removed or evicted while this incarnation was away (see MasterState.departed):
    # its rows for them are stale and are not indexed again when it comes back
    gone: set[str] | None = field(default_factory=set)  # None: too much changed, index nothing
    disk: DiskTier | None = None  # its disk tier, if it has one (master/tiers.py)

    @property
    def node_id(self) -> str:
        return self.desc.node_id

    def all_keys(self) -> list[str]:
        """Every key with a replica (pending or committed, in memory or on disk) on this node."""
        if self.disk is not None:
            return [*self.lru, *self.soft_lru, *self.fixed, *self.disk.keys()]
        return [*self.lru, *self.soft_lru, *self.fixed]

    def lru_lists(self) -> tuple[OrderedDict, ...]:
        """Its LRU lists, plain then soft-pinned: memory's, then its disk tier's if it has one."""
        d = self.disk
        return (self.lru, self.soft_lru) if d is None else (self.lru, self.soft_lru, d.lru, d.soft_lru)

    def drop_key(self, key: str) -> None:
        """``key`` has no replica here any more."""
        for lru in self.lru_lists():
            lru.pop(key, None)
        self.fixed.discard(key)

    def release_quarantine(self, now: float) -> None:
        """Give back to the allocator the quarantined ranges whose time (monotonic seconds)
        has come."""
        if self.quarantine and self.quarantine[0][0] <= now:
            keep = []
            for until, off, size in self.quarantine:
                if until <= now:
                    self.alloc.free(off, size)
                else:
                    keep.append((until, off, size))
            self.quarantine = keep

    def usage(self) -> float:
        return self.alloc.used / self.alloc.capacity if self.alloc.capacity else 1.0
