"""etcd hygiene: bounded history (compaction), a full etcd (NOSPACE), several endpoints.

Real etcd servers and real master/store-node processes throughout: the embedded etcd of
:class:`cli.cluster.LocalCluster`, or a three-member etcd cluster started here.
"""
import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aetcd
import aetcd.exceptions
import msgspec
import pytest
from aetcd import rpc

from kvpool.cli.cluster import Child, find_etcd, free_port
from kvpool.connector.client import KVPoolClient
from kvpool.protocol import errors as E
from kvpool.protocol import messages as M
from kvpool.protocol.config import load_config
from kvpool.protocol.etcd import Etcd, Keys, parse_endpoints, read_key_sync
from tests.conftest import wait_for

MiB = 1 << 20


def etcd_do(endpoints: str, fn):
    """Run ``await fn(etcd)`` on a fresh :class:`Etcd` connection; its result."""
    async def go():
        async with Etcd(endpoints) as e:
            return await fn(e)

    return asyncio.run(go())


def status(endpoints: str):
    return etcd_do(endpoints, lambda e: e.status())


# ---- config -----------------------------------------------------------------------------


def test_etcd_config_keys_are_checked_and_name_the_key():
    cfg = load_config(None, environ={})
    assert cfg.etcd.compaction_flags() == ["--auto-compaction-mode=periodic", "--auto-compaction-retention=300000ms",
                                           f"--quota-backend-bytes={2 << 30}"]
    cfg = load_config(None, {"etcd": {"auto_compaction_mode": "revision", "auto_compaction_retention": 5000,
                                      "quota_backend": "64MiB"}}, environ={})
    assert cfg.etcd.compaction_flags() == ["--auto-compaction-mode=revision", "--auto-compaction-retention=5000",
                                           f"--quota-backend-bytes={64 * MiB}"]
    for over, key in [({"etcd": {"quota_backend": "lots"}}, "etcd.quota_backend"),
                      ({"etcd": {"quota_backend": "4KiB"}}, "etcd.quota_backend"),
                      ({"etcd": {"auto_compaction_mode": "hourly"}}, "etcd.auto_compaction_mode"),
                      ({"etcd": {"auto_compaction_retention": "soon"}}, "etcd.auto_compaction_retention"),
                      ({"etcd": {"auto_compaction_mode": "revision", "auto_compaction_retention": "5m"}},
                       "etcd.auto_compaction_retention"),
                      ({"etcd": {"endpoint": "http://127.0.0.1:2379,https://10.0.0.2:2379"}}, "etcd.endpoint"),
                      ({"master": {"etcd_compaction_interval": "often"}}, "master.etcd_compaction_interval"),
                      ({"master": {"etcd_compaction_retention": -1}}, "master.etcd_compaction_retention")]:
        with pytest.raises(E.ConfigError) as ei:
            load_config(None, over, environ={})
        assert ei.value.fields["key"] == key and key in str(ei.value)
    with pytest.raises(E.ConfigError, match="KVPOOL_ETCD__QUOTA_BACKEND"):
        load_config(None, environ={"KVPOOL_ETCD__QUOTA_BACKEND": "much"})


def test_several_endpoints_are_parsed_and_each_url_checked():
    assert parse_endpoints(" http://127.0.0.1:2379,127.0.0.1:2380 ,http://[::1]:2381") == [
        "http://127.0.0.1:2379", "http://127.0.0.1:2380", "http://[::1]:2381"]
    assert load_config(None, {"etcd": {"endpoint": ["http://a:1", "b:2"]}}, environ={}).etcd.endpoints() == [
        "http://a:1", "http://b:2"]
    for bad, why in [("http://a:2379,", "empty entry"), ("https://a:2379", "https is not supported"),
                     ("a", "needs a port"), ("http://a:0", "1..65535"), ("http://a:x", "1..65535"),
                     ("http://a:1/v3", "no path"), ("http://:1", "needs a host")]:
        with pytest.raises(E.ConfigError, match=why) as ei:
            parse_endpoints(bad)
        assert bad.split(",")[0] in str(ei.value) or "empty" in why
    with pytest.raises(E.ConfigError, match="https"):  # the client checks before any connection
        KVPoolClient(etcd="http://127.0.0.1:2379,https://127.0.0.1:2380")


def test_wire_mapping_knows_etcd_full():
    err = E.EtcdFull("full; defrag", endpoint="http://x:1")
    back = E.from_wire(msgspec.msgpack.decode(M.encode(err.to_wire()), type=E.ErrorInfo))
    assert type(back) is E.EtcdFull and isinstance(back, E.EtcdUnavailable) and back.fields == err.fields


