"""``ucx://host:port`` byte streams over UCX (the optional ``[ucx]`` extra: ``ucxx-cu12``).

Imported lazily by :mod:`protocol.transport` the first time a ``ucx://`` address is used;
importing it registers the scheme. Without ``ucxx`` the import fails and the registry
reports a ConfigError telling how to install the extra.

How a connection is made. ucxx's listener binds every interface (0.0.0.0), which kvpool
must not do, so connections are set up by worker address instead: ``host:port`` names a
small TCP *rendezvous* socket bound to loopback. The rendezvous socket is set up like any
kvpool stream socket first (the cluster-secret handshake, on the store node's selector
with its cap and deadline: :mod:`protocol.session`), so a peer without the secret never
reaches UCX. Then the client sends a random 64-bit connection id and its UCX worker
address, the server answers with its worker address, and each side creates an endpoint
to the other's worker (endpoint error handling off: the bundled UCX's shared-memory
transports need that). The rendezvous socket then stays open
as the liveness channel: a peer that exits or dies closes it, and a blocked receive raises
instead of waiting forever.

Stream semantics on top of UCX tag messages. Each connection uses two tags (client→server
and server→client) derived from its id, so many connections share one worker without
mixing; UCX delivers messages of one tag from one sender in order. Every ``sendall`` /
``sendmsg`` buffer travels as an 8-byte length message followed by the payload message.
``recv_into(view, n)`` receives the length, then the payload straight into ``view`` when it
fits (one copy, done by UCX: shared memory or loopback TCP), else into a staging buffer
from which the following calls are served. A zero length means the peer closed (EOF).

One UCX context and one worker per process, progressed by a ucxx progress thread; the
transports are those UCX picks among ``UCX_TLS`` (default here ``tcp,sm,self``) on
``UCX_NET_DEVICES`` (default ``lo``, so traffic stays on loopback).
"""
from __future__ import annotations

import atexit
import os
import select
import socket
import struct
import threading
import time

os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# ucxx exports UCX_MEMTYPE_CACHE, which the bundled UCX no longer knows: its warning would go
# to stdout (and corrupt `kvpool bench --json`)
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import numpy as np  # noqa: E402
import ucxx._lib.libucxx as ucx_api  # noqa: E402  (ImportError here: the extra is absent)
from ucxx._lib.arr import Array  # noqa: E402

from kvpool.protocol import transport  # noqa: E402

_LEN = struct.Struct("<Q")
_HELLO = struct.Struct("<QI")  # connection id, worker address length
_MAX_ADDR = 1 << 16
_GRACE_S = 0.5


class _Engine:
    """The process's UCX context and worker (created on first use, progress thread on)."""

    _lock = threading.Lock()
    _inst: "_Engine | None" = None

    def __init__(self) -> None:
        self.ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self.worker = ucx_api.UCXWorker(self.ctx, enable_delayed_submission=True)
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=50)
        self.address = self.worker.address.tobytes()

    @classmethod
    def get(cls) -> "_Engine":
        with cls._lock:
            if cls._inst is None:
                cls._inst = cls()
                atexit.register(cls._shutdown)
            return cls._inst

    @classmethod
    def _shutdown(cls) -> None:
        """Stop the progress thread before interpreter teardown (ucxx asks for it)."""
        with cls._lock:
            inst, cls._inst = cls._inst, None
        if inst is not None:
            try:
                inst.worker.stop_progress_thread()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass

    def endpoint(self, peer_address: bytes):
        addr = ucx_api.UCXAddress.create_from_buffer(np.frombuffer(peer_address, dtype=np.uint8))
        return ucx_api.UCXEndpoint.create_from_worker_address(self.worker, addr, False)


