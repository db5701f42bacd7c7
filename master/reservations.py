"""Extents reserved ahead of need: a put in one round trip to the master.

A writer asks for ``count`` extents of one size (``Reserve``) before it has the keys; the
master places them as it would a put (:meth:`MasterState._place`), keyed by nothing, and
answers with write grants whose tokens name no object (:func:`protocol.grants.grant_token`
with key ``""``). The writer claims them on same-host nodes at once (the claim rules of
:mod:`storenode.extents` hold unchanged: a claim is taken before any byte lands), copies
an object into one when it has one, and commits it with ``PutReserved``: the key, the
reservation id and the checksum. The master indexes the object there and then, sends the
nodes its commit notice, and answers with the keyed tokens of the object's replicas (the
writer's own ``commit`` copy to the node names the key, so a failover can rebuild the
index from the nodes) and, when asked, the next reservations. So a same-host put is one
copy and one round trip to the master, against three round trips with ``put_start``.

A reservation lives ``put_timeout_s`` at the master (the writer uses it within half of
that, measured from when it asked); past it, or when the writer gives it back, its extents
are freed (free notice to the nodes, quarantined like a revoked put: its writer may still
be copying). A key already stored (or being written) leaves the reservation reserved for
the writer's next object. Reservations are a leader's own: a new leader knows none, so
a commit naming one of an earlier term fails with PutRevoked and the writer puts the
object again (the node refuses the old term's claims and commits, :mod:`protocol.terms`).

Bounds: one call reserves at most :data:`MAX_PER_CALL` extents and :data:`MAX_BYTES_PER_CALL`
bytes; reserved bytes count as used memory. Extents a put needs now are placed as a put's
are (evicting when memory is short); those reserved ahead of need only in free memory under
the high watermark and within :data:`AHEAD_SHARE` of each node's segment, so reserving
ahead never pushes data out and never takes more than a small share of the cache. A
reservation ahead of need carries as many replicas as a put placed now would get, or is not
made: where too few nodes have room ahead, the writer's put asks for its extents when it
needs them (and may evict), so a put is short only when the cluster lacks nodes or room.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.master.allocator import align_up
from kvpool.master.objects import COMMITTED, Obj
from kvpool.master.placement import placeable, room
from kvpool.master.repair import grant as _grant
from kvpool.protocol import errors as E
from kvpool.protocol.grants import grant_token
from kvpool.protocol.keys import validate_key
from kvpool.protocol.messages import ExtentEntry, ExtentRef, NodeCommit, NodeFree, Reservation, Reserved, ReservedPut

if TYPE_CHECKING:
    from kvpool.master.eviction import Eviction
    from kvpool.master.layouts import Layouts
    from kvpool.master.members import Node
    from kvpool.master.repair import Repair
    from kvpool.master.settings import MasterSettings
    from kvpool.master.story import Story

MAX_PER_CALL = 1024  # extents one Reserve may ask for
MAX_BYTES_PER_CALL = 1 << 30  # bytes one Reserve may ask for
AHEAD_SHARE = 1 / 16  # reservations ahead of need hold at most this share of a node's segment


@dataclass(slots=True)
class Held:
    """One reservation: its size (bytes), replicas, wanted replica count and the monotonic
    time after which the master frees it."""

    size: int
    refs: list[ExtentRef]
    wanted: int
    until: float


class Reservations:
    """Reserve, commit into and give back reserved extents (see the module docstring).
    Given the index ``objects`` (key -> committed Obj) and ``pending`` (key -> Obj being
    written), the node table ``nodes`` (node id -> Node), the state's ``outbox`` (node id
    -> notices), ``counters`` and ``story``, ``settings()`` (the state's current
    :class:`~master.settings.MasterSettings`: ``put_timeout_s``, ``quarantine_s``, replica
    count, watermarks, ``max_objects``), ``layouts`` (shared layout encodings), ``repair``
    (queues an object placed short), ``eviction`` (watermarks and the index bound) and the
    state's ``place(key, size, host_id, replicas, now, live, evict)`` (extents for one
    object, as a put's), ``revoke_pending(obj, now, quarantine)`` (ends a silent writer's
    put) and ``settle_waiting(obj, now)`` (applies a pin or holds that waited for the key).
    :attr:`held`: reservation id -> :class:`Held`."""

    def __init__(self, objects: dict[str, Obj], pending: dict[str, Obj], nodes: dict[str, Node],
                 outbox: dict[str, list], counters: dict[str, int], story: Story,
                 settings: Callable[[], MasterSettings], layouts: Layouts, repair: Repair, eviction: Eviction,
                 place: Callable[..., list[ExtentRef]], revoke_pending: Callable[[Obj, float, bool], None],
                 settle_waiting: Callable[[Obj, float], None]) -> None:
        self.objects, self.pending, self.nodes, self.outbox = objects, pending, nodes, outbox
        self.counters, self.story, self.settings, self.layouts = counters, story, settings, layouts
        self.repair, self.eviction = repair, eviction
        self._place, self._revoke_pending, self._settle_waiting = place, revoke_pending, settle_waiting
        self.held: dict[int, Held] = {}  # reservation id -> extents reserved ahead
        self._rid_pool: list[int] = []  # random reservation ids drawn ahead

    def reserve(self, size: int, count: int, host_id: str, replicas: int, now: float,
                release: list[int] | None = None, ahead: int = 0) -> Reserved:
        """Up to ``count`` + ``ahead`` reservations of ``size`` bytes (``replicas`` each; 0: the
        cluster default), after giving back ``release``. The first ``count`` are placed as
        puts are (evicting when memory is short); the ``ahead`` ones only in free memory under
        the high watermark, so that reserving ahead never pushes data out. Fewer when the
        nodes cannot take more: the reply's ``error`` says why none could be placed. Raises
        InvalidRequest for a size below 1, counts outside 0..MAX_PER_CALL in all or a call
        over MAX_BYTES_PER_CALL."""
        s = self.settings()
        if release:
            self.release(release, now)
        n = count + ahead
        if n == 0:
            return Reserved([], s.put_timeout_s, replicas or s.replicas)
        if (not 1 <= size or count < 0 or ahead < 0 or n > MAX_PER_CALL
                or align_up(size) * n > MAX_BYTES_PER_CALL):
            raise E.InvalidRequest(f"reserve: {count} + {ahead} extents of {size} bytes; accepted: size >= 1, at "
                                   f"most {MAX_PER_CALL} extents and {MAX_BYTES_PER_CALL} bytes per call")
        if not 0 <= replicas <= 16:
            raise E.InvalidRequest(f"replicas must be between 1 and 16 (0 = cluster default), got {replicas}")
        wanted = replicas or s.replicas
        live = placeable(self.nodes, now)
        out: list[Reservation] = []
        until = now + s.put_timeout_s
        error = None
        if wanted == 1 and ahead > 1:  # one range for those ahead, cut into extents (same placement)
            for refs in self._ahead_in_ranges(size, host_id, now, live, ahead):
                rid = self._res_id()
                self.held[rid] = held = Held(size, refs, wanted, until)
                self._count_held(held, 1)
                out.append(Reservation(rid, refs))
            n = count + ahead - len(out)
        full = min(wanted, len(live))  # replicas a put placed now would get: ahead ones get as many or none
        for i in range(n):
            if i >= count:  # ahead of need: within each node's share for reservations
                live = [nd for nd in live if nd.reserved + size <= AHEAD_SHARE * nd.alloc.capacity]
                if len(live) < full:  # fewer nodes have room ahead than a put would get now:
                    break  # a short reservation would make a short put with room to spare
            try:
                refs = self._place("", size, host_id, wanted, now, live, evict=i < count)
            except E.KVPoolError as e:
                error = e.to_wire()
                break
            if i >= count and len(refs) < full:  # placed short (no room under the watermark on enough nodes)
                for r in refs:
                    self.nodes[r.node_id].alloc.free(r.offset, r.size)
                break
            rid = self._res_id()
            self.held[rid] = held = Held(size, refs, wanted, until)
            self._count_held(held, 1)
            out.append(Reservation(rid, refs))
        self.counters["reserved"] += len(out)
        return Reserved(out, s.put_timeout_s, wanted, None if out else error)

    def _res_id(self) -> int:
        """A fresh reservation id: 63 random bits from the OS, so that a client cannot commit
        into a reservation it was not given (ids are the only proof of ownership). Drawn 512
        at a time (one ``getrandom`` call)."""
        while True:
            if not self._rid_pool:
                raw = os.urandom(8 * 512)
                self._rid_pool = [int.from_bytes(raw[i:i + 8], "little") >> 1 for i in range(0, len(raw), 8)]
            rid = self._rid_pool.pop()
            if rid and rid not in self.held:
                return rid

    def _ahead_in_ranges(self, size: int, host_id: str, now: float, live: list, k: int) -> list[list[ExtentRef]]:
        """Up to ``k`` single-replica extents of ``size`` bytes, cut from one free range on
        each of the nodes placement ranks best (the writer's host's nodes, else all). The
        ``k`` are shared out in proportion to each node's room below the high watermark
        (largest remainders), as :func:`master.placement.spread` weights a put's node, and
        interleaved by stride (extent i of a node's n sits at (i + 1/2) / n), so that
        consecutive puts spread over those nodes in the same proportions. The allocator
        keeps nothing per extent, so each is freed on its own later. A node takes no more
        than fits within its share for reservations and under the high watermark; one
        whose range cannot be cut gives none (the caller places the rest one by one).
        Grants as the state's ``place``, for a fraction of the cost per extent."""
        need = align_up(size)
        hw = self.settings().high_watermark
        fits = [nd for nd in live if nd.alloc.capacity >= need]
        if not fits:
            return []
        rank = lambda nd: nd.desc.host_id != host_id  # noqa: E731 - the same rank _place uses
        best = [nd for nd in fits if not rank(nd)] or fits
        rooms = [max(0.0, room(nd, hw)) for nd in best]
        total = sum(rooms)
        if total <= 0:
            return []
        quota = [k * r / total for r in rooms]
        takes = [int(q) for q in quota]
        for i in sorted(range(len(best)), key=lambda i: takes[i] - quota[i])[:k - sum(takes)]:
            takes[i] += 1
        runs: list[list[list[ExtentRef]]] = []
        for node, take in zip(best, takes):
            take = min(take, int((AHEAD_SHARE * node.alloc.capacity - node.reserved) // need),
                       int((hw * node.alloc.capacity - node.alloc.used) // need))
            if take <= 0:
                continue
            node.release_quarantine(now)
            base = node.alloc.alloc(need * take)
            if base is not None:
                runs.append([[_grant(node, base + i * need, size, "")] for i in range(take)])
        slots = [((i + 0.5) / len(run), j, refs) for j, run in enumerate(runs) for i, refs in enumerate(run)]
        return [refs for _, _, refs in sorted(slots, key=lambda t: (t[0], t[1]))]

    def put(self, items: list[ReservedPut], now: float) -> tuple[list, list[list[bytes]]]:
        """Commit objects written into reservations. Per item: None (committed; its keyed
        replica tokens in the second list), ``"exists"`` or ``"in_flight"`` (the key is stored
        or being written: nothing indexed, the reservation stays the writer's), or an
        ErrorInfo: PutRevoked for a reservation this leader does not hold (expired, given
        back, its node died, or granted by an earlier leader), InvalidRequest for a size
        other than the reservation's, NoSpace past ``max_objects``."""
        results: list = []
        tokens: list[list[bytes]] = []
        rows: dict[str, list] = {}  # node id -> commit rows of this call: one notice per node
        for it in items:
            toks: list[bytes] = []
            try:
                results.append(self._put_one(it, now, toks, rows))
            except E.KVPoolError as e:
                results.append(e.to_wire())
            tokens.append(toks)
        for node_id, r in rows.items():
            self.outbox[node_id].append(NodeCommit(r))
        self.eviction.enforce_watermarks(now)
        return results, tokens

    def _put_one(self, it: ReservedPut, now: float, toks: list[bytes], rows: dict[str, list]) -> str | None:
        key = validate_key(it.key)
        held = self.held.get(it.res_id)
        if held is None and (obj := self.objects.get(key)) is not None and obj.put_id == it.res_id:
            for r in obj.replicas:  # a repeat (the reply was lost): the same answer
                if (node := self.nodes.get(r.node_id)) is not None:
                    d = node.desc
                    toks.append(grant_token(d.grant_key, d.incarnation, r.offset, r.size, r.gen, key))
            return None
        if held is None or held.until <= now:
            raise E.PutRevoked(f"reservation {it.res_id} for {key!r} is not held by this master (it expired after "
                               "put_timeout, was given back, lost its store node, or an earlier leader granted it); "
                               "put the object again", key=key)
        if it.size != held.size:
            raise E.InvalidRequest(f"object {key!r} has {it.size} bytes but reservation {it.res_id} is for "
                                   f"{held.size}", key=key)
        self.counters["puts"] += 1
        if key in self.objects:
            return "exists"
        if key in self.pending:
            p = self.pending[key]
            if p.writer_deadline > now:
                return "in_flight"
            self._revoke_pending(p, now, quarantine=True)
        cap = self.settings().max_objects
        if cap and len(self.objects) + len(self.pending) >= cap:
            self.eviction.oldest(len(self.objects) + len(self.pending) - cap + 1, now)
            if len(self.objects) + len(self.pending) >= cap:
                raise E.NoSpace(f"no room for {key!r}: the master holds {len(self.objects)} objects, its bound "
                                f"master.max_objects = {cap}, and none can be evicted; remove or unpin objects, "
                                "or raise master.max_objects", key=key, max_objects=cap)
        del self.held[it.res_id]
        layout = self.layouts.intern(it.wire_layout)
        obj = Obj.new(key, held.size, it.checksum, layout, held.refs, COMMITTED, it.res_id, now, now,
                      replicas_wanted=held.wanted)
        self.objects[key] = obj
        lay = layout
        for r in held.refs:  # a fresh, plain object: the hot end of each of its nodes' LRU lists
            node = self.nodes[r.node_id]
            node.reserved -= r.size
            node.lru[key] = None
            d = node.desc
            toks.append(grant_token(d.grant_key, d.incarnation, r.offset, r.size, r.gen, key))
            rows.setdefault(r.node_id, []).append(ExtentEntry(key, r.offset, r.size, r.gen, it.checksum, lay, True,
                                                              held.wanted))
        self.counters["puts_reserved"] += 1
        self.story.add(key, "stored", [r.node_id for r in held.refs])  # obj.node_ids(), unpacked
        self._settle_waiting(obj, now)
        if len(held.refs) < held.wanted:
            self.repair.maybe_queue(obj)
        return None

    def release(self, res_ids: list[int], now: float) -> None:
        """Give reservations back (unknown ids are ignored): their extents are freed once the
        quarantine has passed, since their writer may still be copying."""
        for rid in res_ids:
            held = self.held.pop(rid, None)
            if held is not None:
                self._free_reserved(held, now)

    def _count_held(self, held: Held, sign: int) -> None:
        for r in held.refs:
            node = self.nodes.get(r.node_id)
            if node is not None:
                node.reserved += sign * r.size

    def _free_reserved(self, held: Held, now: float) -> None:
        self._count_held(held, -1)
        for r in held.refs:
            node = self.nodes.get(r.node_id)
            if node is None:
                continue
            self.outbox[r.node_id].append(NodeFree([(r.offset, r.gen)]))
            node.quarantine.append((now + self.settings().quarantine_s, r.offset, r.size))

    def expire(self, now: float) -> None:
        """Free the reservations whose time has passed (called from the state's tick)."""
        for rid in [rid for rid, h in self.held.items() if h.until <= now]:
            self.counters["reservations_expired"] += 1
            self._free_reserved(self.held.pop(rid), now)

    def drop_node(self, node_id: str, now: float) -> None:
        """``node_id`` left: its reservations go (the other replicas' extents are freed)."""
        for rid in [rid for rid, h in self.held.items() if any(r.node_id == node_id for r in h.refs)]:
            self._free_reserved(self.held.pop(rid), now)

    def held_bytes(self) -> int:
        """Bytes reserved ahead of need on every node together."""
        return sum(n.reserved for n in self.nodes.values())
