"""Store nodes as the master's RPC thread sees them: :class:`StoreNodes`, a part owned by
:class:`master.server.MasterServer` (its ``nodes``).

Membership changes polled from etcd: a node gone or restarted is marked down and its
notice socket closed; a new one is asked for its extent table on a join worker
(:mod:`master.joins`) and taken in from the answer (:meth:`StoreNodes._adopt`; a failover
indexes every node this way, :meth:`StoreNodes.rebuild`). One zmq DEALER notice socket per
node incarnation carries the state's outbox (consecutive commit or free notices coalesced,
each stamped with this leader's term) and brings back the nodes' copy completions and tier
moves (demotions, promotions: :mod:`master.tiers`), or the refusal of a node that knows a
newer term.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Union

import msgspec
import zmq

from kvpool.master.fencing import Fence
from kvpool.master.joins import JoinQueue, Table, fetch_table
from kvpool.master.server_settings import MasterServerSettings
from kvpool.master.state import MasterState
from kvpool.protocol import messages as M
from kvpool.protocol.layout import layout_of
from kvpool.protocol.errors import DECODE_ERRORS, KVPoolError, StaleTerm
from kvpool.protocol.terms import first_gen

log = logging.getLogger("kvpool.master")
NOTICE_DELAY_S = 0.005  # seconds a notice to a store node may wait to go out with later ones
NOTICE_BATCH = 256  # ... or until this many are queued


class StoreNodes:
    """The store nodes of one master: their membership, joins and notice sockets.

    Given: ``s`` (``join_timeout_s``, ``join_backoff_s``, ``join_backoff_max_s``: seconds),
    ``ctx`` (the zmq context, CURVE keys set when the cluster has a secret), ``poller`` (the
    RPC thread's poller: each notice socket is registered there, and the RPC loop hands a
    readable one to :meth:`on_reply`), ``stop`` (ends the join workers' waits),
    ``call_soon(fn)`` (runs ``fn()`` on the RPC thread between two polls, from any thread),
    ``state()`` (the current leadership's :class:`~master.state.MasterState`), ``term()``
    (this master's leader term, 0 while a standby), ``leading()``, ``fence`` (notices wait
    while it is fenced) and ``depose(why)`` (a node refused this term: a newer leader exists).

    Owns: the join workers and their queue ``joins`` (:class:`~master.joins.JoinQueue`, one
    per leadership), the descriptors last polled from etcd (node id -> NodeDesc), the
    notice sockets (node id -> (incarnation, DEALER socket)) and the timing of the outbox
    (when its oldest notice was queued, monotonic seconds).
    """

    def __init__(self, s: MasterServerSettings, ctx: zmq.Context, poller: zmq.Poller, stop: threading.Event,
                 call_soon: Callable[[Callable[[], None]], None], state: Callable[[], MasterState],
                 term: Callable[[], int], leading: Callable[[], bool], fence: Fence,
                 depose: Callable[[str], None]) -> None:
        self.s, self.ctx, self.poller, self.stop, self.call_soon = s, ctx, poller, stop, call_soon
        self._state, self._term, self._leading, self.fence, self.depose = state, term, leading, fence, depose
        self.joins = self._join_queue()
        self._descs: dict[str, M.NodeDesc] = {}  # the store nodes published in etcd, as last polled
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="join")
        self.socks: dict[str, tuple[str, zmq.Socket]] = {}
        self._outbox_since = 0.0  # when the oldest notice to a store node was queued
        self._notices_seen: dict[str, int] = {}  # node id -> notices already looked at (flush_urgent)

    def fetch(self, d: M.NodeDesc, timeout_s: float, term: int) -> concurrent.futures.Future:
        """Ask ``d`` for its extent table on a join worker within ``timeout_s`` seconds, as
        leader of ``term``: a Future of its :class:`~master.joins.Table` (any thread)."""
        return self._pool.submit(fetch_table, self.ctx, d, timeout_s, self.stop, term)

    def close(self) -> None:
        """Stop the join workers (a fetch sees ``stop`` within 0.1 s) and close the sockets."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for _, sock in self.socks.values():
            sock.close(0)

    def waiting(self, now: float) -> dict[str, str]:
        """Node id -> why it is not indexed yet (:meth:`~master.joins.JoinQueue.waiting`)."""
        return self.joins.waiting(now)

    def notice_wait_ms(self) -> int | None:
        """Milliseconds until the queued notices are due (:data:`NOTICE_DELAY_S`); None when
        none is queued."""
        if not self._state().outbox:
            return None
        return max(0, int((self._outbox_since + NOTICE_DELAY_S - time.monotonic()) * 1000) + 1)

    def membership(self, descs: dict[str, M.NodeDesc]) -> None:
        """Apply the nodes etcd publishes now (node id -> descriptor): a node gone or
        restarted is marked down, a new one asked for its extent table."""
        now = time.monotonic()
        state = self._state()
        self._descs = descs
        for nid in list(state.nodes):
            d = descs.get(nid)
            if d is None or d.incarnation != state.nodes[nid].desc.incarnation:
                state.node_down(nid, now)
                self._drop_sock(nid)
        for d, timeout_s in self.joins.due(self._screen(descs), state.nodes, now):
            self._ask_table(d, timeout_s)
        state.repair.pump()

    def _screen(self, descs: dict[str, M.NodeDesc]) -> list[M.NodeDesc]:
        """The nodes of this master's wire version; others are logged once and not placed on."""
        ok, refused = self._state().screen(descs.values())
        for d in refused:
            log.error("master: store node %s (%s) speaks kvpool wire version %s, this master %s: not placing "
                      "there. Run one kvpool version across the cluster", d.node_id, d.data_addr, d.wire,
                      M.WIRE_VERSION)
        return ok

    def _join_queue(self) -> JoinQueue:
        return JoinQueue(self.s.join_timeout_s, self.s.join_backoff_s, self.s.join_backoff_max_s)

    def _ask_table(self, d: M.NodeDesc, timeout_s: float) -> None:
        """Ask ``d`` for its extent table on a join worker; the answer is taken on the RPC
        thread (:meth:`_joined`), tagged with the state it was asked for."""
        state = self._state()
        fut = self.fetch(d, timeout_s, self._term())
        fut.add_done_callback(lambda f: self.call_soon(lambda: self._joined(state, d, f)))

    def _joined(self, state: MasterState, d: M.NodeDesc, fut: concurrent.futures.Future) -> None:
        """A join worker's answer for ``d``: take the node in, unless the leadership it was
        asked for ended or ``d`` is no longer what etcd publishes."""
        if state is not self._state() or not self._leading():
            return
        cur = self._descs.get(d.node_id)
        if cur is None or cur.incarnation != d.incarnation or d.node_id in state.nodes:
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
        state = self._state()
        if not isinstance(table, Table) or table.incarnation != d.incarnation:
            why = (f"{type(table).__name__}: {table}" if isinstance(table, BaseException) else
                   "no answer" if table is None else "it restarted since it published this descriptor")
            n, wait = self.joins.failed(d.node_id, d.incarnation, why, now)
            state.counters["node_join_failures"] += 1
            log.warning("master: store node %s (%s) is not taken in: %s; not placing there, asking again in %gs "
                        "(failed attempt %s). Check that its advertised address is reachable from the master",
                        d.node_id, d.ctrl_addr, why, wait, n)
            return False
        self.joins.done(d.node_id)
        state.node_up(d, now)
        # the node refuses generations it saw freed, and grants of older terms (protocol/terms.py)
        state.gens_above(d.node_id, max(table.max_gen, first_gen(self._term()) - 1))
        for r in table.rows:
            with contextlib.suppress(KVPoolError, ValueError):  # one bad row costs that row
                layout = r.layout if r.layout and layout_of(r.layout) is not None else None  # checked, kept encoded
                if r.tier == M.DISK:  # a file of its disk tier (master/tiers.py)
                    state.tiers.restore_extent(d.node_id, r.key, r.size, r.gen, r.checksum, layout, now,
                                               r.replicas)
                    continue
                state.restore_extent(d.node_id, r.key, r.offset, r.size, r.gen, r.checksum, layout, now,
                                     r.replicas)
        self._sock(d.node_id)
        return True

    def rebuild(self, descs: dict[str, M.NodeDesc], handoffs: list[M.HandoffRecord],
                pins: list[M.PinRecord], tables: dict[str, Table | Exception]) -> list[str]:
        """At the start of a leadership, with ``state()`` and ``term()`` already its own:
        forget the previous leadership's joins; index from live nodes' committed extents
        (``tables``, fetched by the etcd thread; nodes that did not answer join later, see
        :meth:`_adopt`), then hand-off holds and pins from etcd. Holds and soft pins are
        re-armed for their full ttl from now, on this master's monotonic clock. Returns the
        keys of stale pin records (another object under the key, soft pin lapsed), for the
        caller to delete; those of objects not indexed wait for a node to bring them back."""
        self.joins = self._join_queue()  # answers to the previous leadership's asks are dropped
        state, now = self._state(), time.monotonic()
        self._descs = descs
        for d in self._screen(descs):
            self._adopt(d, tables.get(d.node_id), now)
        for rec in handoffs:
            state.restore_handoff(rec, now)
        return [pin.key for pin in pins if not state.restore_pin(pin, now)]

    def _sock(self, node_id: str) -> zmq.Socket | None:
        node = self._state().nodes.get(node_id)
        if node is None:
            return None
        cur = self.socks.get(node_id)
        if cur is not None and cur[0] == node.desc.incarnation:
            return cur[1]
        self._drop_sock(node_id)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100000)
        sock.connect(node.desc.ctrl_addr)
        self.socks[node_id] = (node.desc.incarnation, sock)
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def _drop_sock(self, node_id: str) -> None:
        cur = self.socks.pop(node_id, None)
        if cur is not None:
            with contextlib.suppress(KeyError):
                self.poller.unregister(cur[1])
            cur[1].close(0)

    def on_reply(self, sock: zmq.Socket) -> None:
        """Read ``sock`` (a notice socket the poller found readable): completions of copy
        (repair) requests and of tier moves, or a node's refusal of this term."""
        while True:
            try:
                body = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            with contextlib.suppress(*DECODE_ERRORS):
                rep = msgspec.msgpack.decode(body, type=M.Reply)
                if rep.error is not None and rep.error.code == StaleTerm.code:
                    self.depose(rep.error.message)
                    continue
                done = msgspec.msgpack.decode(rep.result, type=Union[str, M.TierDone])
                if type(done) is M.TierDone:
                    nid = next((n for n, (_, s) in self.socks.items() if s is sock), None)
                    if nid is not None:
                        self._state().tier_done(nid, done, rep.error, time.monotonic())
                    continue
                self._state().repair.done(done, rep.error is None)

    def flush_urgent(self) -> None:
        """Send the queued notices now when any is not a commit (runs before replies leave):
        a free must reach the node before a reply can place a writer over its memory, so a
        reader's lease on the freed grant meets StaleExtent, not another object's bytes.
        Commits alone wait for :meth:`flush_due`."""
        outbox = self._state().outbox
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

    def flush_due(self) -> None:
        """Send the state's notices once the oldest has waited :data:`NOTICE_DELAY_S` or
        :data:`NOTICE_BATCH` are queued (called every turn of the RPC loop)."""
        outbox = self._state().outbox
        if not outbox:
            self._outbox_since = 0.0
            return
        now = time.monotonic()
        if not self._outbox_since:
            self._outbox_since = now
        if now - self._outbox_since >= NOTICE_DELAY_S or sum(len(m) for m in outbox.values()) >= NOTICE_BATCH:
            self._flush()
            if not self._state().outbox:
                self._outbox_since = 0.0

    def _flush(self) -> None:
        """Send the state's notices to the store nodes, stamped with this leader's term; they
        wait while fenced (and go with the state if the leadership ends)."""
        state = self._state()
        if not state.outbox or not self._leading() or self.fence.fenced():
            return
        self._notices_seen.clear()
        term = self._term()
        for node_id, msgs in state.take_outbox().items():
            sock = self._sock(node_id)
            if sock is None:
                continue
            with contextlib.suppress(zmq.ZMQError):
                for m in _coalesce(msgs):  # in order: a commit then a free of one extent stay so
                    m.term = term
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
