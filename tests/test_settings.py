"""Cluster-wide settings in etcd (DESIGN.md §3 ``config``): the first leader records its
flags, later leaders adopt the record over their own flags, ``set_config`` / ``kvpool
settings --set`` change them all or nothing. Real etcd, masters and store nodes."""
import json
import subprocess
import sys

import msgspec
import pytest

from kvpool.connector.client import KVPoolClient
from kvpool.protocol import errors as E
from kvpool.protocol import messages as M
from kvpool.protocol.etcd import Keys, read_key_sync
from tests.conftest import freeze


def _record(lc) -> M.ClusterSettings:
    raw = read_key_sync(lc.etcd_endpoint, Keys(lc.cfg.cluster).config)
    return msgspec.json.decode(raw, type=M.ClusterSettings)


def test_settings_are_recorded_changed_and_survive_failover(make_cluster):
    lc = make_cluster(nodes=2, memory="32MiB", lease_ttl="4s")
    with lc.client() as c:
        first = c.config()
        assert first.replicas == 1 and first.lease_ttl_s == 4.0
        assert _record(lc) == first  # the first leader wrote its flags
        new = c.set_config(replicas=2, lease_ttl_s=7, low_watermark=0.5)
        assert (new.replicas, new.lease_ttl_s, new.low_watermark) == (2, 7.0, 0.5)
        assert c.config() == new == _record(lc)
        c.put("set/a", b"x" * 1000)  # placed with the new default replica count
        assert len(c.lookup(["set/a"])[0].replicas) == 2
        assert c.get_batch(["set/a"]) == [b"x" * 1000]
    # a standby started with other flags leads with the recorded settings, not its own
    lc.cfg = msgspec.structs.replace(lc.cfg, master=msgspec.structs.replace(lc.cfg.master, replicas=1,
                                                                            lease_ttl="2s"))
    standby = lc.start_master(wait_leader=False)
    lc.masters[0].kill()
    standby.wait_line("KVPOOL_LEADER", 20)
    with KVPoolClient(etcd=lc.etcd_endpoint, cluster=lc.cfg.cluster, rpc_timeout_s=20) as c:
        assert c.config() == new
        info = c.lookup(["set/a"])[0]
        assert len(info.replicas) == 2
        lease = c.rpc.call(M.Lookup(["set/a"], lease=True))[0]
        assert lease.lease_ttl_s == 7.0
        c.rpc.send_nowait(M.ReleaseLeases(["set/a"]))


@pytest.mark.parametrize("changes, err, match", [
    ({"replicas": 0}, E.ConfigError, "replicas: 0"),
    ({"replicas": 1.5}, E.ConfigError, "whole number"),
    ({"replicas": float("nan")}, E.ConfigError, "whole number"),
    ({"replicas": float("inf")}, E.ConfigError, "whole number"),
    ({"lease_ttl_s": 1e-6}, E.ConfigError, r"^lease_ttl: 1e-06 seconds; accepted: 0.1 to"),  # the config file's name
    ({"high_watermark": float("nan")}, E.ConfigError, "watermarks"),
    ({"low_watermark": 0.95}, E.ConfigError, "low_watermark <= high_watermark"),
    ({"lease_ttl_s": 0}, E.ConfigError, "lease_ttl"),
    ({"quarantine_s": -1}, E.ConfigError, "^quarantine: -1"),
    ({"nonsense": 1}, E.InvalidRequest, "unknown setting.*accepted: replicas"),
    ({"replicas": 2, "high_watermark": 2.0}, E.ConfigError, "watermarks"),  # all or nothing
])
def test_bad_settings_are_refused_and_change_nothing(cluster, changes, err, match):
    with cluster.client() as c:
        before = c.config()
        with pytest.raises(err, match=match):
            c.set_config(**changes)
        assert c.config() == before == _record(cluster)


