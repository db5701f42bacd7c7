"""Data-plane frames between clients and store nodes.

Each request is ``u32 little-endian header length || msgpack DataRequest`` followed, for
``write``, by exactly ``size`` payload bytes. Each reply is ``u32 length || msgpack
DataReply`` followed, for a successful ``read``, by ``size`` payload bytes. Requests may be
pipelined on one connection; replies come back in order. Payload bytes move with
``sendall``/``recv_into`` on memoryviews: no per-byte Python work.

Ops: ``write`` (bytes into an extent, recording key/gen/checksum/layout), ``claim``
(Unix socket only: a same-host writer asks for the extent before copying into the shared
mapping; refused with PutRevoked or ExtentBusy, see :mod:`storenode.extents`),
``written`` (one-way, no reply: the copy is done, the claim ends, the same record as
``write``), ``read`` (named by offset +
gen; refused for a freed or reused extent: :class:`~protocol.errors.StaleExtent`),
``map`` (Unix socket only: the reply carries the segment's memfd via SCM_RIGHTS),
``commit`` (one-way, no reply: the writer's copy of the master's commit notice, sent once
``put_end`` was acknowledged, so an acknowledged put reaches the node's committed table
even if the master dies before its own notice leaves; same grant token as the write).
Batched forms, one frame for many extents (``items``; the reserved-extent path,
:mod:`connector.claims`): ``claims`` (one reply, ``errors`` per item), ``written_all``
(one-way: the connection's claims of those extents end; nothing is recorded) and
``commits`` (one-way). A frame of any op stays under :data:`MAX_HEADER` bytes:
:func:`batch_frames` splits a long batch.
"""
from __future__ import annotations

import ssl
import struct
import time
from collections.abc import Callable

import msgspec

from kvpool.protocol.errors import DECODE_ERRORS, ErrorInfo, InvalidRequest, NodeUnavailable

_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 16
READ_BUF = 256 << 10


class HeldExtent(msgspec.Struct, array_like=True):
    """One extent of a batched ``claims`` / ``written_all`` / ``commits`` frame
    (:attr:`DataRequest.items`): byte offset and size in the segment, grant generation and
    token, and for a commit the object's key, xxh3_64 checksum, layout and wanted replicas."""

    offset: int
    size: int
    gen: int
    token: bytes
    key: str = ""
    checksum: int = 0
    layout: bytes | None = None
    replicas: int = 0


class DataRequest(msgspec.Struct, array_like=True):
    op: str
    incarnation: str
    offset: int = 0
    size: int = 0
    gen: int = 0
    key: str = ""
    checksum: int = 0
    layout: bytes | None = None
    token: bytes = b""
    pad: bytes = b""  # filler set by :func:`frame` (frame alignment)
    replicas: int = 0  # commit: the object's wanted replica count (0: the cluster default)
    items: list[HeldExtent] = []  # the extents of a batched op (claims, written_all, commits)


class DataReply(msgspec.Struct, array_like=True):
    ok: bool
    error: ErrorInfo | None = None
    size: int = 0
    capacity: int = 0
    pad: bytes = b""  # filler set by :func:`frame` (frame alignment)
    errors: list[ErrorInfo | None] = []  # per item of a batched ``claims``: None (claimed) or why not


_req_dec = msgspec.msgpack.Decoder(DataRequest)
_rep_dec = msgspec.msgpack.Decoder(DataReply)
_enc = msgspec.msgpack.Encoder()


FRAME_ALIGN = 64


