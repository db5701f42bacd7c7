"""The disk tier with real processes and real files (DESIGN.md §12): a working set three
times the nodes' memory written and read back byte-exact, a restarted store node and a
restarted cluster bringing back what their disk tiers hold, pins and hand-off holds across
tiers, and a node SIGKILLed during demotions."""
from __future__ import annotations

import os
import subprocess

import msgspec
import pytest

from kvpool.cli.cluster import LocalCluster, free_port, kvpool_argv
from kvpool.connector.client import KVPoolClient
from kvpool.protocol.config import load_config
from kvpool.protocol.messages import EvictSelector
from tests.conftest import _Started, wait_for

KiB, MiB = 1 << 10, 1 << 20
OBJ = 256 * KiB


def disk_config(tmp, nodes=2, memory="8MiB", disk="256MiB", replicas=1, master=None, **node):
    entries = [{"name": f"node-{i}", "memory": memory, "disk_dir": str(tmp / f"disk-{i}"), "disk_capacity": disk,
                **node} for i in range(nodes)]
    return load_config(None, {"storenodes": entries, "master": {"replicas": replicas, **(master or {})}}, environ={})


@pytest.fixture
def started():
    s = _Started()
    yield s
    s.close()


def start(s: _Started, cfg, **kw) -> LocalCluster:
    lc = LocalCluster(cfg, **kw)
    s.clusters.append(lc)
    lc.__enter__()
    for c in [*lc.nodes.values(), *lc.masters]:
        assert c.alive(), f"{c.name} died at start:\n{c.tail()}"
    return lc


def settled(c, high=0.9) -> bool:
    """No tier move under way and every node's memory under its high watermark."""
    st = c.stats()
    return all(n.tier_moves == 0 and n.used <= high * n.capacity for n in st.nodes)


