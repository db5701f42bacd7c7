"""Cluster statistics (``Stats``, ``kvpool status``, ``/metrics``) without stalling the
master's request thread.

Per-node object counts, bytes held for hand-offs and the under-replicated count are sums
over the whole object index. :meth:`StatsSnapshot.take` runs on the RPC thread and costs
one C-level copy of the index's values (no Python code per object) plus the node table;
:meth:`StatsSnapshot.finish` walks that copy on any other thread (a scrape's, or the
master's stats thread) while the RPC thread keeps serving. The walk reads each object's
``rec`` (an immutable ``bytes`` replaced whole) and ``ext`` once, so every object is read
consistently, as it was at some instant of the walk; objects put after the snapshot are
not counted, objects dropped meanwhile are. With the index quiet the numbers are exact.
"""
from __future__ import annotations

import concurrent.futures
import logging
from collections import defaultdict
from collections.abc import Callable

from kvpool.master.durable import Pending
from kvpool.master.objects import _HEAD, _HS, _NODE_INFO, _REP, _RS
from kvpool.protocol.errors import KVPoolError
from kvpool.protocol.messages import DISK, ClusterStats, NodeStats

_WANTED_AT = _HS - 1  # byte offset of "replicas wanted" (the last field of the record's head)


class StatsSnapshot:
    """What :class:`~protocol.messages.ClusterStats` needs, taken at one instant of the
    RPC thread; :meth:`finish` builds it (anywhere)."""

    __slots__ = ("objs", "nodes", "head", "extra")

    def __init__(self, objs: list, nodes: list[tuple], head: tuple, extra: dict) -> None:
        self.objs, self.nodes, self.head, self.extra = objs, nodes, head, extra

    @classmethod
    def take(cls, state) -> "StatsSnapshot":
        """Snapshot a :class:`~master.state.MasterState` (its owner's thread only)."""
        s = state.s
        nodes = [(n.node_id, n.desc.data_addr, n.desc.host_id, n.alloc.capacity, n.alloc.used, n.draining,
                  n.desc.incarnation, n.desc.device, n.reserved, _disk_fields(n)) for n in state.nodes.values()]
        head = (state.leader_addr, state.cluster, len(state.objects), len(state.pending), s.high_watermark,
                s.low_watermark)
        extra = {"counters": dict(state.counters), "refused": dict(state.refused),
                 "repairs_in_flight": len(state.repair.in_flight),
                 "reserved_bytes": state.reservations.held_bytes()}
        return cls(list(state.objects.values()), nodes, head, extra)

    def finish(self, **more) -> ClusterStats:
        """The statistics, walking the snapshot's objects (any thread); ``more``: fields to
        set besides (e.g. ``joining``)."""
        per_num: dict[int, int] = defaultdict(int)  # node number (one incarnation) -> replicas
        held = under = 0
        unpack_rep, unpack_head = _REP.unpack_from, _HEAD.unpack_from
        for o in self.objs:
            rec = o.rec  # one read: the record is replaced whole, never changed in place
            end = len(rec)
            n = (end - _HS) // _RS
            for p in range(_HS, end, _RS):
                per_num[unpack_rep(rec, p)[0]] += 1
            if n < rec[_WANTED_AT]:
                under += 1
            e = o.ext
            if e is not None and e.holds:
                held += unpack_head(rec)[0] * n
        per_node: dict[str, int] = defaultdict(int)  # memory replicas
        on_disk: dict[str, int] = defaultdict(int)  # disk-resident replicas
        for num, count in per_num.items():
            info = _NODE_INFO[num]
            (on_disk if info[6] == DISK else per_node)[info[0]] += count
        nodes = [NodeStats(nid, addr, host, cap, used, per_node[nid], True, draining, inc, dev, reserved,
                           *((disk[0], disk[1], on_disk[nid], *disk[2:]) if disk else ()))
                 for nid, addr, host, cap, used, draining, inc, dev, reserved, disk in self.nodes]
        leader, cluster, objects, pending, high, low = self.head
        return ClusterStats(leader, cluster, nodes, objects, pending, sum(n.used for n in nodes),
                            sum(n.capacity for n in nodes), held, high, low, under, **self.extra,
                            disk_capacity=sum(n.disk_capacity for n in nodes),
                            disk_used=sum(n.disk_used for n in nodes), disk_objects=sum(on_disk.values()), **more)


def _disk_fields(node) -> tuple:
    """NodeStats' disk fields of ``node`` but its object count: ``(capacity, used,
    demotions, demotion seconds, promotions, promotion seconds, moves in flight)``; empty
    without a disk tier."""
    d = node.disk
    if d is None:
        return ()
    return (d.capacity, d.used, d.demotions, d.demotion_s, d.promotions, d.promotion_s, d.jobs + d.promoting)


class StatsWalks:
    """Answers ``Stats`` requests from walks on a thread of its own, so the RPC thread only
    takes snapshots. Requests that arrive while a walk runs share the next walk, whose
    snapshot is taken after they arrived (an answer never predates its request).

    ``post(fn)`` runs ``fn`` on the RPC thread (the server's event queue); everything else
    here runs on the RPC thread, but the walk. ``answer(pending, result, error)`` sends an
    answer; ``take()`` returns ``(snapshot, fields to add)`` of the state in charge now."""

    def __init__(self, post: Callable[[Callable[[], None]], None],
                 answer: Callable[[Pending, ClusterStats | None, KVPoolError | None], None],
                 take: Callable[[], tuple[StatsSnapshot, dict]]) -> None:
        self.post, self.answer, self.take = post, answer, take
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stats")
        self.waiting: list[Pending] = []  # want a snapshot taken after they arrived
        self.walking = False

    def request(self) -> Pending:
        """A Stats request: its answer comes later (through ``answer``)."""
        p = Pending("", None, "stats")
        self.waiting.append(p)
        if not self.walking:
            self._start()
        return p

    def _start(self) -> None:
        snap, more = self.take()
        batch, self.waiting = self.waiting, []
        self.walking = True

        def walk() -> None:
            try:
                result, err = snap.finish(**more), None
            except Exception as e:  # noqa: BLE001 - a bug must cost these requests, not the master
                logging.getLogger("kvpool.master").exception("master: stats walk failed")
                result, err = None, KVPoolError(f"master failed on Stats: {type(e).__name__}: {e}; this is a "
                                                "kvpool bug, please report it with the master's log")
            self.post(lambda: self._done(batch, result, err))

        self.pool.submit(walk)

    def _done(self, batch: list[Pending], result, err) -> None:
        self.walking = False
        for p in batch:
            self.answer(p, result, err)
        if self.waiting:
            self._start()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