# ---- embedded etcd: data_dir, auto-compaction -------------------------------------------


def test_embedded_etcd_honours_data_dir(make_cluster, tmp_path):
    data = tmp_path / "etcd"
    lc = make_cluster(nodes=1, memory="16MiB", etcd={"data_dir": str(data)})
    with lc.client() as c:
        c.put("dd/k", b"v")
        c.pin("dd/k")
    assert (data / "member").is_dir()
    endpoint, keys = lc.etcd_endpoint, Keys(lc.cfg.cluster)
    lc.stop()
    assert (data / "member").is_dir()  # a configured data dir outlives its cluster
    # a fresh etcd process on other ports, same data; the node takes its name back once the
    # lease of its first run lapses
    lc2 = make_cluster(nodes=1, memory="16MiB", etcd={"data_dir": str(data)})
    assert lc2.etcd_endpoint != endpoint
    assert read_key_sync(lc2.etcd_endpoint, keys.pin("dd/k")) is not None


def test_embedded_etcd_compacts_its_history(make_cluster):
    lc = make_cluster(nodes=0, etcd={"auto_compaction_retention": "1s"}, etcd_compaction_interval=0)
    assert "--auto-compaction-retention=1000ms" in lc._etcd_argv

    async def write(e: Etcd) -> int:
        for i in range(20):
            await e.put("/kvpool/test/auto", str(i).encode())
        return (await e.status()).revision

    rev = etcd_do(lc.etcd_endpoint, write)

    async def compacted_at(e: Etcd) -> bool:  # a read at an old revision fails once etcd compacted past it
        try:
            await e.client.kvstub.Range(rpc.RangeRequest(key=b"/kvpool/test/auto", revision=rev - 5), timeout=2)
        except rpc.AioRpcError as err:
            return "compacted" in (err.details() or "")
        return False

    wait_for(lambda: etcd_do(lc.etcd_endpoint, compacted_at), 20, 0.5, what="etcd's own compaction")


# ---- many hand-offs: history stays bounded ----------------------------------------------

HANDOFFS = 10_000
QUOTA = 8 * MiB  # 10,000 records of ~1.2 KiB write more than this (etcd's history of them: ~16 MiB)


@pytest.mark.slow
def test_10k_handoffs_keep_etcd_small(make_cluster):
    """Publish + ack 10,000 hand-offs against an embedded etcd with an 8 MiB quota and its
    own compaction off: the leader's compaction alone keeps the database bounded, every call
    succeeds, and no record of a finished hand-off stays in etcd."""
    lc = make_cluster(nodes=1, memory="16MiB", etcd={"quota_backend": QUOTA, "auto_compaction_retention": 0},
                      etcd_compaction_interval="1s", etcd_compaction_retention=1000)
    keys = [f"tiny/{i}" for i in range(64)]
    extra = {"kv_transfer_params": "p" * 1000}  # what a vLLM producer attaches, roughly
    sizes: list[int] = []
    with lc.client() as c:
        assert c.put_batch(keys, [b"t" * 32] * len(keys)) is not None

        def one(i: int) -> int:
            rid = f"hyg-{i}"
            rec = c.handoff_publish(rid, {"0": [keys[(i + j) % 64] for j in range(8)]}, {}, ttl_s=600, extra=extra)
            c.handoff_ack(rid)
            return len(M.encode(rec))

        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as ex:  # the master pipelines: several calls in flight
            for n, size in enumerate(ex.map(one, range(HANDOFFS))):
                sizes.append(size)
                if n % 1000 == 0:
                    db = status(lc.etcd_endpoint).db_size
                    assert db < QUOTA // 2, f"etcd db {db} B after {n} hand-offs"
        took = time.monotonic() - t0
        st = c.stats()
    end = status(lc.etcd_endpoint)
    written = sum(sizes)
    print(f"{HANDOFFS} hand-offs in {took:.1f}s; {written / MiB:.1f} MiB of records written; etcd db "
          f"{end.db_size / MiB:.2f} MiB ({end.db_size_in_use / MiB:.2f} MiB in use) at revision {end.revision}")
    assert written > QUOTA  # without compaction this much history could not fit in the quota
    assert end.db_size < QUOTA // 2
    assert st.counters["handoffs_acked"] == HANDOFFS
    wait_for(lambda: not etcd_do(lc.etcd_endpoint, lambda e: e.get_prefix(Keys(lc.cfg.cluster).handoffs)), 10,
             what="every finished hand-off's record deleted")


