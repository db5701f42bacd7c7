"""Client side of the data plane: moves extent bytes between caller buffers and store nodes.

Paths, chosen per replica (``transport="auto"``):

* **same host, shared memory** (``shm``): the node's segment memfd is received once over
  its Unix socket (SCM_RIGHTS) and mapped. A get is **one copy** (segment → caller
  buffer); with ``ReadOp(digest=True)`` it goes in 256 KiB chunks, each hashed (xxh3_64,
  streaming) right after it lands, while still in cache, so the checksum costs no second
  pass over memory. The hash is of the bytes delivered, read back from ``out``, never of
  the segment: a force-removed extent can be reused under a reader, and a hash of what
  landed catches that torn read. A put is **one copy** (caller buffer → segment), hashed
  as it goes, unless the client hashed the buffer while waiting for ``put_start``
  (objects up to 4 MiB) or a helper thread hashes it beside one GIL-free ``memcpy``
  (bigger ones, :meth:`DataPlane._hash_aside`); the checksum reaches the master with
  ``put_end``. Plus a small ``written`` notice; a batch's notices go out in one send
  before the copies, so the node's round trip overlaps them. Big copies without a hash release the GIL (numpy), so the second
  replica of a put and the per-node threads of a batch copy in parallel; copies hit by 4K
  aliasing are bounced (see :meth:`DataPlane._copy_out`).
* **same host, Unix socket** (``transport="unix"``, or when the segment cannot be mapped)
  and **network** (``tcp``): one pipelined stream per node per thread. Reads: every
  request frame of the batch in one send, replies parsed through a 256 KiB buffer, and
  each payload ``recv_into`` the caller's buffer directly: **one copy** (kernel → buffer;
  payload bytes that arrived with a reply header, at most 256 KiB, take one extra copy from
  the reply buffer). A buffer that does not start on a cache line (numpy arrays and
  bytearrays start 16 bytes into a page) receives through a 256 KiB L2-resident bounce
  buffer instead: two copies, measured faster than the kernel's slow misaligned one
  (4 MiB over TCP: 3.3 ms instead of 5.1 ms). Writes: headers and payloads go out with
  ``sendmsg`` scatter/gather straight from the caller's buffer: **one copy** (buffer →
  kernel); a put's first replica is sent in 256 KiB pieces, each hashed right after the
  kernel copied it, so the checksum (sent with ``put_end``) needs no pass of its own.
* **CUDA tensors** (:class:`connector.device_buffer.DeviceBuffer`): on the shared-memory
  path the segment's mapping is registered with CUDA (``cudaHostRegister``, in 64 MiB
  windows on first use) and the bytes move in **one DMA copy** between the extent and the
  tensor, the checksum hashed from the segment's host bytes after the DMA ended (the
  tensor's bytes are not on the host; a byte the DMA read from a reused extent is the new
  one or a later one by then, so a torn read fails the check unless the extent was
  rewritten with the very bytes it held). Other paths stage through a pinned host buffer
  (one DMA + the host path's copy). ``cuda_direct=False`` stages always.
* **UCX** (``transport="ucx"``, nodes started with ``--ucx``): the same frames over a
  ``ucx://`` stream (:mod:`protocol.ucx_transport`); UCX moves the payload (shared memory
  or TCP) straight into the caller's buffer when it fits.

No per-byte Python work on any path. Every byte range is bounds-checked against the
master's grant (the ExtentRef). Errors: :class:`~protocol.errors.NodeUnavailable` (node
dead/unreachable), :class:`~protocol.errors.StaleExtent` (extent freed or node restarted).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import select
import socket
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import numpy as np
import xxhash

from kvpool.protocol import transport
from kvpool.protocol.dataplane import DataReply, DataRequest, FrameReader, frame, recv_reply, sendv
from kvpool.protocol.errors import ConfigError, InvalidRequest, KVPoolError, NodeUnavailable, from_wire
from kvpool.protocol.messages import ExtentRef

_CHUNK = 256 << 10      # shm copy+hash granularity: fits L2, so the hash reads hot bytes
_BIG = 64 << 10         # payloads at least this big are read without greedy buffering
_PAGE = 4096
_ALIAS = 64             # destinations 1..63 bytes ahead of the source, modulo a page, ...
_BOUNCE_MAX = 512 << 10  # ... and copies smaller than this take glibc's slow rep-movsb path
_GIL_FREE = 1 << 20      # copies at least this big run without the GIL (numpy)
HASH_ASIDE_MIN = 4 << 20  # shm put copies at least this big are hashed by a helper thread beside them
_BOUNCE_RECV = 64 << 10  # socket payloads at least this big into a misaligned buffer are bounced
_COMMIT_CONNECT_S = 1.0  # seconds a commit copy may wait to connect
_REDIAL_S = 2.0  # seconds a redial of a stale connection (to a restarted node's old instance) may take
_POPULATE_MAX = 8 << 30  # segments up to this size get their page tables prefaulted (~2 MiB of PTEs per GiB)
_rep_dec = msgspec.msgpack.Decoder(DataReply)
log = logging.getLogger("kvpool.data")


class WriteOp:
    """Write ``data`` (a byte memoryview, or a :class:`~connector.device_buffer.DeviceBuffer`)
    into the granted extent ``ref``. ``checksum=None`` asks the data plane
    to hash the bytes as it copies or sends them and set :attr:`checksum` (xxh3_64); the
    node learns it from the master's commit."""

    __slots__ = ("ref", "data", "key", "checksum", "layout", "error", "replicas")

    def __init__(self, ref: ExtentRef, data, key: str, checksum: int | None, layout: bytes | None,
                 replicas: int = 0):
        self.ref, self.data, self.key, self.checksum, self.layout = ref, data, key, checksum, layout
        self.replicas = replicas  # the object's wanted replica count (for the writer's commit copy)
        self.error: KVPoolError | None = None


