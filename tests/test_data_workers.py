"""The store node's data server serves from a bounded pool of workers and one selector
thread (storenode/connpool.py), not a thread per connection: idle authenticated connections
cost the node no thread, active clients are all served meanwhile, and a peer that stalls
mid-frame holds a worker for at most ``security.frame_timeout``. Real processes; figures are
printed (``-s``); the asserts are thread counts and loose bounds, never speeds."""
from __future__ import annotations

import threading
import time

import psutil
import pytest

from kvpool.cli.cluster import LocalCluster
from kvpool.protocol import transport
from kvpool.protocol.config import load_config
from kvpool.protocol.dataplane import DataRequest, frame, recv_reply
from test_auth import _closed, _descs

MiB = 1 << 20
WORKERS = 4
IDLE = 200
FEW = 4  # threads allowed beyond those of a node at rest (e.g. the writer watch, started on demand)


@pytest.fixture(scope="module")
def lc():
    cfg = load_config(None, {"storenodes": [{"name": "node-0", "memory": "64MiB", "data_workers": WORKERS}],
                             "security": {"frame_timeout": "2s"}}, environ={})
    c = LocalCluster(cfg, secure=True)
    c.__enter__()
    try:
        yield c
    finally:
        c.stop()


def _threads(pid: int) -> int:
    """The process's thread count, from /proc/<pid>/status."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _ping(s, incarnation: str) -> None:
    s.sendall(frame(DataRequest("ping", incarnation)))
    assert recv_reply(s).ok


def test_idle_connections_cost_no_thread_and_active_clients_are_served(lc):
    node = lc.nodes["node-0"]
    pid = node.proc.pid
    d = _descs(lc)[0]
    with lc.client(transport="tcp") as c:  # the node at rest, after serving one client
        c.put("warm", b"w" * 65536)
        assert c.get("warm") == b"w" * 65536
    rest = _threads(pid)
    rss0 = psutil.Process(pid).memory_info().rss
    idle = []
    for i in range(IDLE):  # half TCP, half the Unix socket; each served once, then left idle
        s = transport.connect(d.data_addr if i % 2 else d.shm_path, 10.0, lc.security)
        _ping(s, d.incarnation)
        idle.append(s)
    with_idle = _threads(pid)
    grown = psutil.Process(pid).memory_info().rss - rss0

    peak = [with_idle]
    done = threading.Event()

    def sample():
        while not done.wait(0.02):
            peak[0] = max(peak[0], _threads(pid))

    errors: list[BaseException] = []
    served = []

    def active(k: int, how: str) -> None:
        try:
            with lc.client(transport=how, write_timeout_s=30.0) as c:  # one node: no other to place on
                for j in range(10):
                    key = f"active-{k}-{j}"
                    data = bytes([k + j]) * (65536 + 4096 * j)
                    c.put(key, data)
                    assert c.get(key) == data
            served.append(k)
        except BaseException as e:  # reported below
            errors.append(e)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    clients = [threading.Thread(target=active, args=(k, "tcp" if k % 3 else "auto"), daemon=True)
               for k in range(3 * WORKERS)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    done.set()
    sampler.join(5)
    assert not errors, errors
    assert sorted(served) == list(range(3 * WORKERS))
    for s in idle:  # handed back to the selector, not dropped: each is served again
        _ping(s, d.incarnation)
        s.close()
    print(f"\ndata workers: node at rest {rest} threads; with {IDLE} idle authenticated connections {with_idle} "
          f"(+{grown / MiB:.1f} MiB); peak with {3 * WORKERS} active clients as well {peak[0]}")
    assert with_idle <= rest + FEW
    assert peak[0] <= rest + FEW
    assert node.alive()


def test_a_peer_stalled_mid_frame_holds_a_worker_at_most_frame_timeout(lc):
    """Every worker held by a peer that sent half a frame: the connections are closed at
    ``security.frame_timeout`` (2 s here), and an honest client is served after that."""
    d = _descs(lc)[0]
    stalled = []
    for _ in range(WORKERS):
        s = transport.connect(d.data_addr, 10.0, lc.security)
        s.sendall(frame(DataRequest("ping", d.incarnation))[:10])  # 10 bytes of a 64-byte frame
        stalled.append(s)
    t0 = time.monotonic()
    with lc.client(transport="tcp", write_timeout_s=30.0) as c:  # waits for a worker
        c.put("after-stall", b"s" * 65536)
        assert c.get("after-stall") == b"s" * 65536
    served_after = time.monotonic() - t0
    for s in stalled:
        s.settimeout(30)
        assert _closed(s)
        s.close()
    closed_after = time.monotonic() - t0
    print(f"\nstalled peers: {WORKERS} half-sent frames holding every worker; an honest client served after "
          f"{served_after:.1f}s, the stalled ones closed after {closed_after:.1f}s")
    assert closed_after < 2.0 + 20  # the deadline, with a generous margin for a busy machine
