"""Re-replication in the master state (after a node death, a corrupt replica, a put that
landed fewer replicas than it asked for, or a drain): a copy is queued to a source node,
and the new replica joins when the copy is done.

Every event that can leave an object below its replica count queues it
(:meth:`Repair.maybe_queue`); held and pinned objects go to a front queue, the rest
to a back queue. :meth:`Repair.pump` (each tick, and whenever a copy finishes
or a held or pinned object is queued) starts copies from the front queue first, at most
``repair_in_flight`` at a time and on average ``repair_rate`` per second (a token bucket
holding at most one second's worth), and looks at no more than :data:`REPAIR_SCAN` queued
objects per call, so a long backlog never holds up the RPC thread. An object that every
node not draining holds already waits for a node to join (or stop draining); one that found
no room, or whose copy failed, is tried again after :data:`REPAIR_RETRY_S` seconds. The
copies a departing node was sending or receiving are cancelled and queued again at once.

:class:`Repair` is a part owned by :class:`master.state.MasterState` (its ``repair``); no
I/O (copies go out through the outbox).
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.master.allocator import align_up
from kvpool.master.frees import free_extent
from kvpool.master.placement import placeable, spread
from kvpool.protocol import errors as E
from kvpool.protocol.grants import grant_token
from kvpool.protocol.messages import ExtentEntry, ExtentRef, NodeCommit, NodeCopy, NodeFree

if TYPE_CHECKING:
    from kvpool.master.lru import Lru
    from kvpool.master.members import Node
    from kvpool.master.objects import Obj
    from kvpool.master.settings import MasterSettings
    from kvpool.master.story import Story

REPAIR_SCAN = 256  # queued objects one pump looks at, at most
REPAIR_RETRY_S = 5.0  # parked objects are queued again after this many seconds (or when a node joins)
_QUEUED_BACK, _QUEUED_FRONT, _PARKED = 1, 2, 3  # Obj.queued: where the object waits (0: nowhere)


def commit_row(obj: Obj, ref: ExtentRef) -> ExtentEntry:
    """The node's extent-table row for replica ``ref`` of committed ``obj``."""
    return ExtentEntry(obj.key, ref.offset, ref.size, ref.gen, obj.checksum,
                       obj.layout, True, obj.replicas_wanted)


def grant(node: Node, offset: int, size: int, key: str) -> ExtentRef:
    """A write grant of object ``key`` for ``[offset, +size)`` on ``node``, with a fresh
    generation and token."""
    d = node.desc
    gen = next(node.next_gen)
    return ExtentRef(d.node_id, d.incarnation, d.data_addr, d.shm_path, d.host_id, offset, size, gen,
                     grant_token(d.grant_key, d.incarnation, offset, size, gen, key), d.ucx_addr)


