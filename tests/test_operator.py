"""The operator surface of the processes, on real processes: ``--config`` for the master and
store node (flags over the file), ``/healthz`` and ``/readyz`` flipping as they should,
store-node metrics, log lines with level and timestamp, and `kvpool up` serving metrics."""
import json
import re
import signal
import subprocess
import time
import sys
import urllib.error
import urllib.request
import uuid

import pytest

from kvpool.cli.cluster import Child, LocalCluster, kvpool_argv
from kvpool.protocol.config import load_config
from tests.conftest import freeze, wait_for

MiB = 1 << 20
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) \S")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metrics_url(child: Child) -> str:
    return child.wait_line("KVPOOL_METRICS", 30).split()[-1]


def _log_lines(child: Child) -> list[str]:
    """The log lines of ``child`` (its stderr in its log file; stdout's machine-read lines left out)."""
    return [ln for ln in open(child.log_path).read().splitlines() if ln and not ln.startswith("KVPOOL_")]


@pytest.fixture
def etcd_only():
    lc = LocalCluster(load_config(None, {"cluster": f"op-{uuid.uuid4().hex[:6]}"}, environ={}))
    extra: list[Child] = []
    try:
        lc.start_etcd()
        yield lc, extra
    finally:
        for c in extra:
            c.stop()
        lc.stop()


def test_master_and_storenode_read_config_and_flags_override(etcd_only, tmp_path):
    lc, extra = etcd_only
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"cluster: {lc.cfg.cluster}\nlog_level: debug\netcd:\n  endpoint: {lc.etcd_endpoint}\n"
                   "master:\n  replicas: 2\n  lease_ttl: 7s\n  metrics_port: 0\n  node_ttl: 2s\n"
                   "storenodes:\n  - name: n1\n    memory: 8MiB\n    metrics_port: 0\n"
                   "  - name: n2\n    memory: 16MiB\n")

    def start(name: str, *args: str) -> Child:
        c = Child(name, kvpool_argv(*args), lc.run_dir)
        extra.append(c)
        return c

    m = start("m", "master", "--config", str(cfg), "--lease-ttl", "9s")  # flag over the file's 7s
    addr = m.wait_line("KVPOOL_LEADER master", 30).split()[-1]
    n1 = start("n1", "storenode", "--config", str(cfg), "--name", "n1", "--log-level", "warning")
    n2 = start("n2", "storenode", "--config", str(cfg), "--name", "n2", "--memory", "12MiB")
    n1.wait_line("KVPOOL_READY storenode n1", 30)
    n2.wait_line("KVPOOL_READY storenode n2", 30)
    from kvpool.connector.client import KVPoolClient

    with KVPoolClient(addr, security=getattr(lc, "security", None)) as c:
        wait_for(lambda: len(c.stats().nodes) == 2, 15, what="both nodes joined")
        cs = c.config()
        assert (cs.replicas, cs.lease_ttl_s) == (2, 9.0)  # the file's replicas, the flag's lease ttl
        assert {n.node_id: n.capacity for n in c.stats().nodes} == {"n1": 8 * MiB, "n2": 12 * MiB}
    # metrics_port from the file: the master and n1 serve, n2 (no key) does not
    assert _get(_metrics_url(m) + "/healthz")[0] == 200
    assert _get(_metrics_url(n1) + "/healthz")[0] == 200
    assert not [ln for ln in n2.lines if ln.startswith("KVPOOL_METRICS")]
    # log_level from the file (debug: the master logs each HTTP request), the flag's on n1
    wait_for(lambda: any(" DEBUG " in ln and "/healthz" in ln for ln in _log_lines(m)), 10,
             what="the master's debug line for the /healthz request")
    assert all(LOG_LINE.match(ln) for ln in _log_lines(m)), _log_lines(m)[:5]
    assert not [ln for ln in _log_lines(n1) if " DEBUG " in ln or " INFO " in ln]
    # several entries and no --name: a clear error, exit 2
    p = subprocess.run(kvpool_argv("storenode", "--config", str(cfg)), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "pick one with --name" in p.stderr, p.stderr


def test_health_and_readiness_flip(make_cluster):
    """A leader and a standby that knows it are ready; a store node waiting for its name is
    alive but not ready, and ready once registered; a master whose etcd stops answering is
    not ready (still alive), and ready again when etcd is back."""
    lc = make_cluster(nodes=1, memory="16MiB", metrics=True, node_ttl="5s")
    leader = lc.metrics_urls["master-0"]
    standby_child = lc.start_master(wait_leader=False)
    standby = lc.metrics_urls[standby_child.name]
    code, body = _get(leader + "/readyz")
    assert code == 200 and body.startswith("ok: leader"), body
    code, body = wait_for(lambda: (r := _get(standby + "/readyz"))[0] == 200 and r, 15, what="standby ready")
    assert f"standby; the leader is {lc.master_addr}" in body
    assert _get(standby + "/healthz") == (200, "ok: standby\n")

    path = lc.write_config()
    dup = Child("dup", kvpool_argv("storenode", "--config", path, "--name", "node-0", "--run-dir", lc.run_dir),
                lc.run_dir, lc._env())
    try:
        url = _metrics_url(dup)
        wait_for(lambda: "is registered by another process" in open(dup.log_path).read(), 15, what="dup waits")
        code, body = _get(url + "/readyz")
        assert code == 503 and "not registered in etcd" in body, body
        assert _get(url + "/healthz")[0] == 200  # alive all the same
        assert "kvpool_storenode_registered{node=\"node-0\"} 0.0" in _get(url + "/metrics")[1]
        assert any(LOG_LINE.match(ln) and " WARNING " in ln for ln in _log_lines(dup))
        lc.nodes["node-0"].stop()  # deletes its key: the waiting process takes the name
        wait_for(lambda: _get(url + "/readyz")[0] == 200, 20, what="dup ready once registered")
    finally:
        dup.stop()

    freeze(lc.etcd.proc.pid)
    try:
        code, body = wait_for(lambda: (r := _get(leader + "/readyz"))[0] == 503 and r, 15, what="leader not ready")
        assert "etcd did not answer" in body, body
        assert _get(leader + "/healthz")[0] == 200
    finally:
        lc.etcd.kill(signal.SIGCONT)
    wait_for(lambda: _get(leader + "/readyz")[0] == 200 or _get(standby + "/readyz")[0] == 200, 30,
             what="a master ready again")


def test_storenode_metrics_scrape(make_cluster):
    from kvpool.protocol import transport
    from kvpool.protocol.dataplane import DataRequest, frame, recv_reply

    lc = make_cluster(nodes=1, memory="16MiB", metrics=True)
    url = lc.metrics_urls["node-0"] + "/metrics"
    data = bytes(range(256)) * 1024  # 256 KiB
    with lc.client(transport="tcp") as c:
        c.put("op/a", data)
        assert c.get("op/a") == data
        node = c.stats().nodes[0]
    sock = transport.connect(node.data_addr, 5.0, getattr(lc, "security", None))
    try:
        sock.sendall(frame(DataRequest("no-such-op", node.incarnation)))
        assert not recv_reply(sock).ok
    finally:
        sock.close()
    body = _get(url)[1]
    want = {'kvpool_storenode_received_bytes_total{node="node-0"}': len(data),
            'kvpool_storenode_sent_bytes_total{node="node-0"}': len(data),
            'kvpool_storenode_extents{node="node-0",state="committed"}': 1,
            'kvpool_storenode_segment_bytes{kind="used",node="node-0"}': len(data),
            'kvpool_storenode_segment_bytes{kind="free",node="node-0"}': 16 * MiB - len(data),
            'kvpool_storenode_segment_bytes{kind="capacity",node="node-0"}': 16 * MiB,
            'kvpool_storenode_requests_total{kind="write",node="node-0",plane="data"}': 1,
            'kvpool_storenode_requests_total{kind="read",node="node-0",plane="data"}': 1,
            'kvpool_storenode_errors_total{kind="invalid_request",node="node-0",plane="data"}': 1,
            'kvpool_storenode_registered{node="node-0"}': 1}
    got = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines()
           if ln and not ln.startswith("#")}
    assert {k: got.get(k) for k in want} == {k: float(v) for k, v in want.items()}
    assert got.get('kvpool_storenode_requests_total{kind="commit",node="node-0",plane="control"}', 0) >= 1


