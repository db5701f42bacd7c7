"""Puts into extents reserved ahead of need: one copy and one round trip to the master.

The client holds reservations per object size (:mod:`connector.reservations`; protocol in
:mod:`master.reservations`). A put takes one per object (asking for any it lacks first),
copies each object into its extents (same host: straight into the claimed shared mapping;
network: a ``write`` to the node, which claims while the bytes land), then commits the
batch with one ``PutReserved`` whose reply carries the next reservations when the pool runs
low. The ``written_all`` frames that end the claims and the writer's ``commit`` copies of
what was acknowledged are queued and go to each same-host node in one send: right after a
put that committed a batch, else at most 5 ms later (see :meth:`ReservedPuts._end_claims`).

Anything this path cannot finish (a refused claim, a failed write, a reservation the master
no longer holds, a new leader) falls back to ``put_start``/``put_end`` for that object, so
its outcome is what a put without reservations would report. A daemon thread gives back
reservations that reach their use-by time unused.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import msgspec

from kvpool.connector.dataclient import WriteOp
from kvpool.connector.prehash import prehash
from kvpool.connector.reservations import CLAIM_AHEAD, ReservationPool, Slot
from kvpool.protocol import messages as M
from kvpool.protocol.errors import KVPoolError, NodeUnavailable, PutRevoked, from_wire
from kvpool.protocol.layout import layout_bytes

_REAP_S = 1.0  # the reaper looks for expired reservations at least this often (seconds)
_FLUSH_S = 0.005  # queued claim ends and commit copies wait at most this long (seconds)
_FLUSH_ITEMS = 256  # ... or until this many are queued
_FLUSH_BATCH = 16  # ... or at once after a put that committed this many
_EARLY_REFILL_BYTES = 1 << 20  # a put copying this many bytes asks for its refill first, copying meanwhile


class ReservedPuts:
    """The reserved-put path of one :class:`~connector.client.KVPoolClient` (its
    ``reserved``), built with what it uses of the client: ``rpc`` (its MasterRPC), ``data``
    (its DataPlane), ``host_id``; ``parallel(fn, by_node)`` runs writes per node;
    ``write_deadline`` bounds one replica's write (None: the I/O timeout);
    ``await_in_flight(items, idx, positions, results)`` waits for another writer's put of
    the same key; ``remember(key, ref)`` notes where a key lives (connector/hinted_reads.py).
    ``budget_bytes``: reservations held at most; ``max_object_bytes``: the largest object
    put this way."""

    def __init__(self, rpc, data, host_id: str, budget_bytes: int, max_object_bytes: int,
                 parallel: Callable, write_deadline, await_in_flight: Callable, remember: Callable) -> None:
        self.rpc, self.data, self.host_id = rpc, data, host_id
        self._parallel, self._write_deadline = parallel, write_deadline
        self._await_in_flight, self._remember = await_in_flight, remember
        self.reserve_budget = budget_bytes
        self.reserve_max_object = max_object_bytes
        self._res_pool = ReservationPool(budget_bytes)
        self._reaper: threading.Thread | None = None
        self._reaper_stop = threading.Event()
        self._reaper_wake = threading.Event()
        self._reaper_lock = threading.Lock()
        self._ends_lock = threading.Lock()
        # (node id, incarnation) -> (claims to end, commit copies), queued (see _end_claims)
        self._ends: defaultdict = defaultdict(lambda: ([], []))
        self._ends_n = 0
        self._ends_since = 0.0
        self._term_seen = 0  # the leader term whose reservations the pool holds (see forget_old_terms)

    def reservable(self, size: int) -> bool:
        return self.reserve_budget > 0 and 0 < size <= self.reserve_max_object

    # ---- the put ------------------------------------------------------------------------

    def put(self, items, bufs, idx, replicas, results, stored) -> list[int]:
        """Put ``items`` through reservations; returns the positions (in ``items``) left for
        ``put_start`` (not reservable, or this path could not finish them)."""
        self.forget_old_terms()
        rep = replicas or 0
        fallback: list[int] = []
        by_size: dict[int, list[int]] = {}
        for j, it in enumerate(items):
            js = by_size.get(it.size)
            if js is None:
                js = by_size[it.size] = []
            js.append(j)
        for size in [size for size in by_size if not self.reservable(size)]:
            fallback += by_size.pop(size)
        fallback.sort()
        slot_of: dict[int, Slot] = {}
        now = time.monotonic()
        try:
            for size, js in by_size.items():
                slots = self._res_pool.take(size, rep, len(js), now, self.rpc.term)
                slot_of.update(zip(js, slots))
                if len(slots) < len(js):
                    more = self._reserve(size, rep, len(js) - len(slots))
                    slot_of.update(zip(js[len(slots):], more))
                    slots += more
                fallback += js[len(slots):]
        except BaseException:  # the master did not answer: what this call took goes back to the pool
            self._res_pool.give_back(list(slot_of.values()))
            raise
        if not slot_of:
            self._give_back_dead()
            return fallback
        need = [s for s in slot_of.values() if not s.claimed]
        sums: dict[int, int] = {}  # position -> xxh3_64 of its buffer, hashed while claims are answered
        if need:  # one claim round trip for them and the next few of each size
            ahead = [a for size in {s.size for s in need} for a in self._res_pool.claim_ahead(size, rep, CLAIM_AHEAD)]
            refused = {id(s) for s in self._claim(need + ahead, lambda: prehash(bufs, sums, slot_of))}
            self._res_pool.claimed([a for a in ahead if id(a) not in refused], [a for a in ahead if id(a) in refused])
            if refused:
                self.rpc.send_nowait(M.Reserve(0, 0, self.host_id, 0, [s.res.res_id for s in need + ahead
                                                                       if id(s) in refused]))
                for j in [j for j, s in slot_of.items() if id(s) in refused]:
                    del slot_of[j]
                    fallback.append(j)
                if not slot_of:
                    return sorted(fallback)
        by_node: dict[str, list[WriteOp]] = defaultdict(list)
        ops_of: dict[int, list[WriteOp]] = {}
        lays: dict[int, tuple] = {}  # id(wire layout) -> (it, its bytes): items of a batch share one
        for j, s in slot_of.items():
            raw = items[j].wire_layout
            got = lays.get(id(raw))
            if got is None or got[0] is not raw:
                got = lays[id(raw)] = (raw, layout_bytes(raw))
            lay, buf, ops = got[1], bufs[j], []
            for k, r in enumerate(s.res.replicas):
                op = WriteOp(r, buf, "", sums.get(j) if k == 0 else 0, lay, s.wanted)
                ops.append(op)
                by_node[r.node_id].append(op)
            ops_of[j] = ops
        early = None  # (size, replicas, when asked) of a refill the master grants while the bytes are copied
        try:
            if sum(s.size for s in slot_of.values()) >= _EARLY_REFILL_BYTES and (want := self._refill_of(
                    slot_of.values())) is not None:
                size, rp, count = want
                t_sent = time.monotonic()
                got = self.rpc.call(M.Reserve(size, 0, self.host_id, rp, [], ahead=count),
                                    meanwhile=lambda answered: self._parallel(self._write_held, by_node))
                early = size, rp, t_sent
            else:
                self._parallel(self._write_held, by_node)
        except BaseException:  # a bug or Ctrl-C mid-copy, or no master: the reservations are given back
            self._release(list(slot_of.values()))
            raise
        if early is not None:
            self._take_reserved(got, early[1], early[0], early[2])
        done: list[Slot] = []  # not committed and given up: their claims end now (a commit ends its own:
        # the master's notice, or the commit copy sent below on the same claim stream, storenode/extents.py)
        failed: list[Slot] = []  # a replica write failed: given back, the object goes the long way
        commit_j, failed_j = [], []
        for j, ops in ops_of.items():
            for op in ops:
                if op.error is not None:
                    failed.append(slot_of[j])
                    failed_j.append(j)
                    break
            else:
                commit_j.append(j)
        fallback += failed_j
        if failed_j:  # the node may have restarted (a new incarnation, at the same address): its other
            # reservations are dropped too, and the long way finds out (and reports) whether it is dead
            gone = {(op.ref.node_id, op.ref.incarnation) for j in failed_j for op in ops_of[j] if op.error is not None}
            self._res_pool.drop_nodes(gone)
            for nid, inc in {(op.ref.node_id, op.ref.incarnation) for j in failed_j for op in ops_of[j]
                             if isinstance(op.error, NodeUnavailable)}:
                self.rpc.send_nowait(M.ReportDead(nid, inc))  # the long way places elsewhere meanwhile
        commits: dict[str, list] = defaultdict(list)  # same-host node -> commit copies
        net_commits: dict[str, list[WriteOp]] = defaultdict(list)
        if not commit_j:
            self._release(failed)
            return sorted(fallback)
        size, rp, count = self._refill_of(slot_of[j] for j in commit_j) or (0, 0, 0)
        dead = self._res_pool.take_dead(time.monotonic())
        back = [s.res.res_id for s in dead + failed]
        refill = M.Reserve(size, 0, self.host_id, rp, back, ahead=count) if count or back else None
        t_sent = time.monotonic()
        try:
            reply = self.rpc.call(M.PutReserved(
                [M.ReservedPut(items[j].key, slot_of[j].res.res_id, items[j].size, ops_of[j][0].checksum or 0,
                               items[j].wire_layout) for j in commit_j], refill))
        except BaseException:  # not acknowledged: the master frees what it did not commit
            self._end_claims([slot_of[j] for j in commit_j] + dead + failed)
            raise
        keep: list[Slot] = []  # not consumed: the reservation stays ours, still claimed
        in_flight = []
        for j, res, toks in zip(commit_j, reply.results, reply.tokens):
            s = slot_of[j]
            if res is None:
                stored[idx[j]] = (len(ops_of[j]), s.wanted or len(ops_of[j]))
                checksum = ops_of[j][0].checksum or 0
                for op, tok in zip(ops_of[j], toks):
                    ref = msgspec.structs.replace(op.ref, token=tok)
                    if op.ref in s.local:
                        commits[op.ref.node_id].append((ref, items[j].key, checksum, op.layout, s.wanted))
                    else:
                        op.ref, op.key, op.checksum = ref, items[j].key, checksum
                        net_commits[op.ref.node_id].append(op)
                        if not s.local:  # a key with a same-host replica is read from it
                            self._remember(items[j].key, ref)
            elif isinstance(res, str):  # "exists" / "in_flight"
                keep.append(s)
                if res == "in_flight":
                    in_flight.append(j)
            else:
                err = from_wire(res)
                if isinstance(err, PutRevoked):  # not held by this leader: put it the long way
                    done.append(s)
                    fallback.append(j)
                else:  # e.g. NoSpace past max_objects: the master keeps the reservation
                    keep.append(s)
                    results[idx[j]] = err
        self._end_claims(done + dead + failed, commits, now=len(commit_j) >= _FLUSH_BATCH)
        for ops in net_commits.values():
            self.data.commit(ops)
        self._res_pool.give_back(keep)
        if reply.refill is not None:
            self._take_reserved(reply.refill, rp, size, t_sent)
        if in_flight:
            self._await_in_flight(items, idx, in_flight, results)
        return sorted(fallback)

    def _refill_of(self, slots) -> tuple[int, int, int] | None:
        """The refill a put of ``slots`` asks for: (size, replicas, count) of the size whose
        pool runs lowest, or None while every size's pool covers its next batch."""
        size, rp, count = max(((size, rp, self._res_pool.refill(size, rp)) for size, rp in {(s.size, s.replicas)
                                                                                            for s in slots}),
                              key=lambda w: w[2], default=(0, 0, 0))
        count = _per_call(size, count)
        return (size, rp, count) if count else None

    def _write_held(self, ops: list[WriteOp]) -> None:
        self.data.write(ops, self._write_deadline, held=True)

    # ---- reservations -------------------------------------------------------------------

    def _reserve(self, size: int, replicas: int, n: int) -> list[Slot]:
        """Ask for ``n`` reservations now (and for the pool's target beyond them); returns
        up to ``n``, the rest going to the pool. [] when the master could place none."""
        n = _per_call(size, n)
        ahead = _per_call(size, n + self._res_pool.target(size, replicas)) - n
        dead = self._res_pool.take_dead(time.monotonic())
        t_sent = time.monotonic()
        try:
            got = self.rpc.call(M.Reserve(size, n, self.host_id, replicas, [s.res.res_id for s in dead], ahead))
        finally:
            self._end_claims(dead)
        slots = self._take_reserved(got, replicas, size, t_sent, keep=n)
        return slots

    def _take_reserved(self, got: M.Reserved, replicas: int, size: int, t_sent: float, keep: int = 0) -> list[Slot]:
        """Slots for reservations ``got``: the first ``keep`` are returned (for the put at
        hand), the others go to the pool. None is claimed yet (see :meth:`_claim`)."""
        term = self.rpc.term
        use_by = t_sent + got.ttl_s * 0.5
        local = iter(self.data.segmaps.shm_segments([x for r in got.reservations for x in r.replicas]))
        slots = [Slot(r, size, replicas, got.replicas_wanted, term, use_by,
                      claimed=all([next(local) is None for _ in r.replicas])) for r in got.reservations]
        self._res_pool.add(slots[keep:])
        self._start_reaper()
        return slots[:keep]

    def _claim(self, slots: list[Slot], meanwhile: Callable[[], None] | None = None) -> list[Slot]:
        """Claim the same-host extents of ``slots`` (one frame batch per node); returns those
        refused (or unanswered), whose other claims are ended. Sets ``claimed`` on the rest.
        ``meanwhile()``: work done once, while the first node answers."""
        local: dict[str, list[tuple[int, M.ExtentRef]]] = defaultdict(list)
        pairs = [(i, r) for i, s in enumerate(slots) for r in s.res.replicas]
        for (i, r), seg in zip(pairs, self.data.segmaps.shm_segments([r for _, r in pairs])):
            if seg is not None:
                local[r.node_id].append((i, r))
        if self._ends_n:
            self.flush_ends()  # our own ended claims first: a range freed since may come back to us
        timeout = self._write_deadline.timeout_s if self._write_deadline is not None else self.data.io_timeout_s
        bad: set[int] = set()
        verdicts = self.data.claims.claim_many({nid: [r for _, r in pairs] for nid, pairs in local.items()},
                                               timeout, meanwhile)
        for nid, pairs in local.items():
            for (i, r), err in zip(pairs, verdicts[nid]):
                slots[i].local.append(r)  # refused too: a late verdict of an unanswered claim ends with written
                if err is not None:
                    bad.add(i)
        for i, s in enumerate(slots):
            s.claimed = i not in bad
        refused = [slots[i] for i in sorted(bad)]
        self._end_claims(refused)  # the claims of their other replicas (or granted late) end
        return refused

    def _release(self, slots: list[Slot], give_back: bool = True) -> None:
        """End the claims of ``slots`` and, with ``give_back``, tell the master (one-way)."""
        if not slots:
            return
        self._end_claims(slots)
        if give_back:
            self.rpc.send_nowait(M.Reserve(0, 0, self.host_id, 0, [s.res.res_id for s in slots]))

    def _end_claims(self, slots: list[Slot], commits: dict[str, list] | None = None, now: bool = False) -> None:
        """Queue, per same-host node, ``written`` for ``slots``' extents there and the commit
        copies ``commits[node_id]``; they go out in one send per node once
        :data:`_FLUSH_ITEMS` are queued or the oldest has waited :data:`_FLUSH_S` (the
        reaper's timer), before the next claims, at close, or at once with ``now`` (a put
        that committed :data:`_FLUSH_BATCH` or more: the node works through them while the
        caller makes its next batch, instead of before answering that batch's claims).

        Why waiting is safe: a claim that lasts a little longer only keeps its own range
        busy; the commit copy is the second path by which a node learns an acknowledged
        commit (the master's notice left before the acknowledgement), needed only when the
        master dies in the instant after it, and a new leader reads the nodes' tables no
        sooner than the leader key's TTL later."""
        with self._ends_lock:
            for s in slots:
                for r in s.local:
                    self._ends[r.node_id, r.incarnation][0].append(r)
                    self._ends_n += 1
            for group in (commits or {}).values():
                for c in group:
                    self._ends[c[0].node_id, c[0].incarnation][1].append(c)
                    self._ends_n += 1
            first = self._ends_n and not self._ends_since
            if first:
                self._ends_since = time.monotonic()
            due = now or self._ends_n >= _FLUSH_ITEMS or (
                self._ends_since and time.monotonic() - self._ends_since >= _FLUSH_S)
        if due:
            self.flush_ends()
        elif first:  # the reaper's timer sends them
            self._start_reaper()
            self._reaper_wake.set()

    def forget_old_terms(self) -> None:
        """Once a newer leader term is seen, end at once the claims of every reservation an
        earlier leader granted (and send all queued ends): the new leader knows none of them
        and places other puts, this client's own included, over their extents, which a live
        claim would refuse (ExtentBusy) until it ended."""
        term = self.rpc.term
        if term == self._term_seen:
            return
        self._term_seen = term
        if self._res_pool.drop_older(term):
            self._give_back_dead()
        if self._ends_n:
            self.flush_ends()

    @property
    def ends_pending(self) -> bool:
        """Whether claim ends or commit copies are queued (see :meth:`_end_claims`)."""
        return self._ends_n > 0

    def flush_ends(self) -> None:
        """Send what :meth:`_end_claims` queued."""
        with self._ends_lock:
            ends, self._ends = self._ends, defaultdict(lambda: ([], []))
            self._ends_n, self._ends_since = 0, 0.0
        for done, copies in ends.values():
            self.data.claims.end(done, copies)

    def _give_back_dead(self, now: float | None = None) -> None:
        dead = self._res_pool.take_dead(now)
        if dead:
            self._release(dead)

    # ---- upkeep -------------------------------------------------------------------------

    def _start_reaper(self) -> None:
        with self._reaper_lock:
            if self._reaper is None and not self._reaper_stop.is_set():
                self._reaper = threading.Thread(target=self._reap, name="kvpool-reservations", daemon=True)
                self._reaper.start()

    def _reap(self) -> None:
        """Give back reservations that reached their use-by time unused, and send queued
        claim ends and commit copies :data:`_FLUSH_S` after they were queued."""
        while not self._reaper_stop.is_set():
            nxt = self._res_pool.next_use_by()
            wait = _REAP_S if nxt is None else min(_REAP_S, max(nxt - time.monotonic(), 0.01))
            since = self._ends_since
            if since:
                wait = min(wait, max(since + _FLUSH_S - time.monotonic(), 0.0))
            self._reaper_wake.wait(wait)
            self._reaper_wake.clear()
            if self._reaper_stop.is_set():
                return
            with contextlib.suppress(KVPoolError, OSError):
                since = self._ends_since
                if since and time.monotonic() - since >= _FLUSH_S:
                    self.flush_ends()
                self._give_back_dead(time.monotonic())

    def close(self) -> None:
        """Give every reservation back (closing)."""
        self._reaper_stop.set()
        self._reaper_wake.set()
        if self._reaper is not None:
            self._reaper.join(timeout=2 * _REAP_S)
        with contextlib.suppress(KVPoolError, OSError):
            self._release(self._res_pool.drain())
            self.flush_ends()

    def held(self) -> int:
        """Reservations this client holds now (all sizes)."""
        return self._res_pool.held()


def _per_call(size: int, count: int) -> int:
    """``count`` within what one Reserve may ask for (:mod:`master.reservations`)."""
    return max(0, min(count, 1024, (1 << 30) // max((size + 4095) & ~4095, 4096)))
