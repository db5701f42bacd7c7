"""Health endpoints answer while their port is flooded (issue 31, item 6): a real master and
store node with metrics ports, each held by hundreds of idle connections (every one the
server closes is opened again) and by connections trickling a request head, while
``/healthz`` and ``/readyz`` probes with a 1 s timeout (a Kubernetes probe's) all succeed."""
from __future__ import annotations

import select
import socket
import threading
import time
import urllib.request

from tests.conftest import wait_for

IDLE, TRICKLING, PROBES = 600, 100, 20


def _probe(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            r.read()
            return r.status
    except OSError:
        return 0


def _flood(url: str, stop: threading.Event, opened: threading.Event) -> None:
    """Hold IDLE silent connections to ``url`` (each one closed is opened again) and
    TRICKLING ones that send a request line a byte at a time, until ``stop``."""
    host, port = url.removeprefix("http://").split(":")
    idle: dict[int, socket.socket] = {}
    slow: list[socket.socket] = []

    def connect() -> socket.socket | None:
        try:
            return socket.create_connection((host, int(port)), timeout=1)
        except OSError:  # a server that cannot take them all: the probes tell
            return None

    deadline = time.monotonic() + 20
    while len(slow) < TRICKLING and time.monotonic() < deadline:
        if (s := connect()) is not None:
            slow.append(s)
    i = 0
    try:
        while not stop.is_set():
            while len(idle) < IDLE and not stop.is_set() and (opened.is_set() or time.monotonic() < deadline):
                if (s := connect()) is not None:
                    idle[s.fileno()] = s
            opened.set()
            p = select.poll()
            for fd in idle:
                p.register(fd, select.POLLIN)
            for fd, _ in p.poll(200):  # closed by the server: opened again on the next turn
                idle.pop(fd).close()
            for s in slow:  # one byte of a request line that never ends
                try:
                    s.send(b"GET /metrics HTTP/1.1"[i % 21:i % 21 + 1])
                except OSError:
                    pass
            i += 1
    finally:
        for s in [*idle.values(), *slow]:
            s.close()


def test_probes_answer_while_the_metrics_ports_are_flooded(make_cluster):
    lc = make_cluster(nodes=1, memory="16MiB", metrics=True)
    urls = [lc.metrics_urls["master-0"], lc.metrics_urls["node-0"]]
    for u in urls:
        wait_for(lambda u=u: _probe(u + "/readyz") == 200, 20, what=f"{u} ready")
    stop = threading.Event()
    opened = [threading.Event() for _ in urls]
    floods = [threading.Thread(target=_flood, args=(u, stop, o), daemon=True) for u, o in zip(urls, opened)]
    for t in floods:
        t.start()
    try:
        for o in opened:
            assert o.wait(60)
        answers = {u: [(_probe(u + "/healthz"), _probe(u + "/readyz")) for _ in range(PROBES)] for u in urls}
    finally:
        stop.set()
        for t in floods:
            t.join(30)
    for u, got in answers.items():
        assert got == [(200, 200)] * PROBES, f"{u}: {got}"
