"""Threaded data server: reads and writes extents straight between sockets and the
segment, with no per-byte Python work.

One thread per connection, at most ``max_conns`` of them (more are refused with
:class:`~protocol.errors.Overloaded`); socket calls release the GIL, so several streams
run in parallel. Each connection first passes TLS and the cluster-secret handshake when
they are configured (:mod:`protocol.auth`, within ``auth.HANDSHAKE_S``). Frames are described in :mod:`protocol.dataplane`. A malformed frame gets an
error reply and the connection is closed (its stream position can no longer be trusted).

Syscalls per request are what bound small objects, so each connection:

* reads through a 256 KiB buffer (:class:`protocol.dataplane.FrameReader`): one ``recv_into`` brings in many
  pipelined request frames; a write's payload is taken from the buffer as far as it is
  there, and the rest is ``recv_into`` the segment directly (no staging copy);
* gathers replies and sends them with one ``sendmsg`` (header + payload memoryviews,
  scatter/gather) when no complete request is left in the buffer, or when 1 MiB of reply
  is pending. So a pipelined batch of N reads costs about one recv and a few sends.

Copies per byte: ``write`` — kernel socket buffer → segment (one copy; bytes that arrived
with the request frame take one extra user copy from the read buffer, at most 256 KiB per
recv); ``read`` — segment → kernel socket buffer (one copy); ``written`` — none here (the
same-host client copied straight into the shared segment). A device segment adds one copy
each way through its staging buffer (see :mod:`storenode.device_segment`).
"""
from __future__ import annotations

import contextlib
import socket
import threading

import msgspec

from kvpool.protocol import auth, transport
from kvpool.protocol.auth import OPEN, Security
from kvpool.protocol.dataplane import DataReply, DataRequest, FrameReader, frame, sendv
from kvpool.protocol.errors import AuthFailed, InvalidRequest, KVPoolError, NodeUnavailable, Overloaded, StaleExtent
from kvpool.protocol.grants import check_token
from kvpool.protocol.messages import ExtentEntry
from kvpool.storenode.device_segment import DeviceSegment
from kvpool.storenode.extents import ExtentTable
from kvpool.storenode.metrics import NodeStats
from kvpool.storenode.segment import Segment
from kvpool.storenode.writers import Writer, WriterWatch

_FLUSH_BYTES = 1 << 20
_req_dec = msgspec.msgpack.Decoder(DataRequest)
_OK = frame(DataReply(True))


