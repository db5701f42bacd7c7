"""Store node process: segment + extent table + data server, registered in etcd under
a lease, with a zmq control socket for the master's commit/free/list/copy notices.

The segment is host shared memory (``device="cpu"``, :mod:`storenode.segment`) or device
memory served through staging (``cuda:N``, :mod:`storenode.device_segment`). With a disk
directory (``storenodes[].disk_dir``) the node also has a disk tier: its files are verified
and indexed before the node registers (:mod:`storenode.disk_tier`), the master's demotions
and promotions run on :mod:`storenode.demotion`'s threads, and clients read disk-resident
objects from a read server of its own (:mod:`storenode.disk_reads`).
Readiness is one line on stdout: ``KVPOOL_READY storenode <node_id> <data_addr>``. With a
metrics port, ``KVPOOL_METRICS storenode <node_id> <url>`` comes first, and that HTTP
server answers ``/metrics`` (:mod:`storenode.metrics`), ``/healthz`` (the event loop turns)
and ``/readyz`` (registered in etcd, etcd answering, segment mapped).
The node keeps the newest leader term it knows (the masters' notices and etcd's ``leader``
key, :meth:`StoreNode._follow_term`) and refuses notices and write grants of older terms
with StaleTerm (:mod:`protocol.terms`).
If the etcd lease is lost (an etcd outage or a pause), the node registers again with the
same segment and extent table (while etcd is full, every 5 s until it has room; a node
starting on a full etcd stops with :class:`~protocol.errors.EtcdFull`); a master that
dropped it meanwhile re-indexes its committed extents and grants only generations above
any it has seen, so nothing the cluster removed in between comes back. A key that vanishes
under a live lease is published again (:mod:`storenode.registration`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import msgspec
from kvpool.protocol import messages as M
from kvpool.protocol import transport
from kvpool.protocol.auth import OPEN, Security
from kvpool.protocol.config import ClusterConfig, SecurityConfig, StoreNodeConfig
from kvpool.protocol.dataplane import DataReply, DataRequest, frame, recv_reply
from kvpool.protocol.errors import (DECODE_ERRORS, ConfigError, EtcdFull, InvalidRequest, KVPoolError, Overloaded,
                                    StaleTerm)
from kvpool.protocol.etcd import NO_AUTH, Etcd, EtcdAuth, Keys, kept_alive
from kvpool.storenode.control import ControlChannel
from kvpool.storenode.dataserver import DataServer
from kvpool.storenode.device_segment import DeviceSegment
from kvpool.storenode.disk_reads import DiskReadServer
from kvpool.storenode.disk_tier import DiskTier
from kvpool.storenode.demotion import TierMover
from kvpool.storenode.extents import ExtentTable
from kvpool.storenode.registration import Registration
from kvpool.storenode.segment import Segment

log = logging.getLogger("kvpool.storenode")
_NODE = StoreNodeConfig()  # the defaults, stated once (protocol/config.py)
COPY_MAX = 64  # copy requests queued or running at once; more are answered Overloaded
COPIERS = 4  # threads pushing copies
COPY_CONNECT_S = 10.0  # seconds a copy waits to connect to (and authenticate with) its destination
CTRL_MAX_MSG = 256 << 20  # bytes: the largest control message accepted (a batch of commit rows)


@dataclass(frozen=True)
class NodeSettings:
    """``memory_bytes`` of segment; ``node_ttl_s`` etcd lease TTL (seconds). Defaults: those
    of :class:`~protocol.config.StoreNodeConfig` (build it with :meth:`from_config`)."""

    etcd: str
    cluster: str = ClusterConfig().cluster
    node_id: str | None = None
    memory_bytes: int = _NODE.memory
    host: str = _NODE.host
    data_port: int = _NODE.data_port
    host_id: str | None = None
    node_ttl_s: float = ClusterConfig().master.node_ttl
    run_dir: str | None = None
    device: str = _NODE.device
    ucx: bool = _NODE.ucx
    metrics_port: int | None = _NODE.metrics_port  # /metrics, /healthz, /readyz (0: any free port; None: off)
    security: Security = OPEN  # the cluster secret and TLS on the data and control sockets (protocol/auth.py)
    max_conns: int = SecurityConfig().max_conns  # data connections served at once
    advertise: str | None = _NODE.advertise  # host published in the descriptor (transport.advertise_host)
    control_port: int = _NODE.control_port  # 0: any free port
    ucx_port: int = _NODE.ucx_port  # 0: any free port
    etcd_auth: EtcdAuth = NO_AUTH  # etcd user/password and TLS
    data_workers: int = _NODE.data_workers  # threads serving data requests (storenode/connpool.py)
    frame_timeout_s: float = SecurityConfig().frame_timeout  # deadline of each data socket call
    # the disk tier (None: none): directory, bytes, watermarks (fractions), read threads and
    # the demotions' write rate (bytes per second, 0: no bound)
    disk_dir: str | None = _NODE.disk_dir
    disk_capacity: int = _NODE.disk_capacity
    disk_high_watermark: float = _NODE.disk_high_watermark
    disk_low_watermark: float = _NODE.disk_low_watermark
    disk_readers: int = _NODE.disk_readers
    disk_write_rate: int = _NODE.disk_write_rate
    disk_port: int = _NODE.disk_port  # 0: any free port

    @classmethod
    def from_config(cls, cfg: ClusterConfig, node: StoreNodeConfig, run_dir: str | None = None) -> "NodeSettings":
        """The settings of store node ``node`` of ``cfg`` (validated by
        :func:`~protocol.config.load_config`; its lease TTL is ``master.node_ttl``), whose
        ``etcd.endpoint`` must be set. Raises ConfigError."""
        eps = cfg.etcd.endpoints()
        if not eps:
            raise ConfigError("no etcd endpoint: pass --etcd http://host:port or set etcd.endpoint in the --config "
                              "file (a store node does not start etcd; `kvpool up` does)", key="etcd.endpoint")
        return cls(",".join(eps), cfg.cluster, node.name, node.memory, node.host, node.data_port,
                   node.host_id, cfg.master.node_ttl, run_dir, node.device, node.ucx,
                   node.metrics_port, Security.for_server(cfg.security, "this store node"), cfg.security.max_conns, node.advertise,
                   node.control_port, node.ucx_port, EtcdAuth.from_config(cfg.etcd), node.data_workers,
                   cfg.security.frame_timeout, node.disk_dir, node.disk_capacity,
                   node.disk_high_watermark, node.disk_low_watermark, node.disk_readers,
                   node.disk_write_rate, node.disk_port)


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
        # published host: the advertised one (checked before anything is bound: ConfigError)
        self.public = transport.advertise_host(s.host, s.advertise, "storenodes[].advertise")
        addrs = [f"tcp://{transport.host_port(s.host, s.data_port)}", f"unix://{self.unix_path}"]
        if s.ucx:  # raises ConfigError naming the extra when ucxx is not installed
            addrs.append(f"ucx://{transport.host_port(s.host, s.ucx_port)}")
        if s.security.secret is not None:  # derived from the secret: never published in etcd
            self.segment.grant_key = s.security.grant_key(self.segment.incarnation)
        self.data = DataServer(self.segment, self.table, addrs, s.security, s.max_conns, s.data_workers,
                               s.frame_timeout_s)
        self.disk: DiskTier | None = None
        self.mover: TierMover | None = None
        self.disk_reads: DiskReadServer | None = None
        if s.disk_dir is not None:
            self._open_disk(run_dir)
        self._copies = 0  # copy requests queued or running (at most COPY_MAX)
        self._copies_lock = threading.Lock()
        self._copier = concurrent.futures.ThreadPoolExecutor(COPIERS, thread_name_prefix="kvpool-copy")
        self.control: ControlChannel | None = None
        self.host_id = s.host_id or transport.default_host_id()
        self._stop = asyncio.Event()
        self.stats = self.data.stats
        self.registered = False  # the descriptor is published under a live etcd lease
        # its key watched (published again when it vanishes) and etcd's answers (storenode/registration.py)
        self.registration = Registration(self.node_id, max(0.2, min(1.0, s.node_ttl_s / 3)))
        self.loop: asyncio.AbstractEventLoop | None = None

    def _open_disk(self, run_dir: str) -> None:
        """The disk tier: verify and index its files (before the node registers, so its
        first table holds them), start its mover and its read server."""
        s = self.s
        disk = self.disk = DiskTier(s.disk_dir, s.disk_capacity)  # ConfigError: unusable or in use
        t0 = time.monotonic()
        kept, dropped = disk.scan()
        files, used = disk.usage()
        log.info("storenode %s: disk tier %s: %d object(s), %d bytes of %d, verified in %.1fs%s", self.node_id,
                 disk.path, kept, used, disk.capacity, time.monotonic() - t0,
                 f"; {dropped} bad file(s) dropped" if dropped else "")
        self.mover = TierMover(self.segment, self.table, disk, s.disk_write_rate)
        addrs = [f"tcp://{transport.host_port(s.host, s.disk_port)}",
                 f"unix://{os.path.join(run_dir, self.node_id)}.disk.sock"]
        self.disk_reads = DiskReadServer(disk, self.segment, self.table, addrs, s.security, s.max_conns,
                                         s.disk_readers, s.frame_timeout_s)

    def published(self, addr: str) -> str:
        """A bound ``tcp://``/``ucx://`` address with its host replaced by the advertised one."""
        scheme, rest = transport.split_addr(addr)
        return f"{scheme}://{transport.host_port(self.public, int(rest.rsplit(':', 1)[1]))}"

    def descriptor(self, ctrl_addr: str) -> M.NodeDesc:
        """The etcd record of this node: every network address with the advertised host."""
        desc = M.NodeDesc(self.node_id, self.segment.incarnation, self.published(self.data.addrs[0]),
                          self.published(ctrl_addr), self.data.addrs[1], self.host_id, self.segment.capacity,
                          self.s.device, b"" if self.s.security.secret is not None else self.segment.grant_key,
                          self.published(self.data.addrs[2]) if self.s.ucx else "", M.WIRE_VERSION)
        if self.disk_reads is None:
            return desc
        return msgspec.structs.replace(desc, disk_capacity=self.disk.capacity,
                                       disk_high_watermark=self.s.disk_high_watermark,
                                       disk_low_watermark=self.s.disk_low_watermark,
                                       disk_addr=self.published(self.disk_reads.addrs[0]),
                                       disk_path=self.disk_reads.addrs[1])

    async def run(self) -> None:
        loop = self.loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        ops = None
        if self.s.metrics_port is not None:
            from kvpool.protocol.opshttp import OpsServer
            from kvpool.storenode.metrics import node_registry

            ops = OpsServer(self.s.host, self.s.metrics_port, node_registry(self), self.healthz, self.readyz)
            print(f"KVPOOL_METRICS storenode {self.node_id} {ops.url}", flush=True)
        self.data.start()
        if self.disk_reads is not None:
            self.disk_reads.stats = self.stats  # one set of request counters per node
            self.disk_reads.start()
        ctrl = self.control = ControlChannel(self.s.host, self.s.control_port, self.s.security, CTRL_MAX_MSG,
                                             self._control)
        ctrl.start()
        ctrl_addr = ctrl.addr
        announced = registered = False
        term_task = None
        try:
            async with Etcd(self.s.etcd, auth=self.s.etcd_auth) as etcd:
                term_task = asyncio.create_task(self._follow_term(etcd))
                while not self._stop.is_set():
                    lost = asyncio.Event()
                    try:
                        async with kept_alive(etcd, self.s.node_ttl_s, lost) as lease:
                            desc = self.descriptor(ctrl_addr)
                            if not await self._register(etcd, lease, desc):
                                break  # stopped while waiting for the name
                            registered = self.registered = True
                            if not announced:
                                print(f"KVPOOL_READY storenode {self.node_id} {desc.data_addr}", flush=True)
                                announced = True
                            stop_wait = asyncio.create_task(self._stop.wait())
                            lost_wait = asyncio.create_task(lost.wait())
                            watch = asyncio.create_task(self.registration.watch(etcd, self.keys.node(self.node_id),
                                                                                desc, lease))
                            await asyncio.wait({stop_wait, lost_wait}, return_when=asyncio.FIRST_COMPLETED)
                            for task in (stop_wait, lost_wait, watch):
                                task.cancel()
                            self.registered = self.registration.published = False
                    except EtcdFull as e:
                        if not announced:
                            raise  # at start-up: stop with the error, which says how to free space
                        # serving already: keep the segment and register again once etcd has room
                        log.error("storenode %s: cannot register again: %s", self.node_id, e)
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._stop.wait(), 5.0)
                        continue
                    if lost.is_set() and not self._stop.is_set():
                        # etcd let our lease lapse (an outage, a pause): register again with
                        # the same segment; a master that dropped us meanwhile re-indexes our
                        # committed extents when it sees us join (master/nodes.py _adopt)
                        log.warning("storenode %s: etcd lease lost; registering again", self.node_id)
                        await asyncio.sleep(0.2)
                if registered:
                    with contextlib.suppress(Exception):
                        await etcd.delete(self.keys.node(self.node_id))
        finally:
            self.registered = False
            if ops is not None:
                ops.close()
            if term_task is not None:
                term_task.cancel()
            self.data.stop()
            if self.disk_reads is not None:
                self.disk_reads.stop()
                self.mover.close()
                with contextlib.suppress(OSError):
                    os.unlink(self.disk_reads.addrs[1].removeprefix("unix://"))
            ctrl.close()
            self._copier.shutdown(wait=False, cancel_futures=True)
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
            if self._own_run_dir:
                with contextlib.suppress(OSError):
                    os.rmdir(self.run_dir)

    def healthz(self) -> tuple[bool, str]:
        """Alive (called from the ops HTTP server's threads): the event loop answers within
        2 s and the control loop runs. ``(ok, detail)``."""
        loop = self.loop
        if loop is None or self._stop.is_set():
            return False, "stopping" if loop is not None else "starting"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        loop.call_soon_threadsafe(fut.set_result, None)
        try:
            fut.result(timeout=2.0)
        except concurrent.futures.TimeoutError:
            return False, "the event loop did not answer within 2s"
        ctrl = getattr(self, "control", None)
        if ctrl is None or not ctrl.alive():
            return False, "the control channel is not running"
        return True, "registered" if self.registered else "not registered in etcd"

    def readyz(self) -> tuple[bool, str]:
        """Ready: the descriptor is published in etcd under a live lease, etcd answered within
        :meth:`~storenode.registration.Registration.stale_after` seconds, and the segment is
        mapped. ``(ok, detail or reason)``."""
        mm = getattr(self.segment, "mm", None)
        if mm is not None and mm.closed:
            return False, "the segment is unmapped"
        if not self.registered:
            return False, "not registered in etcd (starting, the name is held, or the etcd lease was lost)"
        reg = self.registration
        if not reg.etcd_ok():
            return False, f"etcd has not answered for {time.monotonic() - reg.seen_at:.1f}s"
        if not reg.published:
            return False, "its etcd registration is gone (deleted, or taken by another process); registering again"
        return True, f"registered as {self.node_id}, {self.segment.capacity} bytes of {self.s.device} memory"

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
            except DECODE_ERRORS:
                other = None
            if other is not None and other.incarnation == desc.incarnation:
                await etcd.put(key, val, lease=lease)  # our own earlier registration
                return True
            where = f"data address {other.data_addr}" if other is not None else "an unreadable record"
            if time.monotonic() > deadline:
                raise ConfigError(f"store node name {self.node_id!r} is held by a live node ({where}); start "
                                  "this one with another --name, or stop that node first", key="name")
            if not told:
                log.warning("storenode %s: the name is registered by another process (%s); waiting up to %.0fs for "
                            "its lease to lapse", self.node_id, where, deadline - time.monotonic())
                told = True
            try:
                await asyncio.wait_for(self._stop.wait(), 0.25)
                return False
            except asyncio.TimeoutError:
                pass
        return True

    def _control(self, ident: bytes, body: bytes) -> bytes | None:
        """One master notice (on the control channel's thread): its reply's bytes, or None."""
        try:
            req = M.decode_node_request(body)
            self.stats.requests["control", type(req).__name__.removeprefix("Node").lower()] += 1
            return self._control_one(ident, req)
        except (KVPoolError, ValueError, TypeError, OverflowError) as e:
            err = e if isinstance(e, KVPoolError) else KVPoolError(f"bad control request: {e}")
            self.stats.errors["control", err.code] += 1
            return M.encode(M.Reply(error=err.to_wire()))

    def _control_one(self, ident: bytes, req) -> bytes | None:
        self._see_term(req.term, type(req).__name__)  # raises StaleTerm: answered as an error Reply
        if isinstance(req, M.NodeCommit):
            bad = self.table.commit_many(req.rows, until_error=True)
            if bad and bad[-1] is not None:
                raise bad[-1]
        elif isinstance(req, M.NodeFree):
            for off, gen in req.extents:
                self.table.free(off, gen)
        elif isinstance(req, M.NodeList):
            if self.mover is None:
                rows = self.table.committed()
            else:  # memory rows first; no tier move publishes meanwhile (storenode/demotion.py, "Terms")
                with self.mover.publish_lock:
                    rows = self.table.committed() + self.disk.rows()
            return M.encode(M.Reply(msgspec.Raw(M.encode([self.segment.incarnation, rows, self.table.max_gen]))))
        elif isinstance(req, (M.NodeDemote, M.NodePromote, M.NodeDiskFree)):
            return self._tier_request(ident, req)
        elif isinstance(req, M.NodeCopy):
            with self._copies_lock:
                full = self._copies >= COPY_MAX
                self._copies += not full
            if full:  # bounded: a flood is refused, not queued
                err = Overloaded(f"store node {self.node_id} has {COPY_MAX} copies queued; retry later")
                self.stats.errors["control", err.code] += 1
                return M.encode(M.Reply(msgspec.Raw(M.encode(req.key)), err.to_wire()))
            self._copier.submit(self._copy, ident, req)
        return None

    def _tier_request(self, ident: bytes, req) -> bytes | None:
        """A demotion, promotion or disk free of the master (storenode/demotion.py): queued,
        answered with a TierDone once done (an error beside it when it failed)."""
        if self.mover is None:
            raise InvalidRequest(f"store node {self.node_id} has no disk tier (storenodes[].disk_dir)")
        if isinstance(req, M.NodeDiskFree):  # file deletes: off the control channel's thread
            self._copier.submit(self.disk.delete, req.ids)
            return None
        demote = isinstance(req, M.NodeDemote)
        done = M.TierDone("demote", req.key, req.gen, 0) if demote else M.TierDone("promote", req.key, req.dst.gen,
                                                                                 req.disk_id)
        try:
            fut = self.mover.demote(req) if demote else self.mover.promote(req)
        except KVPoolError as e:
            self.stats.errors["control", e.code] += 1
            return M.encode(M.Reply(msgspec.Raw(M.encode(done)), e.to_wire()))
        fut.add_done_callback(lambda f: self._tier_answer(ident, f, done))
        return None

    def _tier_answer(self, ident: bytes, fut, done: M.TierDone) -> None:
        """Send a finished tier move's TierDone back through the control channel."""
        err = None
        try:
            done = fut.result()
        except KVPoolError as e:
            self.stats.errors["control", e.code] += 1
            err = e.to_wire()
        except Exception as e:  # noqa: BLE001 - a bug costs this move, answered as failed
            log.exception("storenode %s: tier move of %r failed", self.node_id, done.key)
            err = KVPoolError(f"{type(e).__name__}: {e}").to_wire()
        self.control.reply_later(ident, M.encode(M.Reply(msgspec.Raw(M.encode(done)), err)))

    def _see_term(self, term: int, what: str) -> None:
        """A master's notice of leader ``term``: refused (StaleTerm) when a newer term is
        known here (its sender was deposed); a newer one is adopted, so from now on every
        notice and write grant of the older leaderships is refused (:mod:`protocol.terms`)."""
        known = self.table.term
        if term < known:
            raise StaleTerm(f"store node {self.node_id}: {what} of leader term {term} refused; term {known} has "
                            "been elected since, so its sender is no longer the leader", term=known)
        if term > known:
            self.table.term = term
            log.info("storenode %s: leader term %d", self.node_id, term)

    async def _follow_term(self, etcd: Etcd) -> None:
        """Learn the leader term from etcd itself (the ``leader`` key's create revision),
        every ``min(1, node_ttl/3)`` seconds: a deposed leader is the one that cannot see
        etcd, so the node must not rely on the masters alone to tell it. A term *below* the
        known one can only come from an etcd whose history restarted (revisions never go
        back within one history); the node then follows that etcd."""
        every = max(0.2, min(1.0, self.s.node_ttl_s / 3))
        while True:
            with contextlib.suppress(Exception):  # etcd unreachable: the masters' notices still count
                meta = await etcd.get_meta(self.keys.leader)
                if meta is not None and meta.create_revision != self.table.term:
                    if meta.create_revision < self.table.term:
                        log.warning("storenode %s: etcd names leader term %d, below the %d seen here: etcd's "
                                    "history restarted; following it", self.node_id, meta.create_revision,
                                    self.table.term)
                        self.table.term = meta.create_revision
                    else:
                        self._see_term(meta.create_revision, "etcd's leader key")
            await asyncio.sleep(every)

    def _copy(self, ident: bytes, req: M.NodeCopy) -> None:
        """Push one committed extent to another node (re-replication for repair/drain), on a
        copier thread; the answer goes back through the control channel."""
        err = None
        try:
            if req.src_tier == M.DISK:  # a disk replica: read (and checked) first, then sent
                if self.disk is None:
                    raise InvalidRequest(f"store node {self.node_id} has no disk tier to copy from")
                buf = bytearray(req.dst.size)
                row = self.disk.read_into(req.src_gen, memoryview(buf))
            else:
                row = self.table.check_read(req.src_offset, req.dst.size, req.src_gen)
            checksum = row.checksum if row is not None else req.checksum  # (no row yet: the master's commit)
            sock = transport.connect(req.dst.data_addr, COPY_CONNECT_S, self.s.security)
            try:
                sock.settimeout(self.s.frame_timeout_s)
                sock.sendall(frame(DataRequest("write", req.dst.incarnation, req.dst.offset, req.dst.size,
                                               req.dst.gen, req.key, checksum, req.layout, req.dst.token)))
                if req.src_tier == M.DISK:
                    sock.sendall(buf)
                else:
                    self.segment.send(sock, req.src_offset, req.dst.size)
                rep: DataReply = recv_reply(sock)
                if not rep.ok:
                    raise KVPoolError(rep.error.message if rep.error else "copy failed")
            finally:
                sock.close()
        except (KVPoolError, OSError) as e:
            err = M.ErrorInfo("copy_failed", str(e))
        finally:
            with self._copies_lock:
                self._copies -= 1
        self.control.reply_later(ident, M.encode(M.Reply(msgspec.Raw(M.encode(req.key)), err)))


def main(s: NodeSettings) -> None:
    node = StoreNode(s)
    try:
        asyncio.run(node.run())
    except KVPoolError as e:
        log.error("storenode: %s", e)
        sys.exit(2)
    finally:
        node.segment.close()
        if node.disk is not None:
            node.disk.close()


