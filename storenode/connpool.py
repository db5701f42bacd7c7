"""Connections of the data server: one selector thread, a bounded pool of workers.

No thread per connection. A connection is owned by exactly one of:

* the **selector thread** (``selectors.DefaultSelector``), while it authenticates or sits
  idle. It steps each connection's set-up (:class:`protocol.session.ServerSession`: TLS
  through ``ssl`` with ``do_handshake_on_connect=False``, then the cluster-secret
  handshake, on non-blocking reads) within ``auth.HANDSHAKE_S`` of the accept, so
  unauthenticated peers cost no worker; and it watches authenticated connections for
  their next request. A ``ucx://`` connection is set up the same way on its rendezvous
  socket, and only then becomes a UCX stream, served on a thread of its own. The cap and the
  handshake deadlines follow the rules every port shares (:mod:`protocol.admission`): a
  connection accepted at the server's connection cap takes the place of the oldest one
  still in its handshake (closed, AuthFailed ``evicted``), and with none in its handshake
  it is refused (``refuse``);
* a **worker** (``workers`` of them), once the connection is readable: the worker runs
  ``serve(conn)``, which serves every request that arrives while it holds the connection
  and returns True to hand it back to the selector (or False: it was closed). A TLS
  connection whose SSL object still buffers plaintext (``pending() > 0``) goes straight back
  to the work queue, since its socket may never become readable for those bytes.

A worker keeps a connection it has just served for up to :data:`LINGER_S` more, waiting
for its next request, while another worker is free: a client that sends one request per
reply is then not handed between threads on every request. A connection made readable
meanwhile waits at most that long for a worker, and only when every other worker is busy.

While a worker holds a connection its socket is blocking with a deadline on every ``recv``
and ``send`` (``SO_RCVTIMEO``/``SO_SNDTIMEO`` on plain sockets, the socket timeout under TLS);
a deadline that passes closes the connection. Sends wait ``frame_timeout_s``. Receives
wait in slices of :data:`SLICE_S` (under TLS through :class:`TLSSlices`), and
between slices the server's :meth:`ConnPool.patience` decides, charging the frame for the
bytes it actually brought: a frame may take ``frame_timeout_s`` from its first byte while
no other connection waits for a worker, but once one waits, a frame older than
:data:`STALL_S` that brought less than :data:`MIN_RATE` bytes per second is cut off
(:class:`~protocol.dataplane.Stalled`) and its connection closed. So peers that send
frames slowly, however many and however they pace their bytes, hold the workers for about
``STALL_S`` each while honest clients wait, instead of the frame deadline.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import select
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import deque
from typing import Any, Callable

from kvpool.protocol import admission, auth
from kvpool.protocol.errors import AuthFailed
from kvpool.protocol.session import WANT_READ, WANT_WRITE, ServerSession

_log = logging.getLogger("kvpool.storenode")
_R, _W = selectors.EVENT_READ, selectors.EVENT_WRITE
_SWEEP_S = 0.25  # the selector wakes at least this often while handshakes are under way
LINGER_S = 0.005  # a worker waits this long for a served connection's next request (another worker free)
SLICE_S = 0.25  # seconds: a plain socket's receive deadline, after which patience is asked
STALL_S = 1.0  # seconds a frame may take, whatever its pace, while other connections wait
MIN_RATE = 1 << 20  # bytes per second a frame older than STALL_S must average while others wait


class TLSSlices:
    """A TLS socket as a frame reader's source: each receive waits at most ``slice_s`` (the
    reader's patience decides between slices, as for a plain socket), and the socket's
    timeout is ``rest_s`` again afterwards, for the replies sent on it. A timed-out TLS
    read leaves the connection usable: OpenSSL keeps a partial record for the next read."""

    __slots__ = ("sock", "slice_s", "rest_s")

    def __init__(self, sock: ssl.SSLSocket, slice_s: float, rest_s: float) -> None:
        self.sock, self.slice_s, self.rest_s = sock, slice_s, rest_s

    def recv_into(self, view, n: int = 0) -> int:
        s = self.sock
        s.settimeout(self.slice_s)
        try:
            return s.recv_into(view, n)
        finally:
            s.settimeout(self.rest_s)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


class Conn:
    """One accepted stream. ``sock``: the stream served (an ``ssl.SSLSocket`` under TLS);
    ``unix``: it came in on the Unix socket; ``session``: its set-up until it is done
    (:class:`protocol.session.ServerSession`); ``upgrade``: for a stream set up on its
    socket but served as another (``ucx://``: its rendezvous socket), what serves it on a
    thread of its own once it is set up; ``state``: what the server keeps for it once it
    is authenticated (its writer identity)."""

    __slots__ = ("sock", "unix", "tls", "session", "upgrade", "events", "authed", "closed", "state", "over_cap")

    def __init__(self, sock, unix: bool, tls: bool, session: ServerSession | None, over_cap: bool = False,
                 upgrade: Callable[["Conn"], None] | None = None) -> None:
        self.sock = sock
        self.unix = unix
        self.tls = tls
        self.session = session
        self.upgrade = upgrade
        self.events = 0  # what the selector watches it for (0: not registered)
        self.authed = False
        self.closed = False
        self.state: Any = None
        self.over_cap = over_cap  # accepted at the connection cap: admitted only in place of a handshake


class ConnPool:
    """Authenticates connections and hands readable ones to ``workers`` threads.

    ``opened(conn)`` runs (on the selector thread) once a connection is authenticated;
    ``serve(conn) -> bool`` (on a worker) serves it and returns whether to watch it again;
    ``closed(conn)`` runs once for every connection when it is closed; ``failed(err)`` counts
    a connection that failed TLS or the handshake (``err``: the AuthFailed, or an OSError);
    ``refuse(conn)`` tells a connection accepted at the cap that the server is full (its
    socket is closed after); ``max_conns``: the server's connection cap."""

    def __init__(self, workers: int, frame_timeout_s: float, tls: ssl.SSLContext | None, auth_key: dict[str, bytes] | None,
                 reject: Callable[[AuthFailed, bytes], bytes], opened: Callable[[Conn], None],
                 serve: Callable[[Conn], bool], closed: Callable[[Conn], None],
                 failed: Callable[[BaseException], None], refuse: Callable[[Conn], None] = lambda c: None,
                 max_conns: int = 1024) -> None:
        self.workers = workers
        self.frame_timeout_s = frame_timeout_s
        self._timeval = struct.pack("ll", int(frame_timeout_s), int(frame_timeout_s % 1 * 1e6))
        self.slice_s = slice_s = min(SLICE_S, frame_timeout_s)
        self._slice = struct.pack("ll", int(slice_s), int(slice_s % 1 * 1e6))
        self._tls, self._key, self._reject = tls, auth_key, reject
        self._not_tls = admission.not_tls("store node")
        self._opened, self._serve, self._closed, self._failed, self._refuse = opened, serve, closed, failed, refuse
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, _R, None)
        self._back: deque[Conn] = deque()  # new and parked connections for the selector to take
        self.admission: admission.Admission[Conn] = admission.Admission(max_conns)  # the selector's
        self._work: queue.SimpleQueue[Conn | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.conns: set[Conn] = set()
        self._idle = 0  # workers waiting for work (under _lock)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __len__(self) -> int:
        return len(self.conns)

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._select, daemon=True, name="kvpool-data-select")]
        self._threads += [threading.Thread(target=self._worker, daemon=True, name=f"kvpool-data-{i}")
                          for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop the threads and shut every connection down (blocked workers see EOF)."""
        self._stop.set()
        self._wake()
        for _ in range(self.workers):
            self._work.put(None)
        with self._lock:
            conns = list(self.conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)

    def add(self, sock: socket.socket, unix: bool, tcp: bool, over_cap: bool = False,
            upgrade: Callable[[Conn], None] | None = None) -> None:
        """Take a freshly accepted socket (any thread); its set-up starts on the selector.
        ``over_cap``: the server is at its connection cap, so the socket is admitted only in
        place of a connection still in its handshake, and refused otherwise. ``upgrade``: see
        :class:`Conn` (no TLS: TLS is for ``tcp://`` only)."""
        sock.setblocking(False)
        tls = tcp and upgrade is None and self._tls is not None
        if tls:
            sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        hs = auth.ServerHandshake(self._key, auth.DATA, self._reject) if self._key is not None else None
        session = None
        if tls or hs is not None:  # a plaintext TCP port with a secret tells TLS clients so at once
            session = ServerSession(sock, tls, hs, self._not_tls if tcp and upgrade is None else None)
        c = Conn(sock, unix, tls, session, over_cap, upgrade)
        with self._lock:
            self.conns.add(c)
        self._back.append(c)
        self._wake()

    def handshaking(self) -> bool:
        """Whether connections may be in their handshake (any thread; the selector checks)."""
        return self.admission.handshaking() > 0

    def close(self, c: Conn) -> None:
        """Close ``c`` (by its current owner)."""
        if c.closed:
            return
        c.closed = True
        if not c.authed:  # (only the selector thread closes connections in their handshake)
            self.admission.done(c)
        with self._lock:
            self.conns.discard(c)
        with contextlib.suppress(OSError):
            c.sock.close()
        self._closed(c)

    # ---- the selector thread ------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"\0")

    def _select(self) -> None:
        sel = self._sel
        while not self._stop.is_set():
            timeout = _SWEEP_S if self.admission.handshaking() else None
            for key, ev in sel.select(timeout):
                c = key.data
                if c is None:
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                elif c.authed:
                    self._unwatch(c)
                    self._work.put(c)
                else:
                    self._step(c)
            while self._back:
                c = self._back.popleft()
                if c.closed:
                    continue
                if c.authed:
                    self._watch(c, _R)
                elif c.over_cap and not self._make_room():
                    self._refuse(c)
                    self.close(c)
                else:
                    self.admission.start(c, time.monotonic())
                    self._step(c)
            for c in self.admission.expired(time.monotonic()):
                self._fail(c, AuthFailed("peer did not finish the cluster-secret handshake in time", cause="timeout"))
        for key in list(sel.get_map().values()):
            if key.data is not None:
                self.close(key.data)
        sel.close()

    def _make_room(self) -> bool:
        """At the cap: close the oldest connection still in its handshake; False when there is none."""
        admitted, victim = self.admission.admit(self.admission.max_conns)
        if victim is not None:
            self._fail(victim, AuthFailed("closed in its handshake to make room at the connection cap "
                                          "(security.max_conns)", cause="evicted"))
        return admitted

    def _watch(self, c: Conn, events: int) -> None:
        if c.events == events:
            return
        if c.events:
            self._sel.modify(c.sock, events, c)
        else:
            self._sel.register(c.sock, events, c)
        c.events = events

    def _unwatch(self, c: Conn) -> None:
        if c.events:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(c.sock)
            c.events = 0

    def _fail(self, c: Conn, err: BaseException) -> None:
        self._unwatch(c)
        self._failed(err)
        self.close(c)

    def _step(self, c: Conn) -> None:
        """Advance ``c``'s set-up as far as its socket allows; once done, serve it."""
        s = c.sock
        if c.session is not None:
            try:
                got = c.session.step()
            except (AuthFailed, OSError) as e:  # ssl.SSLError is an OSError
                return self._fail(c, e)
            if got == WANT_READ:
                return self._watch(c, _R)
            if got == WANT_WRITE:
                return self._watch(c, _W)
            c.session = None  # nothing lies past the proof: the handshake is read no further than its steps
        self._unwatch(c)
        if c.upgrade is not None:  # served as another stream, on a thread of its own
            self.admission.done(c)
            c.authed = True
            self._opened(c)
            threading.Thread(target=c.upgrade, args=(c,), daemon=True, name="kvpool-data-stream").start()
            return None
        try:
            s.setblocking(True)
            if c.tls:
                s.settimeout(self.frame_timeout_s)
            else:  # kernel deadlines: no extra poll per call
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._slice)  # patience() decides
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, self._timeval)
        except OSError as e:
            return self._fail(c, e)
        self.admission.done(c)
        c.authed = True
        self._opened(c)
        if c.tls and s.pending():
            self._work.put(c)  # requests pipelined after the proof, already decrypted
        else:
            self._watch(c, _R)

    # ---- workers ------------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            c = self._work.get()
            with self._lock:
                self._idle -= 1
            if c is None:
                return
            try:
                keep = self._serve(c)
                while keep and self._idle and not self._stop.is_set() and self._linger(c):
                    keep = self._serve(c)
            except Exception:  # a bug must not cost the pool a worker
                _log.exception("storenode: data connection failed")
                keep = False
            if not keep:
                self.close(c)
            elif self._stop.is_set():
                self.close(c)
            elif c.tls and c.sock.pending():
                self._work.put(c)
            else:
                self._back.append(c)
                self._wake()

    def patience(self, seconds: float, got: int) -> bool:
        """Whether a worker keeps waiting for a frame begun ``seconds`` ago that brought
        ``got`` bytes so far (module docstring): within ``frame_timeout_s`` while no
        connection waits for a worker; once one waits, only a frame younger than STALL_S
        or averaging MIN_RATE bytes per second."""
        if seconds < STALL_S:
            return True
        if seconds >= self.frame_timeout_s:
            return False
        return self._work.empty() or got >= MIN_RATE * seconds

    @staticmethod
    def _linger(c: Conn) -> bool:
        """``c`` has more to read within LINGER_S."""
        if c.tls and c.sock.pending():
            return True
        p = select.poll()
        p.register(c.sock.fileno(), select.POLLIN)
        return bool(p.poll(LINGER_S * 1000))