# ---- a full etcd ------------------------------------------------------------------------


async def _fill(e: Etcd) -> int:
    """Write big values until etcd refuses with NOSPACE; how many landed."""
    n = 0
    while True:
        try:
            await e.put(f"/fill/{n}", b"f" * (256 << 10))
        except E.EtcdFull:
            return n
        n += 1


async def _free_space(e: Etcd) -> None:
    """What the EtcdFull message says to do: delete, compact, defragment, disarm the alarm."""
    await e.client.delete_prefix(b"/fill/")
    await e.client.compact((await e.status()).revision, physical=True)
    await e.client.defragment()
    for alarm in [a async for a in e.client.list_alarms()]:  # as `etcdctl alarm disarm` does: each member's
        await e.client.disarm_alarm(alarm.member_id)
    assert (await e.status()).db_size < MiB


@pytest.mark.chaos
def test_a_full_etcd_fails_pins_and_handoffs_clearly_and_serves_data(make_cluster):
    lc = make_cluster(nodes=2, memory="32MiB", node_ttl="1s", etcd={"quota_backend": "2MiB"})
    with lc.client() as c:
        c.put("full/a", b"a" * 1000, replicas=2)  # on both nodes: it outlives node-1's restart below
        c.handoff_publish("full-before", {"0": ["full/a"]}, {}, ttl_s=60)
        assert etcd_do(lc.etcd_endpoint, _fill) > 0
        fix = r"compact.*defrag.*alarm disarm.*--quota-backend-bytes"
        with pytest.raises(E.EtcdFull, match="pins need etcd and nothing was changed: etcd at .* is full.*" + fix):
            c.pin("full/a")
        with pytest.raises(E.EtcdFull, match="hand-off records need etcd.*is full.*" + fix):
            c.handoff_publish("full-req", {"0": ["full/a"]}, {}, ttl_s=60)
        c.handoff_ack("full-before")  # deleting a record needs no space
        # the data plane does not need etcd: plain puts and gets go on
        for i in range(20):
            assert c.put(f"full/p{i}", bytes([i]) * 4096) is True
            assert c.get(f"full/p{i}") == bytes([i]) * 4096
        assert c.get("full/a") == b"a" * 1000

        # a restarting store node cannot take a lease: it stops at once and says why
        lc.kill_node("node-1")
        with pytest.raises(E.KVPoolError, match="exited with code 2") as ei:
            lc.start_node("node-1", "32MiB")
        assert "is full" in str(ei.value) and "defrag" in str(ei.value)
        # a standby master waits for room instead of dying or looping silently
        standby = lc.start_master(wait_leader=False)
        wait_for(lambda: "cannot campaign for leadership: etcd at" in open(standby.log_path).read(), 10,
                 what="the standby's log to name the full etcd")
        assert standby.alive()

        etcd_do(lc.etcd_endpoint, _free_space)  # the fix the message names works
        wait_for(lambda: _try(lambda: c.pin("full/a")), 10, what="pins to work again")
        lc.start_node("node-1", "32MiB")
        assert c.handoff_publish("full-after", {"0": ["full/a"]}, {}, ttl_s=60).request_id == "full-after"


def _try(fn) -> bool:
    try:
        fn()
        return True
    except E.EtcdUnavailable:
        return False


# ---- several etcd endpoints -------------------------------------------------------------


class EtcdCluster:
    """Three etcd members on loopback ports, started by the test."""

    def __init__(self, run_dir: str, n: int = 3) -> None:
        self.names = [f"e{i}" for i in range(n)]
        self.client_urls = [f"http://127.0.0.1:{free_port()}" for _ in self.names]
        peers = [f"http://127.0.0.1:{free_port()}" for _ in self.names]
        initial = ",".join(f"{name}={p}" for name, p in zip(self.names, peers))
        self.members: dict[str, Child] = {}
        for name, url, peer in zip(self.names, self.client_urls, peers):
            argv = [find_etcd(), "--name", name, "--data-dir", os.path.join(run_dir, name),
                    "--listen-client-urls", url, "--advertise-client-urls", url,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", initial, "--initial-cluster-state", "new",
                    "--initial-cluster-token", "kvpool-test"]
            self.members[url] = Child(name, argv, run_dir)
        for url in self.client_urls:
            wait_for(lambda u=url: _reads(u), 30, 0.2, what=f"etcd member {url}")

    def raft_leader(self) -> str:
        async def go():
            async with aetcd.Client(*self.client_urls[0][len("http://"):].split(":")) as c:
                return (await c.status()).leader.client_urls[0]

        return asyncio.run(go())

    def stop(self) -> None:
        for m in self.members.values():
            m.stop()


