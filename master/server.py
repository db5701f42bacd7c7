"""Master process: a thin shell around :class:`~master.state.MasterState`.

Two threads, and workers for joins:

* the **RPC thread** owns every socket and the state object: one poller over the client
  connections (:mod:`master.clients`: plain TCP, framed by :mod:`protocol.rpcwire`,
  pipelined and bounded per client) and the zmq DEALER sockets to store nodes. It
  decodes requests, calls the state, applies membership changes handed over by the etcd
  thread, runs the periodic ``tick`` and sends the state's outbox (commit/free/copy
  notices) to store nodes. It never waits for a store node.
* the **etcd thread** (asyncio, aetcd) campaigns for leadership (create-if-absent on
  the ``leader`` key under a kept-alive lease), polls ``nodes/`` for membership and
  performs the durable pin and hand-off record writes (:mod:`master.durable`) the RPC
  thread asks for.
* **join workers** ask joining store nodes for their extent tables (:mod:`master.joins`),
  each within a deadline, and hand the answers to the RPC thread through ``events``; a
  node that does not answer is asked again with backoff and takes no placements meanwhile.

On winning the election the index is rebuilt from the store nodes' committed extent
tables (fetched in parallel by the join workers before this master starts answering, for
at most ``join_timeout_s``; nodes answering later join in the background) plus the
hand-off records in etcd (DESIGN.md §8). The state runs on this process's monotonic
clock (every ``now`` is ``time.monotonic()``); the wall clock is read only for what
operators see (``ls`` times, the publish/pin times in etcd records) and to convert
records of older releases (:mod:`master.records`).

Fencing (DESIGN.md §8): each leadership has a term, the etcd revision that created the
``leader`` key (:mod:`protocol.terms`). Every notice to a store node, every write grant
(inside its generation) and every reply carries it, so nodes and clients refuse a deposed
leader. And a leader whose lease was not renewed for half its TTL acknowledges no change
(:mod:`master.fencing`), strictly before etcd can let a standby win. Readiness is one
stdout line ``KVPOOL_READY master <rpc_addr>``; ``KVPOOL_LEADER master <rpc_addr>``
follows when it leads.

This module holds the process (threads, health checks), the RPC loop, the leadership
events and request dispatch. :class:`MasterServer` creates and owns its parts, which live
beside it: the settings (:mod:`master.server_settings`), the etcd thread
(:class:`~master.etcd_thread.EtcdThread`), the store nodes' membership, joins and notices
(:class:`~master.nodes.StoreNodes`), the client connections
(:class:`~master.clients.ClientConns`), the durable etcd writes
(:class:`~master.durable.DurableWrites`) and the cluster settings record
(:class:`~master.cluster_settings.ClusterSettingsPart`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from kvpool.master.batches import PER_KEY_ERRORS, SLICE, SLICED, SlicedBatch
from kvpool.master.clients import ClientConns
from kvpool.master.cluster_settings import ClusterSettingsPart, _settings_of
from kvpool.master.durable import DurableWrites, Pending
from kvpool.master.etcd_thread import EtcdThread
from kvpool.master.fencing import Fence
from kvpool.master.metrics import Metrics
from kvpool.master.nodes import StoreNodes
from kvpool.master.server_settings import MasterServerSettings
from kvpool.master.state import MasterState
from kvpool.master.stats import StatsWalks
from kvpool.protocol import messages as M
from kvpool.protocol import rpcwire, transport
from kvpool.protocol.auth import curve_client_keys
from kvpool.protocol.errors import (EtcdUnavailable, Forbidden, InvalidRequest, KVPoolError, LeaderFenced,
                                    NotFound, NotLeader, ReplyTooLarge)
from kvpool.protocol.etcd import Etcd, Keys
from kvpool.protocol.spin import Spinner

HEALTH_STALL_S = 10.0  # /healthz fails when the RPC loop has not turned for this long (seconds)
log = logging.getLogger("kvpool.master")


def _typed(e: Exception, op: str) -> KVPoolError:
    """``e`` as the typed error a client is told: a KVPoolError as it is, anything else a
    kvpool bug (logged with its traceback)."""
    if isinstance(e, KVPoolError):
        return e
    log.error("master: request %s failed", op, exc_info=e)
    return KVPoolError(f"master failed on {op}: {type(e).__name__}: {e}; this is a kvpool bug, please report it "
                       "with the master's log")


_HANDLERS: dict[type, Callable] = {}  # request type -> MasterServer handler (registered by @_handles)


def _handles(*types: type) -> Callable:
    """Register the decorated MasterServer method as the handler of requests of ``types``."""
    def register(fn: Callable) -> Callable:
        for t in types:
            _HANDLERS[t] = fn
        return fn
    return register


class MasterServer:
    """One master process: its RPC thread (the loop, request dispatch, leadership events)
    and its parts, each created here and given what it uses: ``conns``
    (:class:`~master.clients.ClientConns`), ``nodes`` (:class:`~master.nodes.StoreNodes`),
    ``etcd`` (:class:`~master.etcd_thread.EtcdThread`), ``durable``
    (:class:`~master.durable.DurableWrites`), ``settings``
    (:class:`~master.cluster_settings.ClusterSettingsPart`), ``stats``
    (:class:`~master.stats.StatsWalks`) and ``metrics``. ``events``: what other threads hand
    the RPC thread (etcd's ``lead``, ``nodes`` and ``step_down``; ``("run", fn)`` and
    ``("call", fn, future)`` to run ``fn`` there)."""

    def __init__(self, s: MasterServerSettings) -> None:
        self.s = s
        self.keys = Keys(s.cluster)
        self.state = MasterState(s.state, s.cluster)
        self.metrics = Metrics(self.state, ask=self._on_rpc_thread)
        self.leading = False
        self.leader_addr = ""
        self.term = 0  # this master's leader term while it leads (protocol/terms.py)
        self.fence = Fence()  # when to stop acknowledging (master/fencing.py)
        self.ctx = zmq.Context()
        if s.security.secret is not None:  # every DEALER to a store node is a CURVE client (protocol/auth.py)
            spk, pk, sk = curve_client_keys(s.security)
            self.ctx.setsockopt(zmq.CURVE_SERVERKEY, spk)
            self.ctx.setsockopt(zmq.CURVE_PUBLICKEY, pk)
            self.ctx.setsockopt(zmq.CURVE_SECRETKEY, sk)
        self.events: deque = deque()  # other threads -> RPC thread (append/popleft are atomic)
        self.stop = threading.Event()
        self.rpc_beat = time.monotonic()  # last turn of the RPC loop (/healthz)
        public = transport.advertise_host(s.host, s.advertise, "master.advertise")  # before binding: ConfigError
        listeners = [transport.listen(f"tcp://{transport.host_port(s.host, s.rpc_port)}")]
        # what clients dial and the leader key holds: the advertised host, the bound port
        self.rpc_addr = f"tcp://{transport.host_port(public, listeners[0].getsockname()[1])}"
        if s.advertise is None and public != s.host:
            log.info("master: bound to %s, advertising %s (pass --advertise to choose)", s.host, public)
        # same-host clients switch to this abstract Unix socket (half the round trip), told by
        # Hello over TCP; a random name cannot be taken before us, and clients check our pid
        alias = f"unix://@kvpool-master-{secrets.token_hex(16)}"
        try:
            listeners.append(transport.listen(alias))
        except OSError as e:
            log.warning("master: no same-host Unix alias (%s); local clients use TCP", e)
            alias = ""
        self.hello = M.encode(M.Reply(msgspec.Raw(M.encode(M.HelloReply(alias, os.getpid(),
                                                                         transport.default_host_id(),
                                                                         M.WIRE_VERSION)))))
        self.poller = zmq.Poller()  # the RPC thread's one poller: client connections and node sockets
        call_soon = self._call_soon
        self.nodes = StoreNodes(s, self.ctx, self.poller, self.stop, call_soon, lambda: self.state,
                                lambda: self.term, lambda: self.leading, self.fence, self._depose)
        self.conns = ClientConns(listeners, self.poller, self._handle, self.nodes.flush_urgent, s.security,
                                 s.max_conns, s.frame_timeout_s)
        self.metrics.refusals = self.conns.refusals
        self.etcd = EtcdThread(s, self.keys, self.rpc_addr, self.stop, self.events.append, self.nodes.fetch,
                               self._saw_leader)
        self._forget_retry: set[str] = set()  # etcd deletes to retry once etcd answers
        self.durable = DurableWrites(self.etcd.submit, self._answer, lambda key: self._forget_retry.add(key))
        self.settings = ClusterSettingsPart(lambda: self.state, self.durable, self.keys)  # master/cluster_settings.py
        # Stats are walked on a thread of their own, from snapshots the RPC thread takes (master/stats.py)
        self.stats = StatsWalks(call_soon, self._answer,
                                lambda: (self.state.stats_snapshot(),
                                         {"joining": self.nodes.waiting(time.monotonic())}))

    # ---- process ------------------------------------------------------------------------

    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        if self.s.metrics_port is not None:
            url = self.metrics.serve(self.s.host, self.s.metrics_port, self.healthz, self.readyz)
            print(f"KVPOOL_METRICS master {url}", flush=True)
        self.etcd.start()
        try:
            self._rpc_loop()
        finally:
            self.stop.set()
            self.etcd.join(10)
            self.nodes.close()
            self.stats.close()
            self.conns.close_all()
            self.ctx.term()
        if self.etcd.fatal is not None:
            raise self.etcd.fatal

    # ---- health (the ops HTTP server's threads) ------------------------------------------

    def healthz(self) -> tuple[bool, str]:
        """Alive: the RPC loop turned within HEALTH_STALL_S seconds and the etcd thread's
        event loop answers within 2 s. ``(ok, detail)``."""
        if self.stop.is_set():
            return False, "stopping"
        stalled = time.monotonic() - self.rpc_beat
        if stalled > HEALTH_STALL_S:
            return False, f"the RPC loop has not turned for {stalled:.1f}s"
        if not self.etcd.running():
            return False, "the etcd thread is not running"
        if not self.etcd.responsive(2.0):
            return False, "the etcd thread's event loop did not answer within 2s"
        return True, "leader" if self.leading else "standby"

    def readyz(self) -> tuple[bool, str]:
        """Ready: etcd answers (a read of the ``leader`` key within 2 s) and this master leads,
        or is a standby that knows the leader. ``(ok, detail or reason)``."""
        if not self.etcd.connected():
            return False, "not connected to etcd yet"
        try:
            cur = self.etcd.submit(lambda e: e.get(self.keys.leader), "readiness checks", False).result(timeout=2.0)
        except Exception as e:  # noqa: BLE001 - etcd down, slow or refusing: not ready
            return False, f"etcd did not answer ({type(e).__name__}: {e})"
        leader = cur.decode(errors="replace") if cur else ""
        if self.leading and leader == self.rpc_addr:
            return True, f"leader {self.rpc_addr}"
        if self.leading:
            return False, f"stepping down: etcd names {leader or 'no leader'}"
        if not leader:
            return False, "standby, and no leader is elected yet"
        return True, f"standby; the leader is {leader}"

    # ---- fencing (RPC thread) -------------------------------------------------------------

    def _depose(self, why: str) -> None:
        """A newer leadership exists (a store node refused our term): stop acknowledging at
        once and give the leadership up; the etcd thread then campaigns again as a standby."""
        if not self.leading or self.fence.deposed:
            return
        self.fence.deposed = True
        log.warning("master: deposed (%s); stepping down", why)
        self.etcd.give_up_lead()

    def _saw_leader(self, addr: str) -> None:
        """The etcd thread read the ``leader`` key while campaigning: ``addr`` leads ("" none)."""
        self.leader_addr = addr

    def _forget(self, key: str) -> None:
        """Delete an etcd record, after any write to it still in flight; a delete etcd
        refuses is retried once etcd answers again, so no stale pin or hand-off record stays."""
        async def delete(e: Etcd) -> None:
            try:
                await e.delete(key)
            except Exception:  # noqa: BLE001 - any failure: try again later
                self._call_soon(lambda: self._forget_retry.add(key))

        if self.durable.after(key, delete, "etcd records"):
            return
        try:
            self.etcd.submit(delete, "etcd records", False)
        except EtcdUnavailable:
            self._forget_retry.add(key)

    # ---- RPC thread ---------------------------------------------------------------------

    def _rpc_loop(self) -> None:
        conns, poller = self.conns, self.poller
        spin = Spinner(self.s.spin_wait_s)
        awake_until = 0.0  # polled for (protocol/spin.py) instead of slept on until then: master.spin_wait
        next_tick = time.monotonic()
        while not self.stop.is_set():
            self.rpc_beat = now = time.monotonic()  # /healthz: the loop turns
            served = set()
            wait = 0 if conns.busy else 5 if self.durable or self.stats.walking else 50
            due = self.nodes.notice_wait_ms()  # notices wait at most NOTICE_DELAY_S (master/nodes.py)
            if due is not None:
                wait = min(wait, due)
            events = spin.spin(lambda: poller.poll(0), awake_until - now) if wait and now < awake_until else None
            if events is None:
                events = poller.poll(wait)
            if events:
                awake_until = time.monotonic() + self.s.spin_wait_s
            for sock, ev in events:
                if isinstance(sock, int):  # zmq's poller names plain sockets by fd
                    c = conns.on_event(sock, ev)
                    if c is not None:
                        served.add(c)
                else:
                    self.nodes.on_reply(sock)
            conns.work_busy(served)  # requests left over from their last turn
            if self.durable:
                self.durable.advance()
            self._apply_events()
            if self.leading and time.monotonic() >= next_tick and not self.fence.check(time.monotonic()):
                next_tick = time.monotonic() + self.s.membership_poll_s
                expired = self.state.tick(time.monotonic())
                for rid in expired:
                    self._forget(self.keys.handoff(rid))
                if self._forget_retry and self.etcd.ok:
                    keys, self._forget_retry = self._forget_retry, set()
                    for key in keys:
                        self._forget(key)
            for key in self.state.take_unpinned():  # pinned objects removed, evicted or lost
                self._forget(self.keys.pin(key))
            self.nodes.flush_urgent()
            self.nodes.flush_due()

    def _answer(self, d: Pending, result, error: KVPoolError | None) -> None:
        """Send a durable write's answer to the client that asked (if it still listens)."""
        if d.answered or d.client is None:
            return
        d.answered = True
        self.metrics.observe(d.op, time.perf_counter() - d.t0)
        reply = (M.Reply(error=error.to_wire(), term=self.term) if error is not None
                 else M.Reply(msgspec.Raw(M.encode(result)), term=self.term))
        self.conns.answer(d.client, d.rid, M.encode(reply))

    def _call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the RPC thread between two polls (from any thread)."""
        self.events.append(("run", fn))

    def _on_rpc_thread(self, fn, timeout_s: float = 5.0):
        """Run ``fn()`` on the RPC thread between two polls and return its result (for
        readers on other threads, e.g. a metrics scrape); raises TimeoutError after
        ``timeout_s`` seconds (a stopped or wedged RPC loop)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.events.append(("call", fn, fut))
        return fut.result(timeout=timeout_s)

    def _apply_events(self) -> None:
        while True:
            try:
                ev = self.events.popleft()
            except IndexError:
                return
            kind = ev[0]
            if kind == "call":
                fn, fut = ev[1], ev[2]
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
            elif kind == "run":  # posted by another thread (a finished stats walk, a join, a failed delete)
                ev[1]()
            elif kind == "lead":
                self.state = MasterState(self.s.state, self.s.cluster)
                self.state.leader_addr = self.rpc_addr
                self.metrics.state = self.state
                self.term = ev[6]
                self.fence.lead(self.term, ev[7])
                self.settings.adopt(ev[4])
                for key in self.nodes.rebuild(ev[1], ev[2], ev[3], ev[5]):  # stale pin records
                    self._forget(self.keys.pin(key))
                self.leading, self.leader_addr = True, self.rpc_addr
                log.info("master: leading with term %d", self.term)
                print(f"KVPOOL_LEADER master {self.rpc_addr}", flush=True)
            elif kind == "step_down":
                self.leading, self.term, self.leader_addr = False, 0, ""  # the campaign reads the new one
            elif kind == "nodes" and self.leading:
                self.nodes.membership(ev[1])

    def _handle(self, body: bytes, role: str = "cluster") -> bytes | Pending | SlicedBatch:
        """One request of a peer acting in ``role`` → its encoded Reply (a typed error for
        anything malformed or not allowed to that role), a :class:`Pending` when the answer
        waits for etcd, or a :class:`~master.batches.SlicedBatch` for a big batch (answered
        over several loop turns)."""
        t0 = time.perf_counter()
        op = "invalid"
        try:
            req = M.decode_request(body)
            op = type(req).__name__
            if type(req) is M.Hello:  # about this connection, not the cluster: standbys answer it too
                return self.hello
            if role == "client" and (type(req) in _OPERATOR_ONLY or type(req) is M.Remove and req.force):
                raise Forbidden(f"{op} needs an operator credential (kvpool credential --role operator) or the "
                                "cluster secret; this connection holds a client credential", cause="role",
                                op=op)
            if M.batch_len(req) > M.MAX_BATCH_KEYS:
                raise InvalidRequest(f"{op} carries {M.batch_len(req)} keys; the limit is {M.MAX_BATCH_KEYS} per "
                                     "request (KVPoolClient splits larger batches): split it", op=op,
                                     limit=M.MAX_BATCH_KEYS)
            M.check_layouts(req)  # each distinct layout decoded once; a bad one refuses the whole batch
            self._check_serving(req)
            if type(req) in SLICED and M.batch_len(req) > SLICE:
                return self._sliced(req, role, op, t0)
            result = self._dispatch(req, role)
            if isinstance(result, Pending):
                result.op, result.t0 = op, t0
                return result
        except Exception as e:  # noqa: BLE001 - typed errors answered; a bug costs one request
            result = e
        return self._reply(result, op, t0)

    def _check_serving(self, req) -> None:
        """Raise unless this master may answer ``req`` now: NotLeader on a standby,
        LeaderFenced for a change while its leadership lease is unconfirmed."""
        if not self.leading:
            raise NotLeader(f"this master is a standby; the leader is {self.leader_addr or 'unknown'}",
                            leader=self.leader_addr)
        if type(req) not in _READS and self.fence.check(time.monotonic()):
            raise LeaderFenced(f"the leading master {self.rpc_addr} could not renew its leadership lease in "
                               f"etcd for {self.fence.clock.age():.1f}s, so it acknowledges no change until etcd "
                               "answers again or a new leader is elected (reads still work); check etcd and "
                               "the master's route to it, then retry", term=self.term)

    def _sliced(self, req, role: str, op: str, t0: float) -> SlicedBatch:
        """``req`` answered SLICE keys per loop turn, each slice checked as a request is; a
        slice finding another leadership's state ends the batch with NotLeader."""
        state = self.state

        def run(part):
            if self.state is not state:
                raise NotLeader("the leadership changed while this batch was being answered; retry it",
                                leader=self.leader_addr)
            self._check_serving(part)
            return self._dispatch(part, role)

        return SlicedBatch(req, run, lambda result: self._reply(result, op, t0),
                           (lambda e: _typed(e, op).to_wire()) if type(req) in PER_KEY_ERRORS else None)

    def _reply(self, result, op: str, t0: float) -> bytes:
        """The encoded Reply carrying ``result``, or the error it is (a typed one as it is;
        any other exception as a kvpool bug, logged)."""
        if isinstance(result, KVPoolError):
            reply = M.Reply(error=result.to_wire(), term=self.term)
        elif isinstance(result, Exception):
            reply = M.Reply(error=_typed(result, op).to_wire())
        else:
            reply = M.Reply(msgspec.Raw(M.encode(result)), term=self.term)
        out = M.encode(reply)
        if len(out) > rpcwire.MAX_FRAME - 8:  # (its layouts, most likely): the client splits the batch
            out = M.encode(M.Reply(error=ReplyTooLarge(
                f"the answer to this {op} is {len(out)} bytes, over the {rpcwire.MAX_FRAME}-byte frame limit; ask "
                "for fewer keys per request", reply_bytes=len(out), limit=rpcwire.MAX_FRAME).to_wire(), term=self.term))
        self.metrics.observe(op, time.perf_counter() - t0)
        return out

    def _dispatch(self, req, role: str = "cluster"):
        """The result of ``req`` (its handler in :data:`_HANDLERS`, by type)."""
        handler = _HANDLERS.get(type(req))
        if handler is None:
            raise KVPoolError(f"unhandled request {type(req).__name__}")
        return handler(self, req, self.state, time.monotonic(), role)  # every lease, pin, hold and deadline: this clock

    # ---- one handler per request type: (req, state, now, role) -> result ---------------------------------

    @_handles(M.PutStart)
    def _put_start(self, req, st, now, role):
        return st.put_start(req.items, req.host_id, req.replicas, now)

    @_handles(M.PutEnd)
    def _put_end(self, req, st, now, role):
        return st.put_end(req.keys, req.put_ids, now, req.checksums)

    @_handles(M.PutReserved)
    def _put_reserved(self, req, st, now, role):
        results, tokens = st.reservations.put(req.items, now)
        r = req.refill
        refill = None if r is None else st.reservations.reserve(r.size, r.count, r.host_id, r.replicas, now,
                                                                r.release, r.ahead)
        return M.PutReservedReply(results, tokens, refill)

    @_handles(M.Reserve)
    def _reserve(self, req, st, now, role):
        return st.reservations.reserve(req.size, req.count, req.host_id, req.replicas, now, req.release, req.ahead)

    @_handles(M.Lookup)
    def _lookup(self, req, st, now, role):
        return st.lookup(req.keys, req.lease, now)

    @_handles(M.ReleaseLeases)
    def _release_leases(self, req, st, now, role):
        return st.release_leases(req.keys, now)

    @_handles(M.Exists)
    def _exists(self, req, st, now, role):
        return st.exists(req.keys)

    @_handles(M.PutRevoke)
    def _put_revoke(self, req, st, now, role):
        return st.put_revoke(req.keys, req.put_ids, now)

    @_handles(M.Remove)
    def _remove(self, req, st, now, role):
        return st.remove(req.keys, req.force, now)

    @_handles(M.ListObjects)
    def _list_objects(self, req, st, now, role):
        return st.list_objects(req.prefix, req.limit, now, time.time())  # wall: for display only

    @_handles(M.Story)
    def _story(self, req, st, now, role):  # the key's own entries, at most STORY_LIMIT (master/story.py)
        return [M.StoryEntry(t, e, d) for t, e, d in st.story.of(req.key, req.limit)]

    @_handles(M.Stats)
    def _stats(self, req, st, now, role):  # walked off this thread; answered when the walk is done
        return self.stats.request()

    @_handles(M.Unpin)
    def _unpin(self, req, st, now, role):  # durable first: an acknowledged unpin survives a failover
        key = self.keys.pin(req.key)
        st.check_unpin(req.key)  # a pin waiting for an away node can be cancelled too
        return self.durable.write(key, lambda e: e.delete(key), "pins", lambda: st.unpin(req.key))

    @_handles(M.Pin)
    def _pin(self, req, st, now, role):  # durable first: an acknowledged pin survives a failover
        ttl, key = req.ttl_s, self.keys.pin(req.key)
        obj = st.check_pin(req.key, ttl)
        val = M.encode(M.PinRecord(req.key, ttl, obj.size, obj.checksum, time.time()))  # a duration

        def pin_same(k=req.key, size=obj.size, checksum=obj.checksum):
            cur = st.check_pin(k, ttl)
            if (cur.size, cur.checksum) != (size, checksum):  # re-put meanwhile: the record names the old bytes
                raise NotFound(f"{k!r} was replaced while its pin was being recorded; pin it again", key=k)
            return st.pin(k, ttl, time.monotonic())  # counted from when the record landed

        return self.durable.write(key, lambda e: e.put(key, val), "pins", pin_same,
                                  undo=lambda: self._forget(key))

    @_handles(M.Evict)
    def _evict(self, req, st, now, role):
        open_ = [rid for rid, h in st.handoffs.items() if h.status == "open"] if req.force else []
        report = st.eviction.admin(req.selector, req.dry_run, req.force, now)
        for rid in open_:  # a forced evict releases the hand-offs holding its objects: their records go
            if (h := st.handoffs.get(rid)) is None or h.status != "open":
                self._forget(self.keys.handoff(rid))
        return report

    @_handles(M.Drain)
    def _drain(self, req, st, now, role):
        return st.repair.drain(req.node_id, req.undo)

    @_handles(M.ReportDead)
    def _report_dead(self, req, st, now, role):
        return st.report_dead(req.node_id, req.incarnation, now)

    @_handles(M.ReportCorrupt)
    def _report_corrupt(self, req, st, now, role):
        return st.report_corrupt(req.key, req.node_id, req.gen, req.incarnation, trusted=role != "client")

    @_handles(M.HandoffPublish)
    def _handoff_publish(self, req, st, now, role):
        rec = st.handoff_publish(msgspec.structs.replace(req.record, published_at=time.time()), now)
        key, val = self.keys.handoff(rec.request_id), M.encode(rec)
        return self.durable.write(key, lambda e: e.put(key, val), "hand-off records", lambda: rec)

    @_handles(M.GetConfig)
    def _get_config(self, req, st, now, role):
        return _settings_of(st.s)

    @_handles(M.SetConfig)
    def _set_config(self, req, st, now, role):
        return self.settings.change(req.changes)

    @_handles(M.HandoffClaim)
    def _handoff_claim(self, req, st, now, role):
        return st.handoff_claim(req.request_id, now)

    @_handles(M.HandoffAck, M.HandoffRelease)
    def _handoff_finish(self, req, st, now, role):
        if st.handoff_finish(req.request_id, "acked" if type(req) is M.HandoffAck else "released", now):
            self._forget(self.keys.handoff(req.request_id))
        return None


# answered even while fenced: they change nothing another leader must know (a read lease
# given here is not honoured by a successor, and reads check generation and checksum)
# requests of operators (or the cluster secret's holders) only, never of a client credential
_OPERATOR_ONLY = frozenset((M.SetConfig, M.Evict, M.Drain))
_READS = (M.Lookup, M.ReleaseLeases, M.Exists, M.Stats, M.ListObjects, M.GetConfig, M.Story)


def main(s: MasterServerSettings) -> None:
    try:
        MasterServer(s).run()
    except KVPoolError as e:
        log.error("master: %s", e)
        sys.exit(2)
