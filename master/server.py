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
records of older releases (:mod:`master.records`). Readiness is one
stdout line ``KVPOOL_READY master <rpc_addr>``; ``KVPOOL_LEADER master <rpc_addr>``
follows when it leads.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import msgspec
import zmq

from kvpool.master.clients import ClientConns
from kvpool.master.durable import DurableWrites, Pending
from kvpool.master.joins import JoinQueue, Table, fetch_table
from kvpool.master.metrics import Metrics
from kvpool.master.records import decode_records
from kvpool.master.state import MasterSettings, MasterState
from kvpool.protocol import messages as M
from kvpool.protocol import transport
from kvpool.protocol.config import MasterConfig
from kvpool.protocol.errors import ConfigError, EtcdFull, EtcdUnavailable, InvalidRequest, KVPoolError, NotFound, NotLeader
from kvpool.protocol.etcd import Etcd, Keys, kept_alive
from kvpool.protocol.units import parse_duration


@dataclass(frozen=True)
class MasterServerSettings:
    etcd: str
    cluster: str = "default"
    host: str = "127.0.0.1"
    rpc_port: int = 0
    metrics_port: int | None = None
    membership_poll_s: float = 0.25
    node_ttl_s: float = 3.0
    state: MasterSettings = field(default_factory=MasterSettings)
    # while leading, compact etcd's history every this many seconds (0 = never) to the current
    # revision minus ``etcd_compaction_retention`` revisions
    etcd_compaction_interval_s: float = parse_duration(MasterConfig().etcd_compaction_interval)
    etcd_compaction_retention: int = MasterConfig().etcd_compaction_retention
    # asking a joining store node for its extent table: deadline of a first attempt, doubled
    # with the wait before the next one after each failure, up to join_backoff_max_s (seconds)
    join_timeout_s: float = 2.0
    join_backoff_max_s: float = 30.0