def _reads(url: str) -> bool:
    try:
        read_key_sync(url, "/kvpool/ping", timeout_s=1.0)
        return True
    except (E.KVPoolError, aetcd.exceptions.ClientError):
        return False


@pytest.mark.chaos
@pytest.mark.parametrize("victim", ["raft leader", "follower"])
def test_master_node_and_client_fail_over_between_etcd_members(tmp_path, make_cluster, victim):
    """Everyone is given all three members, the victim first (so everyone uses it); SIGKILL
    it: after a bounded pause pins and hand-offs work again on the other two, puts and gets
    never stop, the nodes stay registered, and new clients and nodes start on the rest."""
    ec = EtcdCluster(str(tmp_path))
    try:
        lead = ec.raft_leader()
        first = lead if victim == "raft leader" else next(u for u in ec.client_urls if u != lead)
        endpoints = ",".join([first, *[u for u in ec.client_urls if u != first]])
        lc = make_cluster(nodes=2, memory="32MiB", node_ttl="2s", etcd={"endpoint": endpoints})
        assert lc.etcd is None  # no embedded etcd: the three members above
        with KVPoolClient(etcd=endpoints, cluster=lc.cfg.cluster, rpc_timeout_s=20) as c:
            c.put("mm/0", b"0" * 1000)
            c.pin("mm/0")
            c.handoff_publish("mm-r0", {"0": ["mm/0"]}, {}, ttl_s=60)
            c.handoff_ack("mm-r0")

            done = threading.Event()
            data: dict = {"n": 0, "slowest": 0.0, "errors": []}

            def data_plane() -> None:  # puts and gets all along, from another thread
                while not done.is_set():
                    k, t = f"dp/{data['n']}", time.monotonic()
                    try:
                        assert c.put(k, b"d" * 1000) is True and c.get(k) == b"d" * 1000
                    except Exception as e:  # noqa: BLE001 - collected, asserted below
                        data["errors"].append(repr(e))
                    data["slowest"] = max(data["slowest"], time.monotonic() - t)
                    data["n"] += 1

            ec.members[first].kill(signal.SIGKILL)
            t0 = time.monotonic()
            mover = threading.Thread(target=data_plane)
            mover.start()
            back, i = None, 0
            try:
                while back is None:
                    assert time.monotonic() - t0 < 30, "pins and hand-offs did not come back within 30s"
                    i += 1
                    c.put(f"mm/{i}", b"x" * 1000)
                    try:
                        c.pin(f"mm/{i}")
                        c.handoff_publish(f"mm-r{i}", {"0": [f"mm/{i}"]}, {}, ttl_s=60)
                        c.handoff_ack(f"mm-r{i}")
                        back = time.monotonic() - t0
                    except E.EtcdUnavailable:
                        time.sleep(0.05)
                for j in range(i + 1, i + 21):  # and they keep working, every one
                    c.put(f"mm/{j}", b"y" * 1000)
                    c.pin(f"mm/{j}")
                    c.handoff_publish(f"mm-r{j}", {"0": [f"mm/{j}"]}, {}, ttl_s=60)
                    c.handoff_ack(f"mm-r{j}")
            finally:
                done.set()
                mover.join(30)
            print(f"killed etcd member {first} ({victim}, everyone's first endpoint): pins and hand-offs back after "
                  f"{back:.2f}s; {data['n']} put+get pairs meanwhile, slowest {data['slowest'] * 1000:.0f}ms")
            assert back < 15 and not data["errors"] and data["n"] > 0
            time.sleep(2 * 2 + 1)  # past the node TTL: the nodes' leases were kept alive on the others
            st = c.stats()
            assert len(st.nodes) == 2 and st.counters["handoffs_acked"] == 22
            assert [ln for ln in lc.masters[0].lines if ln.startswith("KVPOOL_LEADER")] == [
                f"KVPOOL_LEADER master {lc.master_addr}"]  # it led throughout: its lease never lapsed
        lc.start_node("node-2", "32MiB")  # a new node registers through the surviving members
        lc.wait_nodes(3)
        with KVPoolClient(etcd=endpoints, cluster=lc.cfg.cluster, rpc_timeout_s=20) as c2:  # a new client
            assert c2.get("mm/0") == b"0" * 1000
            with pytest.raises(E.Pinned):  # pins taken before and after the kill hold
                c2.remove("mm/0")
            with pytest.raises(E.Pinned):
                c2.remove(f"mm/{i + 20}")
    finally:
        ec.stop()
