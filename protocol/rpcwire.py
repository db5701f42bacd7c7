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
BIG_FRAME = 1 << 20  # bytes; a frame at least this long is handed over in its receive buffer (FrameParser)


def pack(rid: int, body: bytes) -> bytes:
    """One frame: header + body (``bytes``)."""
    return HEAD.pack(8 + len(body), rid) + body


class FrameParser:
    """Incremental parser: :meth:`feed` bytes as they arrive, get whole frames back as
    ``(request id, body)`` pairs (``body``: bytes, or for a frame of :data:`BIG_FRAME` bytes
    or more, the receive buffer itself, a bytearray handed over without another copy). The
    buffer holds only what was received: a length announced but not sent costs nothing. An
    oversized or impossible length sets :attr:`error` (an InvalidRequest whose
    ``fields['rid']`` is that frame's request id) after the frames before it were returned:
    the stream cannot be trusted past it, so the master answers those frames, then the
    error, and closes the connection."""

    __slots__ = ("buf", "error")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.error: InvalidRequest | None = None

    @property
    def partial(self) -> bool:
        """True while part of a frame has been received and the rest has not."""
        return bool(self.buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[int, bytes | bytearray]]:
        if self.error is not None:
            return []
        buf = self.buf
        buf += data
        out: list[tuple[int, bytes | bytearray]] = []
        pos, n = 0, len(buf)
        while n - pos >= 12:
            size, rid = HEAD.unpack_from(buf, pos)
            if size < 8 or size > MAX_FRAME:
                self.error = InvalidRequest(f"RPC frame of {size} bytes is outside [8, {MAX_FRAME}]; connection "
                                            "closed", rid=rid)
                buf.clear()
                return out
            end = pos + 4 + size
            if n < end:
                break
            if pos == 0 and size >= BIG_FRAME:  # hand the buffer over: cutting its head costs no copy
                rest = buf[end:]
                del buf[end:]
                del buf[:12]
                out.append((rid, buf))
                self.buf = buf = rest
                n = len(buf)
                continue
            with memoryview(buf) as mv:
                out.append((rid, bytes(mv[pos + 12:end])))
            pos = end
        if pos:
            del buf[:pos]
        return out


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
