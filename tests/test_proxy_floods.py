"""``kvpool proxy`` under floods of slow or numerous clients (issue 31, item 1): a real proxy
process in front of a stand-in OpenAI server (``tests/stub_openai.py``), flooded from
background threads while a well-behaved client sends valid requests, each on a new
connection. What is asserted is how many of those are served (200 with the decode
server's answer), never how fast:

* five chunked uploads trickling one byte per second;
* requests announcing ``Content-Length: 99999999999`` and sending no body (answered 413 at
  once, and sent again);
* 4,100 idle connections, each replaced (200 a second at most) when the proxy closes it.

Also: a client that hangs up mid-request leaves no traceback in the proxy's log, and a
proxy bound to a non-loopback address needs an API key or ``--allow-no-api-key``.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvpool.cli.cluster import free_port
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
VALID = 30  # valid requests sent during each flood
BODY = json.dumps({"model": "stub", "prompt": "hello", "max_tokens": 4}).encode()


class _Child:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(argv, cwd=str(REPO), env=ENV, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _start(logs: Path, *args: str):
    """A stand-in backend and a proxy in front of it (``args``: more proxy flags)."""
    sport, pport = free_port(), free_port()
    stub = _Child([sys.executable, str(REPO / "tests" / "stub_openai.py"), str(sport)], logs / "stub.log")
    backend = f"http://127.0.0.1:{sport}"
    p = _Child([sys.executable, "-m", "kvpool.cli", "proxy", "--prefill", backend, "--decode", backend,
                "--port", str(pport), "--health-interval", "0.5s", *args], logs / "proxy.log")
    url = f"http://127.0.0.1:{pport}"
    try:
        wait_for(lambda: _get(url + "/health") == 200 or p.proc.poll() is not None, 60, 0.1, "the proxy healthy")
        assert p.proc.poll() is None, p.text()
    except BaseException:
        p.stop()
        stub.stop()
        raise
    return url, p, stub


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    url, p, stub = _start(tmp_path_factory.mktemp("proxy-floods"), "--read-timeout", "5s")
    try:
        yield url, p
    finally:
        p.stop()
        stub.stop()


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _valid(url: str) -> bool:
    """One valid completion request on a new connection: True when it was served."""
    req = urllib.request.Request(url + "/v1/completions", data=BODY, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status == 200 and json.loads(r.read())["choices"][0]["text"] == "decoded"
    except (OSError, ValueError, KeyError):
        return False


def _served(url: str, n: int = VALID) -> int:
    return sum(_valid(url) for _ in range(n))


class _Flood:
    """``worker(stop)`` run on ``n`` threads until :meth:`stop`."""

    def __init__(self, n: int, worker) -> None:
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(worker,), daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, worker) -> None:
        try:
            worker(self._stop)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.errors.append(e)

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads)


def test_slow_chunked_uploads_leave_others_served(proxy):
    """Five uploads at one byte per second (chunked, no length), each restarted when the
    proxy cuts it: every valid request meanwhile is served."""
    url, _ = proxy
    started = threading.Semaphore(0)

    def trickle(stop: threading.Event) -> None:
        while not stop.is_set():
            with socket.create_connection(_addr(url), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n")
                started.release()
                try:
                    while not stop.wait(1.0):
                        s.sendall(b"1\r\n \r\n")  # one byte of body per second
                except OSError:
                    pass  # cut by the proxy: start again

    flood = _Flood(5, trickle)
    try:
        for _ in range(5):
            assert started.acquire(timeout=20)
        served = _served(url)
    finally:
        flood.stop()
    assert served == VALID, f"{served} of {VALID} valid requests served during the slow uploads"


def test_huge_announced_lengths_are_refused_at_once(proxy):
    """Requests announcing 99,999,999,999 bytes and sending none are answered 413 at once
    (and sent again, five at a time): every valid request meanwhile is served."""
    url, _ = proxy
    answers: list[bytes] = []

    def huge(stop: threading.Event) -> None:
        while not stop.is_set():
            with socket.create_connection(_addr(url), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 99999999999\r\n\r\n")
                try:
                    got = s.recv(4096)
                except OSError:
                    got = b""
                answers.append(got[:12])
                stop.wait(0.01)

    flood = _Flood(5, huge)
    try:
        wait_for(lambda: len(answers) >= 5, 20, what="the huge requests answered")
        served = _served(url)
    finally:
        flood.stop()
    assert served == VALID, f"{served} of {VALID} valid requests served during the huge-length flood"
    assert answers and all(a == b"HTTP/1.1 413" for a in answers), set(answers)


@pytest.mark.parametrize("peers", [1, 5])
def test_thousands_of_idle_connections_leave_others_served(proxy, peers):
    """4,100 connections that never send a byte (each replaced when the proxy closes it,
    200 a second at most),
    from the valid client's own address or from five others (127.0.0.2-6, so that the
    proxy's connection cap is reached, not only one peer's share): the valid requests
    meanwhile are served."""
    url, _ = proxy
    opened = threading.Event()
    sources = ["127.0.0.1"] if peers == 1 else [f"127.0.0.{i}" for i in range(2, 2 + peers)]

    def idle(stop: threading.Event) -> None:
        socks: dict[int, socket.socket] = {}
        turn = iter(range(1 << 30))

        def one() -> None:
            s = socket.create_connection(_addr(url), timeout=10, source_address=(sources[next(turn) % peers], 0))
            s.setblocking(False)
            socks[s.fileno()] = s

        for _ in range(4100):
            one()
        opened.set()
        while not stop.is_set():
            p = select.poll()
            for fd in socks:
                p.register(fd, select.POLLIN)
            for fd, _ in p.poll(200):  # closed (or answered) by the proxy: open another, 200 a second at most
                socks.pop(fd).close()
                one()
                stop.wait(0.005)
        for s in socks.values():
            s.close()

    flood = _Flood(1, idle)
    try:
        assert opened.wait(120), flood.errors
        served = _served(url)
    finally:
        flood.stop()
    assert not flood.errors, flood.errors
    assert served >= VALID - 1, f"{served} of {VALID} valid requests served beside 4,100 idle connections"


def test_a_client_that_hangs_up_leaves_no_traceback(proxy):
    """Clients that hang up mid-body, mid-head or right after their request: the proxy
    logs no traceback, and serves on."""
    url, p = proxy
    for raw in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"mo",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)):
        with socket.create_connection(_addr(url), timeout=10) as s:
            s.sendall(raw)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
    assert _served(url, 3) == 3
    assert "Traceback" not in p.text() and " ERROR " not in p.text(), p.text()[-3000:]


def test_a_proxy_on_all_interfaces_needs_an_api_key(tmp_path):
    """Bound beyond loopback without an API key the proxy does not start (exit 2, naming
    the flags); with --allow-no-api-key it starts and warns."""
    argv = [sys.executable, "-m", "kvpool.cli", "proxy", "--prefill", "http://127.0.0.1:1", "--decode",
            "http://127.0.0.1:1", "--host", "0.0.0.0", "--port", "0"]
    env = {k: v for k, v in ENV.items() if k != "KVPOOL_PROXY_API_KEY"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=str(REPO))
    assert r.returncode == 2 and "--api-key-file" in r.stderr and "--allow-no-api-key" in r.stderr, r.stderr
    log = tmp_path / "open.log"
    child = _Child(argv + ["--allow-no-api-key"], log)
    try:
        wait_for(lambda: "kvpool proxy on" in child.text() or child.proc.poll() is not None, 60, 0.1,
                 "the proxy to start")
        assert child.proc.poll() is None, child.text()
        assert "WARNING" in child.text() and "WITHOUT AN API KEY" in child.text(), child.text()
    finally:
        child.stop()


def test_a_slot_is_taken_by_a_request_being_served_not_by_a_slow_body(tmp_path):
    """With --max-in-flight 1: a request whose body is still arriving takes no slot (others
    are served meanwhile); one being served by the backend takes it, so the next gets 503
    ``overloaded`` at once; once it is answered, requests are served again."""
    url, p, stub = _start(tmp_path, "--max-in-flight", "1", "--read-timeout", "60s")
    try:
        with socket.create_connection(_addr(url), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\"")
            assert _served(url, 3) == 3
        slow = json.dumps({"model": "stub", "prompt": "p", "max_tokens": 4, "stub_delay_s": 30}).encode()
        answers: list[int] = []

        def hold() -> None:  # until it has the slot (a probe below may hold it at first)
            while not answers or answers[-1] == 503:
                try:
                    with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=slow,
                                                                       method="POST"), timeout=60) as r:
                        answers.append(r.status)
                except urllib.error.HTTPError as e:
                    answers.append(e.code)

        held = threading.Thread(target=hold, daemon=True)
        held.start()

        def refused() -> bool:
            req = urllib.request.Request(url + "/v1/completions", data=BODY, method="POST")
            try:
                urllib.request.urlopen(req, timeout=10).read()
                return False
            except urllib.error.HTTPError as e:
                return e.code == 503 and json.loads(e.read())["error"]["type"] == "overloaded"
        wait_for(refused, 20, what="the slot to be taken")
        stub.proc.kill()  # the held request fails (502) and gives its slot back
        held.join(60)
        assert answers[-1] == 502
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            assert 'kvpool_proxy_requests_total{endpoint="/v1/completions",outcome="overloaded"}' in r.read().decode()
    finally:
        p.stop()
        stub.stop()
