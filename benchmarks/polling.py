"""Polling for answers on both ends (protocol/spin.py), measured in one run.

Starts local clusters that differ only in ``master.spin_wait``: one with 0 (the master sleeps
in ``poll`` at once) and one per value of ``--master-spin-wait`` (default: the setting's
default), and clients in this process: two of the first cluster (``spin_wait_s=0`` and the
client's default) and one of each other cluster (the client's default). Then it alternates
segments of ``--segment`` calls of ``put_batch`` (``--batch`` fresh keys of ``--size`` bytes)
between the clients, ``--rounds`` times, in an order that reverses every round, so that all
of them see the same moments of a machine whose load moves. ``--load N`` runs N CPU-burning
processes throughout, those of ``kvpool bench --load`` (started before the clusters, so the
polls meet them from the first call).

Printed per setting: the median over the segments of the mean microseconds per object, its
min and max, the median p50, and the median of the per-round ratio "nothing polls" ÷ this
setting (above 1: faster). Example::

    python benchmarks/polling.py --size 64KiB --rounds 12
    python benchmarks/polling.py --size 64KiB --rounds 12 --load 2 --json
    python benchmarks/polling.py --size 4MiB --segment 100 --master-spin-wait 300us,600us
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import uuid

import numpy as np

from kvpool.cli.bench_worker import Proc, stop_all
from kvpool.cli.cluster import LocalCluster
from kvpool.client import KVPoolClient
from kvpool.protocol.config import load_config
from kvpool.protocol.units import parse_duration, parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64KiB")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--segment", type=int, default=300, help="put_batch calls per segment")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--load", type=int, default=0, help="CPU-burning processes running throughout")
    ap.add_argument("--master-spin-wait", default=None,
                    help="master.spin_wait of the polling clusters, comma separated (default: the setting's default)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    size = parse_size(a.size)
    burners = [Proc("--burn", None, "load") for _ in range(a.load)]
    try:
        waits = [None] if a.master_spin_wait is None else [parse_duration(w) for w in a.master_spin_wait.split(",")]
        with contextlib.ExitStack() as ex:
            quiet = ex.enter_context(LocalCluster(load_config(None, overrides={"master": {"spin_wait": 0}})))
            clients = {"master 0, client 0": KVPoolClient(quiet.master_addr, security=quiet.security, spin_wait_s=0),
                       "master 0, client default": KVPoolClient(quiet.master_addr, security=quiet.security)}
            for w in waits:
                lc = ex.enter_context(LocalCluster(load_config(None, overrides={"master": {"spin_wait": w}}
                                                               if w is not None else None)))
                clients[f"master {'default' if w is None else f'{w * 1e6:g}us'}, client default"] = KVPoolClient(
                    lc.master_addr, security=lc.security)
            for c in clients.values():
                ex.enter_context(c)
            out = _run(clients, size, a)
    finally:
        stop_all(burners)
    out.update(size=size, batch=a.batch, segment=a.segment, rounds=a.rounds, load=a.load)
    if a.json:
        print(json.dumps(out, indent=1))
        return
    for name, r in out["settings"].items():
        print(f"{name:32s} mean {r['mean_us']:7.1f} us/object ({r['min_us']:.0f}-{r['max_us']:.0f})  "
              f"p50 {r['p50_us']:7.1f}  speed-up over no polling {r['speedup']:.2f} "
              f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f})")


def _run(clients: dict[str, KVPoolClient], size: int, a) -> dict:
    data = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(a.batch)]
    tag = uuid.uuid4().hex[:8]
    n = 0

    def segment(c: KVPoolClient) -> tuple[float, float]:
        nonlocal n
        ts = []
        for _ in range(a.segment):
            keys = [f"polling/{tag}/{n}/{i}" for i in range(a.batch)]
            n += 1
            t = time.perf_counter()
            errs = c.put_batch(keys, data)
            ts.append(time.perf_counter() - t)
            if any(errs):
                raise SystemExit(f"put failed: {next(e for e in errs if e)}")
        return statistics.mean(ts) / a.batch, statistics.median(ts) / a.batch

    for c in clients.values():  # warm: connections, mappings, reservations of this size
        segment(c)
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    order = list(clients)
    for r in range(a.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            got[name].append(segment(clients[name]))
    base = [m for m, _ in got[order[0]]]
    settings = {}
    for name, rows in got.items():
        means = [m for m, _ in rows]
        ratio = [b / m for b, m in zip(base, means)]
        settings[name] = {"mean_us": statistics.median(means) * 1e6, "min_us": min(means) * 1e6,
                          "max_us": max(means) * 1e6, "p50_us": statistics.median(p for _, p in rows) * 1e6,
                          "speedup": statistics.median(ratio), "speedup_min": min(ratio), "speedup_max": max(ratio),
                          "segments_mean_us": [m * 1e6 for m in means]}
    return {"settings": settings, "loadavg_end": os.getloadavg()}


if __name__ == "__main__":
    main()
