"""Store node process: segment + extent table + data server, registered in etcd under
a lease, with a zmq control socket for the master's commit/free/list/copy notices.

The segment is host shared memory (``device="cpu"``, :mod:`storenode.segment`) or device
memory served through staging (``cuda:N``, :mod:`storenode.device_segment`).
Readiness is one line on stdout: ``KVPOOL_READY storenode <node_id> <data_addr>``.
If the etcd lease is lost (an etcd outage or a pause), the node registers again with the
same segment and extent table (while etcd is full, every 5 s until it has room; a node
starting on a full etcd stops with :class:`~protocol.errors.EtcdFull`); a master that
dropped it meanwhile re-indexes its committed extents and grants only generations above
any it has seen, so nothing the cluster removed in between comes back.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from kvpool.protocol import messages as M
from kvpool.protocol import transport
from kvpool.protocol.dataplane import DataReply, DataRequest, frame, recv_reply
from kvpool.protocol.errors import ConfigError, EtcdFull, KVPoolError
from kvpool.protocol.etcd import Etcd, Keys, kept_alive
from kvpool.storenode.dataserver import DataServer
from kvpool.storenode.device_segment import DeviceSegment
from kvpool.storenode.extents import ExtentTable
from kvpool.storenode.segment import Segment


@dataclass(frozen=True)
class NodeSettings:
    """``memory_bytes`` of segment; ``node_ttl_s`` etcd lease TTL (seconds)."""

    etcd: str
    cluster: str = "default"
    node_id: str | None = None
    memory_bytes: int = 1 << 30
    host: str = "127.0.0.1"
    data_port: int = 0
    host_id: str | None = None
    node_ttl_s: float = 3.0
    run_dir: str | None = None
    device: str = "cpu"
    ucx: bool = False


class StoreNode:
    def __init__(self, s: NodeSettings) -> None:
        self.s = s
        self.node_id = s.node_id or f"node-{uuid.uuid4().hex[:8]}"
        self.keys = Keys(s.cluster)
        self.segment = (Segment(s.memory_bytes, name=f"kvpool-{self.node_id}") if s.device == "cpu"
                        else DeviceSegment(s.memory_bytes, s.device))  # raises ConfigError for a bad device
        self.table = ExtentTable(s.memory_bytes)
        self._own_run_dir = s.run_dir is None
        run_dir = s.run_dir or tempfile.mkdtemp(prefix="kvpool-node-")
        self.run_dir = run_dir
        self.unix_path = os.path.join(run_dir, f"{self.node_id}.sock")
        addrs = [f"tcp://{s.host}:{s.data_port}", f"unix://{self.unix_path}"]
        if s.ucx:  # raises ConfigError naming the extra when ucxx is not installed
            addrs.append(f"ucx://{s.host}:0")
        self.data = DataServer(self.segment, self.table, addrs)
        self.host_id = s.host_id or transport.default_host_id()
        self._stop = asyncio.Event()

    def descriptor(self, ctrl_addr: str) -> M.NodeDesc:
        return M.NodeDesc(self.node_id, self.segment.incarnation, self.data.addrs[0], ctrl_addr,
                          self.data.addrs[1], self.host_id, self.segment.capacity, self.s.device,
                          self.segment.grant_key, self.data.addrs[2] if self.s.ucx else "", M.WIRE_VERSION)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self.data.start()
        ctx = zmq.asyncio.Context()
        ctrl = ctx.socket(zmq.ROUTER)
        ctrl.setsockopt(zmq.LINGER, 0)
        port = ctrl.bind_to_random_port(f"tcp://{self.s.host}")
        ctrl_addr = f"tcp://{self.s.host}:{port}"
        ctrl_task = asyncio.create_task(self._control(ctrl))
        announced = registered = False
        try:
            async with Etcd(self.s.etcd) as etcd:
                while not self._stop.is_set():
                    lost = asyncio.Event()
                    try:
                        async with kept_alive(etcd, self.s.node_ttl_s, lost) as lease:
                            desc = self.descriptor(ctrl_addr)
                            if not await self._register(etcd, lease, desc):
                                break  # stopped while waiting for the name
                            registered = True
                            if not announced:
                                print(f"KVPOOL_READY storenode {self.node_id} {desc.data_addr}", flush=True)
                                announced = True
                            stop_wait = asyncio.create_task(self._stop.wait())
                            lost_wait = asyncio.create_task(lost.wait())
                            await asyncio.wait({stop_wait, lost_wait}, return_when=asyncio.FIRST_COMPLETED)
                            stop_wait.cancel()
                            lost_wait.cancel()
                    except EtcdFull as e:
                        if not announced:
                            raise  # at start-up: stop with the error, which says how to free space
                        # serving already: keep the segment and register again once etcd has room
                        print(f"storenode {self.node_id}: cannot register again: {e}", file=sys.stderr, flush=True)
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._stop.wait(), 5.0)
                        continue
                    if lost.is_set() and not self._stop.is_set():
                        # etcd let our lease lapse (an outage, a pause): register again with
                        # the same segment; a master that dropped us meanwhile re-indexes our
                        # committed extents when it sees us join (master/server.py _adopt)
                        print(f"storenode {self.node_id}: etcd lease lost; registering again", flush=True)
                        await asyncio.sleep(0.2)
                if registered:
                    with contextlib.suppress(Exception):
                        await etcd.delete(self.keys.node(self.node_id))
        finally:
            ctrl_task.cancel()
            self.data.stop()
            ctrl.close(0)
            ctx.term()
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
            if self._own_run_dir:
                with contextlib.suppress(OSError):
                    os.rmdir(self.run_dir)

    async def _register(self, etcd: Etcd, lease, desc: M.NodeDesc) -> bool:
        """Publish ``desc`` under this node's name only if no other process holds the name.
        A previous run of this node that died holds it until its lease lapses: waited for,
        up to 2 × node_ttl + 1 s. A live node keeps its lease alive, so a second process
        under its name stops with a ConfigError instead of taking the name over (the master
        would drop the first node and its data). False when asked to stop while waiting."""
        key, val = self.keys.node(self.node_id), msgspec.msgpack.encode(desc)
        deadline = time.monotonic() + 2 * self.s.node_ttl_s + 1.0
        told = False
        while not await etcd.create_if_absent(key, val, lease):
            raw = await etcd.get(key)
            try:
                other = None if raw is None else msgspec.msgpack.decode(raw, type=M.NodeDesc)
            except (msgspec.DecodeError, msgspec.ValidationError):
                other = None
            if other is not None and other.incarnation == desc.incarnation:
                await etcd.put(key, val, lease=lease)  # our own earlier registration
                return True
            where = f"data address {other.data_addr}" if other is not None else "an unreadable record"
            if time.monotonic() > deadline:
                raise ConfigError(f"store node name {self.node_id!r} is held by a live node ({where}); start "
                                  "this one with another --name, or stop that node first", key="name")
            if not told:
                print(f"storenode {self.node_id}: the name is registered by another process ({where}); waiting "
                      f"up to {deadline - time.monotonic():.0f}s for its lease to lapse", flush=True)
                told = True
            try:
                await asyncio.wait_for(self._stop.wait(), 0.25)
                return False
            except asyncio.TimeoutError:
                pass
        return True

    async def _control(self, ctrl) -> None:
        while True:
            frames = await ctrl.recv_multipart()
            if len(frames) != 2:
                continue  # not our framing (identity, body): drop it, keep serving
            ident, body = frames
            try:
                await self._control_one(ctrl, ident, M.decode_node_request(body))
            except (KVPoolError, ValueError, TypeError, OverflowError) as e:
                err = e if isinstance(e, KVPoolError) else KVPoolError(f"bad control request: {e}")
                await ctrl.send_multipart([ident, M.encode(M.Reply(error=err.to_wire()))])

    async def _control_one(self, ctrl, ident: bytes, req) -> None:
        if isinstance(req, M.NodeCommit):
            for row in req.rows:
                self.table.commit(row)
        elif isinstance(req, M.NodeFree):
            for off, gen in req.extents:
                self.table.free(off, gen)
        elif isinstance(req, M.NodeList):
            rows = self.table.committed()
            await ctrl.send_multipart([ident, M.encode(M.Reply(msgspec.Raw(M.encode(
                [self.segment.incarnation, rows, self.table.max_gen]))))])
        elif isinstance(req, M.NodeCopy):
            asyncio.create_task(self._copy(ctrl, ident, req))

    async def _copy(self, ctrl, ident: bytes, req: M.NodeCopy) -> None:
        """Push one committed extent to another node (re-replication for repair/drain)."""
        def push() -> None:
            row = self.table.check_read(req.src_offset, req.dst.size, req.src_gen)
            sock = transport.connect(req.dst.data_addr, 10.0)
            try:
                sock.sendall(frame(DataRequest("write", req.dst.incarnation, req.dst.offset, req.dst.size,
                                               req.dst.gen, req.key, row.checksum, req.layout, req.dst.token)))
                self.segment.send(sock, req.src_offset, req.dst.size)
                rep: DataReply = recv_reply(sock)
                if not rep.ok:
                    raise KVPoolError(rep.error.message if rep.error else "copy failed")
            finally:
                sock.close()

        err = None
        try:
            await asyncio.to_thread(push)
        except (KVPoolError, OSError) as e:
            err = M.ErrorInfo("copy_failed", str(e))
        await ctrl.send_multipart([ident, M.encode(M.Reply(msgspec.Raw(M.encode(req.key)), err))])


def main(s: NodeSettings) -> None:
    node = StoreNode(s)
    try:
        asyncio.run(node.run())
    except KVPoolError as e:
        print(f"storenode: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        node.segment.close()