def test_settings_cli(cluster):
    def kv(*args):
        return subprocess.run([sys.executable, "-m", "kvpool.cli", "settings", *args, "--master", cluster.master_addr],
                              capture_output=True, text=True, timeout=60)

    with cluster.client() as c:
        before = c.config()
    try:
        p = kv("--set", "max_handoff_ttl=2m", "--set", "high_watermark=0.95")
        assert p.returncode == 0, p.stderr
        assert "max_handoff_ttl" in p.stdout and "120s" in p.stdout and "0.95" in p.stdout
        got = json.loads(kv("--json").stdout)
        assert got["max_handoff_ttl_s"] == 120.0 and got["high_watermark"] == 0.95
        p = kv("--set", "replicas")
        assert p.returncode == 2 and "KEY=VALUE" in p.stderr
        p = kv("--set", "lease_ttl=soon")
        assert p.returncode == 2 and "lease_ttl" in p.stderr
        p = kv("--set", "put_timeout=0.01s")
        assert p.returncode == 2 and "put_timeout: 0.01 seconds; accepted: 0.1 to" in p.stderr and "_s" not in p.stderr
        with cluster.client() as c:
            nodes = len(c.stats().nodes)
        p = kv("--set", f"replicas={nodes + 1}")
        assert p.returncode == 0 and f"warning: replicas={nodes + 1} but {nodes} store node(s) take" in p.stdout
        assert "warning" not in kv("--set", f"replicas={nodes}").stdout
        with cluster.client() as c:
            c.drain("node-1")  # a draining node takes no new objects
            try:
                assert f"warning: replicas={nodes} but {nodes - 1} store node(s)" in kv("--set", f"replicas={nodes}").stdout
            finally:
                c.drain("node-1", undo=True)
    finally:
        with cluster.client() as c:
            c.set_config(**msgspec.structs.asdict(before))


def test_a_change_in_flight_refuses_another_and_lands_whole(make_cluster):
    """Two changes at once would each be built on the settings of their arrival, and the
    later would undo the earlier: while one is on its way to etcd, another is refused. (A
    6 s lease TTL: the leader is not fenced, DESIGN.md §8, during the 0.5 s etcd stall.)"""
    import os
    import signal
    import threading
    import time

    lc = make_cluster(nodes=1, memory="32MiB", node_ttl="6s")
    with lc.client() as c:
        before = c.config()
        got = {}
        freeze(lc.etcd.proc.pid)  # etcd hangs: the first write stays in flight
        try:
            t = threading.Thread(target=lambda: got.setdefault("a", _try(lambda: c.set_config(replicas=2))))
            t.start()
            time.sleep(0.5)
            with lc.client() as c2, pytest.raises(E.EtcdUnavailable, match="another settings change"):
                c2.set_config(lease_ttl_s=7)
        finally:
            os.kill(lc.etcd.proc.pid, signal.SIGCONT)
        t.join(20)
        # the first is answered (done, or "outcome unknown" after 3 s) and lands whole
        assert got["a"] is None or isinstance(got["a"], E.EtcdUnavailable)
        deadline = time.monotonic() + 10
        while c.config().replicas != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.config() == msgspec.structs.replace(before, replicas=2) == _record(lc)


def _try(fn):
    try:
        fn()
    except E.KVPoolError as e:
        return e
    return None


def test_max_handoff_ttl_bounds_publishes(cluster):
    from kvpool.protocol.layout import LayoutSpec, TensorSpec

    lay = LayoutSpec(kind="raw", tokens_per_block=1, tensors=(TensorSpec("b", (8,), "uint8"),))
    with cluster.client() as c:
        before = c.config()
        c.put("mh/a", bytes(8), lay)
        try:
            c.set_config(max_handoff_ttl_s=60)
            with pytest.raises(E.InvalidRequest, match="at most 60s, the cluster's max_handoff_ttl"):
                c.handoff_publish("mh-req", {"0": ["mh/a"]}, {"0": lay}, ttl_s=120)
            assert c.handoff_publish("mh-req", {"0": ["mh/a"]}, {"0": lay}, ttl_s=30).request_id == "mh-req"
            c.handoff_release("mh-req")
        finally:
            c.set_config(**msgspec.structs.asdict(before))


def test_master_flags_outside_the_settings_bounds_are_refused():
    p = subprocess.run([sys.executable, "-m", "kvpool.cli", "master", "--etcd", "http://127.0.0.1:1", "--replicas", "20"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "replicas: 20; accepted: 1 to 16" in p.stderr
