"""``kvpool proxy``'s own limits, with no backend behind it (nothing is forwarded in any of
these cases): a slow request head is closed, a connection past the cap takes the place of
the oldest silent one (503 when every connection is busy), bodies past the in-flight budget
get 503 at once, and numbers JSON cannot carry are refused."""
import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvpool.cli import proxy as P
from kvpool.protocol.config import ProxyConfig


@pytest.fixture
def proxy(monkeypatch):
    monkeypatch.setattr(P, "HEAD_TIMEOUT_S", 1.0)
    monkeypatch.setattr(P, "KEEPALIVE_S", 1.0)
    monkeypatch.setattr(P, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(P, "MAX_SILENT_PER_PEER", 8)
    monkeypatch.setattr(P, "BODY_BUDGET_BYTES", 1 << 20)
    dead = "http://127.0.0.1:1"  # nothing listens: health checks fail, nothing is forwarded
    s = P.ProxySettings.from_config(ProxyConfig(prefill=[dead], decode=[dead], port=0, health_interval="1h"))
    stop, urls = asyncio.Event(), []
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_until_complete, args=(P.serve(s, stop, urls.append),), daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not urls:
        assert time.monotonic() < deadline and t.is_alive(), "the proxy did not start"
        time.sleep(0.05)
    yield urls[0]
    loop.call_soon_threadsafe(stop.set)
    t.join(20)
    assert not t.is_alive()


def _post(url: str, raw: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=raw, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=20)


def test_numbers_json_cannot_carry_are_refused(proxy):
    for raw in (b'{"model": "m", "prompt": "w", "max_tokens": 1e400}',
                b'{"model": "m", "prompt": "w", "temperature": -Infinity}'):
        st, doc = _post(proxy, raw)
        assert st == 400 and "not JSON" in doc["error"]["message"], doc


def test_a_slow_request_head_is_closed(proxy):
    with _connect(proxy) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the proxy, no answer
        assert time.monotonic() - t0 < 10
    st, _ = _post(proxy, b"{}")
    assert st == 400  # still serving


def test_at_the_cap_the_oldest_silent_connection_makes_room(proxy):
    held = [_connect(proxy) for _ in range(P.MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # let the proxy accept them all
        st, _ = _post(proxy, b"{}")  # one more: the oldest silent one is closed for it
        assert st == 400
        assert held[0].recv(1024) == b""
    finally:
        for s in held:
            s.close()


def test_connections_past_the_cap_get_503_when_all_are_busy(proxy):
    held = [_connect(proxy) for _ in range(P.MAX_CONNECTIONS)]
    try:
        for s in held:  # each sends a request head and one byte of its body: busy, not silent
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        time.sleep(0.2)  # let the proxy read them all
        with _connect(proxy) as s:
            got = s.recv(4096)
        assert got.startswith(b"HTTP/1.1 503") and b"overloaded" in got, got[:200]
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while _post(proxy, b"{}")[0] != 400:  # the held ones closed: served again
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_bodies_past_the_budget_get_503_at_once(proxy):
    with _connect(proxy) as s:  # announces a body larger than the whole budget, sends none of it
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 2000000\r\n\r\n")
        got = s.recv(4096)
    assert got.startswith(b"HTTP/1.1 503") and b"overloaded" in got, got[:300]


class _Transport:
    def __init__(self, peer: str) -> None:
        self.peer, self.closed = peer, False

    def get_extra_info(self, name: str):
        return (self.peer, 1) if name == "peername" else None

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def test_guard_evicts_silent_connections_by_age_and_per_peer():
    """ConnectionGuard's bookkeeping alone: a peer past its share of silent connections
    closes its own oldest; past the cap the oldest silent connection goes, then an idle
    keep-alive one (after its grace), and a busy one never."""
    from prometheus_client import CollectorRegistry, Counter

    from kvpool.cli import proxy_guard as G

    refused = Counter("r", "r", ["reason"], registry=CollectorRegistry())
    g = G.ConnectionGuard(None, 4, 10.0, 10.0, refused, max_waiting_per_peer=2)
    a1, a2, a3, b1 = _Transport("a"), _Transport("a"), _Transport("a"), _Transport("b")
    for t in (a1, a2, a3):
        g.opened(t)
    assert a1.closed and not a2.closed and list(g.fresh) == [a2, a3]  # a's share is 2
    g.opened(b1)
    g.seen(a2)  # busy: never evicted
    assert g.make_room() and a3.closed and not b1.closed  # the oldest silent one
    g.idle(a2)  # answered, idle on keep-alive: evicted only after the grace
    g.seen(b1)
    assert not g.make_room() and not a2.closed
    g.kept[a2] = (g.kept[a2][0], "", g.kept[a2][2] - G.KEPT_GRACE_S)
    assert g.make_room() and a2.closed
    assert refused.labels("peer_waiting")._value.get() == 1 and refused.labels("evicted")._value.get() == 2