class Repair:
    """Queue, pace and complete re-replication; drain. Given the index ``objects`` (key ->
    Obj), the node table ``nodes`` (node id -> Node), the state's ``outbox`` (node id ->
    notices), ``counters`` and ``story``, ``settings()`` (the state's current
    :class:`~master.settings.MasterSettings`: ``repair_rate`` copies per second,
    ``repair_in_flight``, watermarks), ``clock()`` (the time of the state's latest event,
    monotonic seconds), ``lru`` (a replica moves an object between LRU lists) and ``rng``
    (placement's random choices, :func:`master.placement.spread`). :attr:`in_flight`: the
    copies started, by key."""

    def __init__(self, objects: dict[str, Obj], nodes: dict[str, Node], outbox: dict[str, list],
                 counters: dict[str, int], story: Story, settings: Callable[[], MasterSettings],
                 clock: Callable[[], float], lru: Lru, rng: random.Random) -> None:
        self.objects, self.nodes, self.outbox, self.counters, self.story = objects, nodes, outbox, counters, story
        self.settings, self.clock, self.lru, self.rng = settings, clock, lru, rng
        self.timeout_s = 30.0  # a copy unanswered this long (seconds) counts as failed
        # key -> (new replica, started (monotonic), object, source node id)
        self.in_flight: dict[str, tuple[ExtentRef, float, Obj, str]] = {}
        self._front: deque[Obj] = deque()  # held and pinned objects
        self._back: deque[Obj] = deque()  # the rest
        self._parked: list[Obj] = []  # no room now, or the copy failed: retried after REPAIR_RETRY_S
        self._no_node: list[Obj] = []  # every live node has a replica: retried when a node joins
        self._retry_at = 0.0
        self._tokens = max(1.0, settings().repair_rate)
        self._t = 0.0  # when the token bucket was last filled (monotonic seconds)

    def _live_replicas(self, obj: Obj) -> list[ExtentRef]:
        """Replicas on nodes that are not draining."""
        return [r for r in obj.replicas if r.node_id in self.nodes and not self.nodes[r.node_id].draining]

    def _short(self, obj: Obj) -> bool:
        """True when ``obj`` has fewer replicas than it wants. Replicas on draining nodes count
        only for objects that are neither held nor pinned (a drain moves held and pinned
        objects off its node, and leaves the rest)."""
        if not obj.replica_count():
            return False
        have = len(self._live_replicas(obj)) if (obj.holds or obj.pin) else len(obj.replicas)
        return have < obj.replicas_wanted

    def maybe_queue(self, obj: Obj) -> None:
        """Queue re-replication of ``obj`` when it is below its replica count; a held or
        pinned one goes to the front and copying starts at once (within the bounds)."""
        if obj.repairing or not self._short(obj):
            return
        if obj.holds or obj.pin:
            if obj.queued != _QUEUED_FRONT:
                obj.queued = _QUEUED_FRONT
                self._front.append(obj)
            self.pump(self.clock(), front_only=True)
        elif not obj.queued:
            obj.queued = _QUEUED_BACK
            self._back.append(obj)

    def pump(self, now: float | None = None, front_only: bool = False) -> int:
        """Start queued copies within the bounds (see the module docstring) at ``now``
        (monotonic seconds; default: the latest event's time), of held and pinned objects
        only with ``front_only``; returns how many started."""
        if now is None:
            now = self.clock()
        s = self.settings()
        rate = s.repair_rate
        if now > self._t:
            self._tokens = min(max(1.0, rate), self._tokens + (now - self._t) * rate)
            self._t = now
        if self._parked and now >= self._retry_at:
            self.unpark(room_only=True)
        started, budget = 0, REPAIR_SCAN
        queues = ((self._front, _QUEUED_FRONT),) if front_only else (
            (self._front, _QUEUED_FRONT), (self._back, _QUEUED_BACK))
        for q, where in queues:
            while q and budget and self._tokens >= 1.0 and len(self.in_flight) < s.repair_in_flight:
                obj = q.popleft()
                budget -= 1
                if obj.queued != where:  # moved to the front queue, or parked, since
                    continue
                obj.queued = 0
                if self.objects.get(obj.key) is not obj or obj.repairing or not self._short(obj):
                    continue
                why = self._start(obj, now)
                if not why:
                    self._tokens -= 1.0
                    started += 1
                elif why == "node":
                    obj.queued = _PARKED
                    self._no_node.append(obj)
                else:
                    self._park(obj, now)
        return started

    def _park(self, obj: Obj, now: float) -> None:
        if not self._parked:
            self._retry_at = now + REPAIR_RETRY_S
        obj.queued = _PARKED
        self._parked.append(obj)

    def unpark(self, room_only: bool = False) -> None:
        """Queue parked objects again: every one (a node joined or stopped draining), or
        with ``room_only`` those that found no room or whose copy failed (their retry time)."""
        for parked in (self._parked,) if room_only else (self._parked, self._no_node):
            objs = parked[:]
            parked.clear()
            for obj in objs:
                if obj.queued == _PARKED:
                    obj.queued = 0
                    self._requeue(obj)

    def _requeue(self, obj: Obj) -> None:
        if obj.holds or obj.pin:
            obj.queued = _QUEUED_FRONT
            self._front.append(obj)
        else:
            obj.queued = _QUEUED_BACK
            self._back.append(obj)

    def _start(self, obj: Obj, now: float) -> str:
        """Queue one copy of ``obj`` to a node that holds none of it, among those new
        extents may go to (:func:`master.placement.placeable`: not draining, not suspect)
        with room (for an object neither held nor pinned: room below the high watermark, so
        a background copy causes no eviction), in :func:`master.placement.spread` order, nodes on hosts
        without a replica first. Returns "" when queued, "node" when every node that is not
        draining holds a replica, "room" when no node can take it now."""
        need = align_up(max(obj.size, 1))
        used = set(obj.node_ids())
        if all(n.node_id in used or n.draining for n in self.nodes.values()):
            return "node"
        hosts = {self.nodes[n].desc.host_id for n in used if n in self.nodes}
        urgent = bool(obj.holds or obj.pin)
        hw = self.settings().high_watermark
        cands = [n for n in placeable(self.nodes, now) if n.node_id not in used and n.suspect_until <= now
                 and n.alloc.fits(need) and (urgent or n.alloc.used + need <= hw * n.alloc.capacity)]
        for dst in spread(cands, lambda n: n.desc.host_id in hosts, hw, self.rng):
            off = dst.alloc.alloc(obj.size)
            if off is not None:
                break
        else:
            return "room"
        ref = grant(dst, off, obj.size, obj.key)
        live = [r for r in obj.replicas if r.node_id in self.nodes]
        src = next((r for r in live if not r.tier), live[0])  # a memory replica when there is one
        obj.repairing = True
        self.in_flight[obj.key] = (ref, now, obj, src.node_id)
        self.story.add(obj.key, "repair started", (f"copy from {src.node_id}", f"to {dst.node_id}"))
        self.outbox[src.node_id].append(NodeCopy(src.offset, src.gen, ref, obj.key, obj.checksum,
                                                 obj.layout, src_tier=src.tier))
        self.counters["repairs_started"] += 1
        return ""

    def done(self, key: str, ok: bool) -> None:
        """A store node finished (or failed) the copy queued for ``key``. A failed copy parks
        its object (tried again later); a done one adds the replica and queues the next copy
        if the object still needs one."""
        pending = self.in_flight.pop(key, None)
        if pending is None:
            return
        dst, _, obj, _ = pending
        node = self.nodes.get(dst.node_id)
        obj.repairing = False
        current = self.objects.get(key) is obj  # else removed, evicted or replaced meanwhile
        if not ok or not current or node is None or node.desc.incarnation != dst.incarnation:
            if node is not None and node.desc.incarnation == dst.incarnation:
                node.alloc.free(dst.offset, dst.size)
                self.outbox[dst.node_id].append(NodeFree([(dst.offset, dst.gen)]))
            if not ok:
                self.counters["repairs_failed"] += 1
            if current:
                self.story.add(key, "repair failed" if not ok else "repair dropped", dst.node_id)
            if current and self._short(obj):
                self._park(obj, self.clock())
            return
        self.lru.remove(obj)
        if len(self._live_replicas(obj)) >= obj.replicas_wanted:
            # enough replicas meanwhile (a node came back with its copy): this one is not needed
            node.alloc.free(dst.offset, dst.size)
            self.outbox[dst.node_id].append(NodeFree([(dst.offset, dst.gen)]))
        else:
            obj.replicas = [*obj.replicas, dst]
            node.fixed.add(key)
            self.outbox[dst.node_id].append(NodeCommit([commit_row(obj, dst)]))
        if len(self._live_replicas(obj)) >= obj.replicas_wanted:
            # moved off draining nodes: drop those copies
            gone = [r for r in obj.replicas if self.nodes[r.node_id].draining]
            if gone:
                obj.replicas = [r for r in obj.replicas if not self.nodes[r.node_id].draining]
            for r in gone:
                self.nodes[r.node_id].drop_key(key)
                free_extent(self.nodes, self.outbox, r)
        self.lru.add(obj)
        self.counters["repairs_done"] += 1
        self.story.add(key, "repair done", obj.node_ids())
        self.maybe_queue(obj)
        self.pump(self.clock())

    def cancel(self, node_id: str) -> None:
        """``node_id`` left: the copies it was sending or receiving will not finish. Free
        their new extents and queue their objects again (after
        :meth:`MasterState.node_down <master.state.MasterState.node_down>` dropped the node's
        replicas)."""
        for key in [k for k, p in self.in_flight.items() if node_id in (p[0].node_id, p[3])]:
            dst, _, obj, _ = self.in_flight.pop(key)
            obj.repairing = False
            node = self.nodes.get(dst.node_id)
            if node is not None and node.desc.incarnation == dst.incarnation:
                node.alloc.free(dst.offset, dst.size)
                self.outbox[dst.node_id].append(NodeFree([(dst.offset, dst.gen)]))
            self.counters["repairs_cancelled"] += 1
            if self.objects.get(key) is obj:
                self.maybe_queue(obj)

    def expire(self, now: float) -> None:
        """Count the copies unanswered for :attr:`timeout_s` seconds at ``now`` as failed."""
        for key in [k for k, (_, t0, _, _) in self.in_flight.items() if now - t0 > self.timeout_s]:
            self.counters["repairs_timed_out"] += 1
            self.done(key, ok=False)

    def drain(self, node_id: str, undo: bool = False) -> None:
        """Stop placing on ``node_id`` and move held/pinned objects off it (via repair), or
        with ``undo`` place on it again."""
        node = self.nodes.get(node_id)
        if node is None:
            raise E.InvalidRequest(f"drain: no live node {node_id!r}; see `kvpool status`")
        node.draining = not undo
        if undo:
            self.unpark()
            return
        for key in node.all_keys():
            obj = self.objects.get(key)
            if obj is not None:
                self.maybe_queue(obj)