class MasterServer:
    def __init__(self, s: MasterServerSettings) -> None:
        self.s = s
        self.keys = Keys(s.cluster)
        self.state = MasterState(s.state, s.cluster)
        self.metrics = Metrics(self.state, ask=self._on_rpc_thread)
        self.leading = False
        self.leader_addr = ""
        self.ctx = zmq.Context()
        self.node_socks: dict[str, tuple[str, zmq.Socket]] = {}
        self.events: deque = deque()  # etcd thread -> RPC thread (append/popleft are atomic)
        self.stop = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fatal: KVPoolError | None = None
        self.etcd_ok = True
        self.etcd: Etcd | None = None
        listeners = [transport.listen(f"tcp://{s.host}:{s.rpc_port}")]
        self.rpc_addr = "tcp://%s:%d" % listeners[0].getsockname()[:2]
        # same-host clients switch to this abstract Unix socket (half the round trip), told by
        # Hello over TCP; a random name cannot be taken before us, and clients check our pid
        alias = f"unix://@kvpool-master-{secrets.token_hex(16)}"
        try:
            listeners.append(transport.listen(alias))
        except OSError as e:
            print(f"master: no same-host Unix alias ({e}); local clients use TCP", file=sys.stderr, flush=True)
            alias = ""
        self.hello = M.encode(M.Reply(msgspec.Raw(M.encode(M.HelloReply(alias, os.getpid(),
                                                                         transport.default_host_id(),
                                                                         M.WIRE_VERSION)))))
        self.poller = zmq.Poller()  # the RPC thread's one poller: client connections and node sockets
        self.conns = ClientConns(listeners, self.poller, self._handle, self._flush)
        self._settings_write: Pending | None = None  # the settings change on its way to etcd, if any
        self._forget_retry: set[str] = set()  # etcd deletes to retry once etcd answers
        self.durable = DurableWrites(self._etcd_submit, self._answer, lambda key: self._forget_retry.add(key))
        self.joins = self._join_queue()
        self._descs: dict[str, M.NodeDesc] = {}  # the store nodes published in etcd, as last polled
        self._join_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="join")

    # ---- process ------------------------------------------------------------------------

    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        if self.s.metrics_port is not None:
            self.metrics.serve(self.s.host, self.s.metrics_port)
        etcd_thread = threading.Thread(target=self._etcd_main, name="etcd", daemon=True)
        etcd_thread.start()
        try:
            self._rpc_loop()
        finally:
            self.stop.set()
            etcd_thread.join(10)
            self._join_pool.shutdown(wait=True, cancel_futures=True)  # fetches see ``stop`` within 0.1 s
            for _, sock in self.node_socks.values():
                sock.close(0)
            self.conns.close_all()
            self.ctx.term()
        if self.fatal is not None:
            raise self.fatal

    # ---- etcd thread --------------------------------------------------------------------

    def _etcd_main(self) -> None:
        try:
            asyncio.run(self._etcd_async())
        except KVPoolError as e:
            print(f"master: {e}", file=sys.stderr, flush=True)
            self.fatal = e
            self.stop.set()

    async def _etcd_async(self) -> None:
        self.loop = asyncio.get_running_loop()
        async with Etcd(self.s.etcd) as etcd:
            self.etcd = etcd
            print(f"KVPOOL_READY master {self.rpc_addr}", flush=True)
            told = 0.0
            while not self.stop.is_set():
                try:
                    await self._campaign_and_lead(etcd)
                except EtcdFull as e:  # no lease can be granted: campaign again once etcd has room
                    if time.monotonic() - told > 60:
                        print(f"master: cannot campaign for leadership: {e}", file=sys.stderr, flush=True)
                        told = time.monotonic()
                    await asyncio.sleep(1.0)
                except KVPoolError:
                    raise
                except Exception as e:  # noqa: BLE001 - no etcd endpoint answered: campaign again
                    if time.monotonic() - told > 60:
                        print(f"master: cannot campaign for leadership, etcd did not answer ({type(e).__name__}: "
                              f"{e}); retrying", file=sys.stderr, flush=True)
                        told = time.monotonic()
                    await asyncio.sleep(1.0)

    async def _campaign_and_lead(self, etcd: Etcd) -> None:
        lost = asyncio.Event()
        async with kept_alive(etcd, self.s.node_ttl_s, lost) as lease:
            while not self.stop.is_set() and not lost.is_set():
                if await etcd.create_if_absent(self.keys.leader, self.rpc_addr.encode(), lease):
                    break
                cur = await etcd.get(self.keys.leader)
                self.leader_addr = cur.decode() if cur else ""
                await asyncio.sleep(self.s.membership_poll_s)
            else:
                return
            nodes = await self._read_nodes(etcd)
            tables = await self._fetch_tables(nodes)
            handoffs, pins = decode_records((await etcd.get_prefix(self.keys.handoffs)).values(),
                                            (await etcd.get_prefix(self.keys.pins)).values())
            settings = await etcd.get(self.keys.config)
            if settings is None:  # the cluster's first leader: its flags become the cluster's settings
                settings = msgspec.json.encode(_settings_of(self.s.state))
                try:
                    await etcd.put(self.keys.config, settings)
                except Exception as e:  # noqa: BLE001 - the next leader writes them
                    print(f"master: could not record the cluster settings in etcd ({e})", file=sys.stderr,
                          flush=True)
            self.events.append(("lead", nodes, handoffs, pins, settings, tables))
            compactor = asyncio.create_task(self._compact_history(etcd))
            try:
                while not self.stop.is_set() and not lost.is_set():
                    await asyncio.sleep(self.s.membership_poll_s)
                    try:
                        self.events.append(("nodes", await self._read_nodes(etcd)))
                        self.etcd_ok = True
                    except Exception:
                        self.etcd_ok = False  # etcd unavailable: membership changes wait (DESIGN.md §8)
            finally:
                compactor.cancel()
                self.events.append(("step_down",))
                if not lost.is_set():
                    with contextlib.suppress(Exception):
                        await etcd.delete(self.keys.leader)

    async def _fetch_tables(self, descs: dict[str, M.NodeDesc]) -> dict[str, Table | Exception]:
        """The extent tables of the published nodes of this wire version, asked in parallel on
        the join workers, each within ``join_timeout_s`` (node id -> table, or the error)."""
        ask = [d for d in descs.values() if d.wire == M.WIRE_VERSION]
        got = await asyncio.gather(*(asyncio.wrap_future(self._join_pool.submit(
            fetch_table, self.ctx, d, self.s.join_timeout_s, self.stop)) for d in ask), return_exceptions=True)
        return {d.node_id: r for d, r in zip(ask, got)}

    async def _compact_history(self, etcd: Etcd) -> None:
        """While leading: every ``etcd_compaction_interval_s`` seconds, compact etcd's history to
        its current revision minus ``etcd_compaction_retention`` revisions, so that an etcd
        without auto-compaction does not fill its quota with superseded pin and hand-off
        records. Runs on the etcd thread beside the durable writes; errors are logged (once a
        minute at most) and the next round tries again."""
        every, keep = self.s.etcd_compaction_interval_s, self.s.etcd_compaction_retention
        if every <= 0:
            return
        done, told = 0, 0.0
        while True:
            await asyncio.sleep(every)
            try:
                target = (await etcd.status()).revision - keep
                if target > done:
                    await etcd.compact(target)  # False: etcd's own compaction got there first
                    done = target
            except Exception as e:  # noqa: BLE001 - not fatal: etcd may be down or refuse for a while
                if time.monotonic() - told > 60:
                    print(f"master: etcd compaction failed ({type(e).__name__}: {e}); retrying every {every:g}s",
                          file=sys.stderr, flush=True)
                    told = time.monotonic()

    async def _read_nodes(self, etcd: Etcd) -> dict[str, M.NodeDesc]:
        out = {}
        for v in (await etcd.get_prefix(self.keys.nodes)).values():
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                d = msgspec.msgpack.decode(v, type=M.NodeDesc)
                out[d.node_id] = d
        return out

    def _etcd_forget(self, key: str) -> None:
        """Delete an etcd record, after any write to it still in flight; a delete etcd
        refuses is retried once etcd answers again, so no stale pin or hand-off record stays."""
        async def delete(e: Etcd) -> None:
            try:
                await e.delete(key)
            except Exception:  # noqa: BLE001 - any failure: try again later
                self.events.append(("forget_failed", key))

        if self.durable.after(key, delete, "etcd records"):
            return
        try:
            self._etcd_submit(delete, "etcd records", False)
        except EtcdUnavailable:
            self._forget_retry.add(key)

    def _etcd_submit(self, coro_fn, what: str, check: bool = True):
        """Start ``coro_fn(etcd)`` on the etcd thread; its concurrent Future. Raises
        EtcdUnavailable at once when etcd is known to be down (``check``) or not connected."""
        if self.loop is None or self.etcd is None or (check and not self.etcd_ok):
            raise EtcdUnavailable(f"etcd is unavailable; {what} need etcd. Check the etcd endpoint (`kvpool "
                                  "status` still works), then retry")
        return asyncio.run_coroutine_threadsafe(coro_fn(self.etcd), self.loop)

    # ---- RPC thread ---------------------------------------------------------------------

    def _rpc_loop(self) -> None:
        conns = self.conns
        next_tick = time.monotonic()
        while not self.stop.is_set():
            served = set()
            for sock, ev in self.poller.poll(0 if conns.busy else 5 if self.durable else 50):
                if isinstance(sock, int):  # zmq's poller names plain sockets by fd
                    c = conns.on_event(sock, ev)
                    if c is not None:
                        served.add(c)
                else:
                    self._node_reply(sock)
            conns.work_busy(served)  # requests left over from their last turn
            if self.durable:
                self.durable.advance()
            self._apply_events()
            if self.leading and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.s.membership_poll_s
                expired = self.state.tick(time.monotonic())
                for rid in expired:
                    self._etcd_forget(self.keys.handoff(rid))
                if self._forget_retry and self.etcd_ok:
                    keys, self._forget_retry = self._forget_retry, set()
                    for key in keys:
                        self._etcd_forget(key)
            for key in self.state.take_unpinned():  # pinned objects removed, evicted or lost
                self._etcd_forget(self.keys.pin(key))
            self._flush()

    def _answer(self, d: Pending, result, error: KVPoolError | None) -> None:
        """Send a durable write's answer to the client that asked (if it still listens)."""
        if d.answered or d.client is None:
            return
        d.answered = True
        self.metrics.observe(d.op, time.perf_counter() - d.t0)
        reply = M.Reply(error=error.to_wire()) if error is not None else M.Reply(msgspec.Raw(M.encode(result)))
        self.conns.answer(d.client, d.rid, M.encode(reply))

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
            elif kind == "forget_failed":
                self._forget_retry.add(ev[1])
            elif kind == "joined":
                self._joined(*ev[1:])
            elif kind == "lead":
                self.state = MasterState(self.s.state, self.s.cluster)
                self.state.leader_addr = self.rpc_addr
                self.metrics.state = self.state
                self.joins = self._join_queue()  # answers to the previous leadership's asks are dropped
                self._adopt_settings(ev[4])
                self._rebuild(ev[1], ev[2], ev[3], ev[5])
                self.leading, self.leader_addr = True, self.rpc_addr
                print(f"KVPOOL_LEADER master {self.rpc_addr}", flush=True)
            elif kind == "step_down":
                self.leading = False
            elif kind == "nodes" and self.leading:
                self._membership(ev[1])

    def _adopt_settings(self, raw: bytes) -> None:
        """Apply the cluster settings recorded in etcd (over this process's flags)."""
        try:
            cs = msgspec.json.decode(raw, type=M.ClusterSettings).check()
        except (msgspec.DecodeError, msgspec.ValidationError, KVPoolError) as e:
            print(f"master: ignoring the cluster settings in etcd ({e}); using this master's flags. "
                  "Fix them with `kvpool settings --set KEY=VALUE`", file=sys.stderr, flush=True)
            return
        if cs != _settings_of(self.state.s):
            print(f"master: cluster settings from etcd override this master's flags: {cs}", flush=True)
        self._apply_settings(cs)

    def _apply_settings(self, cs: M.ClusterSettings) -> M.ClusterSettings:
        self.state.s = msgspec.structs.replace(self.state.s, **msgspec.structs.asdict(cs))
        return cs

    def _set_settings(self, changes: dict[str, float]) -> Pending:
        """Validate ``changes`` against the current settings, write the result to etcd and
        apply it once written (a durable answer)."""
        cur = msgspec.structs.asdict(_settings_of(self.state.s))
        unknown = sorted(set(changes) - set(cur))
        if unknown:
            raise InvalidRequest(f"unknown setting(s) {', '.join(unknown)}; accepted: {', '.join(cur)}")
        if "replicas" in changes:
            r = changes["replicas"]
            if not (math.isfinite(r) and r == int(r)):
                raise ConfigError(f"replicas: {r!r}; must be a whole number", key="replicas")
            changes = {**changes, "replicas": int(r)}
        new = M.ClusterSettings(**{**cur, **changes}).check()
        if self._settings_write is not None and not self._settings_write.answered:
            # built on the settings of now: a change still on its way to etcd would be undone
            raise EtcdUnavailable("another settings change is being recorded in etcd; nothing was changed, "
                                  "retry in a moment")
        key, val = self.keys.config, msgspec.json.encode(new)
        self._settings_write = self.durable.write(key, lambda e: e.put(key, val), "cluster settings",
                                                  lambda: self._apply_settings(new))
        return self._settings_write

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
        self.state.repair_all()

    def _screen(self, descs: dict[str, M.NodeDesc]) -> list[M.NodeDesc]:
        """The nodes of this master's wire version; others are logged once and not placed on."""
        ok, refused = self.state.screen(descs.values())
        for d in refused:
            print(f"master: store node {d.node_id} ({d.data_addr}) speaks kvpool wire version {d.wire}, this "
                  f"master {M.WIRE_VERSION}: not placing there. Run one kvpool version across the cluster",
                  file=sys.stderr, flush=True)
        return ok

    def _join_queue(self) -> JoinQueue:
        return JoinQueue(self.s.join_timeout_s, backoff_max_s=self.s.join_backoff_max_s)

    def _ask_table(self, d: M.NodeDesc, timeout_s: float) -> None:
        """Ask ``d`` for its extent table on a join worker; the answer comes back as a
        ``joined`` event (:meth:`_joined`), tagged with the state it was asked for."""
        state = self.state
        fut = self._join_pool.submit(fetch_table, self.ctx, d, timeout_s, self.stop)
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
            print(f"master: store node {d.node_id} ({d.ctrl_addr}) is not taken in: {why}; not placing there, "
                  f"asking again in {wait:g}s (failed attempt {n}). Check that its advertised address is "
                  "reachable from the master", file=sys.stderr, flush=True)
            return False
        self.joins.done(d.node_id)
        self.state.node_up(d, now)
        self.state.gens_above(d.node_id, table.max_gen)  # the node refuses generations it saw freed
        for r in table.rows:
            with contextlib.suppress(KVPoolError, ValueError):  # one bad row costs that row
                layout = M.LayoutSpec.decode(r.layout) if r.layout else None
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
        """Completion of a copy (repair) request."""
        while True:
            try:
                body = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                rep = msgspec.msgpack.decode(body, type=M.Reply)
                key = msgspec.msgpack.decode(rep.result, type=str)
                self.state.repair_done(key, rep.error is None)

    def _flush(self) -> None:
        if not self.state.outbox:
            return
        for node_id, msgs in self.state.take_outbox().items():
            sock = self._sock(node_id)
            if sock is None:
                continue
            with contextlib.suppress(zmq.ZMQError):
                for m in _coalesce(msgs):  # in order: a commit then a free of one extent stay so
                    sock.send(M.encode(m), zmq.NOBLOCK)

    def _handle(self, body: bytes) -> bytes | Pending:
        """One request → its encoded Reply (a typed error for anything malformed), or a
        :class:`Pending` when the answer waits for etcd."""
        t0 = time.perf_counter()
        op = "invalid"
        try:
            req = M.decode_request(body)
            op = type(req).__name__
            if type(req) is M.Hello:  # about this connection, not the cluster: standbys answer it too
                return self.hello
            if not self.leading:
                raise NotLeader(f"this master is a standby; the leader is {self.leader_addr or 'unknown'}",
                                leader=self.leader_addr)
            result = self._dispatch(req)
            if isinstance(result, Pending):
                result.op, result.t0 = op, t0
                return result
            reply = M.Reply(msgspec.Raw(M.encode(result)))
        except KVPoolError as e:
            reply = M.Reply(error=e.to_wire())
        except Exception as e:  # noqa: BLE001 - a bug must cost one request, not the master
            traceback.print_exc(file=sys.stderr)
            reply = M.Reply(error=KVPoolError(f"master failed on {op}: {type(e).__name__}: {e}; this is a "
                                              "kvpool bug, please report it with the master's log").to_wire())
        out = M.encode(reply)
        self.metrics.observe(op, time.perf_counter() - t0)
        return out

    def _dispatch(self, req):
        st, now = self.state, time.monotonic()  # every lease, pin, hold and deadline: this clock
        if isinstance(req, M.PutStart):
            return st.put_start(req.items, req.host_id, req.replicas, now)
        if isinstance(req, M.PutEnd):
            return st.put_end(req.keys, req.put_ids, now, req.checksums)
        if isinstance(req, M.Lookup):
            return st.lookup(req.keys, req.lease, now)
        if isinstance(req, M.ReleaseLeases):
            return st.release_leases(req.keys, now)
        if isinstance(req, M.Exists):
            return st.exists(req.keys)
        if isinstance(req, M.PutRevoke):
            return st.put_revoke(req.keys, req.put_ids, now)
        if isinstance(req, M.Remove):
            return st.remove(req.keys, req.force, now)
        if isinstance(req, M.ListObjects):
            return st.list_objects(req.prefix, req.limit, now, time.time())  # wall: for display only
        if isinstance(req, M.Stats):
            return msgspec.structs.replace(st.stats(), joining=self.joins.waiting(now))
        if isinstance(req, (M.Pin, M.Unpin)):  # durable first: an acknowledged (un)pin survives a failover
            ttl = req.ttl_s if isinstance(req, M.Pin) else None
            key = self.keys.pin(req.key)
            if isinstance(req, M.Unpin):
                st.check_unpin(req.key)  # a pin waiting for an away node can be cancelled too
                return self.durable.write(key, lambda e: e.delete(key), "pins", lambda: st.unpin(req.key))
            obj = st.check_pin(req.key, ttl)
            val = M.encode(M.PinRecord(req.key, ttl, obj.size, obj.checksum, time.time()))  # a duration

            def pin_same(k=req.key, size=obj.size, checksum=obj.checksum):
                cur = st.check_pin(k, ttl)
                if (cur.size, cur.checksum) != (size, checksum):  # re-put meanwhile: the record names the old bytes
                    raise NotFound(f"{k!r} was replaced while its pin was being recorded; pin it again", key=k)
                return st.pin(k, ttl, time.monotonic())  # counted from when the record landed

            return self.durable.write(key, lambda e: e.put(key, val), "pins", pin_same,
                                      undo=lambda: self._etcd_forget(key))
        if isinstance(req, M.Evict):
            open_ = [rid for rid, h in st.handoffs.items() if h.status == "open"] if req.force else []
            report = st.evict(req.selector, req.dry_run, req.force, now)
            for rid in open_:  # a forced evict releases the hand-offs holding its objects: their records go
                if (h := st.handoffs.get(rid)) is None or h.status != "open":
                    self._etcd_forget(self.keys.handoff(rid))
            return report
        if isinstance(req, M.Drain):
            return st.drain(req.node_id, req.undo)
        if isinstance(req, M.ReportDead):
            return st.report_dead(req.node_id, req.incarnation, now)
        if isinstance(req, M.ReportCorrupt):
            return st.report_corrupt(req.key, req.node_id, req.gen, req.incarnation)
        if isinstance(req, M.HandoffPublish):
            rec = st.handoff_publish(msgspec.structs.replace(req.record, published_at=time.time()), now)
            key, val = self.keys.handoff(rec.request_id), M.encode(rec)
            return self.durable.write(key, lambda e: e.put(key, val), "hand-off records", lambda: rec)
        if isinstance(req, M.GetConfig):
            return _settings_of(st.s)
        if isinstance(req, M.SetConfig):
            return self._set_settings(req.changes)
        if isinstance(req, M.HandoffClaim):
            return st.handoff_claim(req.request_id, now)
        if isinstance(req, (M.HandoffAck, M.HandoffRelease)):
            status = "acked" if isinstance(req, M.HandoffAck) else "released"
            if st.handoff_finish(req.request_id, status):
                key = self.keys.handoff(req.request_id)
                self._etcd_forget(key)
            return None
        raise KVPoolError(f"unhandled request {type(req).__name__}")


def _settings_of(s: MasterSettings) -> M.ClusterSettings:
    """The cluster-wide part of a master's settings (what etcd's ``config`` record holds)."""
    return M.ClusterSettings(**{f: getattr(s, f) for f in M.ClusterSettings.__struct_fields__})


def _coalesce(msgs: list) -> list:
    """Merge runs of consecutive commit (or free) notices into one message, keeping order."""
    out: list = []
    for m in msgs:
        prev = out[-1] if out else None
        if isinstance(m, M.NodeCommit) and isinstance(prev, M.NodeCommit):
            out[-1] = M.NodeCommit(prev.rows + m.rows)
        elif isinstance(m, M.NodeFree) and isinstance(prev, M.NodeFree):
            out[-1] = M.NodeFree(prev.extents + m.extents)
        else:
            out.append(m)
    return out


def main(s: MasterServerSettings) -> None:
    try:
        MasterServer(s).run()
    except KVPoolError as e:
        print(f"master: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