def frame(msg: DataRequest | DataReply) -> bytes:
    """``u32 length || msgpack`` padded (the message's ``pad`` field) to a multiple of
    :data:`FRAME_ALIGN` bytes. Why: the kernel copies a socket payload into or out of page
    fragments at (about) the stream offset, and ``rep movsb`` between addresses 1–63 bytes
    apart modulo 4 KiB runs far slower (4K aliasing; see ``ShmCopies.copy_out`` in
    connector/shmcopy.py). With every frame a multiple of 64 bytes, payloads of 64-byte
    multiples (KV blocks are) keep page-aligned buffers and the kernel's fragments 64-byte
    aligned to each other (benchmarks/RESULTS.md, "Measurements behind choices in the code")."""
    body = _enc.encode(msg)
    short = -(4 + len(body)) % FRAME_ALIGN
    if short:  # an empty ``pad`` is 2 bytes (bin8 header); pad bytes up to 255 keep that header
        body = _enc.encode(msgspec.structs.replace(msg, pad=bytes(short)))
    return _LEN.pack(len(body)) + body


def recv_exact(sock, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; raises NodeUnavailable on EOF."""
    pos, n = 0, len(view)
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if got == 0:
            raise NodeUnavailable("data connection closed mid-frame")
        pos += got


def _recv_frame(sock) -> bytes:
    head = bytearray(4)
    recv_exact(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > MAX_HEADER:
        raise InvalidRequest(f"data frame header of {n} bytes exceeds {MAX_HEADER}")
    body = bytearray(n)
    recv_exact(sock, memoryview(body))
    return bytes(body)


def recv_request(sock) -> DataRequest:
    body = _recv_frame(sock)
    try:
        return _req_dec.decode(body)
    except DECODE_ERRORS as e:
        raise InvalidRequest(f"malformed data request: {e}") from None


def recv_reply(sock) -> DataReply:
    body = _recv_frame(sock)
    try:
        return _rep_dec.decode(body)
    except DECODE_ERRORS as e:
        raise InvalidRequest(f"malformed data reply: {e}") from None


_IOV_MAX = 512  # stay below the kernel's UIO_MAXIOV (1024) per sendmsg call


def sendv(sock, bufs: list) -> None:
    """Send every buffer in order: ``sendmsg`` scatter/gather, resuming after partial sends.
    Falls back to ``sendall`` per buffer for stream objects without ``sendmsg``."""
    send = None if isinstance(sock, ssl.SSLSocket) else getattr(sock, "sendmsg", None)  # TLS has no sendmsg
    if send is None:
        for b in bufs:
            sock.sendall(b)
        return
    i = 0
    bufs = [memoryview(b).cast("B") if not isinstance(b, bytes) else b for b in bufs if len(b)]
    while i < len(bufs):
        part = bufs[i:i + _IOV_MAX]
        n = send(part)
        for b in part:
            if n >= len(b):
                n -= len(b)
                i += 1
            else:
                bufs[i] = memoryview(b)[n:]
                break


class Stalled(NodeUnavailable):
    """A peer sent a frame too slowly while other connections waited for a worker (the
    server closes it)."""


class FrameReader:
    """Buffered reader of ``u32 length || body`` frames and raw payloads from a stream.
    Raises NodeUnavailable (:attr:`eof_message`) when the peer closes mid-frame.

    ``patience(seconds, bytes)``, when set, is asked after every receive and every receive
    timeout (the socket's deadline is then a short slice) with the seconds since the current
    frame began and the bytes received for it since: False ends the frame with
    :class:`Stalled` (a peer too slow while others wait; storenode/connpool.py)."""

    __slots__ = ("sock", "buf", "view", "lo", "hi", "patience", "t0", "got")
    eof_message = "data connection closed mid-frame"

    def __init__(self, sock, size: int = READ_BUF) -> None:
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.lo = self.hi = 0
        self.patience: Callable[[float, int], bool] | None = None
        self.t0 = 0.0  # monotonic start of the current frame (with patience)
        self.got = 0  # bytes received for it

    def _recv(self, view: memoryview, n: int) -> int:
        """``recv_into`` with the patience rule (module docstring)."""
        if self.patience is None:
            return self.sock.recv_into(view, n)
        while True:
            try:
                got = self.sock.recv_into(view, n)
            except (BlockingIOError, TimeoutError):  # the slice passed with nothing received
                got = None
            else:
                self.got += got
            if got != 0:  # (EOF is the caller's to raise)
                took = time.monotonic() - self.t0
                if not self.patience(took, self.got):
                    raise Stalled(f"data connection sent {self.got} bytes of a frame in {took:.1f}s while "
                                  "others waited")
            if got is not None:
                return got

    def buffered(self) -> int:
        return self.hi - self.lo

    def has_frame(self) -> bool:
        """A whole frame is already buffered (so reading it will not block)."""
        n = self.hi - self.lo
        if n < 4:
            return False
        (size,) = _LEN.unpack_from(self.buf, self.lo)
        return n >= 4 + size

    def _fill(self, need: int, greedy: bool = True) -> None:
        """Make at least ``need`` bytes available from ``lo`` (need ≤ buffer size). Greedy
        reads take whatever the socket has (many pipelined frames at once); otherwise no more
        than ``need``, so a large payload after the frame can go straight to its buffer."""
        if self.hi - self.lo >= need:
            return
        if self.lo + need > len(self.buf):
            n = self.hi - self.lo
            self.buf[:n] = self.view[self.lo:self.hi]
            self.lo, self.hi = 0, n
        while self.hi - self.lo < need:
            want = len(self.buf) - self.hi if greedy else need - (self.hi - self.lo)
            got = self._recv(self.view[self.hi:self.hi + want], want)
            if got == 0:
                raise NodeUnavailable(self.eof_message)
            self.hi += got

    def frame(self, greedy: bool = True) -> memoryview:
        """The next frame's body (valid until the next call). InvalidRequest when its
        declared length exceeds MAX_HEADER."""
        if self.patience is not None:
            self.t0, self.got = time.monotonic(), 0
        self._fill(4, greedy)
        (n,) = _LEN.unpack_from(self.buf, self.lo)
        if n > MAX_HEADER:
            raise InvalidRequest(f"data frame header of {n} bytes exceeds {MAX_HEADER}")
        self._fill(4 + n, greedy)
        body = self.view[self.lo + 4:self.lo + 4 + n]
        self.lo += 4 + n
        return body

    def read_into(self, dst: memoryview) -> None:
        """Fill ``dst``: buffered bytes first, then ``recv_into`` it directly."""
        n = len(dst)
        take = min(n, self.hi - self.lo)
        if take:
            dst[:take] = self.view[self.lo:self.lo + take]
            self.lo += take
        pos = take
        while pos < n:
            got = self._recv(dst[pos:], n - pos)
            if got == 0:
                raise NodeUnavailable(self.eof_message)
            pos += got

    def skip(self, n: int) -> None:
        """Discard ``n`` payload bytes (a refused write's payload)."""
        take = min(n, self.hi - self.lo)
        self.lo += take
        n -= take
        while n:
            self.lo = self.hi = 0
            got = self._recv(self.view, min(n, len(self.buf)))
            if got == 0:
                raise NodeUnavailable(self.eof_message)
            n -= got


BATCH_ITEMS = 256  # extents per batched frame at most: the reply of a ``claims`` frame (an
# ErrorInfo of ~120 bytes per refused item) must stay under MAX_HEADER too


def batch_frames(op: str, incarnation: str, items: list[HeldExtent]) -> list[bytes]:
    """Frames of the batched ``op`` over ``items``: at most :data:`BATCH_ITEMS` items each,
    each under :data:`MAX_HEADER` bytes (a batch is halved until its frame fits). Raises
    InvalidRequest for one item that alone does not fit (a key and layout of more than
    ~64 KiB)."""
    if not items:
        return []
    if len(items) > BATCH_ITEMS:
        return [f for a in range(0, len(items), BATCH_ITEMS)
                for f in batch_frames(op, incarnation, items[a:a + BATCH_ITEMS])]
    f = frame(DataRequest(op, incarnation, items=items))
    if len(f) - 4 <= MAX_HEADER:
        return [f]
    if len(items) == 1:
        raise InvalidRequest(f"{op} frame of one extent is {len(f)} bytes, over {MAX_HEADER}")
    half = len(items) // 2
    return batch_frames(op, incarnation, items[:half]) + batch_frames(op, incarnation, items[half:])
