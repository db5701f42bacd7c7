"""Connection limits for ``kvpool proxy`` in front of aiohttp's HTTP server.

aiohttp bounds a request's size but not how long a client may take to send its request
head, nor how many connections it holds. :class:`ConnectionGuard` wraps the server's
protocol factory (an :class:`asyncio.Protocol` per connection, delegating to aiohttp's
``RequestHandler``) and adds:

* a head deadline: a connection that has not delivered a complete request head within
  ``head_timeout_s`` seconds of opening, or of its previous response plus aiohttp's
  keep-alive time, is closed (slow-header clients cannot pin connections). The deadline
  runs from the connection's opening, whatever bytes trickle in meanwhile;
* a cap on open connections, ``max_conns``. A connection is *waiting* while it owes a
  request head (just opened, or idle between keep-alive requests). One more past the cap
  takes the place of the oldest waiting connection (one that never sent a request first,
  then an idle keep-alive one), which is closed; only when every connection is busy with a
  request does the newcomer get ``503`` and close. So thousands of silent sockets cannot
  lock out a client that sends its request at once;
* a per-peer share: one peer address holds at most ``max_waiting_per_peer`` connections
  that never sent a request; its next one closes its own oldest such connection.

An idle keep-alive connection is evicted only after :data:`KEPT_GRACE_S` of idleness, so
a response still being written is not cut.

All count in ``kvpool_proxy_connections_refused_total{reason}`` (``max_conns``,
``head_timeout``, ``evicted``, ``peer_waiting``). Event-loop thread only.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

KEPT_GRACE_S = 1.0  # an idle keep-alive connection is evicted only after this long idle (seconds)

_BODY = b'{"error": {"message": "the proxy holds its maximum of connections", "type": "overloaded", "code": 503}}'
_FULL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Content-Length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class ConnectionGuard:
    """``factory()`` is the protocol factory for ``loop.create_server``; ``seen(t)`` marks
    that transport ``t`` delivered a request head, ``idle(t)`` that it answered one (the
    next head is due within ``head_timeout_s`` plus ``keepalive_s``). ``refused``: a
    prometheus Counter with a ``reason`` label."""

    def __init__(self, server, max_conns: int, head_timeout_s: float, keepalive_s: float, refused,
                 max_waiting_per_peer: int | None = None) -> None:
        self.server, self.max_conns = server, max_conns
        self.head_timeout_s, self.keepalive_s = head_timeout_s, keepalive_s
        self.max_waiting_per_peer = max_waiting_per_peer or max(1, max_conns // 4)
        self.refused = refused
        self.open = 0
        # transports owing a request head -> (deadline, peer, since), oldest first: the fresh
        # ones (never sent a request) apart from idle keep-alive ones, which are evicted last
        self.fresh: OrderedDict[asyncio.BaseTransport, tuple[float, str, float]] = OrderedDict()
        self.kept: OrderedDict[asyncio.BaseTransport, tuple[float, str, float]] = OrderedDict()
        self.by_peer: dict[str, OrderedDict[asyncio.BaseTransport, None]] = {}  # fresh ones per peer

    @property
    def due(self) -> dict:
        """Every waiting transport and its deadline (for tests and metrics)."""
        return {t: v[0] for t, v in [*self.fresh.items(), *self.kept.items()]}

    def factory(self) -> asyncio.Protocol:
        return _Guarded(self)

    def seen(self, transport) -> None:
        self._unwait(transport)

    def idle(self, transport) -> None:
        if transport is not None and not transport.is_closing():
            self._unwait(transport)
            now = time.monotonic()
            self.kept[transport] = (now + self.head_timeout_s + self.keepalive_s, "", now)

    def opened(self, t) -> None:
        """A new connection owes its first request head within ``head_timeout_s``."""
        peer = _peer(t)
        mine = self.by_peer.setdefault(peer, OrderedDict())
        if len(mine) >= self.max_waiting_per_peer:  # this peer's share is full: its own oldest goes
            self._evict(next(iter(mine)), "peer_waiting")
        now = time.monotonic()
        self.fresh[t] = (now + self.head_timeout_s, peer, now)
        mine[t] = None

    def _unwait(self, t) -> None:
        got = self.fresh.pop(t, None)
        if got is not None:
            mine = self.by_peer.get(got[1])
            if mine is not None:
                mine.pop(t, None)
                if not mine:
                    del self.by_peer[got[1]]
        else:
            self.kept.pop(t, None)

    def _evict(self, t, reason: str) -> None:
        self._unwait(t)
        self.refused.labels(reason).inc()
        t.close()

    def make_room(self) -> bool:
        """At the cap: close the oldest waiting connection (fresh ones first). False when
        every connection is busy with a request."""
        if self.fresh:
            self._evict(next(iter(self.fresh)), "evicted")
            return True
        if self.kept:
            t, (_, _, since) = next(iter(self.kept.items()))
            if time.monotonic() - since >= KEPT_GRACE_S:
                self._evict(t, "evicted")
                return True
        return False

    async def sweep(self, every_s: float = 0.5) -> None:
        """Close the connections past their head deadline, until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for where in (self.fresh, self.kept):
                for t, (deadline, _, _) in list(where.items()):
                    if now > deadline:
                        self._evict(t, "head_timeout")


def _peer(transport) -> str:
    addr = transport.get_extra_info("peername")
    return str(addr[0]) if isinstance(addr, tuple) and addr else "?"


class _Guarded(asyncio.Protocol):
    def __init__(self, guard: ConnectionGuard) -> None:
        self.g = guard
        self.inner = None
        self.transport = None

    def connection_made(self, transport) -> None:
        g = self.g
        if g.open >= g.max_conns and not g.make_room():
            g.refused.labels("max_conns").inc()
            transport.write(_FULL)
            transport.close()
            return
        g.open += 1
        self.transport = transport
        g.opened(transport)
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
        self.g._unwait(self.transport)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
