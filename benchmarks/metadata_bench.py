"""Master metadata benchmark: the state machine alone, no sockets (``master/state.py``).

For each index size N (default 10k, 100k, 1M committed objects on 2 nodes) it measures,
in this process:

* ops/s of ``put_start + put_end``, ``lookup`` (with a read lease, as a get does, and
  without), ``exists`` and ``remove``: single-key calls and batches of 64;
* the wire cost the RPC adds on top: msgpack encode of the reply (``lookup`` of 64 keys);
* eviction time per object: the index is filled past the high watermark and
  ``enforce_watermarks`` evicts down to the low one (LRU, every victim freed and announced);
* memory per object in the master (RSS growth while filling / N, after ``gc.collect``).

``--redis`` adds a peer: a local redis-server on a free loopback port, SET/GET/EXISTS/DEL of
small values through redis-py, single and pipelined 64, plus its memory per key
(``used_memory`` growth / N). The master side of ``kvpool bench --metadata`` measures the
same ops through the real RPC.

    python benchmarks/metadata_bench.py [--sizes 10000,100000,1000000] [--redis] [--json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

from kvpool.master.state import MasterSettings, MasterState  # noqa: E402
from kvpool.protocol import messages as M  # noqa: E402
from kvpool.protocol.messages import NodeDesc, PutItem  # noqa: E402

BATCH = 64
OBJ_SIZE = 4096
NODES = 2


def _state(capacity: int, high: float = 1.0, low: float = 1.0) -> MasterState:
    st = MasterState(MasterSettings(high_watermark=high, low_watermark=low, lease_ttl_s=5.0))
    for i in range(NODES):
        st.node_up(NodeDesc(f"node-{i}", f"inc{i:014d}", f"tcp://127.0.0.1:{40000 + i}", f"tcp://127.0.0.1:{41000 + i}",
                            f"unix:///tmp/kvpool-bench/node-{i}.sock", f"host-{i % 2}", capacity,
                            grant_key=os.urandom(32)), 0.0)
    return st


def _fill(st: MasterState, keys: list[str], now: float) -> None:
    for i in range(0, len(keys), BATCH):
        ks = keys[i:i + BATCH]
        grants = st.put_start([PutItem(k, OBJ_SIZE, 1) for k in ks], "host-0", 1, now)
        st.put_end([g.key for g in grants], [g.put_id for g in grants], now)
        st.take_outbox()


def _rate(n_keys: int, fn, calls: list, min_s: float = 0.3) -> float:
    """keys/s of ``fn(args)`` over ``calls`` (repeated until ``min_s`` has passed)."""
    done = 0
    t0 = time.perf_counter()
    while True:
        for args in calls:
            fn(args)
        done += n_keys
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return done / dt


def _key(i: int) -> str:
    return f"ns/model/0:8f3a2c1d/blk-{i:016x}"


def bench_index(n: int, ops_sample: int = 8192) -> dict:
    """Fill an index of ``n`` objects, then time ops on it and an eviction pass."""
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    cap = (n + ops_sample * 4) * OBJ_SIZE  # room for everything, split over the nodes
    st = _state(cap)
    keys = [_key(i) for i in range(n)]
    t0 = time.perf_counter()
    _fill(st, keys, 1.0)
    fill_s = time.perf_counter() - t0
    gc.collect()
    per_obj = (psutil.Process().memory_info().rss - rss0) / max(n, 1)
    row: dict = {"objects": n, "fill_keys_per_s": n / fill_s, "master_bytes_per_object": round(per_obj)}

    sample = keys[: min(n, ops_sample)]
    singles = [[k] for k in sample]
    batches = [sample[i:i + BATCH] for i in range(0, len(sample), BATCH)]
    now = 2.0
    for b, calls in ((1, singles), (BATCH, batches)):
        row[f"lookup_lease_b{b}"] = _rate(len(sample), lambda ks: st.lookup(ks, True, now), calls)
        row[f"lookup_b{b}"] = _rate(len(sample), lambda ks: st.lookup(ks, False, now), calls)
        row[f"exists_b{b}"] = _rate(len(sample), st.exists, calls)
    enc = M.encode
    row["lookup_b64_with_encode"] = _rate(len(sample), lambda ks: enc(st.lookup(ks, True, now)), batches)
    # put_start+put_end and remove on fresh keys (the index stays at ~n objects)
    for b in (1, BATCH):
        fresh = [f"fresh/{b}/{i}" for i in range(ops_sample)]
        t0 = time.perf_counter()
        for i in range(0, len(fresh), b):
            ks = fresh[i:i + b]
            grants = st.put_start([PutItem(k, OBJ_SIZE, 1) for k in ks], "host-0", 1, now)
            st.put_end([g.key for g in grants], [g.put_id for g in grants], now)
        row[f"put_b{b}"] = len(fresh) / (time.perf_counter() - t0)
        st.take_outbox()
        t0 = time.perf_counter()
        for i in range(0, len(fresh), b):
            st.remove(fresh[i:i + b], True, now)
        row[f"remove_b{b}"] = len(fresh) / (time.perf_counter() - t0)
        st.take_outbox()
    # eviction: lower the watermarks so ~10% of the index must go, then one pass
    st.s = MasterSettings(high_watermark=0.5, low_watermark=0.45, lease_ttl_s=5.0)
    used = sum(nd.alloc.used for nd in st.nodes.values())
    capacity = sum(nd.alloc.capacity for nd in st.nodes.values())
    target = max(1, int(n * 0.1))
    frac = (used - target * OBJ_SIZE) / capacity  # usage after evicting `target` objects
    st.s = MasterSettings(high_watermark=min(1.0, max(frac, 1e-9)), low_watermark=max(frac, 1e-9) * 0.999,
                          lease_ttl_s=5.0)
    t0 = time.perf_counter()
    evicted = st.enforce_watermarks(100.0)
    ev_s = time.perf_counter() - t0
    st.take_outbox()
    row["evicted"] = evicted
    row["evict_us_per_object"] = ev_s / max(evicted, 1) * 1e6
    return row


# ---- redis peer ---------------------------------------------------------------------------

def bench_redis(n: int, ops_sample: int = 8192) -> dict:
    import shutil
    import tempfile

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        return {"error": "redis-server not installed"}
    from kvpool.cli.cluster import free_port

    port = free_port()
    d = tempfile.mkdtemp(prefix="kvpool-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        mem0 = r.info("memory")["used_memory"]
        val = os.urandom(96)  # about the size of a metadata record (replica ref + checksum + size)
        keys = [_key(i) for i in range(n)]
        p = r.pipeline(transaction=False)
        for i in range(0, n, 1000):
            for k in keys[i:i + 1000]:
                p.set(k, val)
            p.execute()
        row = {"objects": n, "redis_bytes_per_key": round((r.info("memory")["used_memory"] - mem0) / n)}
        sample = keys[: min(n, ops_sample)]
        fresh = [f"fresh/{i}" for i in range(ops_sample)]

        def piped(op, ks):
            p = r.pipeline(transaction=False)
            for k in ks:
                op(p, k)
            p.execute()

        for b in (1, BATCH):
            calls = [sample[i:i + b] for i in range(0, len(sample), b)]
            if b == 1:
                row["get_b1"] = _rate(len(sample), lambda ks: r.get(ks[0]), calls)
                row["exists_b1"] = _rate(len(sample), lambda ks: r.exists(ks[0]), calls)
            else:
                row[f"get_b{b}"] = _rate(len(sample), r.mget, calls)
                row[f"exists_b{b}"] = _rate(len(sample), lambda ks: piped(lambda p, k: p.exists(k), ks), calls)
            fc = [fresh[i:i + b] for i in range(0, len(fresh), b)]
            t0 = time.perf_counter()
            for ks in fc:
                piped(lambda p, k: p.set(k, val), ks) if b > 1 else r.set(ks[0], val)
            row[f"set_b{b}"] = len(fresh) / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for ks in fc:
                r.delete(*ks)
            row[f"del_b{b}"] = len(fresh) / (time.perf_counter() - t0)
        r.close()
        return row
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(d, ignore_errors=True)


def render(rows: list[dict], peers: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 150))
    t = Table(title=f"master state machine (in process; keys/s; batch = {BATCH})")
    cols = [("objects", "objects"), ("put_b1", "put s+e ×1"), ("put_b64", "put s+e ×64"),
            ("lookup_lease_b1", "lookup+lease ×1"), ("lookup_lease_b64", "lookup+lease ×64"),
            ("lookup_b64_with_encode", "lookup+lease ×64 +encode"), ("exists_b64", "exists ×64"),
            ("remove_b1", "remove ×1"), ("remove_b64", "remove ×64"),
            ("evict_us_per_object", "evict µs/obj"), ("master_bytes_per_object", "bytes/obj")]
    for _, name in cols:
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(*[f"{r[k]:,.0f}" if k != "evict_us_per_object" else f"{r[k]:.2f}" for k, _ in cols])
    con.print(t)
    if peers:
        t = Table(title="peer: redis-server over loopback (redis-py; keys/s)")
        pc = [("objects", "keys"), ("set_b1", "SET ×1"), ("set_b64", "SET ×64 piped"), ("get_b1", "GET ×1"),
              ("get_b64", "MGET ×64"), ("exists_b64", "EXISTS ×64 piped"), ("del_b1", "DEL ×1"),
              ("del_b64", "DEL ×64"), ("redis_bytes_per_key", "bytes/key")]
        for _, name in pc:
            t.add_column(name, justify="right")
        for r in peers:
            t.add_row(*[f"{r.get(k, 0):,.0f}" for k, _ in pc])
        con.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="index sizes, comma separated")
    ap.add_argument("--redis", action="store_true", help="also measure a local redis-server as a peer")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: one size, in a fresh process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(bench_index(a.one)))
        return
    sizes = [int(s) for s in a.sizes.split(",")]
    # each size in its own process, so memory per object is not hidden by reused heap
    rows = [json.loads(subprocess.run([sys.executable, __file__, "--one", str(n)], check=True,
                                      capture_output=True, text=True).stdout) for n in sizes]
    peers = [bench_redis(n) for n in sizes] if a.redis else []
    if a.json:
        print(json.dumps({"master": rows, "redis": peers}, indent=2))
    else:
        render(rows, peers)


if __name__ == "__main__":
    main()
