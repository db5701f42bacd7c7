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
  included) and the connection closed, since its stream position can no longer be trusted.

``before_send`` runs before any reply leaves: the master flushes its notices to store nodes
there, so a put is acknowledged only after its commit notice was handed to the node socket.

Answering is ``handle(body) -> encoded Reply | Pending``; a :class:`~master.durable.Pending`
is answered later through :meth:`ClientConns.answer`, when its etcd write lands.
"""
from __future__ import annotations

import contextlib
import errno
import socket
import sys
import time
from collections import deque
from collections.abc import Callable

import zmq

from kvpool.master.durable import Pending
from kvpool.protocol import messages as M
from kvpool.protocol import rpcwire
from kvpool.protocol.errors import KVPoolError

OUT_MAX = 16 << 20  # bytes of unsent replies after which a client's requests wait
PENDING_MAX = 4096  # parsed, unanswered requests after which a client is not read
BUDGET = 64  # requests answered per client per loop turn (the others get their turn)

_IN, _OUT, _ERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)  # plain ints: enum ops are slow


class Client:
    """One client connection: its frame parser, requests not answered yet (in order) and
    the reply bytes not sent yet."""

    __slots__ = ("sock", "parser", "pending", "waiting", "out", "closing", "closed")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = rpcwire.FrameParser()
        self.pending: deque = deque()
        self.waiting = 0  # requests answered later (durable writes); a closing connection waits for them
        self.out = bytearray()
        self.closing = False
        self.closed = False


class ClientConns:
    """Every client connection of ``listeners`` (TCP, and the same-host abstract Unix socket
    that :class:`~protocol.messages.HelloReply` offers)."""

    def __init__(self, listeners: list[socket.socket], poller: zmq.Poller,
                 handle: Callable[[bytes], bytes | Pending], before_send: Callable[[], None] = lambda: None) -> None:
        self.listeners = {lst.fileno(): lst for lst in listeners}
        self.poller = poller
        self.handle = handle
        self.before_send = before_send  # runs before replies go out (the master flushes node notices)
        self.clients: dict[int, Client] = {}  # by fd
        self.busy: set[Client] = set()  # clients with requests left after their turn
        self._rbuf = memoryview(bytearray(1 << 20))  # receive buffer shared by all connections
        self._accept_warned = 0.0
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
        """Give clients with requests left from their last turn (and not just served) another."""
        for c in list(self.busy - served):
            self._work(c)

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
                        print(f"master: accept failed: {e}; raise the open-file limit (ulimit -n)",
                              file=sys.stderr, flush=True)
                    time.sleep(0.01)  # the listener stays readable: do not spin on it
                return
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.clients[sock.fileno()] = Client(sock)
            self.poller.register(sock, _IN)

    def _close(self, c: Client) -> None:
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
            try:
                got = c.sock.recv_into(self._rbuf)
            except (BlockingIOError, InterruptedError):
                got = -1
            except OSError:
                return self._close(c)
            if got == 0:
                return self._close(c)
            if got > 0:
                c.pending.extend(c.parser.feed(self._rbuf[:got]))
                if c.parser.error is not None:  # a corrupt length: answer what came before it, then it, then hang up
                    c.pending.append((int(c.parser.error.fields.get("rid", 0)), c.parser.error))
                    c.closing = True
        self._work(c)

    def _work(self, c: Client) -> None:
        """Answer up to :data:`BUDGET` of ``c``'s requests while its unsent replies stay under
        :data:`OUT_MAX`, send what can be sent, and poll it for what it needs next."""
        budget = BUDGET
        while c.pending and budget and len(c.out) < OUT_MAX:
            budget -= 1
            rid, body = c.pending.popleft()
            reply = M.encode(M.Reply(error=body.to_wire())) if isinstance(body, KVPoolError) else self.handle(body)
            if isinstance(reply, Pending):
                reply.client, reply.rid = c, rid
                c.waiting += 1
            elif rid != rpcwire.ONE_WAY:
                c.out += rpcwire.pack(rid, reply)
        if c.pending and len(c.out) < OUT_MAX:
            self.busy.add(c)
        else:
            self.busy.discard(c)
        self._send(c)

    def _send(self, c: Client) -> None:
        if c.closed:
            return
        if c.out:
            self.before_send()
            try:
                sent = c.sock.send(c.out)
                del c.out[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return self._close(c)
        if c.closing and not c.out and not c.pending and not c.waiting:
            return self._close(c)
        want_in = not c.closing and len(c.pending) < PENDING_MAX and len(c.out) < OUT_MAX
        self.poller.modify(c.sock, (_IN if want_in else 0) | (_OUT if c.out else 0))