def test_up_serves_metrics_and_status_shows_them(tmp_path):
    cluster = f"opup-{uuid.uuid4().hex[:6]}"
    cfg = tmp_path / "c.yaml"
    data_dir = tmp_path / "etcd-data"
    cfg.write_text(f"cluster: {cluster}\netcd:\n  data_dir: {data_dir}\nstorenodes:\n  - name: a\n    memory: 16MiB\n")
    base = [sys.executable, "-m", "kvpool.cli"]
    p = subprocess.Popen(base + ["up", "--config", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        assert f"cluster '{cluster}' up" in p.stdout.readline()
        line = p.stdout.readline()
        assert line.startswith("metrics (/metrics, /healthz, /readyz): master-0 http://") and " a http://" in line
        st = subprocess.run(base + ["status", "--json", "--config", str(cfg)], capture_output=True, text=True,
                            timeout=60)
        assert st.returncode == 0, st.stderr
        urls = json.loads(st.stdout)["metrics"]
        assert sorted(urls) == ["a", "master-0"] and urls["a"] in line
        assert _get(urls["master-0"] + "/readyz")[0] == 200 and _get(urls["a"] + "/readyz")[0] == 200
        assert "kvpool_objects" in _get(urls["master-0"] + "/metrics")[1]
        assert "kvpool_storenode_segment_bytes" in _get(urls["a"] + "/metrics")[1]
        st = subprocess.run(base + ["status", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and urls["a"] in st.stdout, st.stderr
    finally:
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and "cluster stopped" in out
    assert (data_dir / "member").is_dir()  # etcd.data_dir: the embedded etcd's, kept after stop


def test_ops_endpoint_bounds_slow_and_many_peers(monkeypatch):
    """Half-sent requests hold at most MAX_CONNECTIONS threads, each for IO_TIMEOUT_S at
    most; connections past the cap are closed at once; afterwards the probes answer."""
    import socket
    import threading
    import urllib.request

    from prometheus_client import CollectorRegistry

    from kvpool.protocol import opshttp

    monkeypatch.setattr(opshttp, "IO_TIMEOUT_S", 1.0)
    ops = opshttp.OpsServer("127.0.0.1", 0, CollectorRegistry(), lambda: (True, "alive"), lambda: (True, "ready"))
    try:
        host, port = ops.url.removeprefix("http://").split(":")
        before = threading.active_count()
        peers = []
        for _ in range(3 * opshttp.MAX_CONNECTIONS):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # never ends its head
            peers.append(s)
        time.sleep(0.3)
        assert threading.active_count() - before <= opshttp.MAX_CONNECTIONS + 2
        for s in peers:
            s.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(ops.url + "/healthz", timeout=5) as r:
                    assert r.status == 200 and r.read() == b"ok: alive\n"
                    break
            except OSError:
                assert time.monotonic() < deadline, "/healthz did not answer after the flood"
                time.sleep(0.2)
    finally:
        ops.close()
