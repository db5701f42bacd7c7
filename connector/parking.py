"""Connections of threads that ended, kept for the next thread.

The client opens its connections per thread (one master connection, one stream per store
node), so that concurrent calls never share a socket. A thread that makes one call and ends
used to close them, and every TCP connection this side closes leaves a socket in TIME_WAIT
for a minute (RFC 9293 §3.6.1): a caller running each request on a fresh thread piled up
two per request. Instead, a thread's connections are held through a :class:`Parking`; when
the thread ends (its thread-local storage goes), they are parked, and the next thread that
dials the same address takes one of them. A parked connection the peer closed meanwhile
fails on its first use like any broken connection, and the caller dials again.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any


class _Holder:
    """The thread-local slot's value: what the thread holds (``value``); when the holder
    goes with its thread, its finalizer parks what ``value`` still holds."""

    __slots__ = ("value", "fin", "__weakref__")


class Parking:
    """Up to ``keep`` idle connections per address, taken by threads that need one.

    ``items(value)`` lists the ``(address, connection)`` pairs a held value still holds (a
    dict of streams, or one connection); ``close(connection)`` closes one that is not kept."""

    def __init__(self, items: Callable[[Any], Iterable[tuple[str, Any]]], close: Callable[[Any], None],
                 keep: int = 8) -> None:
        self._items, self._close, self.keep = items, close, keep
        self._idle: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def hold(self, local: threading.local, attr: str, value: Any) -> Any:
        """Set ``local.<attr>`` to a holder of ``value`` (read it back with :func:`held`); its
        connections are parked when the thread ends. Returns ``value``."""
        h = _Holder()
        h.value = value
        h.fin = weakref.finalize(h, self._park_all, value)
        h.fin.atexit = False
        setattr(local, attr, h)
        return value

    def take(self, addr: str) -> Any | None:
        """A parked connection to ``addr``, or None."""
        with self._lock:
            idle = self._idle.get(addr)
            return idle.pop() if idle else None

    def close(self) -> None:
        """Close every parked connection; later ones are closed, not parked."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                self._close(c)

    def _park_all(self, value: Any) -> None:
        for addr, c in list(self._items(value)):
            with self._lock:
                idle = self._idle.setdefault(addr, [])
                if not self._closed and len(idle) < self.keep:
                    idle.append(c)
                    continue
            self._close(c)


def held(local: threading.local, attr: str) -> Any | None:
    """The value :meth:`Parking.hold` set on ``local.<attr>``, or None."""
    h = getattr(local, attr, None)
    return None if h is None else h.value


def release(local: threading.local, attr: str) -> None:
    """Forget ``local.<attr>`` without parking what it holds (the caller closed it)."""
    h = getattr(local, attr, None)
    if h is not None:
        h.fin.detach()
        setattr(local, attr, None)
