"""Master process: a thin shell around :class:`~master.state.MasterState`.

Two threads:

* the **RPC thread** owns every socket and the state object: one poll loop over the
  client connections (plain TCP, non-blocking, framed by :mod:`protocol.rpcwire`) and the
  zmq DEALER sockets to store nodes. It decodes requests, calls the state, replies,
  applies membership changes handed over by the etcd thread, runs the periodic ``tick``
  and sends the state's outbox (commit/free/copy notices) to store nodes. Replies to the
  requests that arrived together go out in one ``send`` per connection.
* the **etcd thread** (asyncio, aetcd) campaigns for leadership (create-if-absent on
  the ``leader`` key under a kept-alive lease), polls ``nodes/`` for membership and
  performs the durable hand-off record writes the RPC thread asks for.

On winning the election the index is rebuilt from the store nodes' committed extent
tables plus the hand-off records in etcd (DESIGN.md §8). Readiness is one stdout line
``KVPOOL_READY master <rpc_addr>``; ``KVPOOL_LEADER master <rpc_addr>`` follows when it leads.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import msgspec
import zmq

from master.metrics import Metrics
from master.state import MasterSettings, MasterState
from protocol import messages as M
from protocol import rpcwire, transport
from protocol.errors import EtcdUnavailable, InvalidRequest, KVPoolError, NotLeader
from protocol.etcd import Etcd, Keys, kept_alive


_OUT_MAX = 64 << 20  # bytes of unsent replies after which a client's requests wait


class _Client:
    """One client connection: its frame parser and the reply bytes not sent yet."""

    __slots__ = ("sock", "parser", "out", "closing")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = rpcwire.FrameParser()
        self.out = bytearray()
        self.closing = False


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


class MasterServer:
    def __init__(self, s: MasterServerSettings) -> None:
        self.s = s
        self.keys = Keys(s.cluster)
        self.state = MasterState(s.state, s.cluster)
        self.metrics = Metrics(self.state)
        self.leading = False
        self.leader_addr = ""
        self.ctx = zmq.Context()
        self.node_socks: dict[str, tuple[str, zmq.Socket]] = {}
        self.events: queue.Queue = queue.Queue()  # etcd thread -> RPC thread
        self.stop = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fatal: KVPoolError | None = None
        self.etcd_ok = True
        self.etcd: Etcd | None = None
        self.listener = transport.listen(f"tcp://{s.host}:{s.rpc_port}")
        self.listener.setblocking(False)
        self.rpc_addr = "tcp://%s:%d" % self.listener.getsockname()[:2]
        self.listener_fd = self.listener.fileno()
        self.clients: dict[int, _Client] = {}  # by fd
        self._rbuf = memoryview(bytearray(1 << 20))  # the RPC thread's receive buffer
        self._accept_warned = 0.0

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
            for _, sock in self.node_socks.values():
                sock.close(0)
            for c in list(self.clients.values()):
                c.sock.close()
            self.listener.close()
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
            while not self.stop.is_set():
                await self._campaign_and_lead(etcd)

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
            handoffs, pins = [], []
            for v in (await etcd.get_prefix(self.keys.handoffs)).values():
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    handoffs.append(msgspec.msgpack.decode(v, type=M.HandoffRecord))
            for v in (await etcd.get_prefix(self.keys.pins)).values():
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    pins.append(msgspec.msgpack.decode(v, type=M.PinRecord))
            self.events.put(("lead", nodes, handoffs, pins))
            try:
                while not self.stop.is_set() and not lost.is_set():
                    await asyncio.sleep(self.s.membership_poll_s)
                    try:
                        self.events.put(("nodes", await self._read_nodes(etcd)))
                        self.etcd_ok = True
                    except Exception:
                        self.etcd_ok = False  # etcd unavailable: membership changes wait (DESIGN.md §8)
            finally:
                self.events.put(("step_down",))
                if not lost.is_set():
                    with contextlib.suppress(Exception):
                        await etcd.delete(self.keys.leader)

    async def _read_nodes(self, etcd: Etcd) -> dict[str, M.NodeDesc]:
        out = {}
        for v in (await etcd.get_prefix(self.keys.nodes)).values():
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                d = msgspec.msgpack.decode(v, type=M.NodeDesc)
                out[d.node_id] = d
        return out

    def _etcd_forget(self, key: str) -> None:
        """Delete an etcd record in the background (best effort: a stale pin record is
        dropped at the next rebuild, an expired hand-off record when it is read)."""
        with contextlib.suppress(EtcdUnavailable):
            self._etcd_call(lambda e: e.delete(key), wait=False)

    def _etcd_call(self, coro_fn, wait: bool):
        """Run ``coro_fn(etcd)`` on the etcd thread; block for the result when ``wait``."""
        if self.loop is None or self.etcd is None or (wait and not self.etcd_ok):
            raise EtcdUnavailable("etcd is unavailable; durable hand-off records need etcd. Check the etcd "
                                  "endpoint (`kvpool status` still works), then retry")
        fut = asyncio.run_coroutine_threadsafe(coro_fn(self.etcd), self.loop)
        if not wait:
            return None
        try:
            return fut.result(3.0)
        except Exception as e:  # timeout or a gRPC error: etcd is unavailable
            fut.cancel()
            raise EtcdUnavailable(f"etcd did not answer ({type(e).__name__}); durable hand-off records need etcd. "
                                  "Check `kvpool status` and the etcd endpoint, then retry") from None

    # ---- RPC thread ---------------------------------------------------------------------

    def _rpc_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.listener, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self.stop.is_set():
            for sock, ev in poller.poll(50):
                if isinstance(sock, int):  # zmq's poller names plain sockets by fd
                    if sock == self.listener_fd:
                        self._accept(poller)
                    elif (c := self.clients.get(sock)) is not None:
                        self._serve(poller, c, ev)
                else:
                    self._node_reply(poller, sock)
            self._apply_events(poller)
            if self.leading and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.s.membership_poll_s
                expired = self.state.tick(time.time())
                for rid in expired:
                    self._etcd_forget(self.keys.handoff(rid))
            for key in self.state.take_unpinned():  # pinned objects removed, evicted or lost
                self._etcd_forget(self.keys.pin(key))
            self._flush(poller)

    def _accept(self, poller: zmq.Poller) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of fds, aborted handshake: keep serving the others
                if e.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    now = time.monotonic()
                    if now - self._accept_warned > 10:
                        self._accept_warned = now
                        print(f"master: accept failed: {e}; raise the open-file limit (ulimit -n)",
                              file=sys.stderr, flush=True)
                    time.sleep(0.01)  # the listener stays readable: do not spin on it
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.clients[sock.fileno()] = _Client(sock)
            poller.register(sock, zmq.POLLIN)

    def _close_client(self, poller: zmq.Poller, c: _Client) -> None:
        self.clients.pop(c.sock.fileno(), None)
        with contextlib.suppress(KeyError):
            poller.unregister(c.sock)
        with contextlib.suppress(OSError):
            c.sock.close()

    def _serve(self, poller: zmq.Poller, c: _Client, ev: int) -> None:
        """Read what the connection has, answer every whole request, send the replies."""
        if ev & (zmq.POLLIN | zmq.POLLERR) and not c.closing:  # an error shows up as a failed recv
            try:
                got = c.sock.recv_into(self._rbuf)
            except (BlockingIOError, InterruptedError):
                got = -1
            except OSError:
                return self._close_client(poller, c)
            if got == 0:
                return self._close_client(poller, c)
            if got > 0:
                try:
                    frames = c.parser.feed(self._rbuf[:got])
                except InvalidRequest as e:  # a corrupt length: answer, then hang up
                    frames, c.closing = [], True
                    c.out += rpcwire.pack(int(e.fields.get("rid", 0)), M.encode(M.Reply(error=e.to_wire())))
                for rid, body in frames:
                    reply = self._handle(body)
                    if rid != rpcwire.ONE_WAY:
                        c.out += rpcwire.pack(rid, reply)
        if c.out:
            try:
                sent = c.sock.send(c.out)
                del c.out[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return self._close_client(poller, c)
        if c.closing and not c.out:
            return self._close_client(poller, c)
        # a client that does not read its replies stops being read (no unbounded reply buffer)
        poller.modify(c.sock, (zmq.POLLIN if len(c.out) < _OUT_MAX else 0) | (zmq.POLLOUT if c.out else 0))

    def _apply_events(self, poller: zmq.Poller) -> None:
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return
            kind = ev[0]
            if kind == "lead":
                self.state = MasterState(self.s.state, self.s.cluster)
                self.state.leader_addr = self.rpc_addr
                self.metrics.state = self.state
                self._rebuild(ev[1], ev[2], ev[3])
                self.leading, self.leader_addr = True, self.rpc_addr
                print(f"KVPOOL_LEADER master {self.rpc_addr}", flush=True)
            elif kind == "step_down":
                self.leading = False
            elif kind == "nodes" and self.leading:
                self._membership(ev[1], poller)

    def _membership(self, descs: dict[str, M.NodeDesc], poller: zmq.Poller) -> None:
        now = time.time()
        for nid in list(self.state.nodes):
            d = descs.get(nid)
            if d is None or d.incarnation != self.state.nodes[nid].desc.incarnation:
                self.state.node_down(nid, now)
                self._drop_sock(nid, poller)
        for d in descs.values():
            if d.node_id not in self.state.nodes:
                self.state.node_up(d, now)
        self.state.repair_all()

    def _rebuild(self, descs: dict[str, M.NodeDesc], handoffs: list[M.HandoffRecord],
                 pins: list[M.PinRecord]) -> None:
        """Index from live nodes' committed extents, then hand-off holds and pins from etcd
        (stale pin records — object gone, soft pin lapsed — are deleted)."""
        now = time.time()
        for d in descs.values():
            self.state.node_up(d, now)
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(d.ctrl_addr)
            try:
                sock.send(M.encode(M.NodeList()))
                if not sock.poll(5000):
                    raise TimeoutError
                rep = msgspec.msgpack.decode(sock.recv(), type=M.Reply)
                inc, rows, max_gen = msgspec.msgpack.decode(rep.result, type=tuple[str, list[M.ExtentEntry], int])
                if inc != d.incarnation:
                    continue
                self.state.gens_above(d.node_id, max_gen)  # the node refuses generations it saw freed
                for r in rows:
                    layout = M.LayoutSpec.decode(r.layout) if r.layout else None
                    self.state.restore_extent(d.node_id, r.key, r.offset, r.size, r.gen, r.checksum, layout, now)
            except (TimeoutError, msgspec.DecodeError, msgspec.ValidationError, KVPoolError, ValueError):
                self.state.node_down(d.node_id, now)
            finally:
                sock.close(0)
        for rec in handoffs:
            self.state.restore_handoff(rec)
        for pin in pins:
            if not self.state.restore_pin(pin, now):
                self._etcd_forget(self.keys.pin(pin.key))

    def _sock(self, node_id: str, poller: zmq.Poller) -> zmq.Socket | None:
        node = self.state.nodes.get(node_id)
        if node is None:
            return None
        cur = self.node_socks.get(node_id)
        if cur is not None and cur[0] == node.desc.incarnation:
            return cur[1]
        self._drop_sock(node_id, poller)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100000)
        sock.connect(node.desc.ctrl_addr)
        self.node_socks[node_id] = (node.desc.incarnation, sock)
        poller.register(sock, zmq.POLLIN)
        return sock

    def _drop_sock(self, node_id: str, poller: zmq.Poller) -> None:
        cur = self.node_socks.pop(node_id, None)
        if cur is not None:
            with contextlib.suppress(KeyError):
                poller.unregister(cur[1])
            cur[1].close(0)

    def _node_reply(self, poller: zmq.Poller, sock: zmq.Socket) -> None:
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

    def _flush(self, poller: zmq.Poller) -> None:
        if not self.state.outbox:
            return
        for node_id, msgs in self.state.take_outbox().items():
            sock = self._sock(node_id, poller)
            if sock is None:
                continue
            with contextlib.suppress(zmq.ZMQError):
                for m in _coalesce(msgs):  # in order: a commit then a free of one extent stay so
                    sock.send(M.encode(m), zmq.NOBLOCK)

    def _handle(self, body: bytes) -> bytes:
        """One request → its encoded Reply (a typed error for anything malformed)."""
        t0 = time.perf_counter()
        op = "invalid"
        try:
            req = M.decode_request(body)
            op = type(req).__name__
            if not self.leading:
                raise NotLeader(f"this master is a standby; the leader is {self.leader_addr or 'unknown'}",
                                leader=self.leader_addr)
            reply = M.Reply(msgspec.Raw(M.encode(self._dispatch(req))))
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
        st, now = self.state, time.time()
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
            return st.list_objects(req.prefix, req.limit, now)
        if isinstance(req, M.Stats):
            return st.stats()
        if isinstance(req, M.Pin):  # durable first, so an acknowledged pin survives a failover
            st.check_pin(req.key, req.ttl_s)
            rec = M.PinRecord(req.key, None if req.ttl_s is None else now + req.ttl_s)
            key, val = self.keys.pin(req.key), M.encode(rec)
            self._etcd_call(lambda e: e.put(key, val), wait=True)
            return st.pin(req.key, req.ttl_s, now)
        if isinstance(req, M.Unpin):
            st.unpin(req.key)
            self._etcd_forget(self.keys.pin(req.key))
            return None
        if isinstance(req, M.Evict):
            return st.evict(req.selector, req.dry_run, req.force, now)
        if isinstance(req, M.Drain):
            return st.drain(req.node_id, req.undo)
        if isinstance(req, M.ReportDead):
            return st.report_dead(req.node_id, req.incarnation, now)
        if isinstance(req, M.ReportCorrupt):
            return st.report_corrupt(req.key, req.node_id, req.gen, req.incarnation)
        if isinstance(req, M.HandoffPublish):
            rec = st.handoff_publish(req.record, now)
            key, val = self.keys.handoff(rec.request_id), M.encode(rec)
            self._etcd_call(lambda e: e.put(key, val), wait=True)
            return rec
        if isinstance(req, M.HandoffClaim):
            return st.handoff_claim(req.request_id, now)
        if isinstance(req, (M.HandoffAck, M.HandoffRelease)):
            status = "acked" if isinstance(req, M.HandoffAck) else "released"
            if st.handoff_finish(req.request_id, status):
                key = self.keys.handoff(req.request_id)
                self._etcd_forget(key)
            return None
        raise KVPoolError(f"unhandled request {type(req).__name__}")


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