def _recv_exact_sock(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        got = s.recv_into(view[pos:], n - pos)
        if got == 0:
            raise ConnectionError("ucx rendezvous closed during the handshake")
        pos += got
    return bytes(buf)


class UcxStream:
    """A blocking, stream-oriented socket-like object over one UCX endpoint pair."""

    def __init__(self, rendezvous: socket.socket, ep, send_tag: int, recv_tag: int, engine: _Engine) -> None:
        self._rv = rendezvous
        self._ep = ep
        self._eng = engine
        self._stag = ucx_api.UCXXTag(send_tag)
        self._rtag = ucx_api.UCXXTag(recv_tag)
        self._timeout: float | None = None
        self._hdr = np.zeros(1, dtype=np.uint64)
        self._stage: memoryview | None = None  # unread rest of a message bigger than a recv
        self._left = 0                          # bytes of the current message not yet received
        self._closed = False
        self._peer_gone = False
        self._send_lock = threading.Lock()

    # ---- waiting ------------------------------------------------------------------------

    def settimeout(self, t: float | None) -> None:
        self._timeout = t

    def gettimeout(self) -> float | None:
        return self._timeout

    def _wait(self, req) -> None:
        """Wait for ``req``: spin briefly, then sleep on the rendezvous socket (which wakes
        us at once if the peer goes away) in growing steps; honour the timeout."""
        if req.completed:
            req.check_error()
            return
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        for _ in range(200):
            if req.completed:
                req.check_error()
                return
            time.sleep(0)
        step = 20e-6
        while not req.completed:
            if self._closed:
                raise OSError("ucx stream closed")
            r, _, _ = select.select([self._rv], [], [], step)
            if r and not req.completed and self._rendezvous_eof():
                # a graceful close sends its FIN before hanging up: give what is in
                # flight a moment to land, then report the peer gone
                grace = time.monotonic() + _GRACE_S
                while not req.completed and time.monotonic() < grace:
                    time.sleep(1e-3)
                if not req.completed:
                    raise ConnectionResetError("ucx peer closed the connection")
            if deadline is not None and time.monotonic() > deadline:
                raise socket.timeout("ucx stream timed out")
            step = min(step * 2, 2e-3)
        req.check_error()

    def _rendezvous_eof(self) -> bool:
        try:
            data = self._rv.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if data == b"":
            self._peer_gone = True
            return True
        return False

    # ---- sending ------------------------------------------------------------------------

    def _send_one(self, buf) -> None:
        mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
        n = len(mv)
        if n == 0:
            return
        hdr = np.array([n], dtype=np.uint64)
        r1 = self._ep.tag_send(Array(hdr), self._stag)
        r2 = self._ep.tag_send(Array(mv), self._stag)
        self._wait(r1)
        self._wait(r2)

    def sendall(self, buf) -> None:
        if self._closed:
            raise OSError("ucx stream closed")
        with self._send_lock:
            self._send_one(buf)

    def sendmsg(self, bufs, *_args) -> int:
        """Scatter/gather send of ``bufs`` (all of them; returns the byte count)."""
        if self._closed:
            raise OSError("ucx stream closed")
        total = 0
        with self._send_lock:
            small = [b for b in bufs if len(b) < (64 << 10)]
            if len(small) == len(bufs) and len(bufs) > 1:
                joined = b"".join(bytes(b) if not isinstance(b, bytes) else b for b in bufs)
                self._send_one(joined)
                return len(joined)
            for b in bufs:
                self._send_one(b)
                total += len(b)
        return total

    # ---- receiving ----------------------------------------------------------------------

    def recv_into(self, view, nbytes: int = 0) -> int:
        if self._closed:
            raise OSError("ucx stream closed")
        view = memoryview(view).cast("B")
        n = min(nbytes or len(view), len(view))
        if n == 0:
            return 0
        if self._stage is not None:
            take = min(n, len(self._stage))
            view[:take] = self._stage[:take]
            self._stage = self._stage[take:] if take < len(self._stage) else None
            return take
        if self._peer_gone:
            return 0
        req = self._eng.worker.tag_recv(Array(self._hdr), self._rtag)
        try:
            self._wait(req)
        except ConnectionResetError:
            return 0
        size = int(self._hdr[0])
        if size == 0:
            self._peer_gone = True
            return 0
        if size <= n:
            self._wait(self._eng.worker.tag_recv(Array(view[:size]), self._rtag))
            return size
        stage = np.empty(size, dtype=np.uint8)
        self._wait(self._eng.worker.tag_recv(Array(stage), self._rtag))
        sv = memoryview(stage)
        view[:n] = sv[:n]
        self._stage = sv[n:]
        return n

    def wait_readable(self) -> None:
        """Wait, with no deadline, until a receive would not block: a message (or the peer's
        FIN) arrived, bytes of one are staged, or the peer went away. Raises OSError once
        the stream is closed. A server waits here between requests, so an idle connection
        is allowed while each frame keeps its deadline (:meth:`settimeout`)."""
        step = 20e-6
        while self._stage is None and not self._peer_gone:
            if self._closed:
                raise OSError("ucx stream closed")
            if self._eng.worker.tag_probe(self._rtag).matched:
                return
            r, _, _ = select.select([self._rv], [], [], step)
            if r and self._rendezvous_eof():
                return
            step = min(step * 2, 2e-3)

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self.recv_into(memoryview(buf), n)
        return bytes(buf[:got])

    # ---- closing ------------------------------------------------------------------------

    def shutdown(self, how: int = socket.SHUT_RDWR) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        if not self._peer_gone:
            try:  # FIN: a zero length, ordered after everything sent before
                self._timeout = _GRACE_S
                with self._send_lock:
                    fin = np.zeros(1, dtype=np.uint64)
                    self._wait(self._ep.tag_send(Array(fin), self._stag))
            except (OSError, ucx_api.UCXError):
                pass
        self._closed = True
        try:
            self._rv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._rv.close()

    def fileno(self) -> int:
        return self._rv.fileno()

    def setsockopt(self, *args) -> None:
        """Socket options do not apply to UCX; accepted and ignored."""


class UcxListener:
    """Accepts ``ucx://`` connections on a loopback TCP rendezvous socket."""

    def __init__(self, host: str, port: int) -> None:
        self._eng = _Engine.get()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        h, p = self._sock.getsockname()[:2]
        self.bound_addr = f"ucx://{h}:{p}"

    def getsockname(self):
        return self._sock.getsockname()

    def settimeout(self, t: float | None) -> None:
        self._sock.settimeout(t)

    def accept(self) -> tuple[UcxStream, tuple]:
        """The next stream, for a server without a secret that serves one peer at a time;
        a peer that breaks its worker-address exchange (or stalls it 10 s) is dropped."""
        while True:
            conn, peer = self._sock.accept()
            try:
                return self.upgrade(conn, 10.0), peer
            except OSError:
                conn.close()

    def accept_socket(self) -> tuple[socket.socket, tuple]:
        """A rendezvous connection, not set up yet: the data server authenticates it like any
        stream socket on its selector, then makes it a stream with :meth:`upgrade`."""
        return self._sock.accept()

    def upgrade(self, conn: socket.socket, timeout: float) -> UcxStream:
        """The server's half of the worker-address exchange on an accepted (and
        authenticated) rendezvous socket, within ``timeout`` seconds; raises OSError
        (ConnectionError, socket.timeout) when the peer breaks or stalls it."""
        conn.settimeout(timeout)
        try:
            cid, alen = _HELLO.unpack(_recv_exact_sock(conn, _HELLO.size))
            if not 0 < alen <= _MAX_ADDR:
                raise ConnectionError("bad ucx hello")
            ep = self._eng.endpoint(_recv_exact_sock(conn, alen))
            conn.sendall(_HELLO.pack(cid, len(self._eng.address)) + self._eng.address)
        except ucx_api.UCXError as e:
            raise ConnectionError(f"ucx endpoint: {e}") from None
        conn.settimeout(None)
        return UcxStream(conn, ep, _tag(cid, 1), _tag(cid, 0), self._eng)

    def close(self) -> None:
        self._sock.close()


def _tag(cid: int, direction: int) -> int:
    """Tag of one direction of connection ``cid`` (0: client→server, 1: server→client)."""
    return ((cid << 1) | direction) & ((1 << 64) - 1)


def _connect(rest: str, timeout: float) -> socket.socket:
    """The rendezvous socket to ``host:port``: secured like any stream socket (the cluster
    secret's handshake), then made a stream by :func:`_upgrade`."""
    host, port = rest.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _upgrade(s: socket.socket, timeout: float) -> UcxStream:
    """The client's half of the worker-address exchange on a connected, secured rendezvous
    socket; raises OSError when the server breaks or stalls it within ``timeout`` seconds."""
    eng = _Engine.get()
    s.settimeout(timeout)
    cid = int.from_bytes(os.urandom(8), "little") >> 1
    s.sendall(_HELLO.pack(cid, len(eng.address)) + eng.address)
    got_cid, alen = _HELLO.unpack(_recv_exact_sock(s, _HELLO.size))
    if got_cid != cid or not 0 < alen <= _MAX_ADDR:
        raise ConnectionError("bad ucx hello reply")
    try:
        ep = eng.endpoint(_recv_exact_sock(s, alen))
    except ucx_api.UCXError as e:
        raise ConnectionError(f"ucx endpoint: {e}") from None
    s.settimeout(None)
    return UcxStream(s, ep, _tag(cid, 0), _tag(cid, 1), eng)


def _listen(rest: str) -> UcxListener:
    host, port = rest.rsplit(":", 1)
    return UcxListener(host, int(port))


transport.register("ucx", _connect, _listen, _upgrade)
