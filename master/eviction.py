"""Eviction of the master state (DESIGN.md §6): per-node LRU lists, the watermark rule
and admin eviction by key, prefix, model, node, age or all.

A mixin of :class:`master.state.MasterState`; it uses the state's index and ``_drop`` and
does no I/O. LRU order: each node keeps two lists, plain objects and soft-pinned ones
(evicted last); held, hard-pinned and pending objects are on neither. A node with a disk
tier keeps two more for its disk-resident objects, and its memory watermark demotes
instead of evicting (:mod:`master.tiers`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.protocol import errors as E
from kvpool.protocol.messages import EvictReport, EvictSelector

if TYPE_CHECKING:
    from kvpool.master.members import Node
    from kvpool.master.objects import Obj


_LISTS = ("lru", "soft_lru")
_LISTS_TIERED = ("disk.lru", "lru", "disk.soft_lru", "soft_lru")  # disk objects are the colder ones
_NONE: dict = {}


def _lru_of(node: Node, attr: str):
    """The LRU list ``attr`` of ``node`` ("disk.<list>": of its disk tier; an empty dict
    for a node without one)."""
    if attr.startswith("disk."):
        return getattr(node.disk, attr[5:]) if node.disk is not None else _NONE
    return getattr(node, attr)


class EvictionMixin:
    """LRU bookkeeping, watermark eviction and admin eviction."""

    def _skip_reason(self, obj: Obj, now: float) -> str:
        if obj.holds:
            return "held"
        if obj.pin == "hard" or (obj.pin == "soft" and obj.pin_until > now):
            return "pinned"
        if obj.lease_until > now:
            return "leased"
        return ""

    def _lru_add(self, obj: Obj) -> None:
        """Put ``obj`` at the hot end of its LRU list on each of its nodes (or, when it is
        never evicted, in their ``fixed`` sets)."""
        if self.disk_nodes:
            self._lru_add_tiered(obj)
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

    def _lru_remove(self, obj: Obj) -> None:
        """Take ``obj`` off its nodes' LRU lists (into their ``fixed`` sets)."""
        if self.disk_nodes:
            self._lru_remove_tiered(obj)
            return
        key = obj.key
        for nid in obj.node_ids():
            node = self.nodes.get(nid)
            if node is not None and (node.lru.pop(key, 0) is None or node.soft_lru.pop(key, 0) is None):
                node.fixed.add(key)

    def enforce_watermarks(self, now: float) -> int:
        """Evict LRU objects on every node above the high watermark down to the low one."""
        n = 0
        for node in list(self.nodes.values()):
            if node.usage() > self.s.high_watermark:
                n += self._evict_node(node, target_used=int(self.s.low_watermark * node.alloc.capacity),
                                      need=0, now=now, reason="watermark")
        return n

    def _evict_node(self, node: Node, target_used: int | None, need: int, now: float, reason: str) -> int:
        """Evict from ``node`` until used <= target_used, or until a ``need``-byte range is free.
        The watermark of a node with a disk tier demotes instead (:mod:`master.tiers`)."""
        d = node.disk
        if d is not None and reason == "watermark" and target_used is not None and d.paused_until <= now:
            return self._demote_node(node, target_used, now)

        def done() -> bool:
            if target_used is not None:
                return node.alloc.used <= target_used
            return node.alloc.fits(need)

        return self._evict_lrus((node.lru, node.soft_lru), done, now, reason)

    def _evict_lrus(self, lrus, done: Callable[[], bool], now: float, reason: str) -> int:
        """Drop objects from the cold end of each LRU list of ``lrus`` in turn (plain, then
        soft-pinned) until ``done()``, skipping leased ones (they stay at the cold end for
        next time); returns how many went. Memory and disk tiers share it."""
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
                self._drop(obj, reason=reason)
                evicted += 1
            for key in reversed(skipped):
                lru[key] = None
                lru.move_to_end(key, last=False)
            if done():
                break
        return evicted

    def _evict_count(self, count: int, now: float) -> int:
        """Evict up to ``count`` objects to keep the index within ``max_objects``: the least
        recently used across nodes first (the oldest cold end of the nodes' plain LRU lists,
        then of their soft-pin lists), skipping leased objects as :meth:`_evict_node` does.
        Returns how many went. Cost per object: one look at each node's cold end."""
        evicted = 0
        for attr in (_LISTS_TIERED if self.disk_nodes else _LISTS):
            skipped: list[tuple[Node, list[str]]] = []
            while evicted < count:
                best = None
                for node in self.nodes.values():
                    lru, held = _lru_of(node, attr), []
                    while lru:
                        obj = self.objects.get(next(iter(lru)))
                        if obj is None or obj.lease_until > now:
                            held.append(lru.popitem(last=False)[0])
                            continue
                        if best is None or obj.last_access < best.last_access:
                            best = obj
                        break
                    if held:
                        skipped.append((node, held))
                if best is None:
                    break
                self._drop(best, reason="max_objects")
                evicted += 1
            for node, keys in skipped:  # leased objects stay, at the cold end, for next time
                lru = _lru_of(node, attr)
                for key in reversed(keys):
                    if key in self.objects and node.node_id in self.nodes and key not in lru:
                        lru[key] = None
                        lru.move_to_end(key, last=False)
            if evicted >= count:
                break
        return evicted

    def evict(self, sel: EvictSelector, dry_run: bool, force: bool, now: float) -> EvictReport:
        """Admin eviction; exactly one selector field must be set (InvalidRequest otherwise)."""
        chosen = [f for f in ("key", "prefix", "model", "node", "older_than_s") if getattr(sel, f) is not None]
        if sel.all:
            chosen.append("all")
        if len(chosen) != 1:
            raise E.InvalidRequest(
                "evict needs exactly one selector of --key, --prefix, --model, --node, --older-than, --all; "
                f"got {', '.join(chosen) or 'none'}")
        if sel.prefix == "":
            raise E.InvalidRequest("evict --prefix '' would select every object; use --all for that")
        if sel.node is not None and sel.node not in self.nodes:
            raise E.InvalidRequest(f"evict --node {sel.node!r}: no such live node; see `kvpool status`")
        if sel.key is not None:
            cands = [self.objects[sel.key]] if sel.key in self.objects else []
        else:
            def match(o: Obj) -> bool:
                if sel.all:
                    return True
                if sel.prefix is not None:
                    return o.key.startswith(sel.prefix)
                if sel.model is not None:
                    parts = o.key.split("/")
                    return len(parts) > 1 and parts[1] == sel.model
                if sel.node is not None:
                    return any(r.node_id == sel.node for r in o.replicas)
                return o.last_access < now - (sel.older_than_s or 0.0)
            cands = [o for o in self.objects.values() if match(o)]
        removed = rbytes = leased = pinned = held = 0
        keys: list[str] = []
        for o in cands:
            why = self._skip_reason(o, now)
            if why and not force:
                leased += why == "leased"
                pinned += why == "pinned"
                held += why == "held"
                continue
            removed += 1
            rbytes += o.size
            keys.append(o.key)
            if not dry_run:
                for rid in list(o.holds):
                    h = self.handoffs.get(rid)
                    if h is not None:
                        self.hand.release(h, "released")
                self._drop(o, reason="admin")
        return EvictReport(removed, rbytes, leased, pinned, held, dry_run, keys[:1000])
