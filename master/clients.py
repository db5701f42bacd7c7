"""The master's client connections: accept, read, answer in order, send, with bounds.

One :class:`ClientConns` lives on the master's RPC thread and shares its poller (a
``zmq.Poller``, which also watches the store nodes' zmq sockets). Requests are framed by
:mod:`protocol.rpcwire`; each connection is non-blocking and pipelined: everything that
arrived together is parsed, answered in order, and the replies go out in one ``send``.

Bounds, so one client cannot stall the master or grow its memory:

* at most :data:`BUDGET` requests of one client are answered per loop turn (the rest
  wait in ``busy`` for the next turn, after the other clients had theirs);
* a client with :data:`OUT_MAX` bytes of unsent replies, or :data:`PENDING_MAX` parsed
  and unanswered requests, is not read until it catches up;
* a corrupt frame length is answered (after the requests before it, durable ones
  included) and the connection closed, since its stream position can no longer be trusted;
* the connection cap, the handshake deadline and the refusals are the rules every port
  shares (:mod:`protocol.admission`): at most ``max_conns`` connections, one accepted at
  the cap in place of the oldest still in its handshake, TLS and the cluster-secret
  handshake (:mod:`protocol.auth`, when configured) within ``auth.HANDSHAKE_S`` before any
  request is read (a connection buffers at most the handshake's 69 bytes meanwhile), a
  TLS client on a plaintext master told so at once. A request frame half-sent for
  :data:`FRAME_TIMEOUT_S` with no whole frame meanwhile closes its connection.
  ``refusals`` counts the connections closed for each reason (the master exports it).

``before_send`` runs before any reply leaves: the master sends its queued frees (and any
notice but a commit) to the store nodes there, so no reply can place a writer over memory
whose free is still queued (commits wait up to a few milliseconds, master/nodes.py).

Answering is ``handle(body, role) -> encoded Reply | Pending | SlicedBatch`` (``role``: the
peer's, from its handshake); a :class:`~master.durable.Pending` is answered later through
:meth:`ClientConns.answer`, when its etcd write lands; a :class:`~master.batches.SlicedBatch`
is stepped once per loop turn until it gives its reply.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable

import zmq

from kvpool.master.batches import SlicedBatch
from kvpool.master.durable import Pending
from kvpool.protocol import messages as M
from kvpool.protocol import rpcwire
from kvpool.protocol import admission, auth
from kvpool.protocol.errors import AuthFailed, KVPoolError
from kvpool.protocol.session import BIOStream, ServerSession

OUT_MAX = 16 << 20  # bytes of unsent replies after which a client's requests wait
PENDING_MAX = 4096  # parsed, unanswered requests after which a client is not read
BUDGET = 64  # requests answered per client per loop turn (the others get their turn)
FRAME_TIMEOUT_S = 30.0  # a request frame left half-sent this long (no whole frame meanwhile) closes its client
HELLO_RID = (1 << 64) - 1  # request id of a client's first request (its Hello, connector/rpc.py)
NOT_TLS = admission.not_tls("master")  # sent to a TLS client of a plaintext master, then closed
_log = logging.getLogger("kvpool.master")

_IN, _OUT, _ERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)  # plain ints: enum ops are slow


class Client:
    """One client connection: its frame parser, requests not answered yet (in order) and
    the reply bytes not sent yet; until it is set up, its :class:`~protocol.session.ServerSession`."""

    __slots__ = ("sock", "parser", "pending", "waiting", "out", "closing", "closed", "session", "tls",
                 "partial_since", "role", "batch", "batch_rid")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = rpcwire.FrameParser()
        self.pending: deque = deque()
        self.waiting = 0  # requests answered later (durable writes); a closing connection waits for them
        self.out = bytearray()
        self.closing = False
        self.closed = False
        self.session: ServerSession | None = None  # TLS, the secret handshake, the first bytes: until done
        self.tls: BIOStream | None = None  # TLS over memory BIOs (the socket stays non-blocking)
        self.partial_since: float | None = None  # a frame has been half-received since then
        self.role = "cluster"  # what the peer's credential allows (protocol/auth.py, "Roles"); open: all
        self.batch: SlicedBatch | None = None  # a big batch being answered a slice per turn (master/batches.py)
        self.batch_rid = 0

    def queued(self) -> int:
        """Reply bytes not sent yet (encrypted ones included)."""
        return len(self.out) + (len(self.tls.raw) if self.tls is not None else 0)


def _reject(err: KVPoolError, head: bytes) -> bytes:
    """``err`` as the reply to the first request of a client that sent no handshake."""
    rid = rpcwire.HEAD.unpack_from(head)[1] if len(head) >= rpcwire.HEAD.size else 0
    return rpcwire.pack(rid, M.encode(M.Reply(error=err.to_wire())))


class ClientConns:
    """Every client connection of ``listeners`` (TCP, and the same-host abstract Unix socket
    that :class:`~protocol.messages.HelloReply` offers)."""

    def __init__(self, listeners: list[socket.socket], poller: zmq.Poller,
                 handle: Callable[[bytes, str], bytes | Pending | SlicedBatch], before_send: Callable[[], None] = lambda: None,
                 security: auth.Security = auth.OPEN, max_conns: int = 1024,
                 frame_timeout_s: float = FRAME_TIMEOUT_S) -> None:
        self.security = security
        self.tls_ctx = security.server_context()
        self._auth_key = security.auth_keys() if security.secret is not None else None
        self.max_conns = max_conns
        self.frame_timeout_s = frame_timeout_s
        self.admission: admission.Admission[Client] = admission.Admission(max_conns)
        self.refusals = self.admission.refusals  # closed connections by reason (a metric)
        self._swept = 0.0
        self.listeners = {lst.fileno(): lst for lst in listeners}
        self.poller = poller
        self.handle = handle
        self.before_send = before_send  # runs before replies go out (the master flushes node notices)
        self.clients: dict[int, Client] = {}  # by fd
        self.busy: set[Client] = set()  # clients with requests left after their turn
        self._rbuf = memoryview(bytearray(1 << 20))  # receive buffer shared by all connections
        self._accept_warned = self._tls_warned = 0.0
        for lst in listeners:
            lst.setblocking(False)
            poller.register(lst, _IN)

    def on_event(self, fd: int, ev: int) -> Client | None:
        """Serve a poll event on ``fd`` (a listener or a client); the client served, if any."""
        lst = self.listeners.get(fd)
        if lst is not None:
            self._accept(lst)
            return None
        c = self.clients.get(fd)
        if c is not None:
            self._serve(c, ev)
        return c

    def work_busy(self, served: set[Client]) -> None:
        """Give clients with requests left from their last turn (and not just served) another;
        then, at most every 0.25 s, close connections past their deadlines (:meth:`sweep`)."""
        for c in list(self.busy - served):
            self._work(c)
        now = time.monotonic()
        if now - self._swept >= 0.25:
            self._swept = now
            self.sweep(now)

    def sweep(self, now: float) -> None:
        """Close connections that did not authenticate within ``auth.HANDSHAKE_S``, or hold a
        frame half-received for ``frame_timeout_s`` (no whole frame arrived meanwhile)."""
        for c in self.admission.expired(now):
            self._close(c)
        for c in list(self.clients.values()):
            if c.partial_since is not None and now - c.partial_since > self.frame_timeout_s:
                self.refusals["frame_timeout"] += 1
                _log.warning("master: closed a client that left a request frame half-sent for %.0f s",
                             now - c.partial_since)
                self._close(c)

    def answer(self, c: Client, rid: int, reply: bytes) -> None:
        """Queue and send a late reply (a durable write's answer) if ``c`` still listens."""
        c.waiting -= 1
        if c.closed:
            return
        if rid != rpcwire.ONE_WAY:
            c.out += rpcwire.pack(rid, reply)
        self._send(c)

    def close_all(self) -> None:
        for c in list(self.clients.values()):
            self._close(c)
        for lst in self.listeners.values():
            lst.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of fds, aborted handshake: keep serving the others
                if e.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    now = time.monotonic()
                    if now - self._accept_warned > 10:
                        self._accept_warned = now
                        logging.getLogger("kvpool.master").warning(
                            "master: accept failed: %s; raise the open-file limit (ulimit -n)", e)
                    time.sleep(0.01)  # the listener stays readable: do not spin on it
                return
            sock.setblocking(False)
            tcp = sock.family != socket.AF_UNIX
            if tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            admitted, victim = self.admission.admit(len(self.clients))
            if victim is not None:
                self._close(victim)
            if not admitted:
                self._refuse(sock, tcp)
                continue
            c = Client(sock)
            if tcp and self.tls_ctx is not None:
                c.tls = BIOStream(sock, self.tls_ctx)
            hs = auth.ServerHandshake(self._auth_key, auth.RPC, _reject) if self._auth_key is not None else None
            if c.tls is not None or hs is not None or tcp:
                c.session = ServerSession(c.tls or sock, c.tls is not None, hs, NOT_TLS if tcp else None)
            if c.tls is not None or hs is not None:
                self.admission.start(c, time.monotonic())
            self.clients[sock.fileno()] = c
            self.poller.register(sock, _IN)

    def _refuse(self, sock: socket.socket, tcp: bool) -> None:
        """Over the connection cap: say so (unless under TLS) and close."""
        admission.refuse(sock, admission.overloaded("the master", self.max_conns), secret=self._auth_key is not None,
                         tls=tcp and self.tls_ctx is not None,
                         framed=lambda err: _reject(err, rpcwire.HEAD.pack(0, HELLO_RID)))

    def _warn_tls(self) -> None:
        """A TLS client on this plaintext master (told so by its session): warn, at most every 10 s."""
        now = time.monotonic()
        if now - self._tls_warned > 10:
            self._tls_warned = now
            _log.warning("master: a client opened TLS on this plaintext port; configure security.tls_cert and "
                         "security.tls_key here, or turn TLS off on the client (security.tls_ca)")

    def _close(self, c: Client) -> None:
        self.admission.done(c)
        self.clients.pop(c.sock.fileno(), None)
        self.busy.discard(c)
        c.closed = True
        with contextlib.suppress(KeyError):
            self.poller.unregister(c.sock)
        with contextlib.suppress(OSError):
            c.sock.close()

    def _serve(self, c: Client, ev: int) -> None:
        """Read what the connection has (unless it is already far behind), then answer."""
        if ev & (_IN | _ERR) and not c.closing and len(c.pending) < PENDING_MAX:
            if c.session is not None:
                return self._set_up(c)
            try:
                got = c.sock.recv_into(self._rbuf)
            except (BlockingIOError, InterruptedError):
                got = -1
            except OSError:
                return self._close(c)
            if got == 0:
                return self._close(c)
            if got > 0:
                data = self._rbuf[:got]
                if c.tls is not None:
                    try:
                        data = c.tls.decrypt(data)
                    except ssl.SSLZeroReturnError:  # the peer closed its TLS session
                        return self._close(c)
                    except (ssl.SSLError, OSError):
                        self.refusals["tls"] += 1
                        return self._close(c)
                self._parse(c, data)
        self._work(c)

    def _set_up(self, c: Client) -> None:
        """Step ``c``'s session (protocol/session.py); once it is done, serve what came after it."""
        try:
            got = c.session.step()
        except AuthFailed as e:
            cause = e.fields.get("cause")
            if cause == "tls":
                self._warn_tls()
            if cause != "closed":
                self.refusals["tls" if cause == "tls" else "auth"] += 1
            return self._close(c)
        except ssl.SSLError:
            self.refusals["tls"] += 1
            return self._close(c)
        except OSError:
            return self._close(c)
        if isinstance(got, int):  # waiting for the peer: send the handshake's flight, if any
            return self._send(c)
        c.role, c.session = c.session.role, None
        self.admission.done(c)
        if c.tls is not None:
            try:
                got += c.tls.decrypt(b"")  # requests pipelined after the handshake, already in TLS's buffer
            except (ssl.SSLError, OSError):
                return self._close(c)
        if got:
            self._parse(c, got)
        self._work(c)

    def _parse(self, c: Client, data) -> None:
        frames = c.parser.feed(data)
        c.pending.extend(frames)
        if not c.parser.partial:
            c.partial_since = None
        elif frames or c.partial_since is None:
            c.partial_since = time.monotonic()
        if c.parser.error is not None:  # a corrupt length: answer what came before it, then it, then hang up
            c.pending.append((int(c.parser.error.fields.get("rid", 0)), c.parser.error))
            c.closing = True

    def _work(self, c: Client) -> None:
        """Answer up to :data:`BUDGET` of ``c``'s requests while its unsent replies stay under
        :data:`OUT_MAX`, send what can be sent, and poll it for what it needs next. A big
        batch goes one slice per turn, and the client's later requests wait behind it."""
        budget = BUDGET
        while (c.pending or c.batch is not None) and budget and c.queued() < OUT_MAX:
            budget -= 1
            if c.batch is None:
                rid, body = c.pending.popleft()
                reply = (M.encode(M.Reply(error=body.to_wire())) if isinstance(body, KVPoolError)
                         else self.handle(body, c.role))
                if isinstance(reply, SlicedBatch):
                    c.batch, c.batch_rid = reply, rid
            if c.batch is not None:
                rid, reply = c.batch_rid, c.batch.step()
                if reply is None:
                    break  # its next slice waits for the next turn: the other clients go first
                c.batch = None
            if isinstance(reply, Pending):
                reply.client, reply.rid = c, rid
                c.waiting += 1
            elif rid != rpcwire.ONE_WAY:
                c.out += rpcwire.pack(rid, reply)
        if (c.pending or c.batch is not None) and c.queued() < OUT_MAX:
            self.busy.add(c)
        else:
            self.busy.discard(c)
        self._send(c)

    def _send(self, c: Client) -> None:
        if c.closed:
            return
        tls = c.tls
        if c.out or tls is not None and tls.pending:
            if c.out:
                self.before_send()
            buf = c.out
            if tls is not None:  # replies go through TLS into its raw buffer
                try:
                    tls.encrypt(c.out)
                except ssl.SSLError:
                    return self._close(c)
                c.out.clear()
                buf = tls.raw
            try:
                sent = c.sock.send(buf)
                del buf[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return self._close(c)
        queued = c.queued()
        if c.closing and not queued and not c.pending and not c.waiting and c.batch is None:
            return self._close(c)
        want_in = not c.closing and len(c.pending) < PENDING_MAX and queued < OUT_MAX
        self.poller.modify(c.sock, (_IN if want_in else 0) | (_OUT if queued else 0))