class DataServer:
    """Serves one segment (host shared memory, or a :class:`DeviceSegment` through staging)
    on the given listen addresses (``tcp://``, ``unix://``, ``ucx://``)."""

    def __init__(self, segment: Segment | DeviceSegment, table: ExtentTable, addrs: list[str],
                 security: Security = OPEN, max_conns: int = 1024) -> None:
        self.segment = segment
        self.table = table
        self.writers = WriterWatch(table)  # claims of writers whose connection closed (storenode/writers.py)
        self._writer = threading.local()  # this connection thread's Writer
        self.security = security
        self.max_conns = max_conns  # connections served at once (one thread each); more are refused
        self._tls = security.server_context()
        self.listeners = [(a, transport.listen(a)) for a in addrs]
        self.addrs = [self._bound(a, s) for a, s in self.listeners]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.bytes_in = 0
        self.bytes_out = 0
        self.stats = NodeStats()  # requests and errors by kind (storenode/metrics.py)
        self.refused = 0  # connections refused at the cap
        self.auth_failures = 0  # connections that failed TLS or the secret handshake

    @staticmethod
    def _bound(addr: str, s) -> str:
        scheme, _ = transport.split_addr(addr)
        if scheme == "tcp":
            host, port = s.getsockname()[:2]
            return f"tcp://{host}:{port}"
        if scheme != "unix" and hasattr(s, "bound_addr"):
            return s.bound_addr
        return addr

    def start(self) -> None:
        for addr, s in self.listeners:
            threading.Thread(target=self._accept, args=(addr, s), daemon=True, name=f"accept-{addr}").start()

    def stop(self) -> None:
        self._stop.set()
        self.writers.stop()
        for _, s in self.listeners:
            with contextlib.suppress(OSError):
                s.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()

    def _accept(self, addr: str, s) -> None:
        scheme, _ = transport.split_addr(addr)
        unix = scheme == "unix"
        while not self._stop.is_set():
            try:
                conn, _ = s.accept()
            except OSError:
                return
            if scheme == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                full = len(self._conns) >= self.max_conns
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn, scheme)
                continue
            threading.Thread(target=self._serve, args=(conn, unix, scheme == "tcp"), daemon=True).start()

    def _refuse(self, conn, scheme: str) -> None:
        """Over the cap: tell the peer (in the framing it expects) and close, without a thread."""
        self.refused += 1
        self.stats.errors["data", Overloaded.code] += 1  # exported as kvpool_storenode_errors (storenode/metrics.py)
        err = Overloaded(f"store node data server holds its maximum of {self.max_conns} connections "
                         "(security.max_conns); retry later, or raise it", max_conns=self.max_conns)
        if scheme != "tcp" or self._tls is None:
            msg = auth.refusal(err.message) if self.security.secret is not None else frame(DataReply(False,
                                                                                                     err.to_wire()))
            with contextlib.suppress(OSError):
                conn.setblocking(False)
                conn.send(msg)
        with contextlib.suppress(OSError):
            conn.close()

    def _secure(self, conn, tcp: bool):
        """TLS (TCP, when configured) and the secret handshake, within auth.HANDSHAKE_S: the
        stream to serve, or None (the peer was told why and is to be closed)."""
        try:
            if tcp and self._tls is not None:
                conn.settimeout(auth.HANDSHAKE_S)
                conn = self._tls.wrap_socket(conn, server_side=True)
            if self.security.secret is not None:
                auth.server_handshake(conn, self.security, auth.DATA,
                                      lambda e, _head: frame(DataReply(False, e.to_wire())))
            conn.settimeout(None)
            return conn
        except (AuthFailed, OSError):  # ssl.SSLError and timeouts are OSErrors
            self.auth_failures += 1
            self.stats.errors["data", AuthFailed.code] += 1
            return None

    def _serve(self, raw: socket.socket, unix: bool, tcp: bool = False) -> None:
        conn = self._secure(raw, tcp)
        if conn is None:
            with self._lock:
                self._conns.discard(raw)
            with contextlib.suppress(OSError):
                raw.close()
            return
        if conn is not raw:  # TLS: stop() closes the wrapped socket
            with self._lock:
                self._conns.discard(raw)
                self._conns.add(conn)
        rd = FrameReader(conn)
        out: list = []
        pending = 0
        writer = self._writer.w = Writer(conn if unix else None)
        try:
            while not self._stop.is_set():
                if out and (pending >= _FLUSH_BYTES or not rd.has_frame()):
                    sendv(conn, out)
                    out, pending = [], 0
                try:
                    body = rd.frame()
                    try:
                        req = _req_dec.decode(body)
                    except (msgspec.DecodeError, msgspec.ValidationError) as e:
                        raise InvalidRequest(f"malformed data request: {e}") from None
                except InvalidRequest as e:
                    self.stats.errors["data", e.code] += 1
                    out.append(frame(DataReply(False, e.to_wire())))
                    sendv(conn, out)
                    return
                pending += self._handle(conn, rd, req, unix, out)
        except (NodeUnavailable, OSError):
            return
        except (TypeError, ValueError):
            if not self._stop.is_set():
                raise
            # stopping: the segment was closed under an in-flight transfer; the peer sees EOF
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()
            self.writers.closed(writer)

    def _handle(self, conn, rd: FrameReader, req: DataRequest, unix: bool, out: list) -> int:
        """Serve one request, appending its reply buffers to ``out``; returns their bytes."""
        seg = self.segment
        self.stats.requests["data", req.op] += 1
        try:
            if req.incarnation != seg.incarnation and req.op != "ping":
                raise StaleExtent(f"store node segment restarted (generation {seg.incarnation}, request "
                                  f"named {req.incarnation}); look the key up again")
            if req.op == "written":  # the writer finished copying: its claim ends (needs no grant:
                self.table.release(req.offset, req.gen, self._writer.w)  # it names only its own claims)
            if req.op in ("write", "written", "commit", "claim"):
                self.table.check_bounds(req.offset, req.size)
                if not check_token(seg.grant_key, seg.incarnation, req.offset, req.size, req.gen, req.key,
                                   req.token):
                    raise InvalidRequest(f"write to [{req.offset}, +{req.size}) gen {req.gen} carries no valid "
                                         "grant from the master; writes need a put_start grant")
                if req.op in ("written", "commit"):
                    self.table.check_write(req.offset, req.gen)
            if req.op == "read":
                self.table.check_read(req.offset, req.size, req.gen)
                out.append(frame(DataReply(True, size=req.size)))
                self.bytes_out += req.size
                if seg.view is None:  # device memory: staged now, after what is queued
                    sendv(conn, out)
                    out.clear()
                    seg.send(conn, req.offset, req.size)
                    return 0
                out.append(seg.view[req.offset:req.offset + req.size])
                return req.size + 16
            if req.op == "write":  # claimed by this thread while its bytes land (storenode/extents.py)
                w = self._writer.w
                self.table.claim(req.offset, req.size, req.gen, w)  # before any byte lands
                try:
                    seg.recv(rd, req.offset, req.size)
                finally:
                    self.table.release(req.offset, req.gen, w)
                self.bytes_in += req.size
                self.table.record_write(req.key, req.offset, req.size, req.gen, req.checksum, req.layout)
            elif req.op == "claim":  # a same-host writer asks before copying into the mapping
                if not unix or seg.fd is None:
                    raise InvalidRequest("claim is only served on the Unix socket of a shared-memory segment")
                w = self._writer.w
                w.identify()
                self.table.claim(req.offset, req.size, req.gen, w)
            elif req.op == "commit":  # one-way: no reply, whatever happens
                self.table.commit(ExtentEntry(req.key, req.offset, req.size, req.gen, req.checksum, req.layout,
                                              True, req.replicas), writer=True)
                return 0
            elif req.op == "written":  # one-way, like commit
                if seg.fd is not None:  # nobody can have copied into device memory from outside
                    self.table.record_write(req.key, req.offset, req.size, req.gen, req.checksum, req.layout)
                return 0
            elif req.op == "map":
                if not unix:
                    raise InvalidRequest("map is only served on the node's Unix socket")
                if seg.fd is None:
                    raise InvalidRequest(f"this node's segment is {seg.device} memory and cannot be mapped; "
                                         "read and write it through the node's sockets")
                if out:
                    sendv(conn, out)
                    out.clear()
                socket.send_fds(conn, [frame(DataReply(True, capacity=seg.capacity))], [seg.fd])
                return 0
            elif req.op == "ping":
                out.append(frame(DataReply(True, capacity=seg.capacity)))
                return 16
            else:
                raise InvalidRequest(f"unknown data op {req.op!r}; accepted: write, claim, written, commit, read, map, "
                                     "ping")
            out.append(_OK)
            return len(_OK)
        except KVPoolError as e:
            self.stats.errors["data", e.code] += 1
            if req.op in ("commit", "written"):
                return 0  # one-way: a refused copy of a commit notice is dropped (the master's notice rules)
            if req.op == "write":
                # keep the stream in step: swallow the payload the client is sending
                if not 0 <= req.size <= seg.capacity:
                    out.append(frame(DataReply(False, e.to_wire())))
                    sendv(conn, out)
                    out.clear()
                    raise NodeUnavailable("refused write of impossible size; connection closed") from None
                rd.skip(req.size)
            out.append(frame(DataReply(False, e.to_wire())))
            return 64
