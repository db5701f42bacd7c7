"""Master process: a thin asyncio shell around :class:`~master.state.MasterState`.

It decodes zmq ROUTER requests, calls the state object and sends replies; campaigns for
leadership through etcd (create-if-absent on the ``leader`` key under a kept-alive lease);
polls ``nodes/`` for membership; on winning, rebuilds the object index from the store
nodes' extent tables plus the hand-off records in etcd (DESIGN.md §8); sends the state's
outbox (commit/free/copy notices) to store nodes; and serves Prometheus metrics.

Readiness is one stdout line: ``KVPOOL_READY master <rpc_addr>``; ``KVPOOL_LEADER`` follows
when it leads.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from master.metrics import Metrics
from master.state import MasterSettings, MasterState
from protocol import messages as M
from protocol.errors import KVPoolError, NotLeader
from protocol.etcd import Etcd, Keys, kept_alive


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
        self.leading = False
        self.leader_addr = ""
        self.ctx = zmq.asyncio.Context()
        self.node_socks: dict[str, tuple[str, zmq.asyncio.Socket]] = {}
        self.copies: dict[tuple[str, str], M.ExtentRef] = {}
        self.metrics = Metrics(self.state)
        self._stop = asyncio.Event()
        self.rpc_addr = ""

    # ---- process ------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        rpc = self.ctx.socket(zmq.ROUTER)
        rpc.setsockopt(zmq.LINGER, 0)
        if self.s.rpc_port:
            rpc.bind(f"tcp://{self.s.host}:{self.s.rpc_port}")
            port = self.s.rpc_port
        else:
            port = rpc.bind_to_random_port(f"tcp://{self.s.host}")
        self.rpc_addr = f"tcp://{self.s.host}:{port}"
        if self.s.metrics_port is not None:
            self.metrics.serve(self.s.host, self.s.metrics_port)
        async with Etcd(self.s.etcd) as etcd:
            self.etcd = etcd
            print(f"KVPOOL_READY master {self.rpc_addr}", flush=True)
            serve = asyncio.create_task(self._serve(rpc))
            try:
                while not self._stop.is_set():
                    await self._campaign_and_lead()
            finally:
                serve.cancel()
                with contextlib.suppress(BaseException):
                    await serve
                for _, sock in self.node_socks.values():
                    sock.close(0)
                rpc.close(0)
                self.ctx.term()

    async def _campaign_and_lead(self) -> None:
        lost = asyncio.Event()
        async with kept_alive(self.etcd, self.s.node_ttl_s, lost) as lease:
            while not self._stop.is_set() and not lost.is_set():
                if await self.etcd.create_if_absent(self.keys.leader, self.rpc_addr.encode(), lease):
                    break
                cur = await self.etcd.get(self.keys.leader)
                self.leader_addr = cur.decode() if cur else ""
                await self._sleep(self.s.membership_poll_s)
            else:
                return
            self.leading, self.leader_addr = True, self.rpc_addr
            self.state = MasterState(self.s.state, self.s.cluster)
            self.state.leader_addr = self.rpc_addr
            self.metrics.state = self.state
            await self._rebuild()
            print(f"KVPOOL_LEADER master {self.rpc_addr}", flush=True)
            try:
                while not self._stop.is_set() and not lost.is_set():
                    await self._poll_membership()
                    expired = self.state.tick(time.time())
                    for rid in expired:
                        await self.etcd.delete(self.keys.handoff(rid))
                    await self._flush()
                    await self._sleep(self.s.membership_poll_s)
            finally:
                self.leading = False
                if not lost.is_set():
                    with contextlib.suppress(Exception):
                        await self.etcd.delete(self.keys.leader)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    # ---- membership and rebuild -----------------------------------------------------------

    async def _read_nodes(self) -> dict[str, M.NodeDesc]:
        raw = await self.etcd.get_prefix(self.keys.nodes)
        out = {}
        for k, v in raw.items():
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                d = msgspec.msgpack.decode(v, type=M.NodeDesc)
                out[d.node_id] = d
        return out

    async def _poll_membership(self) -> None:
        now = time.time()
        try:
            descs = await self._read_nodes()
        except Exception:
            return  # etcd unavailable: membership changes wait (DESIGN.md §8)
        for nid in list(self.state.nodes):
            d = descs.get(nid)
            if d is None or d.incarnation != self.state.nodes[nid].desc.incarnation:
                self.state.node_down(nid, now)
                self._drop_sock(nid)
        for d in descs.values():
            if d.node_id not in self.state.nodes:
                self.state.node_up(d, now)
        self.state.repair_all()

    def _sock(self, node_id: str) -> zmq.asyncio.Socket | None:
        node = self.state.nodes.get(node_id)
        if node is None:
            return None
        cur = self.node_socks.get(node_id)
        if cur is not None and cur[0] == node.desc.incarnation:
            return cur[1]
        self._drop_sock(node_id)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(node.desc.ctrl_addr)
        self.node_socks[node_id] = (node.desc.incarnation, sock)
        asyncio.create_task(self._node_replies(node_id, sock))
        return sock

    def _drop_sock(self, node_id: str) -> None:
        cur = self.node_socks.pop(node_id, None)
        if cur is not None:
            cur[1].close(0)

    async def _node_replies(self, node_id: str, sock) -> None:
        """Completion of copy (repair) requests sent to ``node_id``."""
        with contextlib.suppress(zmq.ZMQError, asyncio.CancelledError):
            while True:
                body = await sock.recv()
                rep = msgspec.msgpack.decode(body, type=M.Reply)
                key = msgspec.msgpack.decode(rep.result, type=str)
                dst = self.copies.pop((node_id, key), None)
                if dst is not None:
                    self.state.repair_done(key, dst, rep.error is None)
                    await self._flush()

    async def _rebuild(self) -> None:
        """Rebuild the index from live nodes' committed extents and etcd hand-off records."""
        now = time.time()
        for d in (await self._read_nodes()).values():
            self.state.node_up(d, now)
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(d.ctrl_addr)
            try:
                await sock.send(M.encode(M.NodeList()))
                body = await asyncio.wait_for(sock.recv(), 5.0)
                rep = msgspec.msgpack.decode(body, type=M.Reply)
                inc, rows = msgspec.msgpack.decode(rep.result, type=tuple[str, list[M.ExtentEntry]])
                if inc != d.incarnation:
                    continue
                for r in rows:
                    layout = M.LayoutSpec.decode(r.layout) if r.layout else None
                    self.state.restore_extent(d.node_id, r.key, r.offset, r.size, r.gen, r.checksum, layout, now)
            except (asyncio.TimeoutError, msgspec.DecodeError, KVPoolError, ValueError):
                self.state.node_down(d.node_id, now)
            finally:
                sock.close(0)
        for v in (await self.etcd.get_prefix(self.keys.handoffs)).values():
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                self.state.restore_handoff(msgspec.msgpack.decode(v, type=M.HandoffRecord))

    async def _flush(self) -> None:
        for node_id, msgs in self.state.take_outbox().items():
            sock = self._sock(node_id)
            if sock is None:
                continue
            commits = [e for m in msgs if isinstance(m, M.NodeCommit) for e in m.extents]
            frees = [e for m in msgs if isinstance(m, M.NodeFree) for e in m.extents]
            with contextlib.suppress(zmq.ZMQError):
                if frees:
                    await sock.send(M.encode(M.NodeFree(frees)))
                if commits:
                    await sock.send(M.encode(M.NodeCommit(commits)))
                for m in msgs:
                    if isinstance(m, M.NodeCopy):
                        self.copies[(node_id, m.key)] = m.dst
                        await sock.send(M.encode(m))

    # ---- RPC ----------------------------------------------------------------------------

    async def _serve(self, rpc) -> None:
        while True:
            frames = await rpc.recv_multipart()
            if len(frames) != 3:
                continue  # not our framing: identity, request id, body
            ident, rid, body = frames
            t0 = time.perf_counter()
            op = "invalid"
            try:
                req = M.decode_request(body)
                op = type(req).__name__
                if not self.leading:
                    raise NotLeader(f"this master is a standby; the leader is {self.leader_addr or 'unknown'}",
                                    leader=self.leader_addr)
                result = await self._dispatch(req)
                reply = M.Reply(msgspec.Raw(M.encode(result)))
            except KVPoolError as e:
                reply = M.Reply(error=e.to_wire())
            await rpc.send_multipart([ident, rid, M.encode(reply)])
            self.metrics.observe(op, time.perf_counter() - t0)
            if self.state.outbox:
                await self._flush()

    async def _dispatch(self, req):
        st, now = self.state, time.time()
        if isinstance(req, M.PutStart):
            return st.put_start(req.items, req.host_id, req.replicas, now)
        if isinstance(req, M.PutEnd):
            return st.put_end(req.keys, req.put_ids, now)
        if isinstance(req, M.Lookup):
            return st.lookup(req.keys, req.lease, now)
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
        if isinstance(req, M.Pin):
            return st.pin(req.key, req.ttl_s, now)
        if isinstance(req, M.Unpin):
            return st.unpin(req.key)
        if isinstance(req, M.Evict):
            return st.evict(req.selector, req.dry_run, req.force, now)
        if isinstance(req, M.Drain):
            return st.drain(req.node_id)
        if isinstance(req, M.ReportDead):
            return None  # membership follows etcd; the report only speeds up the next poll
        if isinstance(req, M.HandoffPublish):
            rec = st.handoff_publish(req.record, now)
            await self.etcd.put(self.keys.handoff(rec.request_id), M.encode(rec))
            return rec
        if isinstance(req, M.HandoffClaim):
            return st.handoff_claim(req.request_id, now)
        if isinstance(req, (M.HandoffAck, M.HandoffRelease)):
            if st.handoff_finish(req.request_id, "acked" if isinstance(req, M.HandoffAck) else "released"):
                await self.etcd.delete(self.keys.handoff(req.request_id))
            return None
        raise KVPoolError(f"unhandled request {type(req).__name__}")


def main(s: MasterServerSettings) -> None:
    try:
        asyncio.run(MasterServer(s).run())
    except KVPoolError as e:
        print(f"master: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
