"""CPU per stored object, per process, of kvpool's put path, in one run.

Starts a local cluster (etcd, one master, the store nodes of ``configs/local.yaml``), warms
one client up, then runs ``--batches`` calls of ``put_batch`` of ``--batch`` objects of
``--size`` bytes (fresh keys, ``--threads`` threads sharing the client) per round. For each
round it reads, from ``/proc/<pid>/stat`` (user + system time, in clock ticks), how much CPU
the client process, the master and each store node spent, and divides by the objects
stored. Printed per round and as min / median / max over ``--rounds``:

* ``objects_per_s``: objects stored per second of wall time (all threads together);
* ``client_us``, ``master_us``, ``nodes_us``: CPU microseconds per object in the client
  process (copy and hash included), the master, and every store node together;
* ``sum_us`` and ``wall_us``: their sum, and wall microseconds per object. With one
  thread, ``sum_us`` close to ``wall_us`` means the processes run one after another
  (each waits on the next); ``sum_us`` well under ``wall_us``, that they wait on
  something else (the scheduler of a busy machine).

The CPU counts include each process's every thread (the master's etcd keep-alives, the
nodes' heartbeats: small beside a round of thousands of puts). Example::

    python benchmarks/put_cpu.py --size 64KiB --batch 64 --batches 200 --rounds 3
    python benchmarks/put_cpu.py --size 64KiB --batch 64 --threads 2 --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import uuid

import numpy as np

from kvpool.cli.cluster import LocalCluster
from kvpool.client import KVPoolClient
from kvpool.protocol.config import load_config
from kvpool.protocol.units import parse_size

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _round(client: KVPoolClient, data: list, batches: int, threads: int, pids: dict[str, int]
           ) -> tuple[dict, list[str]]:
    """One round: its figures, and the keys it stored."""
    tag = uuid.uuid4().hex[:10]
    per = batches // threads
    keys = [f"put-cpu/{tag}/{t}/{b}/{i}" for t in range(threads) for b in range(per) for i in range(len(data))]

    def run(t: int) -> None:
        for b in range(per):
            first = (t * per + b) * len(data)
            errs = client.put_batch(keys[first:first + len(data)], data)
            bad = [e for e in errs if e is not None]
            if bad:
                raise bad[0]

    before = {k: _cpu_s(p) for k, p in pids.items()}
    mine0 = os.times()
    t0 = time.perf_counter()
    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    mine1 = os.times()
    after = {k: _cpu_s(p) for k, p in pids.items()}
    n = per * threads * len(data)
    us = {k: (after[k] - before[k]) / n * 1e6 for k in pids}
    client_us = ((mine1.user + mine1.system) - (mine0.user + mine0.system)) / n * 1e6
    nodes_us = sum(v for k, v in us.items() if k != "master")
    return {"objects_per_s": n / wall, "client_us": client_us, "master_us": us["master"], "nodes_us": nodes_us,
            "sum_us": client_us + us["master"] + nodes_us, "wall_us": wall / n * 1e6}, keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="64KiB", help="object size (bytes, or with a unit)")
    ap.add_argument("--batch", type=int, default=64, help="objects per put_batch call")
    ap.add_argument("--batches", type=int, default=200, help="put_batch calls per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads sharing the client")
    ap.add_argument("--transport", default="auto", help="auto (shared memory on this host), tcp or unix")
    ap.add_argument("--json", action="store_true", help="print JSON")
    a = ap.parse_args()
    size = parse_size(a.size)
    cfg = load_config(None)
    rows = []
    with LocalCluster(cfg) as lc:
        pids = {"master": lc.masters[0].proc.pid, **{name: c.proc.pid for name, c in lc.nodes.items()}}
        rng = np.random.default_rng(0)
        data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(a.batch)]
        with KVPoolClient(lc.master_addr, security=lc.security, transport=a.transport) as c:
            c.remove_batch(_round(c, data, max(a.threads, 20), a.threads, pids)[1], force=True)  # warm-up
            for _ in range(a.rounds):
                row, keys = _round(c, data, a.batches, a.threads, pids)
                rows.append(row)
                for i in range(0, len(keys), 4096):  # room for the next round (not timed)
                    c.remove_batch(keys[i:i + 4096], force=True)
    keys = list(rows[0])
    summary = {k: [min(r[k] for r in rows), statistics.median(r[k] for r in rows), max(r[k] for r in rows)]
               for k in keys}
    if a.json:
        print(json.dumps({"args": vars(a), "rounds": rows, "min_median_max": summary}, indent=1))
        return
    print(f"{a.batches} x put_batch({a.batch} x {a.size}), {a.threads} thread(s), transport {a.transport}, "
          f"{a.rounds} rounds; min / median / max")
    for k in keys:
        lo, mid, hi = summary[k]
        print(f"  {k:14s} {lo:10,.1f} {mid:10,.1f} {hi:10,.1f}")


if __name__ == "__main__":
    main()
