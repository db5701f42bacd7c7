"""The operator CLI against a real cluster (subprocesses, as an operator runs it)."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import wait_for


def kv(cluster, *args, ok=True):
    p = subprocess.run([sys.executable, "-m", "kvpool.cli", *args, "--master", cluster.master_addr],
                       capture_output=True, text=True, timeout=60)
    if ok:
        assert p.returncode == 0, p.stderr + p.stdout
    return p


def test_put_get_ls_rm(cluster, tmp_path):
    src = tmp_path / "in.bin"
    src.write_bytes(bytes(range(256)) * 100)
    kv(cluster, "put", "cli/obj", str(src))
    out = tmp_path / "out.bin"
    kv(cluster, "get", "cli/obj", "-o", str(out))
    assert out.read_bytes() == src.read_bytes()
    p = kv(cluster, "ls", "--prefix", "cli/", "--json")
    rows = json.loads(p.stdout)
    assert [r["key"] for r in rows] == ["cli/obj"] and rows[0]["size"] == 25600
    p = kv(cluster, "ls", "--prefix", "cli/", "--long")
    assert "cli/obj" in p.stdout and "raw" in p.stdout
    # a get right after our own get has released its lease: rm works
    kv(cluster, "rm", "cli/obj")
    p = kv(cluster, "get", "cli/obj", ok=False)
    assert p.returncode == 3 and "not stored" in p.stderr
    p = kv(cluster, "rm", "cli/obj", ok=False)
    assert p.returncode == 3


def test_status_table_and_json(cluster):
    p = kv(cluster, "status")
    assert "node-0" in p.stdout and "node-1" in p.stdout and "leader" in p.stdout
    st = json.loads(kv(cluster, "status", "--json").stdout)
    assert len(st["nodes"]) == 2 and st["leader"] == cluster.master_addr
    assert all(n["capacity"] == 256 << 20 and n["device"] == "cpu" for n in st["nodes"])


def test_evict_pin_unpin(cluster, tmp_path):
    src = tmp_path / "x"
    src.write_bytes(b"z" * 1000)
    for i in range(3):
        kv(cluster, "put", f"ev/{i}", str(src))
    kv(cluster, "pin", "ev/0")
    kv(cluster, "pin", "ev/1", "--ttl", "30m")
    p = kv(cluster, "ls", "--prefix", "ev/", "--json")
    pins = {r["key"]: r["pin"] for r in json.loads(p.stdout)}
    assert pins == {"ev/0": "hard", "ev/1": "soft", "ev/2": ""}
    rep = json.loads(kv(cluster, "evict", "--prefix", "ev/", "--dry-run", "--json").stdout)
    assert rep["removed"] == 1 and rep["skipped_pinned"] == 2 and rep["dry_run"]
    assert len(json.loads(kv(cluster, "ls", "--prefix", "ev/", "--json").stdout)) == 3  # dry run changed nothing
    p = kv(cluster, "evict", "--prefix", "ev/")
    assert "removed 1 object(s)" in p.stdout and "pinned 2" in p.stdout and "--force includes" in p.stdout
    kv(cluster, "unpin", "ev/1")
    rep = json.loads(kv(cluster, "evict", "--prefix", "ev/", "--json").stdout)
    assert rep["removed"] == 1 and rep["skipped_pinned"] == 1
    p = kv(cluster, "evict", "--key", "ev/0", ok=False)  # the one key asked for stays: say why and what to do
    assert p.returncode == 6 and "pinned" in p.stderr and "kvpool unpin ev/0" in p.stderr and "--force" in p.stderr
    rep = json.loads(kv(cluster, "evict", "--key", "ev/0", "--force", "--json").stdout)
    assert rep["removed"] == 1
    assert json.loads(kv(cluster, "ls", "--prefix", "ev/", "--json").stdout) == []


@pytest.mark.parametrize("args,msg", [
    ([], "exactly one selector"),
    (["--prefix", "a", "--all"], "exactly one selector"),
    (["--node", "no-such-node"], "no such live node"),
    (["--older-than", "soon"], "not a duration"),
])
def test_bad_selectors_fail_clearly(cluster, args, msg):
    p = kv(cluster, "evict", *args, ok=False)
    assert p.returncode == 2 and msg in p.stderr


def test_errors_say_what_to_do(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", "tcp://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                                         "KVPOOL_CLIENT__RPC_TIMEOUT": "1s"})
    assert p.returncode == 4 and "is it running?" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--cluster", "nothing-here"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "kvpool up" in p.stderr


def test_metrics_endpoint(make_cluster):
    import urllib.request

    from kvpool.cli.cluster import free_port

    port = free_port()
    lc = make_cluster(nodes=1, memory="32MiB", metrics_port=port)
    with lc.client() as c:
        c.put("m/a", b"x" * 100)
        c.get("m/a")
        c.get("m/missing")
    body = wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode(),
                    what="metrics")
    assert "kvpool_objects 1.0" in body
    assert 'kvpool_ops_total{op="hits"} 1.0' in body and 'kvpool_ops_total{op="misses"} 1.0' in body
    assert 'kvpool_node_capacity_bytes{node="node-0"} 3.3554432e+07' in body
    assert 'kvpool_rpc_seconds_count{op="Lookup"} 2.0' in body  # the two gets
    assert 'kvpool_rpc_seconds_bucket{le="+Inf",op="Lookup"} 2.0' in body
    with lc.client() as c:  # a hand-off held and acked: its hold time, by outcome
        c.handoff_publish("m-h", {"0": ["m/a"]}, {}, 60)
        c.handoff_ack("m-h")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvpool_handoff_hold_seconds_count{outcome="acked"} 1.0' in body


def test_metrics_scrapes_under_write_load_all_succeed(make_cluster):
    """A scrape is one snapshot taken on the master's RPC thread: scraping while clients
    put and remove never sees the index change under it (it used to fail with
    'dictionary changed size during iteration')."""
    import threading
    import urllib.request

    from kvpool.cli.cluster import free_port

    port = free_port()
    lc = make_cluster(nodes=1, memory="64MiB", metrics_port=port)
    stop, errors, scrapes = threading.Event(), [], [0]
    with lc.client() as c:  # a larger index: a scrape's walk over it takes a while
        for b in range(40):
            assert c.put_batch([f"base/{b}/{j}" for j in range(500)], [b"y" * 64] * 500) == [None] * 500

    def writer(w: int):
        with lc.client() as c:
            i = 0
            while not stop.is_set():
                c.put_batch([f"load/{w}/{i}/{j}" for j in range(16)], [b"x" * 512] * 16)
                c.remove_batch([f"load/{w}/{i - 2}/{j}" for j in range(16)], force=True)
                i += 1

    ts = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    for t in ts:
        t.start()
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for(lambda: urllib.request.urlopen(url, timeout=5).read(), what="metrics server")
        for _ in range(150):
            try:
                body = urllib.request.urlopen(url, timeout=10).read().decode()
                assert "kvpool_objects" in body
                scrapes[0] += 1
            except Exception as e:  # noqa: BLE001 - counted, reported below
                errors.append(repr(e))
    finally:
        stop.set()
        for t in ts:
            t.join(30)
    assert not errors and scrapes[0] == 150, errors[:3]


def test_master_addresses_that_cannot_work_fail_at_once():
    """A malformed or unresolvable --master is a config error right away (exit 2), not a
    connect retried until the RPC timeout."""
    import subprocess
    import sys
    import time

    for addr, want in [("tcp://127.0.0.1:99999", "port 1-65535"), ("tcp://no-such-host.invalid:1", "cannot resolve"),
                       ("127.0.0.1:5000", "no scheme"), ("http://127.0.0.1:1", "use tcp://host:port")]:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", addr], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and want in r.stderr, (addr, r.stderr)
        assert time.monotonic() - t0 < 8.0


def test_server_flags_are_generated_from_the_config():
    """Each default once (cli/config_flags.py): every scalar field of the master, store-node,
    proxy and security sections is a flag of its command, with the field's description as
    its help and the config's default shown; each field is described."""
    import msgspec
    from typer.main import get_command

    from kvpool.cli.app import app
    from kvpool.cli.config_flags import _flag_type
    from kvpool.protocol.config import MasterConfig, ProxyConfig, SecurityConfig, StoreNodeConfig

    cmd = get_command(app)
    for name, structs in (("master", (MasterConfig, SecurityConfig)), ("storenode", (StoreNodeConfig, SecurityConfig)),
                          ("proxy", (ProxyConfig,))):
        params = {p.name: p for p in cmd.commands[name].params}
        for struct in structs:
            for f in msgspec.structs.fields(struct):
                got = _flag_type(f.type)
                assert got is None or got[1], f"{struct.__name__}.{f.name} has no description"
                if got is None or f.name in ("prefill", "decode"):
                    continue
                p = params[f.name]
                assert "--" + f.name.replace("_", "-") in p.opts, (name, f.name, p.opts)
                assert got[1] in p.help and f"{f.name}" in p.help, (name, f.name, p.help)
    assert "--max-objects" in {o for p in cmd.commands["master"].params for o in p.opts}
    for name in ("master", "storenode", "proxy"):  # piped (taken as 80 columns): no name or default cut off
        out = subprocess.run([sys.executable, "-m", "kvpool.cli", name, "--help"], capture_output=True, text=True,
                             timeout=60, env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")})
        assert out.returncode == 0 and "…" not in out.stdout, out.stdout
        assert "--etcd-compaction-interval" in out.stdout or name != "master"
