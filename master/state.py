"""The master's state machine: events in, decisions out, no I/O (in the manner of
dask/distributed's ``worker_state_machine.py``).

It owns the node table, one :class:`~master.allocator.RangeAllocator` per node segment,
the object index (PENDING → COMMITTED), read leases and pins; its parts (see
:class:`MasterState`) own re-replication, hand-off holds and records, disk tiers,
eviction and reservations. Every method takes ``now`` explicitly so tests drive time:
seconds on the master's monotonic clock (``time.monotonic()``), never a wall clock, so
stepping the host's clock neither ends nor stretches a lease, pin, hold or deadline
(wall-clock times shown to operators are converted at the edge,
:meth:`MasterState.list_objects`). Messages that must reach store nodes
(commit/free/copy notices) are appended to :attr:`MasterState.outbox` for the server to
send.

Eviction order is LRU per node (an ``OrderedDict`` moved to the end on access,
:mod:`master.lru`), so choosing a victim is O(1) amortised regardless of index size;
pinned and held objects leave the LRU. The index keeps each key once (the same str in
:attr:`MasterState.objects` and the LRU lists) and each object as a lean
:class:`~master.objects.Obj` naming nodes by number; a node's keys are its LRU lists plus
a small ``fixed`` set (pending, held, hard-pinned), so no per-node key set is kept.
``max_objects`` bounds the index: a put past it evicts the least recently used object
across nodes, or fails with NoSpace.
"""
from __future__ import annotations

import itertools
import math
import os
import random
from collections import defaultdict
from collections.abc import Iterable

from kvpool.master.allocator import RangeAllocator, align_up
from kvpool.master.eviction import Eviction, skip_reason
from kvpool.master.frees import free_extent
from kvpool.master.handoffs import Handoffs
from kvpool.master.layouts import Layouts
from kvpool.master.lru import Lru
from kvpool.master.members import Node
from kvpool.master.objects import COMMITTED, PENDING, Obj
from kvpool.master.placement import placeable, spread
from kvpool.master.repair import Repair, commit_row, grant as _grant
from kvpool.master.reservations import Reservations
from kvpool.master.settings import MasterSettings
from kvpool.master.stats import StatsSnapshot
from kvpool.master.story import Story
from kvpool.master.tiers import Tiers
from kvpool.protocol import errors as E
from kvpool.protocol.errors import ErrorInfo
from kvpool.protocol.keys import validate_key
from kvpool.protocol.layout import LayoutSpec, layout_of
from kvpool.protocol.messages import (ClusterStats, ExtentRef, HandoffRecord, NodeCommit, NodeDesc, NodeFree,
                               ObjectInfo, ObjectMeta, PinRecord, PutGrant, PutItem, TierDone, WIRE_VERSION)

MAX_REPLICAS = 16
REVOKES_PER_TICK = 1024  # silent writers revoked per tick at most (a tick holds the request thread)
DEPARTED_KEEP_S = 120.0  # how long a dropped node's memory may come back and be indexed again
DEPARTED_MAX_KEYS = 200_000  # removals tracked per away node; past that it comes back empty
# a drop's reason -> the story's event and its explanation (master/story.py)
_GONE = {"remove": "removed", "node_lost": "lost", "corrupt": "dropped"}
_WHY = {"remove": "by a client's remove", "node_lost": "its last replica's store node left (it may bring it back)",
        "corrupt": "its last replica failed its checksum", "watermark": "least recently used while a node was above "
        "the high watermark", "max_objects": "least recently used while the master held master.max_objects",
        "admin": "by an operator's kvpool evict", "alloc": "least recently used, to make room for a put", "disk": "least recently used while a disk tier was "
        "above its high watermark"}


