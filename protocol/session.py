"""A server connection's set-up, stepped the same way on every port.

Every kvpool stream port (the master's RPC port, a store node's data ports over TCP, Unix
and UCX) sets a connection up in the same order before it reads a request: TLS when the
port has it (TCP only), then the cluster-secret handshake when the cluster has a secret
(:class:`protocol.auth.ServerHandshake`), and on a plaintext TCP port that answers TLS
clients in plain text, a check of the peer's first bytes (:data:`protocol.admission.TLS_RECORD`).
:class:`ServerSession` is that order, written once. It steps a *stream*: any object with
``do_handshake()``, ``recv(n)`` and ``send(data)`` that raises ``ssl.SSLWantReadError`` /
``ssl.SSLWantWriteError`` (or ``BlockingIOError``) when it must wait. That is a
non-blocking ``socket.socket`` or ``ssl.SSLSocket`` (the store node's selector), a
:class:`BIOStream` (the master's event loop, which keeps TLS in memory BIOs), or a
blocking stream with a timeout (:meth:`ServerSession.finish`).

The admission rules around it (the connection cap, the handshake deadline, the refusal
counts) are :mod:`protocol.admission`'s; the wire of the handshake is :mod:`protocol.auth`'s.
"""
from __future__ import annotations

import contextlib
import socket
import ssl
import time

from kvpool.protocol import auth
from kvpool.protocol.admission import TLS_RECORD
from kvpool.protocol.errors import AuthFailed

WANT_READ, WANT_WRITE = 1, 2  # what :meth:`ServerSession.step` waits for (the selectors module's EVENT_*)
FIRST_READ = 4096  # bytes read to check the first bytes of a peer that has no handshake to read
TLS_IN_MAX = 1 << 16  # encrypted bytes a BIOStream buffers before its plaintext is read


class ServerSession:
    """The set-up of one server connection over ``stream``: TLS (``tls``: ``stream`` runs a
    server-side TLS handshake in ``do_handshake``), then the secret handshake ``hs`` (None:
    the cluster has no secret). ``not_tls``: bytes a plaintext TCP port sends a peer that
    opens with a TLS record before it is closed (None: the port does not look).

    :meth:`step` advances as far as the stream allows. Failures raise, after the peer was
    told what it can be told: :class:`~protocol.errors.AuthFailed` for the handshake
    (``cause``: the handshake's, ``closed`` for a peer that hung up or does not read, or
    ``tls`` for a TLS client on a plaintext port), ``ssl.SSLError`` for TLS, ``OSError``
    for the socket. ``role`` is the peer's once it authenticated (``cluster`` without a
    secret)."""

    __slots__ = ("stream", "tls_up", "hs", "not_tls", "role")

    def __init__(self, stream, tls: bool, hs: auth.ServerHandshake | None, not_tls: bytes | None = None) -> None:
        self.stream = stream
        self.tls_up = not tls  # the TLS handshake finished (or there is none)
        self.hs = hs  # the secret handshake, until it succeeds
        self.not_tls = not_tls if not tls else None  # checked on the first bytes, then dropped
        self.role = "cluster"

    @property
    def done(self) -> bool:
        return self.tls_up and self.hs is None and self.not_tls is None

    def step(self) -> int | bytes:
        """:data:`WANT_READ` or :data:`WANT_WRITE` (wait for that, then call again), or, once
        the connection is set up, the request bytes read past it (often empty: the
        handshake is read no further than its next step)."""
        s = self.stream
        if not self.tls_up:
            try:
                s.do_handshake()
            except ssl.SSLWantReadError:
                return WANT_READ
            except ssl.SSLWantWriteError:
                return WANT_WRITE
            self.tls_up = True
        while self.hs is not None or self.not_tls is not None:
            try:
                data = s.recv(self.hs.want() if self.hs is not None else FIRST_READ)  # never past the next step
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                return WANT_READ
            except ssl.SSLWantWriteError:
                return WANT_WRITE
            if not data:
                raise AuthFailed("peer closed the connection during the handshake", cause="closed")
            if self.not_tls is not None:
                refusal, self.not_tls = self.not_tls, None
                if data[:2] == TLS_RECORD:
                    with contextlib.suppress(OSError):
                        s.send(refusal)  # a fresh connection's send buffer holds it
                    raise AuthFailed("peer opened TLS on a plaintext port", cause="tls")
                if self.hs is None:
                    return data
            out, rest = self.hs.feed(data)
            if out and s.send(out) != len(out):  # a few bytes into an empty send buffer
                raise AuthFailed("peer does not read the handshake", cause="closed")
            if self.hs.error is not None:
                raise self.hs.error
            if self.hs.done:
                self.role, self.hs = self.hs.role, None
                return rest
        return b""

    def finish(self, deadline: float) -> bytes:
        """Run :meth:`step` on a blocking stream (``settimeout``) until the connection is set
        up, by ``deadline`` (monotonic seconds); the request bytes read past the handshake.
        Raises AuthFailed(``timeout``) when the peer takes longer."""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AuthFailed("peer did not finish the cluster-secret handshake in time", cause="timeout")
                self.stream.settimeout(left)
                got = self.step()
                if not isinstance(got, int):
                    return got
        except (socket.timeout, TimeoutError):
            raise AuthFailed("peer did not finish the cluster-secret handshake in time", cause="timeout") from None


