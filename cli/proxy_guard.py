"""Connection limits for ``kvpool proxy`` in front of aiohttp's HTTP server.

aiohttp bounds a request's size but not how long a client may take to send its request
head, nor how many connections it holds. :class:`ConnectionGuard` wraps the server's
protocol factory (an :class:`asyncio.Protocol` per connection, delegating to aiohttp's
``RequestHandler``) and adds:

* a cap on open connections: one past ``max_conns`` gets ``503`` and is closed at once;
* a head deadline: a connection that has not delivered a complete request head within
  ``head_timeout_s`` seconds of opening, or of its previous response plus aiohttp's
  keep-alive time, is closed (slow-header clients cannot pin connections).

Both count in ``kvpool_proxy_connections_refused_total{reason}``. Event-loop thread only.
"""
from __future__ import annotations

import asyncio
import time

_BODY = b'{"error": {"message": "the proxy holds its maximum of connections", "type": "overloaded", "code": 503}}'
_FULL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Content-Length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class ConnectionGuard:
    """``factory()`` is the protocol factory for ``loop.create_server``; ``seen(t)`` marks
    that transport ``t`` delivered a request head, ``idle(t)`` that it answered one (the
    next head is due within ``head_timeout_s`` plus ``keepalive_s``)."""

    def __init__(self, server, max_conns: int, head_timeout_s: float, keepalive_s: float, refused) -> None:
        self.server, self.max_conns = server, max_conns
        self.head_timeout_s, self.keepalive_s = head_timeout_s, keepalive_s
        self.refused = refused  # Counter with a "reason" label
        self.open = 0
        self.due: dict[asyncio.BaseTransport, float] = {}  # transports owing a request head, by deadline

    def factory(self) -> asyncio.Protocol:
        return _Guarded(self)

    def seen(self, transport) -> None:
        self.due.pop(transport, None)

    def idle(self, transport) -> None:
        if transport is not None and not transport.is_closing():
            self.due[transport] = time.monotonic() + self.head_timeout_s + self.keepalive_s

    async def sweep(self, every_s: float = 0.5) -> None:
        """Close the connections past their head deadline, until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for t, deadline in list(self.due.items()):
                if now > deadline:
                    self.due.pop(t, None)
                    self.refused.labels("head_timeout").inc()
                    t.close()


class _Guarded(asyncio.Protocol):
    def __init__(self, guard: ConnectionGuard) -> None:
        self.g = guard
        self.inner = None
        self.transport = None

    def connection_made(self, transport) -> None:
        g = self.g
        if g.open >= g.max_conns:
            g.refused.labels("max_conns").inc()
            transport.write(_FULL)
            transport.close()
            return
        g.open += 1
        self.transport = transport
        g.due[transport] = time.monotonic() + g.head_timeout_s
        self.inner = g.server()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc) -> None:
        if self.inner is None:
            return
        self.g.open -= 1
        self.g.due.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