class ReadOp:
    """Read ``ref`` into ``out`` (a writable byte memoryview, or a
    :class:`~connector.device_buffer.DeviceBuffer`). With ``digest=True`` the data plane also sets
    :attr:`digest` to the xxh3_64 of the bytes as they landed in ``out`` (computed chunk by
    chunk during the copy), so the caller need not hash them again."""

    __slots__ = ("ref", "out", "error", "digest")

    def __init__(self, ref: ExtentRef, out, digest: bool = False):
        self.ref, self.out = ref, out
        self.error: KVPoolError | None = None
        self.digest: int | bool | None = True if digest else None


class ReplicaDeadline:
    """How long a network read may wait on the one node it reads from, for a caller that
    has another replica to turn to (see ``KVPoolClient(replica_timeout_s=...)``).

    ``timeout_s`` (seconds) bounds the connect and every wait for bytes of the read: a node
    that sends nothing for that long is given up, and the read's ops fail with
    NodeUnavailable. ``first_byte``, when set, replaces the wait for the first reply: called
    with the socket once the requests are sent, it returns True when the socket is readable
    and False to give the node up (a caller hedging to another replica decides there)."""

    __slots__ = ("timeout_s", "first_byte")

    def __init__(self, timeout_s: float, first_byte: Callable[[socket.socket], bool] | None = None) -> None:
        self.timeout_s, self.first_byte = timeout_s, first_byte


def readable(sock: socket.socket, timeout_s: float) -> bool:
    """True when ``sock`` has bytes (or an error or end of stream) within ``timeout_s`` seconds."""
    p = select.poll()
    p.register(sock, select.POLLIN | select.POLLPRI)
    return bool(p.poll(max(int(timeout_s * 1000), 0)))


