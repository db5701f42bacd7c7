"""Eviction of the master state (DESIGN.md §6): the watermark rule, the ``max_objects``
bound and admin eviction by key, prefix, model, node, age or all.

:class:`Eviction` is a part owned by :class:`master.state.MasterState` (its ``eviction``);
it does no I/O. It evicts along the nodes' LRU lists (:mod:`master.lru`): plain objects
first, soft-pinned ones last; held, hard-pinned and pending objects are on neither. A node
with a disk tier keeps two more lists for its disk-resident objects, and its memory
watermark demotes instead of evicting (:meth:`master.tiers.Tiers.demote`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.protocol import errors as E
from kvpool.protocol.messages import EvictReport, EvictSelector

if TYPE_CHECKING:
    from kvpool.master.handoffs import Handoffs
    from kvpool.master.lru import Lru
    from kvpool.master.members import Node
    from kvpool.master.objects import Obj
    from kvpool.master.settings import MasterSettings
    from kvpool.master.tiers import Tiers


_LISTS = ("lru", "soft_lru")
_LISTS_TIERED = ("disk.lru", "lru", "disk.soft_lru", "soft_lru")  # disk objects are the colder ones
_NONE: dict = {}


def _lru_of(node: Node, attr: str):
    """The LRU list ``attr`` of ``node`` ("disk.<list>": of its disk tier; an empty dict
    for a node without one)."""
    if attr.startswith("disk."):
        return getattr(node.disk, attr[5:]) if node.disk is not None else _NONE
    return getattr(node, attr)


def skip_reason(obj: Obj, now: float) -> str:
    """Why ``obj`` may not be evicted or removed at ``now`` (monotonic seconds) without
    force: "held", "pinned", "leased", or "" when it may."""
    if obj.holds:
        return "held"
    if obj.pin == "hard" or (obj.pin == "soft" and obj.pin_until > now):
        return "pinned"
    if obj.lease_until > now:
        return "leased"
    return ""


class Eviction:
    """Watermark eviction, the index bound and admin eviction. Given the node table
    ``nodes`` (node id -> Node), the index ``objects`` (key -> Obj), ``settings()`` (the
    state's current :class:`~master.state.MasterSettings`: watermarks are fractions of a
    node's segment), ``lru`` (the LRU lists and their eviction walk), ``tiers`` (demotes
    where a node has a disk tier), ``hand`` (hand-off holds an admin eviction with force
    releases) and ``drop(obj, reason)``, which forgets an evicted object."""

    def __init__(self, nodes: dict[str, Node], objects: dict[str, Obj], settings: Callable[[], MasterSettings],
                 lru: Lru, tiers: Tiers, hand: Handoffs, drop: Callable[[Obj, str], None]) -> None:
        self.nodes, self.objects, self.settings = nodes, objects, settings
        self.lru, self.tiers, self.hand, self._drop = lru, tiers, hand, drop

    def enforce_watermarks(self, now: float) -> int:
        """Evict LRU objects on every node above the high watermark down to the low one."""
        s, n = self.settings(), 0
        for node in list(self.nodes.values()):
            if node.usage() > s.high_watermark:
                n += self.evict_node(node, target_used=int(s.low_watermark * node.alloc.capacity),
                                     need=0, now=now, reason="watermark")
        return n

    def evict_node(self, node: Node, target_used: int | None, need: int, now: float, reason: str) -> int:
        """Evict from ``node`` until used <= target_used, or until a ``need``-byte range is free.
        The watermark of a node with a disk tier demotes instead (:mod:`master.tiers`)."""
        d = node.disk
        if d is not None and reason == "watermark" and target_used is not None and d.paused_until <= now:
            return self.tiers.demote(node, target_used, now)

        def done() -> bool:
            if target_used is not None:
                return node.alloc.used <= target_used
            return node.alloc.fits(need)

        return self.lru.evict((node.lru, node.soft_lru), done, now, reason)

    def oldest(self, count: int, now: float) -> int:
        """Evict up to ``count`` objects to keep the index within ``max_objects``: the least
        recently used across nodes first (the oldest cold end of the nodes' plain LRU lists,
        then of their soft-pin lists), skipping leased objects as :meth:`evict_node` does.
        Returns how many went. Cost per object: one look at each node's cold end."""
        evicted = 0
        for attr in (_LISTS_TIERED if self.lru.disk_nodes else _LISTS):
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
                self._drop(best, "max_objects")
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

    def admin(self, sel: EvictSelector, dry_run: bool, force: bool, now: float) -> EvictReport:
        """Admin eviction (``kvpool evict``) at ``now`` (monotonic seconds); exactly one
        selector field must be set (InvalidRequest otherwise)."""
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
            why = skip_reason(o, now)
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
                    h = self.hand.records.get(rid)
                    if h is not None:
                        self.hand.release(h, "released")
                self._drop(o, "admin")
        return EvictReport(removed, rbytes, leased, pinned, held, dry_run, keys[:1000])
