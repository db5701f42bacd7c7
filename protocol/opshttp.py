"""The operator HTTP endpoint of a master or store node: ``/metrics`` (Prometheus text),
``/healthz`` (liveness) and ``/readyz`` (readiness).

``/healthz`` and ``/readyz`` answer 200 with ``ok: <detail>`` or 503 with
``not ok: <reason>`` (text/plain), from checks the process supplies; a check that raises
counts as failed. One request per connection (``Connection: close``), GET only.

Served by an asyncio loop on a thread of its own, so that a peer costs a socket and a
coroutine, never a thread: idle or slow connections, however many, cannot starve the
probes (Kubernetes restarts a process whose liveness probe fails). Bounds:

* a connection must deliver its request head (at most :data:`MAX_HEAD` bytes) within
  :data:`IO_TIMEOUT_S` seconds of opening, however the bytes trickle, and take its answer
  within as long; else it is closed;
* at most :data:`MAX_CONNECTIONS` connections: one more takes the place of the oldest one
  that has not delivered its request head yet (closed), and is closed itself only when
  every connection is being answered;
* the checks run on :data:`CHECK_THREADS` threads and scrapes on one thread of their own
  (a check may wait up to a few seconds on the process's loops or etcd; a scrape of a big
  index takes a while), so a slow scrape never holds a probe up.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("kvpool.ops")

Check = Callable[[], tuple[bool, str]]  # -> (passed, detail or reason)

MAX_CONNECTIONS = 1024  # connections held at once; one more evicts the oldest still owing its request
IO_TIMEOUT_S = 5.0  # the request head must arrive, and the answer leave, within this (seconds) each
MAX_HEAD = 16 << 10  # bytes of request line and headers
CHECK_THREADS = 2  # threads running /healthz and /readyz checks
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}


class OpsServer:
    """Serve ``registry`` and the two checks on ``host:port`` (0: any free port); the
    bound URL is :attr:`url`. Raises OSError when the port cannot be bound."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, healthz: Check, readyz: Check) -> None:
        self.registry = registry
        self.routes: dict[str, Check | None] = {"/metrics": None, "/healthz": healthz, "/readyz": readyz}
        self.conns: set[asyncio.StreamWriter] = set()
        self.waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()  # owing their request, oldest first
        self.evicted = 0  # connections closed at the cap for a newer one
        self._checks = concurrent.futures.ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="ops-check")
        self._scrapes = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ops-metrics")
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(host, port, started), name="ops-http", daemon=True)
        self._thread.start()
        try:
            h, p = started.result(timeout=30)
        except BaseException:
            self._thread.join(5)
            self._checks.shutdown(wait=False)
            self._scrapes.shutdown(wait=False)
            raise
        self.url = f"http://{h}:{p}" if ":" not in h else f"http://[{h}]:{p}"

    def _run(self, host: str, port: int, started: concurrent.futures.Future) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._serve, host, port, limit=MAX_HEAD,
                                                                        backlog=1024, reuse_address=True))
        except BaseException as e:  # noqa: BLE001 - handed to the constructor
            started.set_exception(e)
            loop.close()
            return
        started.set_result(self._server.sockets[0].getsockname()[:2])
        try:
            loop.run_forever()
        finally:
            self._server.close()
            for w in list(self.conns):
                w.transport.abort()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.conns) >= MAX_CONNECTIONS and not self._evict_one():
            writer.transport.abort()  # every connection is being answered: no room
            return
        self.conns.add(writer)
        self.waiting[writer] = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return  # too slow, too long, or gone: closed without an answer
            finally:
                self.waiting.pop(writer, None)
            method, path = _request_line(head)
            code, body, ctype = await self._answer(method, path)
            log.debug('http %s: "%s %s" %d', _peer(writer), method, path, code)
            writer.write(f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nContent-Type: {ctype}\r\nContent-Length: "
                         f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await asyncio.wait_for(writer.drain(), IO_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError):
            writer.transport.abort()
        finally:
            self.conns.discard(writer)
            self.waiting.pop(writer, None)
            writer.close()

    def _evict_one(self) -> bool:
        """At the cap: close the oldest connection still owing its request head; False when
        there is none (all are being answered)."""
        if not self.waiting:
            return False
        w, _ = self.waiting.popitem(last=False)
        self.conns.discard(w)
        self.evicted += 1
        w.transport.abort()
        return True

    async def _answer(self, method: str, path: str) -> tuple[int, bytes, str]:
        if method != "GET":
            return 405 if method else 400, b"GET /metrics, /healthz or /readyz\n", "text/plain"
        path = path.split("?", 1)[0]
        if path not in self.routes:
            return 404, b"not found; try /metrics, /healthz or /readyz\n", "text/plain"
        loop = asyncio.get_running_loop()
        if path == "/metrics":
            try:
                return 200, await loop.run_in_executor(self._scrapes, generate_latest, self.registry), \
                    CONTENT_TYPE_LATEST
            except Exception as e:  # noqa: BLE001 - a failed snapshot is this scrape's 500
                return 500, f"metrics snapshot failed: {type(e).__name__}: {e}\n".encode(), "text/plain"
        try:
            ok, detail = await loop.run_in_executor(self._checks, self.routes[path])
        except Exception as e:  # noqa: BLE001 - a check that cannot answer has failed
            ok, detail = False, f"{type(e).__name__}: {e}"
        return (200 if ok else 503), f"{'ok' if ok else 'not ok'}: {detail}\n".encode(), "text/plain"

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._checks.shutdown(wait=False, cancel_futures=True)
        self._scrapes.shutdown(wait=False, cancel_futures=True)


def _request_line(head: bytes) -> tuple[str, str]:
    """``(method, path)`` of a request head; ``("", "")`` when its first line is not one."""
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return "", ""
    return parts[0].decode("ascii", "replace"), parts[1].decode("ascii", "replace")


def _peer(writer: asyncio.StreamWriter) -> str:
    addr = writer.get_extra_info("peername")
    return str(addr[0]) if isinstance(addr, tuple) and addr else "?"
