"""The store node's control channel: the masters' notices (commit, free, list, copy) on a zmq
ROUTER socket, served on a thread of its own.

One blocking thread owns the socket (zmq sockets are not thread-safe): it waits on the
socket and on an inproc wake-up pipe, hands every well-framed message to ``handle(ident,
body)`` and sends back what that returns. Work that must not hold the channel up (a replica
copy to another node) runs elsewhere and answers through :meth:`ControlChannel.reply_later`,
whose replies this thread sends. A plain thread instead of an asyncio socket: a notice
costs one ``recv`` and a decode, not a trip through the event loop's handlers, and the
masters send one per commit batch.

With a cluster secret the socket is a CURVE server that admits only the masters' key
(derived from the secret, :func:`protocol.auth.curve_client_public`), checked by pyzmq's
ZAP authenticator thread; messages over ``max_msg`` bytes drop their peer's connection.
"""
from __future__ import annotations

import hmac
import logging
import threading
from collections import deque
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvpool.protocol import auth, transport
from kvpool.protocol.auth import Security
from kvpool.protocol.errors import ConfigError

log = logging.getLogger("kvpool.storenode")
_POLL_MS = 200  # the thread looks at its stop flag at least this often (milliseconds)


class _MasterKey:
    """ZAP credentials check: the one CURVE client key allowed (the masters', derived from the secret)."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


class ControlChannel:
    """Bind the control socket on ``host`` (``port`` 0: any free port) and serve it on a
    thread once :meth:`start` runs. ``handle(ident, body)`` runs on that thread for each
    message and returns the reply's bytes or None (no reply). Raises ConfigError when the
    port cannot be bound."""

    def __init__(self, host: str, port: int, security: Security, max_msg: int,
                 handle: Callable[[bytes, bytes], bytes | None]) -> None:
        self.handle = handle
        self.ctx = zmq.Context()
        self._zap: ThreadAuthenticator | None = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg)  # a larger message drops its peer's connection
        if security.secret is not None:  # CURVE: only the masters' derived key gets in
            self._zap = ThreadAuthenticator(self.ctx)
            self._zap.start()
            self._zap.configure_curve_callback("*", _MasterKey(auth.curve_client_public(security)))
            auth.curve_server(self.sock, security)
        bind = f"tcp://{transport.host_port(host, 0)}"[:-2]  # tcp://host (IPv6 in brackets)
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
        try:
            if port:
                self.sock.bind(f"{bind}:{port}")
            else:
                port = self.sock.bind_to_random_port(bind)
        except zmq.ZMQError as e:
            self.close()
            raise ConfigError(f"storenodes[].control_port: cannot bind {bind}:{port} ({e}); pick a free port or 0 "
                              "for any", key="storenodes[].control_port") from None
        self.addr = f"{bind}:{port}"
        name = f"inproc://kvpool-control-wake-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(name)
        self._wake_tx = self.ctx.socket(zmq.PUSH)
        self._wake_tx.connect(name)
        self._wake_lock = threading.Lock()  # PUSH is used from other threads: one at a time
        self._later: deque[tuple[bytes, bytes]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvpool-control", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def reply_later(self, ident: bytes, body: bytes) -> None:
        """Queue a reply from another thread; the channel's thread sends it."""
        self._later.append((ident, body))
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # closed (stopping) or already full of wake-ups

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        sock = self.sock
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(_POLL_MS))
                if self._wake_rx in ready:
                    while True:
                        try:
                            self._wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                while self._later:
                    sock.send_multipart(self._later.popleft(), zmq.NOBLOCK)
                if sock not in ready:
                    continue
                for _ in range(256):  # what arrived meanwhile, then a look at the queued replies
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 2:
                        continue  # not our framing (identity, body): drop it, keep serving
                    out = self.handle(frames[0], frames[1])
                    if out is not None:
                        sock.send_multipart([frames[0], out], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                if self._stop.is_set() or e.errno == zmq.ETERM:
                    return
                log.warning("storenode: control channel: %s", e)  # e.g. a reply to a peer that left
            except Exception:  # a bug must cost one message, not the channel
                log.exception("storenode: control message failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * _POLL_MS / 1000 + 1)
        for s in (getattr(self, "_wake_tx", None), getattr(self, "_wake_rx", None), self.sock):
            if s is not None:
                s.close(0)
        if self._zap is not None:
            self._zap.stop()
        self.ctx.term()
