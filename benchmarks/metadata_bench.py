"""Master metadata benchmark: the state machine alone, no sockets (``master/state.py``).

For each index size N (default 10k, 100k, 1M committed objects on 2 nodes) it measures,
in this process:

* ops/s of ``put_start + put_end``, ``lookup`` (with a read lease, as a get does, and
  without), ``exists`` and ``remove``: single-key calls and batches of 64;
* the wire cost the RPC adds on top: msgpack encode of the reply (``lookup`` of 64 keys);
* eviction time per object: the index is filled past the high watermark and
  ``eviction.enforce_watermarks`` evicts down to the low one (LRU, every victim freed and announced);
* memory per object in the master (RSS growth while filling / N, after ``gc.collect``).

``--memory`` measures the index itself at each size, each figure in a fresh process and
repeated ``--runs`` times (min / median / max): bytes per object (key strings included,
created after the baseline) by tracemalloc and, in another process, by RSS growth, after
filling with 4 KiB objects and again after reading every object once (lookup with a lease,
then its release, 64 keys a call); then the latency of single 8 KiB puts (put_start +
put_end, p50 / p99 of 2000) before and after removing half of the objects at random.

``--redis`` adds a peer: a local redis-server on a free loopback port, SET/GET/EXISTS/DEL of
small values through redis-py, single and pipelined 64, plus its memory per key
(``used_memory`` growth / N). The master side of ``kvpool bench --metadata`` measures the
same ops through the real RPC.

    python benchmarks/metadata_bench.py [--sizes 10000,100000,1000000] [--redis] [--json]
    python benchmarks/metadata_bench.py --memory [--sizes 1000000] [--runs 3] [--json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
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
    evicted = st.eviction.enforce_watermarks(100.0)
    ev_s = time.perf_counter() - t0
    st.take_outbox()
    row["evicted"] = evicted
    row["evict_us_per_object"] = ev_s / max(evicted, 1) * 1e6
    return row


# ---- memory and fragmentation ------------------------------------------------------------

def _put_latency(st: MasterState, tag: str, size: int, count: int, now: float) -> tuple[float, float]:
    """p50 and p99 (microseconds) of ``count`` single puts of ``size`` bytes on fresh keys,
    removed again afterwards (the index is left as it was)."""
    ts = []
    keys = [f"lat/{tag}/{i}" for i in range(count)]
    for k in keys:
        t0 = time.perf_counter()
        g = st.put_start([PutItem(k, size, 1)], "host-0", 1, now)
        st.put_end([k], [g[0].put_id], now)
        ts.append(time.perf_counter() - t0)
    for i in range(0, count, BATCH):
        st.remove(keys[i:i + BATCH], True, now)
    st.take_outbox()
    ts.sort()
    return ts[count // 2] * 1e6, ts[int(count * 0.99)] * 1e6


def bench_memory(n: int, tracer: str, lat_puts: int = 2000) -> dict:
    """Bytes per object of an index of ``n`` 4 KiB objects, measured by ``tracer``
    ("tracemalloc" or "rss"), after filling and after reading each object once; with
    "rss" also 8 KiB put latency before and after removing half of the objects at random."""
    import tracemalloc

    st = _state((n + 4 * lat_puts) * OBJ_SIZE * 2)  # room for everything, and for the 8 KiB puts
    gc.collect()
    if tracer == "tracemalloc":
        tracemalloc.start()

        def used() -> int:
            return tracemalloc.get_traced_memory()[0]
    else:
        def used() -> int:
            return psutil.Process().memory_info().rss
    base = used()
    keys = [_key(i) for i in range(n)]  # counted: the index keeps these very strings
    _fill(st, keys, 1.0)
    gc.collect()
    row: dict = {"objects": n, "tracer": tracer, "bytes_per_object": (used() - base) / n}
    now = 2.0
    for i in range(0, n, BATCH):
        ks = keys[i:i + BATCH]
        st.lookup(ks, True, now)
        st.release_leases(ks, now)
        now += 1e-6
    gc.collect()
    row["bytes_per_object_after_reads"] = (used() - base) / n
    if tracer == "tracemalloc":
        tracemalloc.stop()
        return row
    now += 10.0
    row["put8k_p50_us"], row["put8k_p99_us"] = _put_latency(st, "before", 8192, lat_puts, now)
    gone = random.Random(1).sample(keys, n // 2)
    for i in range(0, len(gone), BATCH):
        st.remove(gone[i:i + BATCH], True, now)
    st.take_outbox()
    row["put8k_p50_after_removals_us"], row["put8k_p99_after_removals_us"] = _put_latency(
        st, "after", 8192, lat_puts, now)
    return row


def memory_runs(sizes: list[int], runs: int) -> list[dict]:
    """min / median / max over ``runs`` fresh processes per size and tracer."""
    out = []
    for n in sizes:
        got: dict[str, list[float]] = {}
        for _ in range(runs):
            for tracer in ("tracemalloc", "rss"):
                r = json.loads(subprocess.run([sys.executable, __file__, "--mem-one", f"{n}:{tracer}"], check=True,
                                              capture_output=True, text=True).stdout)
                for k, v in r.items():
                    if k not in ("objects", "tracer"):
                        got.setdefault(k if tracer == "rss" and k.startswith("put") else f"{tracer}_{k}", []).append(v)
        out.append({"objects": n, "runs": runs,
                    **{k: [min(v), statistics.median(v), max(v)] for k, v in got.items()}})
    return out


def render_memory(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="master index memory and 8 KiB put latency (min / median / max)")
    cols = [("tracemalloc_bytes_per_object", "B/obj tracemalloc"),
            ("tracemalloc_bytes_per_object_after_reads", "… after reads"),
            ("rss_bytes_per_object", "B/obj RSS"), ("rss_bytes_per_object_after_reads", "… after reads"),
            ("put8k_p50_us", "put p50 µs"), ("put8k_p99_us", "put p99 µs"),
            ("put8k_p50_after_removals_us", "p50 after ½ removed"),
            ("put8k_p99_after_removals_us", "p99 after ½ removed")]
    t.add_column("objects", justify="right")
    for _, name in cols:
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(f"{r['objects']:,}", *[" / ".join(f"{x:,.0f}" for x in r[k]) for k, _ in cols])
    Console(width=max(Console().width, 160)).print(t)


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
    ap.add_argument("--memory", action="store_true", help="measure memory per object and put latency after removals")
    ap.add_argument("--runs", type=int, default=3, help="with --memory: fresh processes per figure")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: one size, in a fresh process
    ap.add_argument("--mem-one", help=argparse.SUPPRESS)  # internal: N:tracer, in a fresh process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(bench_index(a.one)))
        return
    if a.mem_one:
        n, tracer = a.mem_one.split(":")
        print(json.dumps(bench_memory(int(n), tracer)))
        return
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.memory:
        rows = memory_runs(sizes, a.runs)
        print(json.dumps(rows, indent=2)) if a.json else render_memory(rows)
        return
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
