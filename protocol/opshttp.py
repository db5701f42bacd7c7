"""The operator HTTP endpoint of a master or store node: ``/metrics`` (Prometheus text),
``/healthz`` (liveness) and ``/readyz`` (readiness).

``/healthz`` and ``/readyz`` answer 200 with ``ok: <detail>`` or 503 with
``not ok: <reason>`` (text/plain), from checks the process supplies; a check that raises
counts as failed. Served by a small threaded ``http.server`` in daemon threads, so a slow
scrape never blocks the process's own loops. Bounded: at most :data:`MAX_CONNECTIONS`
connections are served at once (one more is closed at once), and each socket read or
write waits at most :data:`IO_TIMEOUT_S` seconds, so a peer that sends half a request
holds one thread for that long at most.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("kvpool.ops")

Check = Callable[[], tuple[bool, str]]  # -> (passed, detail or reason)

MAX_CONNECTIONS = 32  # scrapers and probes served at once
IO_TIMEOUT_S = 5.0  # one socket read or write of a scrape


class _BoundedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the cap: closed, no thread
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class OpsServer:
    """Serve ``registry`` and the two checks on ``host:port`` (0: any free port); the
    bound URL is :attr:`url`. Raises OSError when the port cannot be bound."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, healthz: Check, readyz: Check) -> None:
        routes = {"/metrics": None, "/healthz": healthz, "/readyz": readyz}

        class Handler(BaseHTTPRequestHandler):
            timeout = IO_TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path not in routes:
                    self._send(404, b"not found; try /metrics, /healthz or /readyz\n", "text/plain")
                elif path == "/metrics":
                    try:
                        body = generate_latest(registry)
                    except Exception as e:  # noqa: BLE001 - a failed snapshot is this scrape's 500
                        self._send(500, f"metrics snapshot failed: {type(e).__name__}: {e}\n".encode(), "text/plain")
                        return
                    self._send(200, body, CONTENT_TYPE_LATEST)
                else:
                    try:
                        ok, detail = routes[path]()
                    except Exception as e:  # noqa: BLE001 - a check that cannot answer has failed
                        ok, detail = False, f"{type(e).__name__}: {e}"
                    self._send(200 if ok else 503, f"{'ok' if ok else 'not ok'}: {detail}\n".encode(), "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args) -> None:
                log.debug("http %s: " + fmt, self.address_string(), *args)

        self.httpd = _BoundedServer((host, port), Handler)
        h, p = self.httpd.server_address[:2]
        self.url = f"http://{h}:{p}" if ":" not in h else f"http://[{h}]:{p}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="ops-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
