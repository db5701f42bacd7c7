"""Tiers in the master state: store nodes' disk tiers under their memory (DESIGN.md §12).

:class:`Tiers` is a part owned by :class:`master.state.MasterState` (its ``tiers``); no I/O
(notices go out through the outbox).
A node that publishes a disk tier (``NodeDesc.disk_capacity``) gets a :class:`DiskTier`
record: capacity, watermarks, bytes used, and LRU lists of its disk-resident objects
(plain and soft-pinned, as for memory; held and hard-pinned objects stay in the node's
``fixed`` set in either tier). Each replica is in one tier: an object's replica on a node
is a memory extent or a disk file (``ExtentRef.tier``), never both in the index.

**Demotion** (memory → disk). Where the memory watermark would evict a replica on a node
with a disk tier, it demotes it instead (:meth:`Tiers.demote`): least recently
used first (plain, then soft-pinned), unleased, and never a held or hard-pinned object (a
pin or hold keeps an object where it is, in memory or on disk). The master sends
:class:`~protocol.messages.NodeDemote` and keeps the memory replica, valid and readable,
until the node answers that the file is durable; only then does the replica become a
disk replica and its memory extent freed (:meth:`Tiers._demote_done`). A demotion is
given up (the file deleted, the object left in memory) when the object was read meanwhile
(its last access is later than the demotion's start: it is warm again, and a reader may
hold a lease on the memory extent), pinned or held since, removed, or replaced. At most
:data:`DEMOTE_IN_FLIGHT` demotions (:data:`DEMOTE_BYTES_IN_FLIGHT` bytes) per node are in
flight; what is left waits for the next enforcement (each answer, put and tick). When the
disk tier cannot take an object (it is larger than the tier's high watermark, or every
disk object is leased, pinned or held) or the node failed a demotion in the last
:data:`TIER_RETRY_S` seconds, the watermark evicts on that node as it does without a
disk tier. A move the node has not answered within :data:`TIER_TIMEOUT_S` counts as
failed (a late answer finds no move: its file is deleted, its commit refused). An allocation that fails (a put that finds memory full) evicts as before too:
a demotion cannot free memory at once.

**Disk eviction.** Above a disk tier's high watermark the least recently used disk
objects are evicted (the object goes, as a memory eviction removes it) down to its low
watermark, skipping leased ones; soft-pinned ones go last, held and hard-pinned ones never.

**Promotion** (disk → memory). A read (a leased lookup) of an object all of whose replicas
are on disk is counted; the :data:`PROMOTE_AFTER`-th such read promotes it: a memory
extent is allocated on a node holding the file (only from free memory under the high
watermark: a promotion never pushes other objects out) and
:class:`~protocol.messages.NodePromote` copies the file into it. Once the node answers,
the memory extent replaces the disk replica; the file is deleted then, or, while a read
lease on the object is live (its reader may be reading the file), when the lease lapses.

**Restarts.** A node's extent table lists its disk files as DISK rows; they are indexed
like memory rows (:meth:`Tiers.restore_extent`), so a restarted node, or a whole
cluster, brings back what its disk tiers hold. Keys removed or evicted while the node was
away (within ``DEPARTED_KEEP_S``) are not brought back, also when the node restarted.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.master.allocator import align_up
from kvpool.master.frees import free_disk_file
from kvpool.master.members import DiskTier, Node
from kvpool.master.objects import COMMITTED, Obj, disk_ref
from kvpool.master.repair import grant
from kvpool.protocol.errors import ErrorInfo
from kvpool.protocol.layout import LayoutSpec
from kvpool.protocol.messages import MEMORY, ExtentRef, NodeDemote, NodeFree, NodePromote, TierDone

if TYPE_CHECKING:
    from kvpool.master.layouts import Layouts
    from kvpool.master.lru import Lru
    from kvpool.master.repair import Repair
    from kvpool.master.settings import MasterSettings
    from kvpool.master.story import Story


DEMOTE_IN_FLIGHT = 32  # demotions in flight per node, at most (the node queues up to 256)
DEMOTE_BYTES_IN_FLIGHT = 256 << 20  # ... and at most this many bytes of them
PROMOTE_IN_FLIGHT = 16  # promotions in flight per node, at most (the node queues up to 64)
PROMOTE_AFTER = 2  # the read of a disk-resident object that promotes it (the 2nd)
TIER_RETRY_S = 5.0  # after a failed demotion, the node's memory watermark evicts for this long
TIER_TIMEOUT_S = 60.0  # a move the node has not answered in this long is counted failed (its answer was lost)
DISK_READS_MAX = 100_000  # disk-resident keys whose reads are counted (the oldest forgotten first)
# failures of a demotion that are not the disk's fault (the source went, or a leader changed)
_MOVE_ERRORS = ("stale_extent", "checksum_mismatch", "stale_term", "not_leader", "invalid_request")


class Tiers:
    """Demotion, promotion and the disk tiers' eviction (see the module docstring). Given
    the index ``objects`` (key -> Obj) and ``pending`` (keys being written), the node table
    ``nodes`` (node id -> Node), the state's ``outbox`` (node id -> notices), ``counters``
    and ``story``, ``settings()`` (the state's current
    :class:`~master.settings.MasterSettings`: memory watermarks), ``departed`` (the state's
    incarnations away: incarnation -> [forget after, keys dropped since]), ``layouts``
    (shared layout encodings), ``lru`` (the LRU lists; this part counts its
    :attr:`~master.lru.Lru.disk_nodes`), ``repair`` (queues an object short of replicas),
    ``drop(obj, reason)`` (forgets an evicted object), ``report_corrupt(key, node_id, gen,
    incarnation)`` (drops a replica that failed) and ``settle_waiting(obj, now)`` (applies
    a pin or holds that waited for the object's key)."""

    def __init__(self, objects: dict[str, Obj], pending: dict[str, Obj], nodes: dict[str, Node],
                 outbox: dict[str, list], counters: dict[str, int], story: Story,
                 settings: Callable[[], MasterSettings], departed: dict[str, list], layouts: Layouts, lru: Lru,
                 repair: Repair, drop: Callable[[Obj, str], None], report_corrupt: Callable[..., None],
                 settle_waiting: Callable[[Obj, float], None]) -> None:
        self.objects, self.pending, self.nodes, self.outbox = objects, pending, nodes, outbox
        self.counters, self.story, self.settings, self.departed = counters, story, settings, departed
        self.layouts, self.lru, self.repair = layouts, lru, repair
        self._drop, self._report_corrupt, self._settle_waiting = drop, report_corrupt, settle_waiting
        # (node id, key) -> (memory replica, started (monotonic), object)
        self.demotions: dict[tuple[str, str], tuple[ExtentRef, float, Obj]] = {}
        # (node id, key) -> (memory extent granted, disk replica, object, started (monotonic))
        self.promotions: dict[tuple[str, str], tuple[ExtentRef, ExtentRef, Obj, float]] = {}
        self._disk_reads: dict[str, int] = {}  # key -> reads while disk-resident (see PROMOTE_AFTER)
        self._last_inc: dict[str, str] = {}  # node id -> its incarnation that went down last

    # ---- membership -----------------------------------------------------------------------

    def node_up(self, node: Node) -> None:
        """``node`` joined: a disk tier record if it publishes one."""
        d = node.desc
        if d.disk_capacity <= 0:
            return
        node.disk = DiskTier(d.disk_capacity, d.disk_high_watermark or 0.95, d.disk_low_watermark or 0.90)
        self.lru.disk_nodes += 1
        old = self._last_inc.pop(d.node_id, None)
        dep = self.departed.get(old) if old is not None else None
        if dep is not None and old != d.incarnation:  # restarted: its files come back, its memory does not
            node.disk.gone = dep[1]

    def node_down(self, node: Node) -> None:
        """``node`` left: its moves in flight are forgotten."""
        nid = node.node_id
        self._last_inc[nid] = node.desc.incarnation
        if node.disk is None:
            return
        self.lru.disk_nodes -= 1
        for k in [k for k in self.demotions if k[0] == nid]:
            del self.demotions[k]
        for k in [k for k in self.promotions if k[0] == nid]:
            del self.promotions[k]

    # ---- demotion ---------------------------------------------------------------------------

    def demote(self, node: Node, target_used: int, now: float) -> int:
        """Demote (or, where the disk cannot take them, evict) LRU objects on ``node`` until
        its memory used, less the demotions in flight, is at most ``target_used`` bytes.
        Returns the objects demoted or evicted."""
        d = node.disk
        nid, n = node.node_id, 0
        for lru in (node.lru, node.soft_lru):
            skipped: list[str] = []
            while lru and node.alloc.used - d.demoting > target_used:
                if d.jobs >= DEMOTE_IN_FLIGHT or d.demoting >= DEMOTE_BYTES_IN_FLIGHT:
                    break
                key, _ = lru.popitem(last=False)
                obj = self.objects.get(key)
                if obj is None:
                    continue
                if obj.lease_until > now or (nid, key) in self.demotions:
                    skipped.append(key)
                    continue
                ref = next((r for r in obj.replicas if r.node_id == nid and r.tier == MEMORY), None)
                if ref is None:  # not in memory here after all: back to the lists its replicas belong in
                    self.lru.add(obj)
                    continue
                n += 1
                if not self._disk_room(node, ref.size, now):
                    self._drop(obj, "watermark")  # the disk cannot take it: evicted as without one
                    continue
                node.fixed.add(key)  # out of the LRU lists while it moves (see _demote_done)
                self.demotions[(nid, key)] = (ref, now, obj)
                d.jobs += 1
                d.demoting += ref.size
                self.outbox[nid].append(NodeDemote(ref.offset, ref.gen, ref.size, key))
                self.counters["demotions_started"] += 1
            for key in reversed(skipped):  # leased objects stay, at the cold end, for next time
                lru[key] = None
                lru.move_to_end(key, last=False)
            if d.jobs >= DEMOTE_IN_FLIGHT or d.demoting >= DEMOTE_BYTES_IN_FLIGHT:
                break
        return n

    def _disk_room(self, node: Node, size: int, now: float) -> bool:
        """Whether ``node``'s disk tier can take ``size`` more bytes below its high
        watermark, evicting disk objects down to the low watermark when that makes room."""
        d = node.disk
        limit = d.high * d.capacity
        if size > limit:
            return False
        if d.used + d.demoting + size <= limit:
            return True
        self._evict_disk(node, int(d.low * d.capacity) - d.demoting - size, now)
        return d.used + d.demoting + size <= limit

    def _evict_disk(self, node: Node, target_used: int, now: float) -> int:
        """Evict LRU disk objects of ``node`` (plain, then soft-pinned; leased ones skipped)
        until its disk used is at most ``target_used`` bytes; returns how many went."""
        d = node.disk
        return self.lru.evict((d.lru, d.soft_lru), lambda: d.used <= target_used, now, "disk")

    def done(self, node_id: str, answer: TierDone, error: ErrorInfo | None, now: float) -> None:
        """A store node answered a demotion or promotion (``error``: it failed) at ``now``
        (monotonic seconds)."""
        if answer.op == "demote":
            self._demote_done(node_id, answer, error, now)
        elif answer.op == "promote":
            self._promote_done(node_id, answer, error, now)

    def _demote_done(self, node_id: str, done: TierDone, error: ErrorInfo | None, now: float) -> None:
        node = self.nodes.get(node_id)
        job = self.demotions.get((node_id, done.key))
        if job is None or job[0].gen != done.gen or node is None:  # not ours (any more): its file is not wanted
            if error is None and node is not None and node.disk is not None and done.disk_id:
                free_disk_file(self.outbox, node_id, done.disk_id)
            return
        del self.demotions[(node_id, done.key)]
        ref, t0, obj = job
        d = node.disk
        d.jobs -= 1
        d.demoting -= ref.size
        current = self.objects.get(obj.key) is obj and ref in obj.replicas
        if error is not None:
            self.counters["demotions_failed"] += 1
            if error.code not in _MOVE_ERRORS:  # the disk's fault (I/O, full, overloaded): evict meanwhile
                d.paused_until = now + TIER_RETRY_S
            if current:
                self.lru.add(obj)
            return
        if not current or obj.last_access > t0 or obj.lease_until > now or obj.evictable_kind() == "none":
            free_disk_file(self.outbox, node_id, done.disk_id)  # warm again, pinned, held, removed or replaced
            self.counters["demotions_aborted"] += 1
            if current:
                self.lru.add(obj)
            return
        self.lru.remove(obj)
        obj.replicas = [disk_ref(node.desc, obj.size, done.disk_id) if r == ref else r for r in obj.replicas]
        node.alloc.free(ref.offset, ref.size)
        self.outbox[node_id].append(NodeFree([(ref.offset, ref.gen)]))
        d.used += obj.size
        d.demotions += 1
        d.demotion_s += done.seconds
        self.counters["demotions"] += 1
        self.counters["demoted_bytes"] += obj.size
        self.story.add(obj.key, "demoted to disk", node_id)
        self._disk_reads.pop(obj.key, None)
        self.lru.add(obj)
        if d.used > d.high * d.capacity:
            self._evict_disk(node, int(d.low * d.capacity), now)
        if node.usage() > self.settings().high_watermark:  # room for the next demotions in flight
            self.demote(node, int(self.settings().low_watermark * node.alloc.capacity), now)

    # ---- promotion ---------------------------------------------------------------------------

    def read(self, obj: Obj, refs: list[ExtentRef], now: float) -> None:
        """A read of ``obj`` (``refs``: its replicas): count it when every replica is on disk,
        and promote the object at its PROMOTE_AFTER-th such read."""
        if not refs or not all(r.tier for r in refs):
            return
        reads = self._disk_reads
        n = reads.pop(obj.key, 0) + 1
        if n < PROMOTE_AFTER:
            reads[obj.key] = n
            if len(reads) > DISK_READS_MAX:
                del reads[next(iter(reads))]
            return
        self._promote(obj, refs, now)

    def _promote(self, obj: Obj, refs: list[ExtentRef], now: float) -> bool:
        """Start copying ``obj`` from a disk replica into memory on the same node (free
        memory under the high watermark only); False when no node can take it now."""
        size, key = obj.size, obj.key
        need = align_up(max(size, 1))
        for ref in refs:
            node = self.nodes.get(ref.node_id)
            if (node is None or node.disk is None or node.draining or node.desc.incarnation != ref.incarnation
                    or (ref.node_id, key) in self.promotions or node.disk.promoting >= PROMOTE_IN_FLIGHT
                    or node.alloc.used + need > self.settings().high_watermark * node.alloc.capacity):
                continue
            node.release_quarantine(now)
            off = node.alloc.alloc(size)
            if off is None:
                continue
            dst = grant(node, off, size, key)
            self.promotions[(ref.node_id, key)] = (dst, ref, obj, now)
            node.disk.promoting += 1
            self.outbox[ref.node_id].append(NodePromote(ref.gen, dst, key))
            self.counters["promotions_started"] += 1
            return True
        return False

    def _promote_done(self, node_id: str, done: TierDone, error: ErrorInfo | None, now: float) -> None:
        node = self.nodes.get(node_id)
        job = self.promotions.get((node_id, done.key))
        if job is None or job[0].gen != done.gen or node is None:
            return  # not ours: a deposed leader's move commits nothing (storenode/demotion.py)
        del self.promotions[(node_id, done.key)]
        dst, dref, obj, _ = job
        node.disk.promoting -= 1
        current = self.objects.get(obj.key) is obj and dref in obj.replicas
        if error is not None or not current:
            node.alloc.free(dst.offset, dst.size)
            self.outbox[node_id].append(NodeFree([(dst.offset, dst.gen)]))
            if error is not None:
                self.counters["promotions_failed"] += 1
                if error.code == "stale_extent" and current:  # the file is gone or damaged: so is the replica
                    self._report_corrupt(obj.key, node_id, dref.gen, dref.incarnation)
            return
        self.lru.remove(obj)
        mem = ExtentRef(dst.node_id, dst.incarnation, dst.data_addr, dst.shm_path, dst.host_id, dst.offset,
                        dst.size, dst.gen, b"", dst.ucx_addr)
        obj.replicas = [mem if r == dref else r for r in obj.replicas]
        d = node.disk
        if obj.lease_until > now:  # a reader may be reading the file: it goes when the lease lapses
            d.retire.append((obj.lease_until, dref.gen, dref.size))
        else:
            d.used -= dref.size
            free_disk_file(self.outbox, node_id, dref.gen)
        d.promotions += 1
        d.promotion_s += done.seconds
        self.counters["promotions"] += 1
        self.counters["promoted_bytes"] += obj.size
        self.story.add(obj.key, "promoted to memory", node_id)
        self.lru.add(obj)

    # ---- restore, periodic ------------------------------------------------------------------

    def restore_extent(self, node_id: str, key: str, size: int, disk_id: int, checksum: int,
                       layout: bytes | LayoutSpec | None, now: float, replicas: int = 0) -> None:
        """A node's extent table lists file ``disk_id`` (a DISK row): index it as a disk
        replica (a restart, or a failover rebuild), unless its key is being written again,
        was removed or evicted while the node was away, already has a replica on this node,
        is stored with other bytes, or has all the replicas it wants: then the file goes."""
        node = self.nodes[node_id]
        d = node.disk
        if d is None:
            return  # a node that publishes no disk tier: nothing to index (its files stay)
        if (key in self.pending or node.gone is None or key in node.gone or d.gone is None or key in d.gone):
            free_disk_file(self.outbox, node_id, disk_id)
            return
        ref = disk_ref(node.desc, size, disk_id)
        obj = self.objects.get(key)
        if obj is None:
            obj = Obj.new(key, size, checksum, self.layouts.intern(layout), [ref], COMMITTED, 0, now, now,
                          replicas_wanted=replicas or self.settings().replicas)
            self.objects[key] = obj
        elif (obj.checksum == checksum and obj.size == size and node_id not in obj.node_ids()
              and len(obj.replicas) < max(obj.replicas_wanted, replicas)):
            obj.replicas = [*obj.replicas, ref]
            obj.replicas_wanted = max(obj.replicas_wanted, replicas)
        else:
            free_disk_file(self.outbox, node_id, disk_id)
            return
        d.used += size
        node.fixed.add(key)
        self.lru.add(obj)
        self._settle_waiting(obj, now)
        if len(obj.replicas) < obj.replicas_wanted:
            self.repair.maybe_queue(obj)

    def tick(self, now: float) -> None:
        """Count moves unanswered for TIER_TIMEOUT_S as failed; delete promoted files whose
        readers' leases lapsed; keep disk tiers under their high watermarks."""
        late = ErrorInfo("timeout", f"no answer within {TIER_TIMEOUT_S:g}s")
        for (nid, key), (ref, t0, _) in list(self.demotions.items()):
            if now - t0 > TIER_TIMEOUT_S:  # a late answer finds no job: its file is deleted
                self._demote_done(nid, TierDone("demote", key, ref.gen), late, now)
        for (nid, key), (dst, dref, _, t0) in list(self.promotions.items()):
            if now - t0 > TIER_TIMEOUT_S:  # its extent is freed: the node refuses a late commit there
                self._promote_done(nid, TierDone("promote", key, dst.gen, dref.gen), late, now)
        for node in self.nodes.values():
            d = node.disk
            if d is None:
                continue
            if d.retire:
                keep = []
                for until, disk_id, size in d.retire:
                    if until <= now:
                        d.used -= size
                        free_disk_file(self.outbox, node.node_id, disk_id)
                    else:
                        keep.append((until, disk_id, size))
                d.retire = keep
            if d.used > d.high * d.capacity:
                self._evict_disk(node, int(d.low * d.capacity), now)
