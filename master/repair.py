"""Re-replication of held/pinned objects (after a node death or for a drain) in the master
state: a copy is queued to a source node, and the new replica joins when the copy is done.

A mixin of :class:`master.state.MasterState`; no I/O (copies go out through the outbox).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from master.allocator import align_up
from protocol import errors as E
from protocol.grants import grant_token
from protocol.messages import ExtentEntry, ExtentRef, NodeCommit, NodeCopy, NodeFree

if TYPE_CHECKING:
    from master.state import Node, Obj


def commit_row(obj: Obj, ref: ExtentRef) -> ExtentEntry:
    """The node's extent-table row for replica ``ref`` of committed ``obj``."""
    return ExtentEntry(obj.key, ref.offset, ref.size, ref.gen, obj.checksum,
                       obj.layout.encode() if obj.layout is not None else None, True, obj.replicas_wanted)


def grant(node: Node, offset: int, size: int, key: str) -> ExtentRef:
    """A write grant of object ``key`` for ``[offset, +size)`` on ``node``, with a fresh
    generation and token."""
    d = node.desc
    gen = next(node.next_gen)
    return ExtentRef(d.node_id, d.incarnation, d.data_addr, d.shm_path, d.host_id, offset, size, gen,
                     grant_token(d.grant_key, d.incarnation, offset, size, gen, key), d.ucx_addr)


class RepairMixin:
    """Queue and complete re-replication; drain."""

    def _live_replicas(self, obj: Obj) -> list[ExtentRef]:
        """Replicas on nodes that are not draining."""
        return [r for r in obj.replicas if r.node_id in self.nodes and not self.nodes[r.node_id].draining]

    def _maybe_repair(self, obj: Obj) -> None:
        """Queue re-replication of a held/pinned object below its replica count (replicas on
        draining nodes do not count)."""
        if obj.repairing or not obj.replicas or not (obj.holds or obj.pin):
            return
        if len(self._live_replicas(obj)) >= obj.replicas_wanted:
            return
        used = {r.node_id for r in obj.replicas}
        cands = [n for n in self.nodes.values() if n.node_id not in used and not n.draining
                 and n.alloc.largest_free() >= align_up(max(obj.size, 1))]
        if not cands:
            return
        dst = max(cands, key=lambda n: n.alloc.capacity - n.alloc.used)
        off = dst.alloc.alloc(obj.size)
        if off is None:
            return
        ref = grant(dst, off, obj.size, obj.key)
        src = obj.replicas[0]
        obj.repairing = True
        self.repairs[obj.key] = (ref, self._now)
        self.outbox[src.node_id].append(NodeCopy(src.offset, src.gen, ref, obj.key, obj.checksum,
                                                 obj.layout.encode() if obj.layout else None))
        self.counters["repairs_started"] += 1

    def repair_done(self, key: str, ok: bool) -> None:
        """A store node finished (or failed) the copy queued for ``key``."""
        pending = self.repairs.pop(key, None)
        if pending is None:
            return
        dst = pending[0]
        obj = self.objects.get(key)
        node = self.nodes.get(dst.node_id)
        if obj is not None:
            obj.repairing = False
        if not ok or obj is None or node is None or node.desc.incarnation != dst.incarnation:
            if node is not None and node.desc.incarnation == dst.incarnation:
                node.alloc.free(dst.offset, dst.size)
                self.outbox[dst.node_id].append(NodeFree([(dst.offset, dst.gen)]))
            return
        self._lru_remove(obj)
        obj.replicas.append(dst)
        obj._read_refs = None
        node.keys.add(key)
        self.outbox[dst.node_id].append(NodeCommit([commit_row(obj, dst)]))
        if len(self._live_replicas(obj)) >= obj.replicas_wanted:
            # moved off draining nodes: drop those copies
            for r in [r for r in obj.replicas if self.nodes[r.node_id].draining]:
                obj.replicas.remove(r)
                self.nodes[r.node_id].keys.discard(key)
                self._free_extent(r)
        self._lru_add(obj)
        self.counters["repairs_done"] += 1
        self._maybe_repair(obj)

    def repair_all(self) -> None:
        for obj in self.objects.values():
            if (obj.holds or obj.pin) and not obj.repairing:
                self._maybe_repair(obj)

    def drain(self, node_id: str, undo: bool = False) -> None:
        """Stop placing on ``node_id`` and move held/pinned objects off it (via repair), or
        with ``undo`` place on it again."""
        node = self.nodes.get(node_id)
        if node is None:
            raise E.InvalidRequest(f"drain: no live node {node_id!r}; see `kvpool status`")
        node.draining = not undo
        if undo:
            return
        for key in list(node.keys):
            obj = self.objects.get(key)
            if obj is not None:
                self._maybe_repair(obj)
