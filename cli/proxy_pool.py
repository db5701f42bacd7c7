"""Backend pools of ``kvpool proxy``: which prefill and decode servers are healthy, and
which one takes the next request.

A :class:`Pool` holds the vLLM OpenAI servers of one role. :func:`health_loop` GETs every
server's ``/health`` each interval, each check bounded by its own timeout; a request that
cannot reach a server also marks it unhealthy at once (:meth:`Pool.mark`), until a later
check finds it well again. :meth:`Pool.pick` returns the healthy server with the fewest
requests in flight, ties broken round robin.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import aiohttp
from yarl import URL

from kvpool.protocol.errors import ConfigError

log = logging.getLogger("kvpool.proxy")

# exceptions that mean "this server did not answer properly" (never a bug of ours)
BACKEND_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def describe(e: BaseException, timeout_s: float | None = None) -> str:
    """One line for a failed backend call: ``no answer within 5s`` or ``Type: message``."""
    if isinstance(e, asyncio.TimeoutError):
        return f"no answer within {timeout_s:g}s" if timeout_s else "timed out"
    if isinstance(e, aiohttp.ClientConnectorError):  # "Cannot connect to host ... ssl:default [...]"
        return f"cannot connect: {os.strerror(e.errno) if e.errno else e.os_error}"
    return f"{type(e).__name__}: {e}".rstrip(": ")


def normalize_url(url: str, role: str) -> str:
    """``http(s)://host:port[/prefix]`` without a trailing slash; raises ConfigError naming
    ``--<role>`` otherwise."""
    try:
        u = URL(url.strip())
    except (ValueError, TypeError):
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.host or u.query_string or u.fragment:
        raise ConfigError(f"--{role} {url!r}: use a server URL like http://127.0.0.1:8100", key=role)
    return str(u).rstrip("/")


@dataclass(eq=False)
class Backend:
    """One vLLM OpenAI server of a pool. ``healthy`` is False until its first check
    passes; ``last_error`` says why it is not healthy; ``outstanding`` counts requests in
    flight through this proxy."""

    url: str
    role: str
    healthy: bool = False
    outstanding: int = 0
    last_error: str = "not checked yet"
    checked_at: float = 0.0  # time.time() of the last health check, 0 = never

    def as_dict(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "outstanding": self.outstanding,
                "last_error": None if self.healthy else self.last_error,
                "checked_at": self.checked_at or None}


class Pool:
    """The servers of one ``role`` (``prefill`` or ``decode``). ``on_health(backend)``
    runs whenever a server's health changes (metrics). Raises ConfigError for a bad or
    repeated URL, or none at all."""

    def __init__(self, role: str, urls: Sequence[str],
                 on_health: Callable[[Backend], None] | None = None) -> None:
        self.role = role
        self.backends: list[Backend] = []
        for raw in urls:
            url = normalize_url(raw, role)
            if any(b.url == url for b in self.backends):
                raise ConfigError(f"--{role} {url} is given twice", key=role)
            self.backends.append(Backend(url, role))
        if not self.backends:
            raise ConfigError(f"give at least one --{role} URL", key=role)
        self._on_health = on_health or (lambda b: None)
        self._next = 0  # round-robin cursor
        for b in self.backends:
            self._on_health(b)

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def pick(self, exclude: Sequence[Backend] = ()) -> Backend | None:
        """The healthy server, not in ``exclude``, with the fewest requests in flight (ties:
        round robin); None when there is none."""
        n = len(self.backends)
        cands = [(b.outstanding, (i - self._next) % n, i) for i, b in enumerate(self.backends)
                 if b.healthy and b not in exclude]
        if not cands:
            return None
        i = min(cands)[2]
        self._next = (i + 1) % n
        return self.backends[i]

    @contextlib.contextmanager
    def busy(self, b: Backend) -> Iterator[Backend]:
        """Count a request in flight on ``b`` for the duration of the block."""
        b.outstanding += 1
        try:
            yield b
        finally:
            b.outstanding -= 1

    def mark(self, b: Backend, ok: bool, reason: str = "") -> None:
        """Record a health result for ``b`` (logs and reports changes)."""
        b.checked_at = time.time()
        if not ok:
            b.last_error = reason or "unhealthy"
        if ok != b.healthy:
            b.healthy = ok
            if ok:
                log.info("%s server %s is healthy", self.role, b.url)
            else:
                log.warning("%s server %s is unhealthy: %s; skipped until a health check passes",
                            self.role, b.url, b.last_error)
            self._on_health(b)

    def reason(self) -> str:
        """Why no server of this pool is healthy (one line, naming each)."""
        return f"no healthy {self.role} server (" + "; ".join(f"{b.url}: {b.last_error}"
                                                             for b in self.backends) + ")"


async def check(session: aiohttp.ClientSession, pool: Pool, b: Backend, timeout_s: float) -> None:
    """GET ``b``'s /health within ``timeout_s`` seconds and record the result."""
    try:
        async with session.get(b.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            await r.read()
            pool.mark(b, r.status == 200, f"GET /health answered HTTP {r.status}")
    except BACKEND_ERRORS as e:
        pool.mark(b, False, describe(e, timeout_s))


async def check_all(session: aiohttp.ClientSession, pools: Sequence[Pool], timeout_s: float) -> None:
    """One round of health checks over every server of ``pools``, in parallel."""
    await asyncio.gather(*(check(session, p, b, timeout_s) for p in pools for b in p.backends))


async def health_loop(session: aiohttp.ClientSession, pools: Sequence[Pool], interval_s: float,
                      timeout_s: float) -> None:
    """Check every server now and then every ``interval_s`` seconds, until cancelled."""
    while True:
        try:
            await check_all(session, pools, timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one bad round stop the checks
            log.exception("health check round failed")
        await asyncio.sleep(interval_s)
