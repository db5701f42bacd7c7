"""Framing of the client ↔ master RPC over a plain byte stream (TCP, or a Unix socket).

Every frame, both directions: ``u32 LE length || u64 LE request id || msgpack body``,
where ``length`` counts the id and the body. Requests carry a ``protocol.messages``
request; replies carry a :class:`~protocol.messages.Reply` with the request's id, in
order per connection. Request id 0 is **one-way**: the master applies it and sends
nothing back (lease release, corruption reports), so it costs the client one ``send``.

Why not zmq: a DEALER/ROUTER round trip crosses two zmq I/O threads per side, and
measured slower than this framing on a plain socket (``benchmarks/rpc_latency.py``;
benchmarks/RESULTS.md, "Master RPC carrier").

:class:`FrameParser` is pure (no I/O), so the master's non-blocking loop and the tests
share it; :class:`BlockingFrames` is the client's buffered reader.
"""
from __future__ import annotations

import select
import struct

from kvpool.protocol.dataplane import FrameReader
from kvpool.protocol.errors import InvalidRequest

HEAD = struct.Struct("<IQ")
MAX_FRAME = 64 << 20  # bytes; a batch of ~500k keys. Larger frames are refused
ONE_WAY = 0
BIG_FRAME = 1 << 20  # bytes; a frame at least this long is gathered in its own buffer (FrameParser)


def pack(rid: int, body: bytes) -> bytes:
    """One frame: header + body (``bytes``)."""
    return HEAD.pack(8 + len(body), rid) + body


class FrameParser:
    """Incremental parser: :meth:`feed` bytes as they arrive, get whole frames back as
    ``(request id, body)`` pairs (``body``: bytes, or a bytearray for a frame of
    :data:`BIG_FRAME` bytes or more, which is gathered in one buffer of its announced size
    and handed over without another copy). An oversized or impossible length sets
    :attr:`error` (an InvalidRequest whose ``fields['rid']`` is that frame's request id)
    after the frames before it were returned: the stream cannot be trusted past it, so the
    master answers those frames, then the error, and closes the connection."""

    __slots__ = ("buf", "error", "big", "big_at", "big_rid")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.error: InvalidRequest | None = None
        self.big: bytearray | None = None  # the body of a big frame being gathered
        self.big_at = 0  # bytes of it received
        self.big_rid = 0

    @property
    def partial(self) -> bool:
        """True while part of a frame has been received and the rest has not."""
        return bool(self.buf) or self.big is not None

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[int, bytes | bytearray]]:
        if self.error is not None:
            return []
        out: list[tuple[int, bytes | bytearray]] = []
        if self.big is not None:
            data = self._gather(memoryview(data), out)
            if not data:
                return out
        buf = self.buf
        buf += data
        pos, n = 0, len(buf)
        while n - pos >= 12:
            size, rid = HEAD.unpack_from(buf, pos)
            if size < 8 or size > MAX_FRAME:
                self.error = InvalidRequest(f"RPC frame of {size} bytes is outside [8, {MAX_FRAME}]; connection "
                                            "closed", rid=rid)
                buf.clear()
                return out
            if n - pos < 4 + size:
                if size >= BIG_FRAME:  # gather the rest straight into a buffer of the frame's size
                    self.big, self.big_rid = bytearray(size - 8), rid
                    with memoryview(buf) as mv:
                        self.big_at = n - pos - 12
                        self.big[:self.big_at] = mv[pos + 12:n]
                    buf.clear()
                    return out
                break
            with memoryview(buf) as mv:
                out.append((rid, bytes(mv[pos + 12:pos + 4 + size])))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return out

    def _gather(self, data: memoryview, out: list) -> memoryview:
        """Copy ``data`` into the big frame being gathered; append it to ``out`` once whole.
        Returns the bytes past its end."""
        big, at = self.big, self.big_at
        take = min(len(data), len(big) - at)
        big[at:at + take] = data[:take]
        self.big_at = at + take
        if self.big_at == len(big):
            out.append((self.big_rid, big))
            self.big = None
        return data[take:]


class BlockingFrames(FrameReader):
    """Buffered frame reader over a blocking socket (the client side): the data plane's
    :class:`~protocol.dataplane.FrameReader` buffer, read as RPC frames. One ``recv``
    usually brings a whole reply; large replies are read straight into their own buffer."""

    __slots__ = ()
    eof_message = "master closed the connection"

    def ready(self) -> bool:
        """True when a reply (or EOF) can be read without blocking: bytes are buffered or
        the socket is readable (one zero-timeout ``poll``)."""
        if self.hi > self.lo or getattr(self.sock, "pending", lambda: 0)():  # TLS: decrypted, unread bytes
            return True
        try:
            p = select.poll()
            p.register(self.sock, select.POLLIN)
            return bool(p.poll(0))
        except (OSError, ValueError):  # closed meanwhile: the read that follows reports it
            return True

    def read(self) -> tuple[int, bytes | memoryview]:
        """The next ``(request id, body)``. Raises NodeUnavailable on EOF, InvalidRequest for
        a corrupt header, socket timeouts as ``TimeoutError``."""
        self._fill(12)
        size, rid = HEAD.unpack_from(self.buf, self.lo)
        if size < 8 or size > MAX_FRAME:
            raise InvalidRequest(f"RPC reply frame of {size} bytes is outside [8, {MAX_FRAME}]")
        n = size - 8
        self.lo += 12
        if n <= len(self.buf):
            self._fill(n)
            body = self.view[self.lo:self.lo + n]
            self.lo += n
            return rid, body
        body = bytearray(n)  # a very large reply: buffered bytes, then recv straight into it
        self.read_into(memoryview(body))
        return rid, body
