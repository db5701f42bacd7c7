"""An acknowledged put keeps every replica it reports (DESIGN.md §5), over real etcd, master
and store-node processes: reservations never make a put short while the cluster has room,
a store node that died before a put confirmed is never counted as one of its replicas (the
same-host path copies into a mapping that outlives the node), and reserved puts in flight
through a leader's SIGKILL lose nothing they acknowledged.

Each chaos test records, per acknowledged put, the bytes' hash and the replica count the put
reported, and reads every one back byte-exact afterwards."""
import os
import signal
import threading
import time

import pytest
import xxhash

from kvpool.connector.client import KVPoolClient
from kvpool.protocol import errors as E
from tests.conftest import wait_for

KiB = 1 << 10


def test_reservations_never_make_a_put_short_with_room_to_spare(make_cluster):
    """Three nodes of 32 MiB, two replicas: reservations held ahead are capped per node, but
    a put is never stored on fewer replicas than asked while two nodes have room."""
    lc = make_cluster(nodes=3, memory="32MiB", replicas=2)
    with lc.client() as c:
        data = {f"s/{i}": os.urandom(128 * KiB) for i in range(40)}
        keys = list(data)
        single = [c.put_batch_results([k], [data[k]])[0] for k in keys[:20]]
        batch = c.put_batch_results(keys[20:], [data[k] for k in keys[20:]])
        for r in single + batch:
            assert r.ok and r.stored and r.replicas == r.replicas_wanted == 2 and not r.short, r
        for info in c.lookup(keys):
            assert len({x.node_id for x in info.replicas}) == 2
        assert c.stats().under_replicated == 0
        for k, v in data.items():
            assert c.get(k) == v


def _node_ids(c: KVPoolClient, key: str) -> list[str]:
    info = c.lookup([key])[0]
    return [] if info is None else [r.node_id for r in info.replicas]


@pytest.mark.chaos
@pytest.mark.parametrize("replicas,path", [(1, "auto"), (2, "auto"), (2, "tcp")])
def test_a_node_killed_before_puts_is_never_counted(make_cluster, replicas, path):
    """Puts made after a store node was SIGKILLed (before the master noticed) never count it,
    and with replicas=1 none of them is lost once its lease lapses: the write path confirms
    each same-host replica's node after the copy, and re-places what it cannot confirm."""
    lc = make_cluster(nodes=3, memory="32MiB", replicas=replicas, node_ttl="1s")
    with lc.client(transport=path) as c:
        before = {f"k/a{i}": os.urandom(64 * KiB) for i in range(20)}
        keys = list(before)
        for part in (keys[:10], keys[10:]):  # a size put twice is reserved ahead of need
            assert all(r.ok for r in c.put_batch_results(part, [before[k] for k in part]))
        assert c.reservations_held() > 0  # reservations on every node, the killed one's included
        lc.kill_node("node-1")  # returns once the process is reaped
        after = {f"k/b{i}": os.urandom(64 * KiB) for i in range(40)}
        keys = list(after)
        results = c.put_batch_results(keys[:20], [after[k] for k in keys[:20]])
        results += [c.put_batch_results([k], [after[k]])[0] for k in keys[20:]]
        for k, r in zip(keys, results):
            assert r.ok and r.stored, r
            nodes = _node_ids(c, k)
            assert "node-1" not in nodes, (k, nodes)
            assert len(set(nodes)) == r.replicas == min(replicas, 2), (k, nodes, r)
        wait_for(lambda: len(c.stats().nodes) == 2, 20, what="the killed node dropped")
        for k, v in after.items():
            assert c.get(k) == v, k
        for k, v in before.items():
            got = c.get(k)
            assert got == v or (replicas == 1 and got is None), k  # replicas=1: it may have lived on node-1