class BIOStream:
    """Server-side TLS over memory BIOs on a non-blocking ``sock`` (``ctx``: the server's
    ``ssl.SSLContext``), for an event loop that owns its sockets' reads and writes. As a
    stream for :class:`ServerSession` it reads the socket itself; once the connection is
    set up the loop feeds it what it read (:meth:`decrypt`) and sends what it encrypts
    (:meth:`encrypt`). ``raw``: encrypted bytes not sent yet (the loop sends them when the
    socket is writable). At most :data:`TLS_IN_MAX` encrypted bytes are taken in from the
    socket while the set-up reads no plaintext."""

    __slots__ = ("sock", "tin", "tout", "tls", "raw")

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext) -> None:
        self.sock = sock
        self.tin, self.tout = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.tin, self.tout, server_side=True)
        self.raw = bytearray()

    def _take_in(self) -> None:
        if self.tin.pending >= TLS_IN_MAX:
            return
        try:
            data = self.sock.recv(TLS_IN_MAX)
        except (BlockingIOError, InterruptedError):
            return
        if data:
            self.tin.write(data)
        else:
            self.tin.write_eof()

    def flush(self) -> None:
        """Send what TLS wrote, as far as the socket takes it now (the rest stays in ``raw``).
        Raises OSError for a broken socket."""
        self.raw += self.tout.read()
        if self.raw:
            try:
                sent = self.sock.send(self.raw)
            except (BlockingIOError, InterruptedError):
                return
            del self.raw[:sent]

    def do_handshake(self) -> None:
        self._take_in()
        try:
            self.tls.do_handshake()
        except ssl.SSLEOFError:
            raise AuthFailed("peer closed the connection during the TLS handshake", cause="closed") from None
        finally:
            self.flush()

    def recv(self, n: int) -> bytes:
        self._take_in()
        try:
            return self.tls.read(n)
        except ssl.SSLZeroReturnError:
            return b""

    def send(self, data: bytes) -> int:
        n = self.tls.write(data)
        self.flush()
        return n

    def decrypt(self, data) -> bytes:
        """The plaintext that ``data`` (bytes read from the socket; empty: none) completes,
        with any plaintext already buffered. Raises ``ssl.SSLZeroReturnError`` when the
        peer closed its TLS session, ``ssl.SSLError`` for a broken one."""
        if data:
            self.tin.write(data)
        out = bytearray()
        while True:
            try:
                part = self.tls.read(1 << 20)
            except ssl.SSLWantReadError:
                break
            if not part:
                break
            out += part
        return bytes(out)

    def encrypt(self, data) -> None:
        """Queue ``data`` under TLS: its records go to ``raw``. Raises ``ssl.SSLError``."""
        if data:
            self.tls.write(data)
        self.raw += self.tout.read()

    @property
    def pending(self) -> bool:
        """Whether encrypted bytes wait to be sent."""
        return bool(self.raw) or self.tout.pending > 0