def write(c, data: dict[str, bytes], batch_bytes: int = 2 * MiB, wait: bool = True) -> None:
    """Put ``data`` in batches of ``batch_bytes``, letting demotions catch up between batches
    (a put that finds memory full evicts, as without a disk tier: the writer paces itself)."""
    keys = list(data)
    per = max(1, batch_bytes // len(data[keys[0]]))
    for a in range(0, len(keys), per):
        part = keys[a:a + per]
        assert c.put_batch(part, [data[k] for k in part]) == [None] * len(part)
        if wait:
            wait_for(lambda: settled(c), 30, interval_s=0.01, what="demotions to catch up")


def tiers(c) -> dict[str, list[str]]:
    return {r.key: r.tiers for r in c.ls(limit=100000)}


def read_back(c, data: dict[str, bytes], keys=None) -> None:
    keys = list(data) if keys is None else keys
    got = c.get_batch(keys)
    bad = [k for k, g in zip(keys, got) if g != data[k]]
    assert not bad, f"{len(bad)} of {len(keys)} keys not read back byte-exact, e.g. {bad[0]!r}: {got[keys.index(bad[0])]!r:.200}"


def test_working_set_three_times_memory_reads_back_byte_exact(started, tmp_path):
    lc = start(started, disk_config(tmp_path))
    with lc.client() as c:
        data = {f"ws/{i}": os.urandom(OBJ) for i in range(3 * 16 * MiB // OBJ)}  # 3 x (2 nodes x 8 MiB)
        write(c, data)
        st = c.stats()
        assert st.objects == len(data) and st.disk_objects >= len(data) // 2, st
        assert not [k for k in st.counters if k.startswith("evictions_")], st.counters  # nothing lost
        assert st.counters["demotions"] == st.disk_objects and st.disk_used == st.disk_objects * OBJ
        on_disk = [k for k, t in tiers(c).items() if t == ["disk"]]
        read_back(c, data)
        # the network path too (a client that never maps the segment)
        with lc.client(transport="tcp") as tcp:
            read_back(tcp, data, on_disk[:40])
        # a disk object read twice (above) is promoted back into memory
        wait_for(lambda: c.stats().counters.get("promotions", 0) > 0, 10, what="a promotion")
        wait_for(lambda: settled(c), 30, what="promotions to finish")
        promoted = [k for k in on_disk if tiers(c)[k] == ["memory"]]
        assert promoted and c.stats().counters.get("promotions_failed", 0) == 0
        read_back(c, data, promoted)
        # kvpool status and ls show each tier
        env = dict(os.environ, COLUMNS="250")
        out = subprocess.run(kvpool_argv("status", "--master", lc.master_addr), capture_output=True, text=True,
                             env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "disk objects" in out.stdout and "demotions to disk" in out.stdout, out.stdout


def test_restarted_node_brings_back_its_disk_objects(started, tmp_path):
    cfg = disk_config(tmp_path)
    port = free_port()  # node-0's disk reads on a fixed port (storenodes[].disk_port), the others on any
    cfg = msgspec.structs.replace(cfg, storenodes=[msgspec.structs.replace(cfg.storenodes[0], disk_port=port),
                                                   cfg.storenodes[1]])
    lc = start(started, cfg)
    with lc.client() as c:
        data = {f"rs/{i}": os.urandom(OBJ) for i in range(3 * 8 * MiB // OBJ)}
        write(c, data)
        where = {r.key: (r.nodes, r.tiers) for r in c.ls(limit=100000)}
        mine = [k for k, (n, t) in where.items() if n == ["node-0"] and t == ["disk"]]
        assert len(mine) > 5
        lc.kill_node("node-0")  # SIGKILL: its memory is gone, its disk tier is not
        lc.wait_nodes(1)
        wait_for(lambda: not any(c.exists_batch(mine)), 10, what="node-0's objects to leave the index")
        lc.start_node("node-0", "8MiB")
        lc.wait_nodes(2)
        wait_for(lambda: all(c.exists_batch(mine)), 15, what="node-0's disk objects to come back")
        assert {r.data_addr for i in c.lookup(mine) for r in i.replicas} == {f"tcp://127.0.0.1:{port}"}
        read_back(c, data, mine)
        log = open(lc.nodes["node-0"].log_path).read()
        assert f"{len(mine)} object(s)" in log and "dropping" not in log, log[-2000:]


@pytest.mark.slow
def test_whole_cluster_restart_keeps_what_is_on_disk(started, tmp_path):
    cfg = disk_config(tmp_path)
    lc = start(started, cfg)
    with lc.client() as c:
        data = {f"wc/{i}": os.urandom(OBJ) for i in range(2 * 16 * MiB // OBJ)}
        write(c, data)
        on_disk = [k for k, t in tiers(c).items() if t == ["disk"]]
    lc.stop()  # everything: store nodes, master and etcd (its data goes with the run directory)
    lc2 = start(started, cfg)
    with lc2.client() as c:
        wait_for(lambda: all(c.exists_batch(on_disk)), 15, what="the disk objects to be indexed")
        assert c.stats().objects == len(on_disk)
        read_back(c, data, on_disk)
        c.put("new", b"x" * 1000)  # and the restarted cluster takes new objects beside them
        assert c.get("new") == b"x" * 1000


@pytest.mark.slow
def test_disk_objects_survive_a_master_failover_and_a_drain_copies_from_disk(started, tmp_path):
    lc = start(started, disk_config(tmp_path, master={"node_ttl": "1s"}))
    standby = lc.start_master(wait_leader=False)
    with lc.client() as c:
        data = {f"fo/{i}": os.urandom(OBJ) for i in range(2 * 16 * MiB // OBJ)}
        write(c, data)
        before = {r.key: list(zip(r.nodes, r.tiers)) for r in c.ls(limit=100000)}
        pinned = next(k for k, w in before.items() if w == [("node-0", "disk")])
        c.pin(pinned)
    lc.masters[0].kill()
    standby.wait_line("KVPOOL_LEADER", 20)
    with KVPoolClient(etcd=lc.etcd_endpoint, cluster=lc.cfg.cluster, rpc_timeout_s=20) as c:
        # the new leader indexed every node's memory and disk rows: same objects, same tiers
        wait_for(lambda: c.stats().objects == len(data), 20, what="the rebuilt index")
        assert {r.key: list(zip(r.nodes, r.tiers)) for r in c.ls(limit=100000)} == before
        read_back(c, data)
        # a drain moves the pinned object off node-0: copied from its file to node-1
        c.drain("node-0")
        # ls lists by prefix: pick the pinned key's own row (fo/1 also prefixes fo/10, fo/100, ...)
        wait_for(lambda: [r.nodes for r in c.ls(pinned) if r.key == pinned] == [["node-1"]], 20,
                 what="the pinned object to move")
        assert c.stats().counters.get("repairs_done", 0) >= 1 and c.get(pinned) == data[pinned]


def test_pins_and_holds_keep_their_meaning_across_tiers(started, tmp_path):
    # one node: 8 MiB of memory, a disk tier of 8 MiB (high watermark 95%)
    lc = start(started, disk_config(tmp_path, nodes=1, memory="8MiB", disk="8MiB"))
    with lc.client() as c:
        c.put("pinned", os.urandom(OBJ))
        c.put("held", os.urandom(OBJ))
        c.pin("pinned")
        c.handoff_publish("req-1", {"0": ["held"]}, {}, ttl_s=600)
        data = {f"fill/{i}": os.urandom(OBJ) for i in range(64)}  # 16 MiB: past memory and disk
        write(c, dict(list(data.items())[:40]))
        t = tiers(c)
        assert t["pinned"] == ["memory"] and t["held"] == ["memory"]  # never demoted
        cold = next(k for k in data if t.get(k) == ["disk"])
        c.pin(cold)  # a disk object pinned: never evicted from disk
        write(c, dict(list(data.items())[40:]))
        st = c.stats()
        assert st.counters.get("evictions_disk", 0) > 0, st.counters  # the disk tier evicted, LRU ...
        assert all(c.exists_batch(["pinned", "held", cold]))  # ... but not what is pinned or held
        assert tiers(c)[cold] == ["disk"] and c.get(cold) == data[cold]
        assert st.nodes[0].disk_used <= 0.95 * st.nodes[0].disk_capacity
        # an admin eviction spans both tiers, and a forced one removes pinned disk objects too
        rep = c.evict(EvictSelector(prefix="fill/"))
        assert rep.skipped_pinned == 1 and rep.removed >= 1 and c.exists(cold)
        st = c.stats()
        assert st.disk_objects == 1 and st.nodes[0].disk_used == OBJ  # only the pinned one is left on disk


@pytest.mark.chaos
def test_node_killed_during_demotions_loses_no_acknowledged_object(started, tmp_path):
    # two replicas; demotions paced at 2 MiB/s so that some are under way when node-0 dies
    lc = start(started, disk_config(tmp_path, memory="16MiB", replicas=2, disk_write_rate="2MiB"))
    with lc.client() as c:
        data = {f"ck/{i}": os.urandom(OBJ) for i in range(24 * MiB // OBJ)}
        keys = list(data)
        write(c, {k: data[k] for k in keys[:-8]})  # 1.4 x memory, every put acknowledged on both nodes
        write(c, {k: data[k] for k in keys[-8:]}, wait=False)  # and 2 MiB more: demotions start
        disk0 = tmp_path / "disk-0"
        wait_for(lambda: any(n.endswith(".tmp") for n in os.listdir(disk0)), 10, what="a file being written")
        lc.kill_node("node-0")
        lc.wait_nodes(1)
        read_back(c, data)  # no acknowledged object lost, no wrong byte: node-1 holds them all
        published = sorted(n for n in os.listdir(disk0) if n.endswith(".kvd"))
        assert [n for n in os.listdir(disk0) if n.endswith(".tmp")], "the kill did not cut a write short"
        with open(disk0 / published[0], "r+b") as f:  # and a published file damaged, as by a lost cache
            f.truncate(os.path.getsize(disk0 / published[0]) // 2)
        lc.start_node("node-0", "16MiB")
        lc.wait_nodes(2)
        log = open(lc.nodes["node-0"].log_path).read()
        assert "an unfinished write" in log and "cut short" in log, log[-2000:]
        assert not [n for n in os.listdir(disk0) if n.endswith(".tmp")] and not (disk0 / published[0]).exists()
        # the restarted node's table brought back every other file it published
        wait_for(lambda: sum(("node-0", "disk") in zip(r.nodes, r.tiers) for r in c.ls(limit=100000))
                 == len(published) - 1, 15, what="node-0's files to be indexed")
        back = [r.key for r in c.ls(limit=100000) if ("node-0", "disk") in zip(r.nodes, r.tiers)]
        read_back(c, data)
        lc.kill_node("node-1")  # node-0 alone: what it brought back reads back byte-exact from its disk
        lc.wait_nodes(1)
        wait_for(lambda: all(n.node_id == "node-0" for n in c.stats().nodes), 10, what="node-1 to leave")
        read_back(c, data, back)