@pytest.mark.chaos
def test_puts_in_flight_through_a_leader_kill_keep_their_replicas(make_cluster):
    """Several writers put through reservations into tight memory while the leader is
    SIGKILLed; the standby rebuilds the index from the nodes' tables. Every put that was
    acknowledged reads back byte-exact and has at least the replicas it reported."""
    lc = make_cluster(nodes=3, memory="32MiB", replicas=2, node_ttl="1s")
    standby = lc.start_master(wait_leader=False)
    per_writer = 240  # 3 x 240 x 32 KiB x 2 replicas = 45 MiB of 96: no eviction
    acked: dict[str, tuple[int, int]] = {}  # key -> (xxh3_64, replicas reported)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        with KVPoolClient(etcd=lc.etcd_endpoint, cluster=lc.cfg.cluster, rpc_timeout_s=30,
                          security=lc.security) as c:
            i = 0
            while i < per_writer:
                keys = [f"f/{w}/{i + j}" for j in range(4)]
                vals = [os.urandom(32 * KiB) for _ in keys]
                try:
                    res = c.put_batch_results(keys, vals)
                except (E.NotLeader, E.LeaderFenced, E.Timeout, E.NodeUnavailable) as e:
                    errors.append(e)  # the election: nothing acknowledged, try the next batch
                    res = []
                for k, v, r in zip(keys, vals, res):
                    if r.ok and r.stored:
                        with lock:
                            acked[k] = (xxhash.xxh3_64_intdigest(v), r.replicas)
                    elif not r.ok and not isinstance(r.error, (E.NotLeader, E.LeaderFenced, E.PutRevoked,
                                                               E.NodeUnavailable, E.Timeout)):
                        errors.append(r.error)
                i += len(keys)

    ts = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(3)]
    for t in ts:
        t.start()
    wait_for(lambda: len(acked) >= 150, 60, what="puts before the leader is killed")
    lc.masters[0].kill(signal.SIGKILL)
    standby.wait_line("KVPOOL_LEADER", 30)
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts), "a writer hung"
    unexpected = [e for e in errors if not isinstance(e, E.KVPoolError)]
    assert not unexpected, unexpected
    with KVPoolClient(etcd=lc.etcd_endpoint, cluster=lc.cfg.cluster, rpc_timeout_s=30,
                      security=lc.security) as c:
        assert c.stats().counters.get("evictions_watermark", 0) == 0
        keys = list(acked)
        infos = c.lookup(keys)
        short = [(k, info) for k, info in zip(keys, infos)
                 if info is None or len({r.node_id for r in info.replicas}) < acked[k][1]]
        assert not short, f"{len(short)} of {len(keys)} acknowledged puts lost replicas: {short[:3]}"
        got = c.get_batch(keys)
        wrong = [k for k, g in zip(keys, got) if not isinstance(g, bytes) or xxhash.xxh3_64_intdigest(g) != acked[k][0]]
        why = [(k, acked[k][2], g if not isinstance(g, bytes) else "other bytes", c.lookup([k])[0])
               for k, g in zip(keys, got) if k in wrong[:3]]
        assert not wrong, f"{len(wrong)} of {len(keys)} acknowledged puts unreadable or wrong: {why}"


@pytest.mark.chaos
def test_puts_in_flight_through_a_node_kill_count_only_live_replicas(make_cluster):
    """Writers put while a store node is SIGKILLed. A put that started after the kill never
    counts the dead node; every acknowledged put stays readable byte-exact with replicas=2."""
    lc = make_cluster(nodes=3, memory="64MiB", replicas=2, node_ttl="1s")
    acked: dict[str, tuple[int, float, list[str]]] = {}  # key -> (xxh3_64, started at, node ids)
    lock = threading.Lock()
    killed_at = [float("inf")]
    stop = threading.Event()

    def writer(w: int) -> None:
        with lc.client(io_timeout_s=5) as c:
            i = 0
            while not stop.is_set() and i < 400:
                keys = [f"n/{w}/{i + j}" for j in range(2)]
                vals = [os.urandom(32 * KiB) for _ in keys]  # 1200 x 32 KiB x 2: 59% of the two survivors
                t0 = time.monotonic()
                for k, v, r in zip(keys, vals, c.put_batch_results(keys, vals)):
                    if r.ok and r.stored:
                        nodes = _node_ids(c, k)
                        with lock:
                            acked[k] = (xxhash.xxh3_64_intdigest(v), t0, nodes)
                i += len(keys)

    ts = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(3)]
    for t in ts:
        t.start()
    wait_for(lambda: len(acked) >= 200, 60, what="puts before the node is killed")
    lc.kill_node("node-2")
    killed_at[0] = time.monotonic()
    for t in ts:
        t.join(120)
    stop.set()
    assert not any(t.is_alive() for t in ts), "a writer hung"
    counted = [k for k, (_, t0, nodes) in acked.items() if t0 > killed_at[0] and "node-2" in nodes]
    assert not counted, f"{len(counted)} puts made after the kill count the dead node: {counted[:3]}"
    with lc.client() as c:
        wait_for(lambda: len(c.stats().nodes) == 2, 20, what="the killed node dropped")
        evicted = {k: v for k, v in c.stats().counters.items() if k.startswith("evictions_") and v}
        assert not evicted, f"the workload reached the watermark ({evicted}): a missing object would be evicted"
        keys = list(acked)
        got = c.get_batch(keys)
        wrong = [k for k, g in zip(keys, got) if not isinstance(g, bytes) or xxhash.xxh3_64_intdigest(g) != acked[k][0]]
        why = [(k, acked[k][2], g if not isinstance(g, bytes) else "other bytes", c.lookup([k])[0])
               for k, g in zip(keys, got) if k in wrong[:3]]
        assert not wrong, f"{len(wrong)} of {len(keys)} acknowledged puts unreadable or wrong: {why}"
