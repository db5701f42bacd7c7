"""The per-node LRU lists of the master state and the eviction walk along them (pure, no
I/O).

Each :class:`~master.members.Node` keeps two lists of the keys it holds in memory, plain
objects and soft-pinned ones (evicted last), and a node with a disk tier two more for its
disk-resident objects (:class:`~master.members.DiskTier`); held, hard-pinned and pending
objects are on none of them but in the node's ``fixed`` set. Lists are ``OrderedDict``
key -> None, coldest first, moved to the end on access, so choosing a victim is O(1)
amortised regardless of index size.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvpool.protocol.messages import DISK

if TYPE_CHECKING:
    from collections import OrderedDict

    from kvpool.master.members import Node
    from kvpool.master.objects import Obj


class Lru:
    """Keeps objects on their nodes' LRU lists and evicts from their cold ends. Given the
    node table ``nodes`` (node id -> Node), the index ``objects`` (key -> Obj) and
    ``drop(obj, reason)``, which forgets an evicted object (frees its replicas, tells the
    story). :attr:`disk_nodes` counts the nodes with a disk tier (the tiers part,
    :class:`master.tiers.Tiers`, keeps it): while it is 0 every method keeps to the memory
    lists."""

    def __init__(self, nodes: dict[str, Node], objects: dict[str, Obj],
                 drop: Callable[[Obj, str], None]) -> None:
        self.nodes, self.objects, self._drop = nodes, objects, drop
        self.disk_nodes = 0  # nodes with a disk tier: 0 keeps every method on the memory-only path

    def add(self, obj: Obj) -> None:
        """Put ``obj`` at the hot end of its LRU list on each of its nodes, in the tier each
        replica is in (or, when it is never evicted, in their ``fixed`` sets)."""
        if self.disk_nodes:
            self._add_tiered(obj)
            return
        kind, key = obj.evictable_kind(), obj.key
        for nid in obj.node_ids():
            node = self.nodes.get(nid)
            if node is None:
                continue
            node.lru.pop(key, None)
            node.soft_lru.pop(key, None)
            if kind == "":
                node.fixed.discard(key)
                node.lru[key] = None
            elif kind == "soft":
                node.fixed.discard(key)
                node.soft_lru[key] = None
            else:
                node.fixed.add(key)

    def _add_tiered(self, obj: Obj) -> None:
        kind, key = obj.evictable_kind(), obj.key
        for nid, tier in obj.tiers():
            node = self.nodes.get(nid)
            if node is None:
                continue
            node.drop_key(key)
            if kind == "none":
                node.fixed.add(key)
                continue
            d = node.disk
            home = d if tier == DISK and d is not None else node
            (home.soft_lru if kind == "soft" else home.lru)[key] = None

    def remove(self, obj: Obj) -> None:
        """Take ``obj`` off its nodes' LRU lists (into their ``fixed`` sets)."""
        key = obj.key
        if self.disk_nodes:
            for nid in obj.node_ids():
                node = self.nodes.get(nid)
                if node is None:
                    continue
                if any(lru.pop(key, 0) is None for lru in node.lru_lists()):  # it was in one of them
                    node.fixed.add(key)
            return
        for nid in obj.node_ids():
            node = self.nodes.get(nid)
            if node is not None and (node.lru.pop(key, 0) is None or node.soft_lru.pop(key, 0) is None):
                node.fixed.add(key)

    def touch(self, obj: Obj, now: float) -> None:
        """A read of ``obj`` at ``now`` (monotonic seconds): its last access, and the hot end
        of its memory lists (no disk tier anywhere: :attr:`disk_nodes` is 0)."""
        obj.last_access = now
        kind = obj.evictable_kind()
        if kind == "none":
            return
        for nid in obj.node_ids():
            node = self.nodes.get(nid)
            if node is not None:
                lru = node.soft_lru if kind == "soft" else node.lru
                if obj.key in lru:
                    lru.move_to_end(obj.key)

    def touch_tiered(self, obj: Obj, now: float) -> None:
        """:meth:`touch` with both tiers' lists."""
        obj.last_access = now
        key = obj.key
        for nid in obj.node_ids():
            node = self.nodes.get(nid)
            if node is None:
                continue
            for lru in node.lru_lists():
                if key in lru:
                    lru.move_to_end(key)
                    break

    def evict(self, lrus: Iterable[OrderedDict], done: Callable[[], bool], now: float, reason: str) -> int:
        """Drop objects from the cold end of each list of ``lrus`` in turn (plain, then
        soft-pinned) until ``done()``, skipping those leased at ``now`` (they stay at the
        cold end for next time); returns how many went. Memory and disk tiers share it."""
        evicted = 0
        for lru in lrus:
            skipped: list[str] = []
            while lru and not done():
                key, _ = lru.popitem(last=False)
                obj = self.objects.get(key)
                if obj is None:
                    continue
                if obj.lease_until > now:
                    skipped.append(key)
                    continue
                self._drop(obj, reason)
                evicted += 1
            for key in reversed(skipped):
                lru[key] = None
                lru.move_to_end(key, last=False)
            if done():
                break
        return evicted
