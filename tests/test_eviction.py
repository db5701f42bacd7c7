"""Leases, pins, watermark eviction and stuck writers on a real cluster (DESIGN.md §5–6)."""
import os
import subprocess
import sys
import threading
import time

import pytest
import xxhash

from kvpool.protocol import errors as E
from kvpool.protocol import messages as M
from tests.conftest import wait_for

MiB = 1 << 20


def used(c):
    """Bytes of data per node (the extents reserved ahead for writers left out)."""
    return {n.node_id: n.used - n.reserved for n in c.stats().nodes}


def test_watermark_eviction_keeps_recent(make_cluster):
    lc = make_cluster(nodes=1, memory="64MiB")
    with lc.client() as c:
        blob = os.urandom(MiB)
        for i in range(50):
            c.put(f"w/{i}", blob)
        for i in range(5):  # touch the five oldest: they become the most recently used
            assert c.get(f"w/{i}") == blob
        for i in range(50, 58):  # the 58th MiB crosses 0.9 x 64 MiB: eviction down to <= 0.8
            c.put(f"w/{i}", blob)
        st = c.stats()
        node = st.nodes[0]
        assert node.used - node.reserved <= 0.8 * node.capacity  # data; reserved ahead: at most 1/16
        assert node.reserved <= node.capacity / 16
        alive = set(k for k, e in zip([f"w/{i}" for i in range(58)], c.exists_batch([f"w/{i}" for i in range(58)]))
                    if e)
        assert {f"w/{i}" for i in range(5)} <= alive, "recently used objects were evicted"
        assert {f"w/{i}" for i in range(50, 58)} <= alive
        assert "w/5" not in alive and "w/6" not in alive  # the least recently used went first
        assert st.counters.get("evictions_watermark", 0) >= 1


def test_slow_reader_under_eviction_pressure_gets_right_bytes(make_cluster):
    lc = make_cluster(nodes=1, memory="64MiB")
    payloads = {f"hot/{i}": os.urandom(MiB) for i in range(4)}
    with lc.client() as w:
        for k, v in payloads.items():
            w.put(k, v)
    bad, reads, lapsed = [], [0], [0]
    stop = threading.Event()

    def reader(transport):
        with lc.client(transport=transport, read_hook=lambda k: time.sleep(0.05)) as r:
            while not stop.is_set():
                for k, v in payloads.items():
                    try:
                        got = r.get(k)
                    except E.LeaseExpired:
                        lapsed[0] += 1
                        continue
                    if got is None:
                        continue  # evicted between reads: a clean miss is fine
                    reads[0] += 1
                    if got != v:
                        bad.append(k)

    ts = [threading.Thread(target=reader, args=(t,)) for t in ("auto", "tcp")]
    for t in ts:
        t.start()
    with lc.client() as w:
        for i in range(200):  # 200 MiB through a 64 MiB node
            w.put(f"churn/{i}", os.urandom(MiB))
    stop.set()
    for t in ts:
        t.join(30)
    assert reads[0] > 10 and not bad


def test_lease_lapsing_mid_read_is_lease_expired(make_cluster):
    lc = make_cluster(nodes=1, memory="32MiB", lease_ttl="1s")
    with lc.client() as w:
        w.put("slow/a", os.urandom(MiB))
    for transport in ("auto", "tcp"):
        with lc.client(transport=transport, lease_retries=0, read_hook=lambda k: time.sleep(1.2)) as r:
            with pytest.raises(E.LeaseExpired, match="lease"):
                r.get("slow/a")
            out = bytearray(MiB)
            with pytest.raises(E.LeaseExpired):
                r.get_into("slow/a", out)


def test_exists_probes_do_not_prevent_eviction(make_cluster):
    lc = make_cluster(nodes=1, memory="64MiB")
    with lc.client() as c:
        blob = os.urandom(MiB)
        for i in range(55):
            c.put(f"p/{i}", blob)
        for _ in range(100):  # 100k probes of the oldest key
            assert all(c.exists_batch(["p/0"] * 1000))
        for i in range(55, 60):
            c.put(f"p/{i}", blob)
        assert c.exists_batch(["p/0"]) == [False]


def test_pins_survive_evict_all_and_soft_pins_go_last(make_cluster):
    lc = make_cluster(nodes=1, memory="64MiB")
    with lc.client() as c:
        blob = os.urandom(MiB)
        c.put("pin/hard", blob)
        c.put("pin/soft", blob)
        c.pin("pin/hard")
        c.pin("pin/soft", ttl_s=3600)
        for i in range(10):
            c.put(f"pin/plain{i}", blob)
        rep = c.evict(M.EvictSelector(all=True))
        assert rep.removed == 10 and rep.skipped_pinned == 2
        assert c.exists_batch(["pin/hard", "pin/soft"]) == [True, True]
        # fill far past capacity: plain objects go first, the soft pin before the hard pin
        for i in range(70):
            c.put(f"fill/{i}", blob)
        assert c.exists_batch(["pin/hard"]) == [True]
        rows = {r.key: r for r in c.ls("pin/")}
        assert rows["pin/hard"].pin == "hard"
        c.unpin("pin/hard")
        c.evict(M.EvictSelector(all=True), force=True)
        wait_for(lambda: all(u == 0 for u in used(c).values()), what="all bytes back")


WRITER = r"""
import sys
from kvpool.connector.client import KVPoolClient
from kvpool.protocol import messages as M
c = KVPoolClient(sys.argv[1])
g = c.rpc.call(M.PutStart([M.PutItem("stuck/key", 1 << 20, 0)], c.host_id, 1))[0]
print(g.put_id, flush=True)
sys.stdin.read()
"""


def test_killed_writer_times_out_and_key_is_retaken(make_cluster):
    lc = make_cluster(nodes=1, memory="32MiB", put_timeout="1s", quarantine="500ms")
    p = subprocess.Popen([sys.executable, "-c", WRITER, lc.master_addr], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    put_id = int(p.stdout.readline())
    with lc.client() as c:
        assert c.stats().pending == 1 and used(c)["node-0"] == MiB
        p.kill()
        p.wait()
        wait_for(lambda: c.stats().pending == 0, 10, what="stuck put revoked")
        wait_for(lambda: used(c)["node-0"] == 0, 10, what="quarantined extent returned")
        late = c.rpc.call(M.PutEnd(["stuck/key"], [put_id]))[0]
        assert late is not None and late.code == "put_revoked"
        data = os.urandom(MiB)
        c.put("stuck/key", data)
        assert xxhash.xxh3_64_intdigest(c.get("stuck/key")) == xxhash.xxh3_64_intdigest(data)
        c.remove("stuck/key")
        assert used(c)["node-0"] == 0


def test_resource_conservation(make_cluster):
    lc = make_cluster(nodes=2, memory="32MiB", replicas=2)
    with lc.client() as c:
        keys = [f"rc/{i}" for i in range(40)]
        assert c.put_batch(keys, [os.urandom(100_000) for _ in keys]) == [None] * 40
        assert all(len(o.nodes) == 2 for o in c.ls("rc/"))
        for k in keys:
            c.get(k)
        assert c.remove_batch(keys) == [None] * 40
        assert used(c) == {"node-0": 0, "node-1": 0}
        assert c.stats().objects == 0