class MasterState:
    """All master decisions. Not thread-safe: the server calls it from one event loop.
    ``settings``: its tunables (:attr:`s`; an operator's change replaces the object, so its
    parts read it through ``lambda: self.s``); ``seed``: of placement's random choices
    (:mod:`master.placement`); None: from the OS.

    It owns the index and the node table and these parts, each given the collaborators it
    uses: :attr:`layouts` (:class:`~master.layouts.Layouts`), :attr:`lru`
    (:class:`~master.lru.Lru`, the nodes' LRU lists), :attr:`repair`
    (:class:`~master.repair.Repair`), :attr:`hand` (:class:`~master.handoffs.Handoffs`),
    :attr:`tiers` (:class:`~master.tiers.Tiers`, disk tiers), :attr:`eviction`
    (:class:`~master.eviction.Eviction`) and :attr:`reservations`
    (:class:`~master.reservations.Reservations`), built in that order: each may use the
    ones before it, never one after."""

    def __init__(self, settings: MasterSettings, cluster: str = "default", seed: int | None = None) -> None:
        self.s = settings
        self.cluster = cluster
        self.nodes: dict[str, Node] = {}
        self.objects: dict[str, Obj] = {}
        self.pending: dict[str, Obj] = {}
        # pins and hand-off holds of objects that are away with a store node (it left, or was
        # not indexed at a rebuild): applied when the key is committed again or the node
        # brings the extent back; pins are forgotten (their etcd record deleted) after
        # DEPARTED_KEEP_S, holds when their hand-off closes
        # key -> (record, soft pin ends or None for hard, forget after), both monotonic
        self.waiting_pins: dict[str, tuple[PinRecord, float | None, float]] = {}
        self.waiting_holds: dict[str, set[str]] = {}  # key -> hand-offs naming it
        self.outbox: dict[str, list] = defaultdict(list)  # node id -> notices; the parts share this dict
        # incarnations dropped from the index -> (forget after, keys dropped since): a node
        # that comes back with the same memory must not bring those keys back
        self.departed: dict[str, list] = {}  # incarnation -> [forget after, keys dropped since | None]
        self.unpinned: list[str] = []  # pinned keys dropped since take_unpinned(): their etcd records go
        self.counters: dict[str, int] = defaultdict(int)
        self.story = Story()  # what happened to each object, for `kvpool story` (master/story.py)
        # put ids from a random base per state (per leader): a writer granted by an earlier
        # leader cannot match another put of its key at the new one (put_end by id)
        self._put_ids = itertools.count((int.from_bytes(os.urandom(5), "little") << 20) + 1)
        self.leader_addr = ""
        self.refused: dict[str, int] = {}  # node id -> wire version, nodes of another kvpool version
        self._now = 0.0  # time of the latest event, for bookkeeping that has no `now` argument
        self.rng = random.Random(seed)
        settings_, clock = (lambda: self.s), (lambda: self._now)
        objects, nodes, outbox, counters, story = self.objects, self.nodes, self.outbox, self.counters, self.story
        self.layouts = Layouts()
        self.lru = Lru(nodes, objects, self._drop)
        tables = dict(objects=objects, nodes=nodes, outbox=outbox, counters=counters, story=story,
                      settings=settings_)  # the index and node table every part below shares
        self.repair = Repair(**tables, clock=clock, lru=self.lru, rng=self.rng)
        self.hand = Handoffs(objects, self.waiting_holds, counters, self.lru.add, self.lru.remove,
                             self.repair.maybe_queue, lambda: self.s.max_handoff_ttl_s, clock)
        self.handoffs = self.hand.records  # request id -> Handoff (master/handoffs.py)
        self.tiers = Tiers(**tables, pending=self.pending, departed=self.departed, layouts=self.layouts,
                           lru=self.lru, repair=self.repair, drop=self._drop, report_corrupt=self.report_corrupt,
                           settle_waiting=self._settle_waiting)
        self.eviction = Eviction(nodes, objects, settings_, lru=self.lru, tiers=self.tiers, hand=self.hand,
                                 drop=self._drop)
        self.reservations = Reservations(**tables, pending=self.pending, layouts=self.layouts, repair=self.repair,
                                         eviction=self.eviction, place=self._place,
                                         revoke_pending=self._revoke_pending, settle_waiting=self._settle_waiting)

    # ---- hand-offs (master/handoffs.py) -------------------------------------------------

    def handoff_publish(self, rec: HandoffRecord, now: float) -> HandoffRecord:
        """:meth:`Handoffs.publish <master.handoffs.Handoffs.publish>` at ``now``."""
        self._now = now
        return self.hand.publish(rec, now)

    def handoff_claim(self, request_id: str, now: float) -> HandoffRecord:
        return self.hand.claim(request_id, now)

    def handoff_finish(self, request_id: str, status: str, now: float | None = None) -> bool:
        return self.hand.finish(request_id, status, now)

    def restore_handoff(self, rec: HandoffRecord, now: float) -> None:
        self.hand.restore(rec, now)

    def hold_histogram(self) -> dict[str, tuple[list[int], float]]:
        return self.hand.hold_histogram()

    # ---- membership ---------------------------------------------------------------------

    def node_up(self, desc: NodeDesc, now: float) -> None:
        """A node key appeared (or was re-read). A new incarnation replaces the old node:
        its extents are gone (the node restarted empty)."""
        old = self.nodes.get(desc.node_id)
        if old is not None and old.desc.incarnation == desc.incarnation:
            return
        if old is not None:
            self.node_down(desc.node_id, now)
        node = self.nodes[desc.node_id] = Node(desc, RangeAllocator(desc.capacity))
        away = self.departed.pop(desc.incarnation, None)
        if away is not None:  # the same memory is back (its etcd lease lapsed in an etcd stall)
            node.gone = away[1]
        self.tiers.node_up(node)
        self.counters["node_joins"] += 1
        self.repair.unpark()  # a new place for what could not be re-replicated

    def node_down(self, node_id: str, now: float) -> list[str]:
        """The node's etcd key lapsed or its data plane failed: drop its replicas at once.
        Returns the keys that lost their last replica (now misses)."""
        self._now = now
        node = self.nodes.pop(node_id, None)
        if node is None:
            return []
        self.counters["node_deaths"] += 1
        self.outbox.pop(node_id, None)
        lost: list[str] = []
        for key in node.all_keys():
            obj = self.objects.get(key) or self.pending.get(key)
            if obj is None:
                continue
            obj.replicas = [r for r in obj.replicas if r.node_id != node_id]
            if obj.state == PENDING:
                self._revoke_pending(obj, now, quarantine=False)
                continue
            if not obj.replicas:
                self._drop(obj, reason="node_lost", away=True)
                lost.append(key)
            else:
                self.story.add(key, "replica lost", node_id)
                self.repair.maybe_queue(obj)
        self.repair.cancel(node_id)
        self.reservations.drop_node(node_id, now)
        self.tiers.node_down(node)
        # after the drops above: what the node alone held may come back with it
        self.departed[node.desc.incarnation] = [now + DEPARTED_KEEP_S, set()]
        return lost

    def report_dead(self, node_id: str, incarnation: str, now: float) -> None:
        """A client could not reach ``node_id``: place nothing there for ``suspect_s`` seconds
        (its etcd lease decides whether it is really dead)."""
        node = self.nodes.get(node_id)
        if node is not None and node.desc.incarnation == incarnation:
            node.suspect_until = now + self.s.suspect_s
            self.counters["nodes_reported_dead"] += 1

    def report_corrupt(self, key: str, node_id: str, gen: int, incarnation: str = "",
                       trusted: bool = True) -> None:
        """A reader found this replica failing its checksum under a live lease: drop it (the
        object goes when it has no replica left, so a later put can store it again). An
        untrusted reader's report (a client credential, protocol/auth.py "Roles") never
        drops the last replica of a pinned or held object: a client may not remove those,
        so its report only counts (``corrupt_reports_kept``); readers keep checking the
        checksum, so no wrong byte is served meanwhile."""
        obj = self.objects.get(key)
        if obj is None:
            return
        bad = [r for r in obj.replicas if r.node_id == node_id and r.gen == gen
               and (not incarnation or r.incarnation == incarnation)]
        if not bad:
            return
        if not trusted and len(obj.replicas) == 1 and (obj.pin or obj.holds):
            self.counters["corrupt_reports_kept"] += 1
            self.story.add(key, "corrupt replica reported", (node_id, "kept: a client credential may not drop the "
                                                              "last replica of a pinned or held object"))
            return
        self.counters["replicas_corrupt"] += 1
        self.story.add(key, "corrupt replica reported", (node_id, "dropped"))
        if len(obj.replicas) == 1:
            self._drop(obj, reason="corrupt")
            return
        self.lru.remove(obj)
        obj.replicas = [r for r in obj.replicas if r != bad[0]]
        self.nodes[node_id].drop_key(key)
        free_extent(self.nodes, self.outbox, bad[0])
        self.lru.add(obj)
        self.repair.maybe_queue(obj)

    def tier_done(self, node_id: str, done: TierDone, error: ErrorInfo | None, now: float) -> None:
        """A store node answered a demotion or promotion (``error``: it failed): the event of
        ``now`` (monotonic seconds), handed to :meth:`Tiers.done <master.tiers.Tiers.done>`."""
        self._now = now
        self.tiers.done(node_id, done, error, now)

    def gens_above(self, node_id: str, gen: int) -> None:
        """Rebuild after failover: grant only generations above ``gen`` on this node."""
        node = self.nodes[node_id]
        node.next_gen = itertools.count(max(gen + 1, next(node.next_gen)))

    def restore_extent(self, node_id: str, key: str, offset: int, size: int, gen: int, checksum: int,
                       layout: bytes | LayoutSpec | None, now: float, replicas: int = 0) -> None:
        """Rebuild after failover (or a node's return): a node reported a committed extent
        from its table (``layout``: its encoding, or None). Raises ValueError when the range is not free on the master's side."""
        node = self.nodes[node_id]
        if key in self.pending:  # being written again right now: that put wins
            self.outbox[node_id].append(NodeFree([(offset, gen)]))
            return
        if node.gone is None or key in node.gone:  # removed or evicted while this node was away
            self.outbox[node_id].append(NodeFree([(offset, gen)]))
            return
        node.alloc.reserve(offset, size)
        ref = ExtentRef(node_id, node.desc.incarnation, node.desc.data_addr, node.desc.shm_path,
                        node.desc.host_id, offset, size, gen, ucx_addr=node.desc.ucx_addr)
        node.next_gen = itertools.count(max(gen + 1, next(node.next_gen)))
        obj = self.objects.get(key)
        if obj is None:
            obj = Obj.new(key, size, checksum, self.layouts.intern(layout), [ref], COMMITTED, 0, now, now,
                          replicas_wanted=replicas or self.s.replicas)
            self.objects[key] = obj
        elif obj.checksum == checksum and obj.size == size and (
                not replicas or len(obj.replicas) < max(obj.replicas_wanted, replicas)):
            obj.replicas = [*obj.replicas, ref]
            obj.replicas_wanted = max(obj.replicas_wanted, replicas)
        else:  # other bytes under the key, or a copy more than wanted (re-replicated while this node was away)
            free_extent(self.nodes, self.outbox, ref)
            return
        node.fixed.add(key)
        self.lru.add(obj)
        self._settle_waiting(obj, now)
        if len(obj.replicas) < obj.replicas_wanted:
            self.repair.maybe_queue(obj)  # skipped when it is due if other nodes' tables brought the rest

    def _settle_waiting(self, obj: Obj, now: float) -> None:
        """``obj`` is committed: when a pin or holds were waiting for its key (see
        :attr:`waiting_pins`), apply them if the record names these bytes, else the pin
        record is stale (reported through :meth:`take_unpinned`)."""
        if obj.key not in self.waiting_pins and obj.key not in self.waiting_holds:
            return
        holds = self.waiting_holds.pop(obj.key, None)
        if holds:
            open_ = {r for r in holds if (h := self.handoffs.get(r)) is not None and h.status == "open"}
            if open_:
                self.lru.remove(obj)
                obj.add_holds(open_)
                self.lru.add(obj)
        waiting = self.waiting_pins.pop(obj.key, None)
        if waiting is not None and not self._restore_pin(waiting[0], waiting[1], now):
            self.unpinned.append(obj.key)

    # ---- puts ---------------------------------------------------------------------------

    def put_start(self, items: list[PutItem], host_id: str, replicas: int, now: float
                  ) -> list[PutGrant | ErrorInfo]:
        if not 0 <= replicas <= MAX_REPLICAS:
            raise E.InvalidRequest(f"replicas must be between 1 and {MAX_REPLICAS} (0 = cluster default "
                                   f"{self.s.replicas}), got {replicas}")
        out: list[PutGrant | ErrorInfo] = []
        live = placeable(self.nodes, now)  # once per batch: membership does not change within a call
        for it in items:
            try:
                out.append(self._put_start_one(it, host_id, replicas or self.s.replicas, now, live))
            except E.KVPoolError as e:
                out.append(e.to_wire())
        return out

    def _put_start_one(self, it: PutItem, host_id: str, replicas: int, now: float, live: list[Node]) -> PutGrant:
        key = validate_key(it.key)
        self.counters["puts"] += 1
        if key in self.objects:
            return PutGrant(key, "exists")
        if key in self.pending:
            p = self.pending[key]
            if p.writer_deadline > now:
                return PutGrant(key, "in_flight")
            self._revoke_pending(p, now, quarantine=True)
        if it.size < 0:
            raise E.InvalidRequest(f"object {key!r}: negative size {it.size}", key=key)
        cap = self.s.max_objects
        if cap and len(self.objects) + len(self.pending) >= cap:
            self.eviction.oldest(len(self.objects) + len(self.pending) - cap + 1, now)
            if len(self.objects) + len(self.pending) >= cap:
                raise E.NoSpace(
                    f"no room for {key!r}: the master holds {len(self.objects)} objects and {len(self.pending)} "
                    f"being written, its bound master.max_objects = {cap}, and none can be evicted (all "
                    "leased, pinned, held or being written); remove or unpin objects, wait for leases to "
                    "lapse, or raise master.max_objects", key=key, max_objects=cap)
        refs = self._place(key, it.size, host_id, replicas, now, live)
        put_id = next(self._put_ids)
        obj = Obj.new(key, it.size, it.checksum, self.layouts.intern(it.wire_layout), refs, PENDING, put_id, now, now,
                      writer_deadline=now + self.s.put_timeout_s, replicas_wanted=replicas)
        self.pending[key] = obj
        for r in refs:
            self.nodes[r.node_id].fixed.add(key)
        return PutGrant(key, "write", put_id, list(refs), replicas)

    def _place(self, key: str, size: int, host_id: str, replicas: int, now: float,
               live: list[Node] | None = None, evict: bool = True) -> list[ExtentRef]:
        """Extents for one object (see :meth:`_alloc_on` for ``evict``). Raises NoSpace or
        ObjectTooLarge."""
        if live is None:
            live = placeable(self.nodes, now)
        if not live:
            draining = sum(n.draining for n in self.nodes.values())
            refused = (f", {len(self.refused)} of another kvpool version ({', '.join(sorted(self.refused))}: "
                       "install this release there)") if self.refused else ""
            raise E.NoSpace(f"no store node can take {key!r}: {len(self.nodes)} live, {draining} draining{refused}; "
                            "start one with `kvpool storenode` or check `kvpool status`", key=key)
        need = align_up(max(size, 1))
        fits = [n for n in live if n.alloc.capacity >= need]
        if not fits:
            biggest = max(n.alloc.capacity for n in live)
            raise E.ObjectTooLarge(
                f"object {key!r} is {size} bytes but the largest store node segment is {biggest} bytes; "
                "split it into smaller objects or start store nodes with more --memory",
                key=key, size=size, largest=biggest)
        # writer's host first, then at random weighted by room (master/placement.py); distinct hosts preferred
        if len(fits) > 1:
            fits = spread(fits, lambda n: n.desc.host_id != host_id, self.s.high_watermark, self.rng)
        want = min(replicas, len(fits))
        if want == 1:
            chosen = fits[:1]
        else:
            chosen, hosts = [], set()
            for n in fits:  # one per host first ...
                if len(chosen) < want and n.desc.host_id not in hosts:
                    chosen.append(n)
                    hosts.add(n.desc.host_id)
            for n in fits:  # ... then fill up with distinct nodes on shared hosts
                if len(chosen) < want and n not in chosen:  # (nodes compare by identity)
                    chosen.append(n)
        refs: list[ExtentRef] = []
        spare = None
        for n in chosen:
            off = self._alloc_on(n, size, now, evict)
            if off is None and spare is None:
                spare = [m for m in fits if m not in chosen]
            while off is None and spare:
                n = spare.pop(0)
                off = self._alloc_on(n, size, now, evict)
            if off is None:
                for r in refs:
                    self.nodes[r.node_id].alloc.free(r.offset, r.size)
                raise E.NoSpace(
                    f"no room for {key!r} ({size} bytes) on {want} store node(s) even after evicting "
                    "every unleased, unpinned object; wait for leases to lapse, unpin objects "
                    "(`kvpool ls --long`), or add store nodes", key=key, size=size)
            refs.append(_grant(n, off, size, key))
        return refs

    def _alloc_on(self, node: Node, size: int, now: float, evict: bool = True) -> int | None:
        """An offset for ``size`` bytes on ``node``, evicting on failure; with ``evict`` False
        only from free memory that stays under the high watermark (extents reserved ahead
        of need must not push out data)."""
        node.release_quarantine(now)
        if not evict:
            if node.alloc.used + align_up(max(size, 1)) > self.s.high_watermark * node.alloc.capacity:
                return None
            return node.alloc.alloc(size)
        off = node.alloc.alloc(size)
        if off is None:
            # evict on allocation failure, then retry once
            self.eviction.evict_node(node, target_used=None, need=align_up(max(size, 1)), now=now,
                                     reason="alloc")
            off = node.alloc.alloc(size)
        return off

    def put_end(self, keys: list[str], put_ids: list[int], now: float,
                checksums: list[int] | None = None) -> list[ErrorInfo | None]:
        """Commit pending puts; ``checksums`` (if given, one per key) replace put_start's."""
        if checksums and len(checksums) != len(keys):
            raise E.InvalidRequest(f"put_end: {len(keys)} keys but {len(checksums)} checksums")
        if len(put_ids) != len(keys):
            raise E.InvalidRequest(f"put_end: {len(keys)} keys but {len(put_ids)} put ids")
        out: list[ErrorInfo | None] = []
        for i, (key, pid) in enumerate(zip(keys, put_ids)):
            obj = self.pending.get(key)
            if obj is None or obj.put_id != pid:
                if key in self.objects and self.objects[key].put_id == pid:
                    out.append(None)  # idempotent repeat
                    continue
                out.append(E.PutRevoked(
                    f"put of {key!r} (put_id {pid}) was revoked (writer silent past put_timeout, "
                    "or a store node died); write it again", key=key).to_wire())
                continue
            del self.pending[key]
            if checksums:
                obj.checksum = checksums[i]
            obj.state = COMMITTED
            obj.writer_deadline = 0.0
            obj.last_access = now
            self.objects[key] = obj
            for r in obj.replicas:
                self.outbox[r.node_id].append(NodeCommit([commit_row(obj, r)]))
            self.story.add(key, "stored", obj.node_ids())
            self.lru.add(obj)
            self._settle_waiting(obj, now)
            if len(obj.replicas) < obj.replicas_wanted:  # fewer nodes could take it than it asked for
                self.repair.maybe_queue(obj)
            out.append(None)
        self.eviction.enforce_watermarks(now)
        return out

    def put_revoke(self, keys: list[str], put_ids: list[int], now: float) -> list[ErrorInfo | None]:
        if len(put_ids) != len(keys):
            raise E.InvalidRequest(f"put_revoke: {len(keys)} keys but {len(put_ids)} put ids")
        out: list[ErrorInfo | None] = []
        for key, pid in zip(keys, put_ids):
            obj = self.pending.get(key)
            if obj is not None and obj.put_id == pid:
                self._revoke_pending(obj, now, quarantine=True)
            out.append(None)
        return out

    def _revoke_pending(self, obj: Obj, now: float, quarantine: bool) -> None:
        self.pending.pop(obj.key, None)
        self.counters["puts_revoked"] += 1
        self.story.add(obj.key, "write revoked", "its writer was silent past put_timeout, another put of the key "
                       "replaced it, or a store node it wrote to left" if quarantine else "a store node it wrote to left")
        for r in obj.replicas:
            node = self.nodes.get(r.node_id)
            if node is None:
                continue
            node.drop_key(obj.key)
            self.outbox[r.node_id].append(NodeFree([(r.offset, r.gen)]))
            if quarantine:
                node.quarantine.append((now + self.s.quarantine_s, r.offset, r.size))
            else:
                node.alloc.free(r.offset, r.size)

    # ---- reads --------------------------------------------------------------------------

    def lookup(self, keys: list[str], lease: bool, now: float) -> list[ObjectInfo | ErrorInfo]:
        out: list[ObjectInfo | ErrorInfo] = []
        ttl = self.s.lease_ttl_s if lease else 0.0
        until = now + ttl
        # with disk tiers (master/tiers.py), LRU order spans both, and reads may promote
        touch = self.lru.touch_tiered if self.lru.disk_nodes else self.lru.touch
        tiered = lease and self.lru.disk_nodes
        for key in keys:
            obj = self.objects.get(key)
            if lease:  # a read; lease-free lookups are metadata queries and are not counted
                self.counters["gets"] += 1
            if obj is None:
                self.counters["misses"] += lease
                out.append(E.NotFound(f"key {key!r} is not stored", key=key).to_wire())
                continue
            self.counters["hits"] += lease
            touch(obj, now)
            if lease:
                if obj.lease_until <= now:
                    obj.lease_count = 0
                obj.lease_count += 1
                if obj.lease_until < until:
                    obj.lease_until = until  # one float per call, shared by its objects
            size, checksum, refs = obj.read_view()
            if tiered:
                self.tiers.read(obj, refs, now)
            out.append(ObjectInfo(key, size, checksum, self.layouts.wire(obj.layout), refs, ttl))
        return out

    def release_leases(self, keys: list[str], now: float) -> None:
        """Readers finished: a lease whose every holder released lapses at once."""
        for key in keys:
            obj = self.objects.get(key)
            if obj is not None and obj.lease_count > 0:
                obj.lease_count -= 1
                if obj.lease_count == 0:
                    obj.lease_until = min(obj.lease_until, now)

    def exists(self, keys: list[str]) -> list[bool]:
        """Existence without a lease and without touching LRU order."""
        return [k in self.objects for k in keys]

    # ---- removal and eviction -----------------------------------------------------------

    def remove(self, keys: list[str], force: bool, now: float) -> list[ErrorInfo | None]:
        out: list[ErrorInfo | None] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                out.append(E.NotFound(f"key {key!r} is not stored", key=key).to_wire())
                continue
            why = skip_reason(obj, now)
            if why and not force:
                err = (E.HasLease(f"{key!r} has a live read lease; retry after it lapses "
                                  f"({self.s.lease_ttl_s:g}s) or force it (kvpool rm --force; force=True)", key=key)
                       if why == "leased" else
                       E.Pinned(f"{key!r} is {why}; unpin it / ack the hand-off, or force it (kvpool rm --force; "
                                "force=True)", key=key))
                out.append(err.to_wire())
                continue
            self._drop(obj, reason="remove")
            out.append(None)
        return out

    def _drop(self, obj: Obj, reason: str, away: bool = False) -> None:
        """Forget ``obj``. ``away``: it left with its store node, which may bring it back
        (DEPARTED_KEEP_S): its pin and holds wait for it instead of ending."""
        self.objects.pop(obj.key, None)
        for dep in self.departed.values():
            if dep[1] is not None:
                dep[1].add(obj.key)
                if len(dep[1]) > DEPARTED_MAX_KEYS:
                    dep[1] = None
        if away and obj.pin:
            until = None if obj.pin == "hard" else obj.pin_until
            rec = PinRecord(obj.key, None if until is None else max(until - self._now, 0.0), obj.size, obj.checksum)
            self.waiting_pins[obj.key] = (rec, until, self._now + DEPARTED_KEEP_S)
        elif obj.pin:
            self.unpinned.append(obj.key)
        if away and obj.holds:
            self.waiting_holds.setdefault(obj.key, set()).update(obj.holds)
        self.lru.remove(obj)
        for r in obj.replicas:
            free_extent(self.nodes, self.outbox, r)
            node = self.nodes.get(r.node_id)
            if node is not None:
                node.drop_key(obj.key)
        self.counters[f"evictions_{reason}"] += 1
        self.story.add(obj.key, _GONE.get(reason, "evicted"), _WHY.get(reason, reason))

    # ---- pins ---------------------------------------------------------------------------

    def check_pin(self, key: str, ttl_s: float | None) -> Obj:
        """The object :meth:`pin` would pin, without pinning; raises what it would refuse
        (InvalidRequest, NotFound)."""
        if ttl_s is not None and not (math.isfinite(ttl_s) and ttl_s > 0):
            raise E.InvalidRequest(f"pin ttl must be a finite number of seconds > 0, got {ttl_s}")
        return self._get(key)

    def pin(self, key: str, ttl_s: float | None, now: float) -> None:
        """Hard pin (``ttl_s=None``) or soft pin for ``ttl_s`` seconds (finite, > 0)."""
        self._now = now
        self.check_pin(key, ttl_s)
        obj = self._get(key)
        self.lru.remove(obj)
        obj.pin = "hard" if ttl_s is None else "soft"
        obj.pin_until = 0.0 if ttl_s is None else now + ttl_s
        self.story.add(key, "pinned", "hard" if ttl_s is None else f"soft, {ttl_s:g}s")
        self.lru.add(obj)
        self.repair.maybe_queue(obj)

    def check_unpin(self, key: str) -> None:
        """Raises NotFound unless ``key`` is stored or has a pin waiting for its node."""
        if key not in self.waiting_pins:
            self._get(key)

    def unpin(self, key: str) -> None:
        """Unpin ``key``, or cancel its pin waiting for a node that is away."""
        if self.waiting_pins.pop(key, None) is not None and key not in self.objects:
            return
        obj = self._get(key)
        self.lru.remove(obj)
        obj.pin, obj.pin_until = "", 0.0
        self.story.add(key, "unpinned")
        self.lru.add(obj)

    def _get(self, key: str) -> Obj:
        obj = self.objects.get(key)
        if obj is None:
            raise E.NotFound(f"key {key!r} is not stored; see `kvpool ls`", key=key)
        return obj

    # ---- periodic work ------------------------------------------------------------------

    def tick(self, now: float) -> list[str]:
        """Revoke silent writers (up to :data:`REVOKES_PER_TICK`), expire hand-offs and soft
        pins, enforce watermarks.
        Returns the request ids of hand-off records that expired (the server deletes them
        from etcd)."""
        late = (o for o in self.pending.values() if o.writer_deadline <= now)  # oldest first
        for obj in list(itertools.islice(late, REVOKES_PER_TICK)):  # the rest on the next ticks
            self._revoke_pending(obj, now, quarantine=True)
        if self.reservations.held:
            self.reservations.expire(now)
        for inc in [i for i, (until, _) in self.departed.items() if until <= now]:
            del self.departed[inc]
        for key in [k for k, (_, until, forget) in self.waiting_pins.items()
                    if forget <= now or (until is not None and until <= now)]:
            del self.waiting_pins[key]  # its node did not bring it back in time, or the soft pin lapsed
            self.unpinned.append(key)
        self._now = now
        for node in self.nodes.values():
            node.release_quarantine(now)
        self.repair.expire(now)
        expired = []
        for h in self.handoffs.values():
            if h.status == "open" and h.deadline <= now:
                self.hand.release(h, "expired")
                expired.append(h.record.request_id)
        # forget closed records after a while (keep them long enough for idempotent repeats)
        for rid in [r for r, h in self.handoffs.items()
                    if h.status != "open" and h.deadline + 3600 <= now]:
            del self.handoffs[rid]
        self.eviction.enforce_watermarks(now)
        if self.lru.disk_nodes:
            self.tiers.tick(now)
        self.repair.pump(now)
        return expired

    # ---- introspection ------------------------------------------------------------------

    def list_objects(self, prefix: str, limit: int, now: float, wall: float | None = None) -> list[ObjectMeta]:
        """Up to ``limit`` objects under ``prefix`` at ``now`` (monotonic). ``wall``: the wall
        clock (Unix seconds) read together with ``now``, to show created/last-access times
        as times of day (without it they stay on the monotonic clock). Raises
        InvalidRequest for a limit below 1."""
        if limit < 1:
            raise E.InvalidRequest(f"ls limit must be >= 1, got {limit}")
        to_wall = 0.0 if wall is None else wall - now
        out = []
        for o in self.objects.values():
            if o.key.startswith(prefix):
                pin = o.pin if (o.pin != "soft" or o.pin_until > now) else ""
                tiers = [_TIER_NAMES[t] for _, t in o.tiers()] if self.lru.disk_nodes else []
                out.append(ObjectMeta(o.key, o.size, layout_of(o.layout).kind if o.layout else "raw",
                                      o.node_ids(), o.created + to_wall, o.last_access + to_wall,
                                      o.lease_until > now, pin, bool(o.holds), o.replicas_wanted,
                                      now - o.created, now - o.last_access, tiers))
                if len(out) >= limit:
                    break
        return out

    def screen(self, descs: Iterable[NodeDesc]) -> tuple[list[NodeDesc], list[NodeDesc]]:
        """Split published store nodes into those this master may place on (same
        :data:`~protocol.messages.WIRE_VERSION`) and those newly refused for speaking another
        version (to report once); :attr:`refused` becomes the refused set of now."""
        descs = list(descs)  # walked twice below
        ok, refused = [], {}
        for d in descs:
            if d.wire == WIRE_VERSION:
                ok.append(d)
            else:
                refused[d.node_id] = d.wire
        new = [d for d in descs if d.node_id in refused and self.refused.get(d.node_id) != d.wire]
        self.refused = refused
        return ok, new

    def stats(self) -> ClusterStats:
        """The cluster's statistics, walking the index here (O(objects)); the server takes a
        :meth:`stats_snapshot` instead and walks it off its request thread."""
        return self.stats_snapshot().finish()

    def stats_snapshot(self) -> StatsSnapshot:
        """A snapshot for :meth:`~master.stats.StatsSnapshot.finish` on another thread: one
        C-level copy of the index, no per-object work here."""
        return StatsSnapshot.take(self)

    def restore_pin(self, rec: PinRecord, now: float) -> bool:
        """Rebuild after failover from the etcd record; False when the record is stale (the
        object under the key is another one now, or the soft pin has no time left,
        ``ttl_s`` <= 0): delete it. A soft pin is re-armed for its full ``ttl_s`` seconds
        from ``now`` (monotonic): how much of it passed before the failover is unknown, and
        a pin is never shortened, so it may outlive its ttl by up to one ttl. A record naming
        no indexed object waits (:attr:`waiting_pins`) for a store node to bring it back:
        one that is away, refused for its version or not answering now."""
        return self._restore_pin(rec, None if rec.ttl_s is None else now + rec.ttl_s, now)

    def _restore_pin(self, rec: PinRecord, until: float | None, now: float) -> bool:
        """:meth:`restore_pin` with the soft pin ending at ``until`` (monotonic; None: hard)."""
        if until is not None and not until > now:  # also NaN
            return False
        obj = self.objects.get(rec.key)
        if obj is None:
            self.waiting_pins[rec.key] = (rec, until, now + DEPARTED_KEEP_S)
            return True
        if (obj.size, obj.checksum) != (rec.size, rec.checksum):
            return False
        self.pin(rec.key, None if until is None else until - now, now)
        return True

    def take_unpinned(self) -> list[str]:
        out, self.unpinned = self.unpinned, []
        return out

    def take_outbox(self) -> dict[str, list]:
        """The notices queued so far (node id -> messages); the outbox is empty after (the
        same dict, which the parts append to)."""
        out = defaultdict(list, self.outbox)
        self.outbox.clear()
        return out


_TIER_NAMES = ("memory", "disk")  # by ExtentRef.tier