class _Stream(FrameReader):
    """One connection plus its buffered reply reader; closed when the thread that owns it
    exits (its thread-local storage goes) or the DataPlane closes. ``incarnation``: of the
    node it was opened to ("" when the caller did not say)."""

    __slots__ = ("bounce", "incarnation", "__weakref__")

    def __del__(self) -> None:
        try:
            self.sock.close()
        except (OSError, AttributeError):
            pass

    def __init__(self, sock, incarnation: str = "") -> None:
        super().__init__(sock)
        self.bounce: memoryview | None = None
        self.incarnation = incarnation

    def reply(self, greedy: bool = True) -> DataReply:
        try:
            return _rep_dec.decode(self.frame(greedy))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise InvalidRequest(f"malformed data reply: {e}") from None

    def read_into(self, dst: memoryview, h) -> None:
        """Fill ``dst`` (buffered bytes first, then ``recv_into`` directly); hash each piece
        into ``h`` as it lands when ``h`` is not None."""
        n = len(dst)
        take = min(n, self.hi - self.lo)
        if take:
            dst[:take] = self.view[self.lo:self.lo + take]
            self.lo += take
            if h is not None:
                h.update(dst[:take])
        pos = take
        recv = self.sock.recv_into
        if n - pos >= _BOUNCE_RECV and _misaligned(dst):
            bounce = self._bounce()
            while pos < n:
                got = recv(bounce, min(len(bounce), n - pos))
                if got == 0:
                    raise NodeUnavailable("data connection closed mid-frame")
                dst[pos:pos + got] = bounce[:got]
                if h is not None:
                    h.update(dst[pos:pos + got])
                pos += got
            return
        while pos < n:
            got = recv(dst[pos:], n - pos)
            if got == 0:
                raise NodeUnavailable("data connection closed mid-frame")
            if h is not None:
                h.update(dst[pos:pos + got])
            pos += got

    def _bounce(self) -> memoryview:
        """This stream's receive bounce buffer: 256 KiB at page offset 2048."""
        if self.bounce is None:
            raw = memoryview(bytearray(_CHUNK + 2 * _PAGE))
            k = (_PAGE // 2 - _address(raw)) % _PAGE
            self.bounce = raw[k:k + _CHUNK]
        return self.bounce


class DataPlane:
    """Thread-safe: connections are per thread; shared-memory maps are shared.

    ``transport_mode``: ``auto``/``shm`` (shared memory on the same host, else TCP),
    ``unix`` (the node's Unix socket on the same host, else TCP), ``tcp`` (always TCP),
    ``ucx`` (the node's ``ucx://`` address when it serves one — store nodes started with
    ``--ucx`` — else as ``unix``). Raises ConfigError for any other mode.
    ``cuda_direct``: move CUDA tensors by DMA to and from registered shared mappings
    (else they stage through pinned host memory on every path).
    """

    MODES = ("auto", "shm", "unix", "tcp", "ucx")

    def __init__(self, host_id: str, transport_mode: str = "auto", io_timeout_s: float = 30.0,
                 cuda_direct: bool = True) -> None:
        if transport_mode not in self.MODES:
            raise ConfigError(f"transport {transport_mode!r}; accepted: {', '.join(self.MODES)}", key="transport")
        self.host_id = host_id
        self.mode = transport_mode
        self.io_timeout_s = io_timeout_s
        self._local = threading.local()
        self._maps: dict[str, memoryview | None] = {}
        self._bases: dict[str, int] = {}
        self._map_lock = threading.Lock()
        self._all_conns: weakref.WeakSet[_Stream] = weakref.WeakSet()  # live threads' streams
        self._mmaps: dict[str, mmap.mmap] = {}
        self._node_inc: dict[str, str] = {}  # node id -> incarnation currently mapped
        self.redials = 0  # stale streams (opened to an earlier incarnation of a node) replaced, all threads
        self.cuda_direct = cuda_direct
        self._pins = None  # connector.device_buffer.PinnedWindows, made on the first CUDA tensor
        self._hasher: ThreadPoolExecutor | None = None  # see _hash_aside
        self._hasher_free = threading.Lock()

    # ---- connections ----------------------------------------------------------------------

    def _conns(self) -> dict[str, _Stream]:
        c = getattr(self._local, "conns", None)
        if c is None:
            c = self._local.conns = {}
        return c

    def _conn(self, addr: str, connect_timeout_s: float | None = None, incarnation: str = "") -> _Stream:
        """This thread's stream to ``addr``, dialled within ``connect_timeout_s`` (default
        ``io_timeout_s``) when it has none. Given the node ``incarnation`` the caller's
        grant names, a stream opened to another one (the node restarted at the same address,
        as a Unix socket path is: its old instance is gone) is stale: it is closed and
        redialled once, within ``min(io_timeout_s, 2 s)``, so that the new instance is never
        taken for dead because of it. Raises OSError or KVPoolError when the dial fails."""
        conns = self._conns()
        s = conns.get(addr)
        if s is not None and incarnation and s.incarnation != incarnation:
            self._drop(addr)
            s = None
            connect_timeout_s = min(connect_timeout_s or self.io_timeout_s, _REDIAL_S)
            self.redials += 1
        if s is None:
            sock = transport.connect(addr, connect_timeout_s or self.io_timeout_s)
            sock.settimeout(self.io_timeout_s)
            s = conns[addr] = _Stream(sock, incarnation)
            with self._map_lock:
                self._all_conns.add(s)
        return s

    def _drop(self, addr: str) -> None:
        s = self._conns().pop(addr, None)
        if s is not None:
            try:
                s.sock.close()
            except OSError:
                pass

    def uses_shm(self, ref: ExtentRef) -> bool:
        return self.mode in ("auto", "shm") and ref.host_id == self.host_id and self._segment(ref) is not None

    def _stream_addr(self, ref: ExtentRef) -> str:
        if self.mode == "ucx" and ref.ucx_addr:
            return ref.ucx_addr
        if self.mode != "tcp" and ref.host_id == self.host_id and ref.shm_path:
            return ref.shm_path  # same host without shm: the node's Unix socket
        return ref.data_addr

    def _segment(self, ref: ExtentRef) -> memoryview | None:
        """The mapped segment of ``ref``'s node incarnation (None when it cannot be mapped)."""
        seg = self._maps.get(ref.incarnation, False)
        if seg is not False:
            return seg
        with self._map_lock:
            if ref.incarnation in self._maps:
                return self._maps[ref.incarnation]
            seg = None
            old = self._node_inc.get(ref.node_id)
            if old is not None and old != ref.incarnation:
                self._unmap(old)  # the node restarted: drop the dead incarnation's mapping
            self._node_inc[ref.node_id] = ref.incarnation
            try:
                s = transport.connect(ref.shm_path, self.io_timeout_s)
                try:
                    s.sendall(frame(DataRequest("map", ref.incarnation)))
                    msg, fds, _, _ = socket.recv_fds(s, 1 << 16, 1)
                    if fds:
                        try:
                            rep = recv_reply(_Buffered(msg))
                            if rep.ok:
                                mm = mmap.mmap(fds[0], rep.capacity, mmap.MAP_SHARED,
                                               mmap.PROT_READ | mmap.PROT_WRITE)
                                self._mmaps[ref.incarnation] = mm
                                seg = memoryview(mm)
                                if rep.capacity <= _POPULATE_MAX:
                                    _prefault_aside(seg, rep.capacity)
                        finally:
                            for fd in fds:
                                os.close(fd)
                finally:
                    s.close()
            except (KVPoolError, OSError):
                seg = None
            self._maps[ref.incarnation] = seg
            return seg

    # ---- writes -------------------------------------------------------------------------

    def write(self, ops: Sequence[WriteOp]) -> None:
        """Write every op (all to one node); sets ``op.error`` per failed op.

        Same host: the ``written`` notices go out first, then the bytes are copied into the
        segment while the node records them, then the replies are read, so the notice round
        trip overlaps the copy (the node only records the row; nothing reads it before the
        master commits it after ``put_end``, which follows this call). Ops with
        ``checksum=None`` are hashed chunk by chunk as they are copied (the bytes are still
        in cache), so the checksum costs no separate pass over memory; network writes of
        such ops hash each 256 KiB piece right after sending it (see :func:`_send_hashing`)."""
        shm, net, dma = [], [], []
        for op in ops:
            local = self.uses_shm(op.ref)
            if not isinstance(op.data, memoryview):  # a CUDA tensor
                if local and self._direct(op.ref, op.data):
                    dma.append(op)
                elif not _stage(op, True):
                    continue
            (shm if local else net).append(op)
        for op in shm:
            r = op.ref
            seg = self._segment(r)
            if seg is None:
                op.error = _gone(r)
            elif r.offset < 0 or r.offset + r.size > len(seg) or len(op.data) != r.size:
                op.error = KVPoolError(f"grant for {op.key!r} does not fit the mapped segment")
        pending = self._send_writes(shm, notice=True)
        for op in shm:
            if op.error is None and isinstance(op.data, memoryview):
                self._write_shm(op)
        self._dma(dma, into_segment=True)
        self._finish_writes(pending)
        self._finish_writes(self._send_writes(net, notice=False))

    def _send_writes(self, ops: Sequence[WriteOp], notice: bool):
        """Send the ``write`` (header + payload) or ``written`` frames of ``ops`` in one
        scatter/gather stream; returns what :meth:`_finish_writes` needs."""
        ops = [op for op in ops if op.error is None]
        if not ops:
            return None
        addr = ops[0].ref.shm_path if notice else self._stream_addr(ops[0].ref)
        try:
            s = self._conn(addr, incarnation=ops[0].ref.incarnation)
            bufs: list = []
            for op in ops:
                r = op.ref
                if not notice and len(op.data) != r.size:
                    raise InvalidRequest(f"buffer for {op.key!r} has {len(op.data)} bytes; the grant is {r.size}")
                if not notice and op.checksum is None and r.size <= _CHUNK:
                    op.checksum = xxhash.xxh3_64_intdigest(op.data)  # one piece: hash it up front
                stream_hash = not notice and op.checksum is None
                bufs.append(frame(DataRequest("written" if notice else "write", r.incarnation, r.offset, r.size,
                                              r.gen, op.key, op.checksum or 0, op.layout, r.token)))
                if stream_hash:  # the node learns the checksum from the master's commit
                    sendv(s.sock, bufs)
                    bufs = []
                    op.checksum = _send_hashing(s.sock, op.data)
                elif not notice and r.size:
                    bufs.append(op.data)
            sendv(s.sock, bufs)
            return addr, s, ops
        except (OSError, KVPoolError) as e:
            self._stream_failed(addr, ops, e, "write")
            return None

    def commit(self, ops: Sequence[WriteOp]) -> None:
        """After ``put_end`` committed ``ops`` (all to one node, ``op.checksum`` set): send
        the node one-way ``commit`` frames, so the commit reaches the node's table even if
        the master dies before its own notice leaves (a failover rebuilds from those tables).
        Best effort, no reply: the master's notice is the primary path."""
        r0 = ops[0].ref
        addr = r0.shm_path if self.uses_shm(r0) else self._stream_addr(r0)
        try:
            # no connection from this thread yet (the writes ran in pool threads): do not let an
            # unreachable node hold up a put that is already acknowledged
            s = self._conn(addr, connect_timeout_s=min(self.io_timeout_s, _COMMIT_CONNECT_S),
                           incarnation=r0.incarnation)
            sendv(s.sock, [b"".join(frame(DataRequest("commit", op.ref.incarnation, op.ref.offset, op.ref.size,
                                                      op.ref.gen, op.key, op.checksum or 0, op.layout, op.ref.token,
                                                      replicas=op.replicas)) for op in ops)])
        except (OSError, KVPoolError):
            self._drop(addr)

    def _finish_writes(self, pending) -> None:
        if pending is None:
            return
        addr, s, ops = pending
        try:
            for op in ops:
                rep = s.reply()
                if not rep.ok and op.error is None:
                    op.error = from_wire(rep.error)
        except (OSError, KVPoolError) as e:
            self._stream_failed(addr, ops, e, "write")

    def _stream_failed(self, addr: str, ops: Sequence, e: Exception, doing: str) -> None:
        """The stream to ``addr`` broke: drop it and fail every op not failed yet with
        NodeUnavailable (or ``e`` itself when it is one)."""
        self._drop(addr)
        err = e if isinstance(e, NodeUnavailable) else NodeUnavailable(
            f"store node {ops[0].ref.node_id} failed during {doing}: {e}", node=ops[0].ref.node_id)
        for op in ops:
            if op.error is None:
                op.error = err

    # ---- reads --------------------------------------------------------------------------

    def read(self, ops: Sequence[ReadOp], deadline: ReplicaDeadline | None = None) -> None:
        """Read every op (all from one node) into its ``out``; sets ``op.error`` on failure
        (and ``op.digest`` when it was asked for). ``deadline``: how long a network read may
        wait on the node (:class:`ReplicaDeadline`; default: ``io_timeout_s``); shared-memory
        copies do not wait on the node and ignore it."""
        net, dma = [], []
        for op in ops:
            local = self.uses_shm(op.ref)
            if not isinstance(op.out, memoryview):  # a CUDA tensor
                if local and self._direct(op.ref, op.out):
                    dma.append(op)
                    continue
                if not _stage(op, False):
                    continue
            if local:
                self._copy_out(op)
            else:
                net.append(op)
        self._dma(dma, into_segment=False)
        if not net:
            return
        addr = self._stream_addr(net[0].ref)
        try:
            s = self._conn(addr, deadline.timeout_s if deadline is not None else None,
                           incarnation=net[0].ref.incarnation)
            for op in net:
                if len(op.out) < op.ref.size:
                    raise InvalidRequest(f"output buffer of {len(op.out)} bytes is smaller than the "
                                         f"{op.ref.size}-byte extent")
            sendv(s.sock, [b"".join([frame(DataRequest("read", op.ref.incarnation, op.ref.offset, op.ref.size,
                                                        op.ref.gen)) for op in net])])
            if deadline is not None and isinstance(s.sock, socket.socket):  # (a UCX stream waits io_timeout_s)
                if not s.buffered() and not (deadline.first_byte or _wait_bytes(deadline.timeout_s))(s.sock):
                    raise NodeUnavailable(f"store node {net[0].ref.node_id} did not answer within the "
                                          f"{deadline.timeout_s:g}s replica deadline", node=net[0].ref.node_id)
                s.sock.settimeout(deadline.timeout_s)  # then no wait for bytes may pass it either
            for op in net:
                size = op.ref.size
                rep: DataReply = s.reply(greedy=size < _BIG)
                if rep.ok:
                    h = xxhash.xxh3_64() if op.digest else None
                    s.read_into(op.out[:size], h)
                    if h is not None:
                        op.digest = h.intdigest()
                else:
                    op.error = from_wire(rep.error)
            if deadline is not None:
                s.sock.settimeout(self.io_timeout_s)
        except (OSError, KVPoolError) as e:  # the stream is dropped: a reply may still be on its way
            self._stream_failed(addr, net, e, "read")

    def _copy_out(self, op: ReadOp) -> None:
        """Shared-memory read: segment → ``op.out``, one copy. With a digest wanted, the copy
        goes in 256 KiB chunks, each hashed right after it lands (still in L2): measured
        +28% over copy-then-hash for 4 MiB, +10% for 64 MiB.

        One exception, measured on AMD EPYC with this glibc: when the destination lies 1–63
        bytes past the source modulo 4 KiB (a numpy array or bytearray sits at page offset
        16, extents are page-aligned), ``memcpy`` of 4–512 KiB runs ~20× slower (4K
        aliasing in ``rep movsb``). Such copies go through a small per-thread bounce buffer
        placed half a page from both, which stays in L2: two fast copies instead of one
        slow one. Bigger copies do not suffer it and stay one ``memcpy``."""
        seg = self._segment(op.ref)
        r = op.ref
        if seg is None:
            op.error = _gone(r)
            return
        if r.offset < 0 or r.offset + r.size > len(seg):
            op.error = KVPoolError(f"extent [{r.offset}, +{r.size}) does not fit the mapped segment")
            return
        if len(op.out) < r.size:
            op.error = InvalidRequest(f"output buffer of {len(op.out)} bytes is smaller than the "
                                      f"{r.size}-byte extent")
            return
        out, size = op.out, r.size
        src = seg[r.offset:r.offset + size]
        bounce = None
        if size > 2048:
            try:
                bounce = self._bounce_for(self._extent_address(r), _address(out))
            except (TypeError, ValueError):
                bounce = None
        if bounce is None and size <= _CHUNK:
            _memcpy(out[:size], src)  # one chunk, no 4K aliasing: copy, then hash the bytes still in L2
            if op.digest:
                op.digest = xxhash.xxh3_64_intdigest(out[:size])
            return
        if size >= _BOUNCE_MAX and bounce is not None:
            bounce = None  # big copies do not suffer the aliasing: one memcpy (+ one hash pass)
            if op.digest:
                _memcpy(out[:size], src)
                op.digest = xxhash.xxh3_64_intdigest(out[:size])
                return
        if not op.digest and bounce is None:
            _memcpy(out[:size], src)
            return
        h = xxhash.xxh3_64() if op.digest else None
        step = _CHUNK if bounce is None else len(bounce)
        for a in range(0, size, step):
            b = min(a + step, size)
            if bounce is not None and b - a > 2048:
                bounce[:b - a] = src[a:b]
                out[a:b] = bounce[:b - a]
            else:
                out[a:b] = src[a:b]
            if h is not None:
                h.update(out[a:b])
        if h is not None:
            op.digest = h.intdigest()

    def _direct(self, ref: ExtentRef, buf) -> bool:
        """True when ``ref`` (a mapped extent) and the CUDA buffer ``buf`` can exchange bytes
        by DMA: direct transfers are on, the extent fits the mapping, and the mapping's
        windows that the extent spans are registered with CUDA (registered here on first
        use; a refusal makes this mapping stage from then on). True also takes a hold on the
        registration, which :meth:`_dma` gives back."""
        if not self.cuda_direct or not buf.flat.is_cuda:
            return False
        seg = self._segment(ref)
        if seg is None or ref.offset < 0 or ref.offset + ref.size > len(seg):
            return False  # the staged path reports the bad extent
        with self._map_lock:
            if self._maps.get(ref.incarnation) is not seg:
                return False  # unmapped meanwhile
            if self._pins is None:
                from kvpool.connector.device_buffer import PinnedWindows

                self._pins = PinnedWindows()
            if not self._pins.ready(ref.incarnation, ref.offset, ref.size):
                base = self._extent_address(ref) - ref.offset
                if not self._pins.ensure(ref.incarnation, base, len(seg), ref.offset, ref.size):
                    return False
            self._pins.acquire(ref.incarnation)
            return True

    def _dma(self, ops: Sequence, into_segment: bool) -> None:
        """Direct transfers between registered extents and CUDA tensors (ops :meth:`_direct`
        accepted; their holds are given back here). Every copy is queued on its tensor's
        stream (the caller's, see :class:`~connector.device_buffer.DeviceBuffer`), split at
        registration windows; then the streams are synchronised and each extent is hashed
        on the host (on puts those that need a checksum; on gets every one, after the DMA
        so that a torn read of a reused extent is caught, see the comment there). Bytes
        are in place when this returns, or the op has its error."""
        if not ops:
            return
        import torch

        from kvpool.connector.device_buffer import window_pieces

        held, streams, hashed = [], {}, []
        try:
            try:
                for op in ops:
                    if op.error is not None:
                        continue
                    r = op.ref
                    buf = op.data if into_segment else op.out
                    if not into_segment and len(buf) < r.size:
                        op.error = InvalidRequest(f"output tensor of {len(buf)} bytes is smaller than the "
                                                  f"{r.size}-byte extent")
                        continue
                    try:
                        src = self._maps[r.incarnation][r.offset:r.offset + r.size]
                    except (KeyError, TypeError, ValueError):  # unmapped by another thread meanwhile
                        op.error = _gone(r)
                        continue
                    hashed.append((op, src))
                    if r.size:
                        host = torch.frombuffer(src, dtype=torch.uint8)
                        held.append(host)
                        streams[buf.stream] = buf
                        with buf.on_stream():
                            for lo, hi in window_pieces(r.offset, r.size):  # one copy per registration
                                if into_segment:
                                    host[lo:hi].copy_(buf.flat[lo:hi], non_blocking=True)
                                else:
                                    buf.flat[lo:hi].copy_(host[lo:hi], non_blocking=True)
                    if not into_segment:
                        buf.landed_direct()
                for buf in streams.values():
                    buf.sync()
            except RuntimeError as e:  # torch.AcceleratorError: CUDA refused a copy
                self._dma_failed(ops, into_segment, e, streams.values())
                return
            for op, src in hashed:
                if into_segment:
                    if op.checksum is None:
                        op.checksum = xxhash.xxh3_64_intdigest(src)
                elif op.digest:
                    # after the DMA ended: a byte it read from a reused (force-removed) extent
                    # is the new bytes or later ones here, so the torn read fails the check
                    # (hashing during the DMA could read the old bytes before the copy did)
                    op.digest = xxhash.xxh3_64_intdigest(src)
        finally:
            with self._map_lock:  # after every copy ended, before the slices in ``held`` go
                for op in ops:
                    self._pins.release(op.ref.incarnation)

    def _dma_failed(self, ops: Sequence, into_segment: bool, e: Exception, used) -> None:
        """A direct copy failed: stage these mappings from now on and redo ``ops`` through
        pinned host memory, so the caller sees the bytes moved, only slower (or, when CUDA
        fails on that path too, a typed error per op)."""
        log.warning("kvpool: a CUDA copy to or from a registered store segment failed (%s); "
                    "staging CUDA tensors through pinned memory for that segment from now on", e)
        for buf in used:  # copies queued before the failure end before the redo
            with contextlib.suppress(RuntimeError):
                buf.sync()
        with self._map_lock:
            for op in ops:
                self._pins.refuse(op.ref.incarnation)
        for op in ops:
            if op.error is not None or not _stage(op, into_segment):
                continue
            if into_segment:
                self._write_shm(op)
            else:
                self._copy_out(op)

    def _write_shm(self, op: WriteOp) -> None:
        """Copy ``op.data`` (a memoryview) into its mapped extent, hashing it on the way
        when no checksum is set yet; NodeUnavailable on the op when the mapping is gone."""
        r = op.ref
        seg = self._segment(r)
        if seg is None:
            op.error = _gone(r)
            return
        digest = self._copy_in(r, seg[r.offset:r.offset + r.size], op.data, op.checksum is None)
        if op.checksum is None:
            op.checksum = digest

    def _extent_address(self, ref: ExtentRef) -> int:
        base = self._bases.get(ref.incarnation)
        if base is None:
            base = self._bases[ref.incarnation] = _address(self._segment(ref)[:1])
        return base + ref.offset

    def _copy_in(self, ref: ExtentRef, dst: memoryview, data: memoryview, digest: bool) -> int | None:
        """Shared-memory write: caller buffer → extent, one copy (bounced in the 4K-aliasing
        case described in :meth:`_copy_out`). With ``digest``, returns the xxh3_64 of the
        bytes, hashed per 256 KiB chunk right after it is copied (source still in L2)."""
        size = len(dst)
        if digest and size >= HASH_ASIDE_MIN:
            fut = self._hash_aside(data)
            if fut is not None:
                _memcpy(dst, data)
                return fut.result()
        bounce = None
        if 2048 < size < _BOUNCE_MAX:
            try:
                bounce = self._bounce_for(_address(data), self._extent_address(ref))
            except (TypeError, ValueError):  # a read-only buffer (bytes): copy directly
                bounce = None
        if bounce is None and (not digest or size <= _CHUNK):
            _memcpy(dst, data)
            return xxhash.xxh3_64_intdigest(data) if digest else None
        h = xxhash.xxh3_64() if digest else None
        step = _CHUNK if bounce is None else len(bounce)
        for a in range(0, size, step):
            b = min(a + step, size)
            if bounce is None:
                dst[a:b] = data[a:b]
            else:
                bounce[:b - a] = data[a:b]
                dst[a:b] = bounce[:b - a]
            if h is not None:
                h.update(data[a:b])
        return h.intdigest() if h is not None else None

    def _hash_aside(self, data) -> Future | None:
        """Start the xxh3_64 of a put's buffer ``data`` on this plane's one helper thread,
        so that it runs beside the caller's GIL-free ``memcpy`` of the same bytes into the
        segment; None when the helper is busy with another thread's copy or shut down
        (``close()``, interpreter exit): that copy hashes as it goes instead. Puts only: the
        caller owns the buffer, so its bytes are the stored ones. A get must hash what
        landed in its output, not the segment (see the module docstring).

        Measured on the project VM (2 vCPUs, interleaved A/B, same-host 16 MiB put p50):
        3.04 ms against 3.57 ms hashing as it copies; at 4 MiB and below the put hashes
        while ``put_start`` is in flight instead, and the ~0.1 ms hand-off to a thread
        ate the gain at 2 MiB, hence :data:`HASH_ASIDE_MIN`."""
        if not self._hasher_free.acquire(blocking=False):
            return None
        try:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kvpool-hash")
            fut = self._hasher.submit(xxhash.xxh3_64_intdigest, data)
        except RuntimeError:  # shut down (close(), or the interpreter is exiting): hash inline
            self._hasher_free.release()
            return None
        except BaseException:
            self._hasher_free.release()
            raise
        fut.add_done_callback(lambda _: self._hasher_free.release())
        return fut

    def _bounce_for(self, src: int, dst: int) -> memoryview | None:
        """A bounce buffer half a page from ``src`` when ``dst`` sits 1–63 bytes past
        ``src`` modulo a page (the slow case), else None."""
        if not 0 < (dst - src) % _PAGE < _ALIAS:
            return None
        b = getattr(self._local, "bounce", None)
        if b is None:
            view = memoryview(bytearray(_CHUNK + 2 * _PAGE))
            b = self._local.bounce = (view, _address(view))
        k = (src + _PAGE // 2 - b[1]) % _PAGE
        return b[0][k:k + _CHUNK]

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=False)
        with self._map_lock:
            for s in list(self._all_conns):
                try:
                    s.sock.close()
                except OSError:
                    pass
            self._all_conns.clear()
            for inc in list(self._maps):
                self._unmap(inc)
            self._node_inc.clear()

    def forget_node(self, node_id: str) -> None:
        """Unmap ``node_id``'s segment (it died): a long-lived client must not keep a dead
        node's whole segment resident."""
        with self._map_lock:
            inc = self._node_inc.pop(node_id, None)
            if inc is not None:
                self._unmap(inc)

    def _unmap(self, incarnation: str) -> None:
        """Caller holds ``_map_lock``."""
        view = self._maps.pop(incarnation, None)
        base = self._bases.pop(incarnation, None)
        if self._pins is not None:
            self._pins.drop(incarnation, base)  # CUDA registration goes before the mapping
        mm = self._mmaps.pop(incarnation, None)
        try:
            if view is not None:
                view.release()
            if mm is not None:
                mm.close()
        except BufferError:
            pass  # a slice is still in use by another thread; the OS unmaps it with the object


def _wait_bytes(timeout_s: float) -> Callable[[socket.socket], bool]:
    return lambda sock: readable(sock, timeout_s)


def _gone(r: ExtentRef) -> NodeUnavailable:
    return NodeUnavailable(f"store node {r.node_id}'s segment went away during a transfer (the node died or "
                           "restarted); retry", node=r.node_id)


def _stage(op, into_segment: bool) -> bool:
    """Give ``op`` its CUDA tensor's pinned staging view in place of the DeviceBuffer (filled
    with the tensor's bytes for a write). False, with ``op.error`` set, when CUDA fails."""
    try:
        if into_segment:
            op.data = op.data.host(fill=True)
        else:
            op.out = op.out.host(fill=False, size=op.ref.size)
        return True
    except RuntimeError as e:
        op.error = KVPoolError(f"CUDA failed while staging the tensor through pinned host memory ({e}); "
                               "check the device (nvidia-smi) and the process's pinned memory")
        return False


def _send_hashing(sock, data: memoryview) -> int:
    """Send ``data`` in 256 KiB pieces, hashing each right after the kernel copied it (the
    piece is still in cache): the xxh3_64 of ``data`` without a separate pass over memory."""
    h = xxhash.xxh3_64()
    for a in range(0, len(data), _CHUNK):
        piece = data[a:a + _CHUNK]
        sendv(sock, [piece])
        h.update(piece)
    return h.intdigest()


def _memcpy(dst: memoryview, src) -> None:
    """``dst[:] = src``; large copies through numpy, which releases the GIL, so the
    per-node threads of a batch (and both replicas of a put) copy in parallel."""
    if len(dst) >= _GIL_FREE:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


def _misaligned(mv: memoryview) -> bool:
    """True when ``mv`` does not start on a cache line (numpy arrays and bytearrays start
    16 bytes into a page): the kernel's copy into such a buffer runs ~1.5× slower."""
    try:
        return _address(mv) % 64 != 0
    except (TypeError, ValueError):
        return False


def _address(mv: memoryview) -> int:
    """Start address of a writable, contiguous buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


_MADV_POPULATE_READ = 22  # Linux >= 5.14, <linux/mman.h>: prefault page tables, reading
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _prefault_aside(seg: memoryview, nbytes: int) -> None:
    """Prefault a new mapping's page tables on a daemon thread (``madvise`` with
    ``MADV_POPULATE_READ``, what ``MAP_POPULATE`` does at ``mmap`` time), so that reads and
    writes on it meanwhile fault only the pages they touch instead of waiting for the whole
    segment: the first transfer of a process no longer pays for prefaulting every page of a
    GiB segment. A kernel without the flag answers EINVAL and pages fault on first touch."""

    def run() -> None:
        try:
            view = seg[:nbytes]
            buf = ctypes.c_char.from_buffer(view)
        except (BufferError, ValueError, TypeError):
            return  # unmapped meanwhile
        try:
            _libc.madvise(ctypes.addressof(buf), nbytes, _MADV_POPULATE_READ)  # the GIL is released here
        finally:
            del buf
            view.release()

    threading.Thread(target=run, name="kvpool-prefault", daemon=True).start()


class _Buffered:
    """Present already-received bytes as a socket for :func:`recv_reply`."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def recv_into(self, view: memoryview, n: int) -> int:
        chunk = self.data[self.pos:self.pos + n]
        view[:len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)
