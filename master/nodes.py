"""Store nodes as the master's RPC thread sees them, mixed into :class:`master.server.MasterServer`.

Membership changes polled from etcd: a node gone or restarted is marked down and its
notice socket closed; a new one is asked for its extent table on a join worker
(:mod:`master.joins`) and taken in from the answer (:meth:`_StoreNodes._adopt`; a failover
indexes every node this way, :meth:`_StoreNodes._rebuild`). One zmq DEALER notice socket per
node incarnation carries the state's outbox (consecutive commit or free notices coalesced,
each stamped with this leader's term) and brings back the nodes' copy completions and tier
moves (demotions, promotions: :mod:`master.tiers`), or the refusal of a node that knows a
newer term.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from typing import Union

import msgspec
import zmq

from kvpool.master.joins import JoinQueue, Table, fetch_table
from kvpool.master.state import MasterState
from kvpool.protocol import messages as M
from kvpool.protocol.layout import layout_of
from kvpool.protocol.errors import KVPoolError, StaleTerm
from kvpool.protocol.terms import first_gen

log = logging.getLogger("kvpool.master")
NOTICE_DELAY_S = 0.005  # seconds a notice to a store node may wait to go out with later ones
NOTICE_BATCH = 256  # ... or until this many are queued


class _StoreNodes:
    """The store-node side of a :class:`~master.server.MasterServer`'s RPC thread (mixed into
    it; uses its ``state``, ``joins``, ``node_socks``, ``poller``, ``ctx``, ``term`` and
    ``fence``)."""

    def _membership(self, descs: dict[str, M.NodeDesc]) -> None:
        now = time.monotonic()
        self._descs = descs
        for nid in list(self.state.nodes):
            d = descs.get(nid)
            if d is None or d.incarnation != self.state.nodes[nid].desc.incarnation:
                self.state.node_down(nid, now)
                self._drop_sock(nid)
        for d, timeout_s in self.joins.due(self._screen(descs), self.state.nodes, now):
            self._ask_table(d, timeout_s)
        self.state.repair.pump()

    def _screen(self, descs: dict[str, M.NodeDesc]) -> list[M.NodeDesc]:
        """The nodes of this master's wire version; others are logged once and not placed on."""
        ok, refused = self.state.screen(descs.values())
        for d in refused:
            log.error("master: store node %s (%s) speaks kvpool wire version %s, this master %s: not placing "
                      "there. Run one kvpool version across the cluster", d.node_id, d.data_addr, d.wire,
                      M.WIRE_VERSION)
        return ok

    def _join_queue(self) -> JoinQueue:
        return JoinQueue(self.s.join_timeout_s, self.s.join_backoff_s, self.s.join_backoff_max_s)

    def _ask_table(self, d: M.NodeDesc, timeout_s: float) -> None:
        """Ask ``d`` for its extent table on a join worker; the answer comes back as a
        ``joined`` event (:meth:`_joined`), tagged with the state it was asked for."""
        state = self.state
        fut = self._join_pool.submit(fetch_table, self.ctx, d, timeout_s, self.stop, self.term)
        fut.add_done_callback(lambda f: self.events.append(("joined", state, d, f)))

    def _joined(self, state: MasterState, d: M.NodeDesc, fut: concurrent.futures.Future) -> None:
        """A join worker's answer for ``d``: take the node in, unless the leadership it was
        asked for ended or ``d`` is no longer what etcd publishes."""
        if state is not self.state or not self.leading:
            return
        cur = self._descs.get(d.node_id)
        if cur is None or cur.incarnation != d.incarnation or d.node_id in self.state.nodes:
            self.joins.done(d.node_id)  # moot: the next poll asks again if it still matters
            return
        try:
            result = fut.result()
        except concurrent.futures.CancelledError:  # shutting down
            return
        except Exception as e:  # noqa: BLE001 - counted and retried like a silent node
            result = e
        self._adopt(d, result, time.monotonic())

    def _adopt(self, d: M.NodeDesc, table: Table | BaseException | None, now: float) -> bool:
        """Take a node in from its extent table: index its committed extents (a failover
        rebuild, or a node whose etcd lease lapsed in an etcd outage and came back with its
        memory intact), grant there only generations above any it has seen, and connect its
        notice socket now, so a first commit notice does not wait for the connection. A
        node without a table (it did not answer in time, or restarted since it published
        ``d``) stays out: logged, counted, and asked again after a backoff. False then."""
        if not isinstance(table, Table) or table.incarnation != d.incarnation:
            why = (f"{type(table).__name__}: {table}" if isinstance(table, BaseException) else
                   "no answer" if table is None else "it restarted since it published this descriptor")
            n, wait = self.joins.failed(d.node_id, d.incarnation, why, now)
            self.state.counters["node_join_failures"] += 1
            log.warning("master: store node %s (%s) is not taken in: %s; not placing there, asking again in %gs "
                        "(failed attempt %s). Check that its advertised address is reachable from the master",
                        d.node_id, d.ctrl_addr, why, wait, n)
            return False
        self.joins.done(d.node_id)
        self.state.node_up(d, now)
        # the node refuses generations it saw freed, and grants of older terms (protocol/terms.py)
        self.state.gens_above(d.node_id, max(table.max_gen, first_gen(self.term) - 1))
        for r in table.rows:
            with contextlib.suppress(KVPoolError, ValueError):  # one bad row costs that row
                layout = r.layout if r.layout and layout_of(r.layout) is not None else None  # checked, kept encoded
                if r.tier == M.DISK:  # a file of its disk tier (master/tiers.py)
                    self.state.tiers.restore_extent(d.node_id, r.key, r.size, r.gen, r.checksum, layout, now,
                                                    r.replicas)
                    continue
                self.state.restore_extent(d.node_id, r.key, r.offset, r.size, r.gen, r.checksum, layout, now,
                                          r.replicas)
        self._sock(d.node_id)
        return True

    def _rebuild(self, descs: dict[str, M.NodeDesc], handoffs: list[M.HandoffRecord],
                 pins: list[M.PinRecord], tables: dict[str, Table | Exception]) -> None:
        """Index from live nodes' committed extents (``tables``, fetched by the etcd thread;
        nodes that did not answer join later, see :meth:`_adopt`), then hand-off holds and
        pins from etcd (stale pin records — another object under the key, soft pin lapsed —
        are deleted; those of objects not indexed wait for a node to bring them back). Holds
        and soft pins are re-armed for their full ttl from now, on this master's monotonic
        clock."""
        now = time.monotonic()
        self._descs = descs
        for d in self._screen(descs):
            self._adopt(d, tables.get(d.node_id), now)
        for rec in handoffs:
            self.state.restore_handoff(rec, now)
        for pin in pins:
            if not self.state.restore_pin(pin, now):
                self._etcd_forget(self.keys.pin(pin.key))

    def _sock(self, node_id: str) -> zmq.Socket | None:
        node = self.state.nodes.get(node_id)
        if node is None:
            return None
        cur = self.node_socks.get(node_id)
        if cur is not None and cur[0] == node.desc.incarnation:
            return cur[1]
        self._drop_sock(node_id)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100000)
        sock.connect(node.desc.ctrl_addr)
        self.node_socks[node_id] = (node.desc.incarnation, sock)
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def _drop_sock(self, node_id: str) -> None:
        cur = self.node_socks.pop(node_id, None)
        if cur is not None:
            with contextlib.suppress(KeyError):
                self.poller.unregister(cur[1])
            cur[1].close(0)

    def _node_reply(self, sock: zmq.Socket) -> None:
        """Completion of a copy (repair) request, or of a tier move."""
        while True:
            try:
                body = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                rep = msgspec.msgpack.decode(body, type=M.Reply)
                if rep.error is not None and rep.error.code == StaleTerm.code:
                    self._depose(rep.error.message)
                    continue
                done = msgspec.msgpack.decode(rep.result, type=Union[str, M.TierDone])
                if type(done) is M.TierDone:
                    nid = next((n for n, (_, s) in self.node_socks.items() if s is sock), None)
                    if nid is not None:
                        self.state.tier_done(nid, done, rep.error, time.monotonic())
                    continue
                self.state.repair.done(done, rep.error is None)

    def _flush_urgent(self) -> None:
        """Send the queued notices now when any is not a commit (runs before replies leave):
        a free must reach the node before a reply can place a writer over its memory, so a
        reader's lease on the freed grant meets StaleExtent, not another object's bytes.
        Commits alone wait for :meth:`_flush_due`."""
        outbox = self.state.outbox
        if not outbox:
            return
        seen = self._notices_seen  # node id -> notices already looked at (all commits)
        for node_id, msgs in outbox.items():
            start = seen.get(node_id, 0)
            for i in range(start, len(msgs)):
                if type(msgs[i]) is not M.NodeCommit:
                    self._flush()
                    return
            seen[node_id] = len(msgs)

    def _flush_due(self) -> None:
        """Send the state's notices once the oldest has waited :data:`NOTICE_DELAY_S` or
        :data:`NOTICE_BATCH` are queued (called every turn of the RPC loop)."""
        outbox = self.state.outbox
        if not outbox:
            self._outbox_since = 0.0
            return
        now = time.monotonic()
        if not self._outbox_since:
            self._outbox_since = now
        if now - self._outbox_since >= NOTICE_DELAY_S or sum(len(m) for m in outbox.values()) >= NOTICE_BATCH:
            self._flush()
            if not self.state.outbox:
                self._outbox_since = 0.0

    def _flush(self) -> None:
        """Send the state's notices to the store nodes, stamped with this leader's term; they
        wait while fenced (and go with the state if the leadership ends)."""
        if not self.state.outbox or not self.leading or self.fence.fenced():
            return
        self._notices_seen.clear()
        for node_id, msgs in self.state.take_outbox().items():
            sock = self._sock(node_id)
            if sock is None:
                continue
            with contextlib.suppress(zmq.ZMQError):
                for m in _coalesce(msgs):  # in order: a commit then a free of one extent stay so
                    m.term = self.term
                    sock.send(M.encode(m), zmq.NOBLOCK)



def _coalesce(msgs: list) -> list:
    """Merge runs of consecutive commit (or free) notices into one message, keeping order
    (linear in the rows: each run is copied once, then extended)."""
    merged = 0  # len(out) when out[-1] became a copy of our own
    out: list = []
    for m in msgs:
        prev = out[-1] if out else None
        if isinstance(m, M.NodeCommit) and isinstance(prev, M.NodeCommit):
            if len(out) > merged:  # the first merge into prev: copy it (the state's message stays as it was)
                out[-1] = prev = M.NodeCommit(list(prev.rows))
                merged = len(out)
            prev.rows.extend(m.rows)
        elif isinstance(m, M.NodeFree) and isinstance(prev, M.NodeFree):
            if len(out) > merged:
                out[-1] = prev = M.NodeFree(list(prev.extents))
                merged = len(out)
            prev.extents.extend(m.extents)
        else:
            out.append(m)
    return out
