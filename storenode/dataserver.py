"""Threaded data server: reads and writes extents straight between sockets and the
segment, with no per-byte Python work.

At most ``max_conns`` connections (more are refused with
:class:`~protocol.errors.Overloaded`; one accepted at the cap takes the place of the oldest
connection still in its handshake, if any), served by a bounded pool of ``workers`` threads
and one selector thread, not a thread each (:mod:`storenode.connpool`): the selector runs
TLS and the cluster-secret handshake when they are configured (:mod:`protocol.auth`,
within ``auth.HANDSHAKE_S``) and watches idle connections; a worker takes a readable one
and serves every request that arrives while it holds it. Socket calls release the GIL, so
several streams run in parallel. Every blocking ``recv``/``send`` of a worker has a
deadline of ``frame_timeout_s``: a peer sending a frame slowly (or not reading its
replies) holds one worker for at most that long per stalled call, then is closed. ``ucx://``
streams have no readiness descriptor: each is set up on its rendezvous socket by the
selector like any other, then keeps a thread of its own. Frames are described in
:mod:`protocol.dataplane`. A malformed frame gets an error reply and the connection is
closed (its stream position can no longer be trusted).

Syscalls per request are what bound small objects, so each connection:

* reads through its worker's 256 KiB buffer (:class:`protocol.dataplane.FrameReader`): one ``recv_into`` brings in many
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
import functools
import socket
import ssl
import threading
from collections.abc import Callable

import msgspec

from kvpool.protocol import admission, transport
from kvpool.protocol.auth import OPEN, Security
from kvpool.protocol.config import SecurityConfig, StoreNodeConfig
from kvpool.protocol.dataplane import DataReply, DataRequest, FrameReader, frame, sendv
from kvpool.protocol.errors import (DECODE_ERRORS, AuthFailed, InvalidRequest, KVPoolError, NodeUnavailable,
                                    Overloaded, StaleExtent)
from kvpool.protocol.grants import check_token, grants_of
from kvpool.protocol.messages import ExtentEntry
from kvpool.storenode.connpool import Conn, ConnPool, TLSSlices
from kvpool.storenode.device_segment import DeviceSegment
from kvpool.storenode.extents import ExtentTable
from kvpool.storenode.metrics import NodeStats
from kvpool.storenode.segment import Segment
from kvpool.storenode.writers import Writer, WriterWatch

_FLUSH_BYTES = 1 << 20
_req_dec = msgspec.msgpack.Decoder(DataRequest)
_BATCHED = ("claims", "written_all", "commits")
_OK = frame(DataReply(True))


class DataServer:
    """Serves one segment (host shared memory, or a :class:`DeviceSegment` through staging)
    on the given listen addresses (``tcp://``, ``unix://``, ``ucx://``). ``workers``: threads
    serving requests; ``frame_timeout_s``: deadline (seconds) of each blocking socket call."""

    def __init__(self, segment: Segment | DeviceSegment, table: ExtentTable, addrs: list[str],
                 security: Security = OPEN, max_conns: int = SecurityConfig().max_conns,
                 workers: int = StoreNodeConfig().data_workers,
                 frame_timeout_s: float = SecurityConfig().frame_timeout) -> None:
        self.segment = segment
        self.table = table
        self.writers = WriterWatch(table)  # claims of writers whose connection closed (storenode/writers.py)
        self.security = security
        self.max_conns = max_conns  # connections held at once; more are refused
        self.frame_timeout_s = frame_timeout_s
        self._tls = security.server_context()
        self._local = threading.local()  # each worker's FrameReader
        self.pool = ConnPool(workers, frame_timeout_s, self._tls,
                             security.auth_keys() if security.secret is not None else None,
                             lambda e, _head: frame(DataReply(False, e.to_wire())),
                             self._opened, self._serve, self._closed, self._auth_failed,
                             lambda c: self._refuse(c.sock, "unix" if c.unix else "ucx" if c.upgrade else "tcp"), max_conns)
        self.listeners = [(a, transport.listen(a)) for a in addrs]
        self.addrs = [self._bound(a, s) for a, s in self.listeners]
        self._stop = threading.Event()
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
        self.pool.start()
        for addr, s in self.listeners:
            threading.Thread(target=self._accept, args=(addr, s), daemon=True, name=f"accept-{addr}").start()

    def stop(self) -> None:
        self._stop.set()
        self.writers.stop()
        self.pool.stop()
        for _, s in self.listeners:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self, addr: str, s) -> None:
        scheme, _ = transport.split_addr(addr)
        unix = scheme == "unix"
        # a stream set up on its accepted socket, then served as the listener's (ucx://: UCX)
        upgrade = functools.partial(self._serve_stream, s.upgrade) if hasattr(s, "upgrade") else None
        accept = s.accept_socket if upgrade is not None else s.accept
        while not self._stop.is_set():
            try:
                conn, _ = accept()
            except OSError:
                return
            if scheme == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            full = len(self.pool) >= self.max_conns
            if full and not self.pool.handshaking():
                self._refuse(conn, scheme)
            else:  # at the cap: in place of a connection in its handshake
                self.pool.add(conn, unix, scheme == "tcp", over_cap=full, upgrade=upgrade)

    def _refuse(self, conn, scheme: str) -> None:
        """Over the cap: tell the peer (in the framing it expects) and close, without a thread."""
        self.refused += 1
        self.stats.errors["data", Overloaded.code] += 1  # exported as kvpool_storenode_errors (storenode/metrics.py)
        admission.refuse(conn, admission.overloaded("store node data server", self.max_conns),
                         secret=self.security.secret is not None, tls=scheme == "tcp" and self._tls is not None,
                         framed=lambda err: frame(DataReply(False, err.to_wire())))

    def _auth_failed(self, _err: BaseException) -> None:
        """A connection failed TLS or the secret handshake (AuthFailed, or an OSError: ssl.SSLError, EOF)."""
        self.auth_failures += 1
        self.stats.errors["data", AuthFailed.code] += 1

    def _opened(self, c: Conn) -> None:
        """``c`` is authenticated: its writer identity."""
        c.state = Writer(c.sock if c.unix else None)

    def _closed(self, c: Conn) -> None:
        if c.state is not None:
            self.writers.closed(c.state)

    def _reader(self, sock) -> FrameReader:
        """This thread's read buffer, reading ``sock``: buffers belong to workers, not to
        connections (one is handed back only with nothing buffered), so an idle connection
        holds no buffer."""
        rd = getattr(self._local, "rd", None)
        if rd is None:
            rd = self._local.rd = FrameReader(sock)
        rd.sock, rd.lo, rd.hi = sock, 0, 0
        # receives wait in slices, the pool deciding between them: a plain socket's by its kernel
        # deadline, a TLS socket's by its timeout, set for each receive (TLSSlices)
        rd.patience = self.pool.patience if type(sock) is socket.socket else None
        if isinstance(sock, ssl.SSLSocket):
            rd.sock, rd.patience = TLSSlices(sock, self.pool.slice_s, self.pool.frame_timeout_s), self.pool.patience
        return rd

    def _serve(self, c: Conn, ready: bool = True) -> bool:
        """Serve every request of ``c`` (on a worker; ``ready``: its socket is readable) until
        nothing is buffered and nothing more has arrived: True to watch it again, False to
        close it (EOF, a malformed frame, a deadline or any socket error)."""
        conn, writer = c.sock, c.state
        rd = self._reader(conn)
        out: list = []
        pending = 0
        try:
            while not self._stop.is_set():
                if out and (pending >= _FLUSH_BYTES or not rd.has_frame()):
                    sendv(conn, out)
                    out, pending = [], 0
                if not rd.buffered() and not ready and not (c.tls and conn.pending()):
                    return True  # nothing buffered: the pool waits for more (storenode/connpool.py)
                ready = False
                try:
                    body = rd.frame()
                    try:
                        req = _req_dec.decode(body)
                    except DECODE_ERRORS as e:
                        raise InvalidRequest(f"malformed data request: {e}") from None
                except InvalidRequest as e:
                    self.stats.errors["data", e.code] += 1
                    out.append(frame(DataReply(False, e.to_wire())))
                    sendv(conn, out)
                    return False
                pending += self._handle(conn, rd, req, c.unix, out, writer)
        except (NodeUnavailable, OSError):
            return False
        except (TypeError, ValueError):
            if not self._stop.is_set():
                raise
            # stopping: the segment was closed under an in-flight transfer; the peer sees EOF
        return False

    def _serve_stream(self, upgrade, c: Conn) -> None:
        """A connection set up on its socket (the pool's selector ran its handshake), made a
        stream by ``upgrade(sock, timeout)`` and served on this thread until it closes. The
        stream waits for each request with no deadline (``wait_readable``) and serves it
        with ``frame_timeout_s`` on every receive and send."""
        try:
            c.sock = stream = upgrade(c.sock, self.frame_timeout_s)
        except OSError as e:
            self._auth_failed(e)
        else:
            keep = True
            while keep and not self._stop.is_set():
                try:
                    stream.wait_readable()  # idle between requests: no deadline
                except OSError:
                    break
                stream.settimeout(self.frame_timeout_s)  # each receive and send of a request: its deadline
                keep = self._serve(c)
        self.pool.close(c)

    def _handle_batch(self, req: DataRequest, unix: bool, out: list, w: Writer) -> int:
        """A batched ``claims`` (one reply, an error or None per item), ``written_all`` or
        ``commits`` (one-way): each item checked as its single op is."""
        seg, table, op = self.segment, self.table, req.op
        if op == "claims" and (not unix or seg.fd is None):
            raise InvalidRequest("claims are only served on the Unix socket of a shared-memory segment")
        if unix and op != "commits" and w.identify():
            self.writers.adopt(w)  # claims this process left on a closed connection are ended here
        if op == "written_all":  # claim ends only: they name the connection's own claims, so need no grant
            for it in req.items:  # (the reservation's commit, from the master and the writer, records the row)
                table.release(it.offset, it.gen, w)
            return 0
        items = req.items
        check = grants_of(seg.grant_key, seg.incarnation).check
        if op == "claims":  # grants checked item by item, then every claim taken under one lock
            errors: list = [None] * len(items)
            todo, where = [], []
            for i, it in enumerate(items):
                try:
                    self._check_grant(it, check)
                except KVPoolError as e:
                    errors[i] = e
                else:
                    todo.append((it.offset, it.size, it.gen))
                    where.append(i)
            for i, e in zip(where, table.claim_many(todo, w)):
                errors[i] = e
            wire = []
            for e in errors:
                if e is None:
                    wire.append(None)
                else:
                    self.stats.errors["data", e.code] += 1
                    wire.append(e.to_wire())
            out.append(frame(DataReply(True, errors=wire)))
            return 64
        if len({it.offset for it in items}) < len(items):  # an offset named twice: one item after the
            for it in items:  # other (items at distinct offsets touch distinct rows)
                self._commit_copies([it], w, check)
        else:
            self._commit_copies(items, w, check)
        return 0

    def _commit_copies(self, items, w: Writer, check: Callable[..., bool]) -> None:
        """The writer's copies of commits (batch items at distinct offsets), one-way: those
        the master's notice settled first only end ``w``'s claims; the others are checked
        (grant, key, then as :meth:`~storenode.extents.ExtentTable.check_write` checks a
        write) and committed. Errors are counted, never answered."""
        table = self.table
        rows = []
        for it, done in zip(items, table.settled_many([(it.offset, it.gen) for it in items], w)):
            if done:
                continue  # the master's notice came first: nothing to check or record
            try:
                self._check_grant(it, check)
                if not it.key:
                    raise InvalidRequest("commit names no object key")
            except KVPoolError as e:
                self.stats.errors["data", e.code] += 1
            else:
                rows.append(ExtentEntry(it.key, it.offset, it.size, it.gen, it.checksum, it.layout, True,
                                        it.replicas))
        for e in table.commit_many(rows, writer=w):
            if e is not None:
                self.stats.errors["data", e.code] += 1

    def _check_grant(self, it, check: Callable[..., bool]) -> None:
        """Raise InvalidRequest unless batch item ``it`` lies in the segment and carries the
        master's grant token for its extent and key (``check``: the segment's
        :meth:`Grants.check <protocol.grants.Grants.check>`)."""
        self.table.check_bounds(it.offset, it.size)
        if not check(it.offset, it.size, it.gen, it.key, it.token):
            raise InvalidRequest(f"[{it.offset}, +{it.size}) gen {it.gen} carries no valid grant from the "
                                 "master; writes need a grant")

    def _handle(self, conn, rd: FrameReader, req: DataRequest, unix: bool, out: list, w: Writer) -> int:
        """Serve one request, appending its reply buffers to ``out``; returns their bytes."""
        seg = self.segment
        self.stats.requests["data", req.op] += 1
        try:
            if req.incarnation != seg.incarnation and (req.op != "ping" or req.incarnation):  # a ping naming
                # an incarnation asks whether that one serves (a liveness check after a same-host copy)
                raise StaleExtent(f"store node segment restarted (generation {seg.incarnation}, request "
                                  f"named {req.incarnation}); look the key up again")
            if req.op in _BATCHED:
                return self._handle_batch(req, unix, out, w)
            if req.op == "written":  # the writer finished copying: its claim ends (needs no grant:
                self.table.release(req.offset, req.gen, w)  # it names only its own claims)
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
            if req.op == "write":  # claimed by this connection while its bytes land (storenode/extents.py)
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
                if w.identify():
                    self.writers.adopt(w)
                self.table.claim(req.offset, req.size, req.gen, w)
            elif req.op == "commit":  # one-way: no reply, whatever happens
                if not req.key:  # a reservation's keyless grant writes bytes but commits no object
                    raise InvalidRequest("commit names no object key")
                self.table.commit(ExtentEntry(req.key, req.offset, req.size, req.gen, req.checksum, req.layout,
                                              True, req.replicas), writer=w)
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
                                     "ping, claims, written_all, commits")
            out.append(_OK)
            return len(_OK)
        except KVPoolError as e:
            self.stats.errors["data", e.code] += 1
            if req.op in ("commit", "written", "written_all", "commits"):
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
