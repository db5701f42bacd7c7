"""``kvpool bench``: kvpool beside its peers and the hardware's ceilings, in one run, the
systems interleaved round by round.

A run is ``rounds`` rounds (:mod:`cli.bench_plan` gives the order). In every round, every
cell (object size × client processes × batch × replicas) runs every system once: a put
phase of fresh keys (a new prefix per round, system and cell), then a get phase of those
keys into preallocated buffers, then a forced removal of them, so memory never fills.
The systems: kvpool over each requested path (``auto`` = same-host shared memory, ``tcp``,
``unix``, ``ucx``) and client setting (e.g. ``spin_wait_s`` 0 and 100 µs), redis-server
(``baseline`` "redis") and Mooncake Store over its TCP transfer engine ("mooncake", both
client paths, the faster one per round reported). The ceilings are measured in the same
rounds (:mod:`cli.bench_ceilings`): memcpy, raw TCP and Unix streams, raw TCP request→reply
shaped as a get and as a put at each cell's object size.

Per cell and op the report gives each system's GB/s, objects/s and p50/p99 latency per round,
and per round the ratios kvpool ÷ peer, kvpool ÷ other kvpool setting and system ÷ ceiling,
each summarised as min / median / max over the rounds (:mod:`cli.bench_stats`). Workers are
separate processes, one set per system family (:mod:`cli.bench_worker`), speaking JSON lines
over stdin/stdout. ``load``: that many CPU-burning processes run during the rounds.
"""
from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
from kvpool.cli.bench_buffers import POOL_BYTES, aligned, pool_slots, slot_views
from kvpool.cli.bench_ceilings import CeilingPeer, memcpy_gbps, socket_gbps
from kvpool.cli.bench_plan import (
    BASELINES,
    META_BATCHES,
    TRANSPORTS,
    Cell,
    Step,
    System,
    kvpool_systems,
    peer_systems,
    plan_rounds,
)
from kvpool.cli.bench_report import render_bench, render_markdown
from kvpool.cli.bench_stats import (
    ceiling_summary,
    group_rows,
    metadata_summary,
    ratio_summary,
    results,
    round_ratios,
    summarise,
)
from kvpool.cli.bench_worker import Proc, broadcast, stop_all

_aligned = aligned  # the name benchmarks/vllm_load.py imports
__all__ = ["POOL_BYTES", "memcpy_gbps", "pool_slots", "render_bench", "render_markdown", "run_bench",
           "slot_views", "socket_gbps"]

CAPACITY_SHARE = 0.4  # a cell moves at most this share of the cluster's capacity per phase


def _listify(v) -> list:
    """None, one value or a sequence of values (None = the client's default)."""
    if v is None:
        return [None]
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _validate(paths: list[str], baselines: list[str], sizes, clients, batches, replicas, rounds: int,
              streams: int, load: int, spins: list, reserves: list, max_batch_bytes) -> None:
    from kvpool.protocol.errors import ConfigError

    for t in paths:
        if t not in TRANSPORTS and t != "shm":
            raise ConfigError(f"bench --transport: {t!r}; accepted: {', '.join(TRANSPORTS)} (comma separated)",
                              key="transport")
    if not paths:
        raise ConfigError(f"bench --transport: none given; accepted: {', '.join(TRANSPORTS)}", key="transport")
    if "ucx" in paths and not _has_ucx():
        raise ConfigError("bench --transport ucx needs the ucx extra: pip install 'kvpool[ucx]'", key="transport")
    for b in baselines:
        if b not in BASELINES:
            raise ConfigError(f"bench --baseline: {b!r}; accepted: {', '.join(BASELINES)} (comma separated)",
                              key="baseline")
    for name, vals in (("sizes", sizes), ("clients", clients), ("batches", batches), ("replicas", replicas)):
        if not vals or min(vals) <= 0:
            raise ConfigError(f"bench --{name}: {list(vals)!r}; accepted: positive integers", key=name)
    if not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"bench --rounds: {rounds!r}; accepted: an integer >= 1", key="rounds")
    if not 1 <= streams <= 16:
        raise ConfigError(f"bench --streams: {streams!r}; accepted: 1 to 16", key="streams")
    if not isinstance(load, int) or not 0 <= load <= 64:
        raise ConfigError(f"bench --load: {load!r}; accepted: 0 to 64 processes", key="load")
    for s in spins:
        if s is not None and not (isinstance(s, (int, float)) and 0 <= s <= 0.01):
            raise ConfigError(f"bench --spin-wait: {s!r}; accepted: durations from 0 to 10ms", key="spin_wait")
    for r in reserves:
        if r is not None and not (isinstance(r, int) and r >= 0):
            raise ConfigError(f"bench --reserve: {r!r}; accepted: sizes >= 0", key="reserve")
    if max_batch_bytes is not None and max_batch_bytes <= 0:
        raise ConfigError(f"bench --max-batch-bytes: {max_batch_bytes!r}; accepted: a positive size",
                          key="max_batch_bytes")


def _has_ucx() -> bool:
    try:  # through our module: it sets the UCX_* environment before ucxx loads UCX
        import kvpool.protocol.ucx_transport  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means the extra is not usable
        return False
    return True


class _Run:
    """The state of one run: cluster, peers, workers, rows; :meth:`step` runs one step."""

    def __init__(self, master: str, run_id: str, log_dir: str, systems: list[System], counts: dict[Cell, int],
                 args: dict) -> None:
        self.master, self.run_id, self.log_dir = master, run_id, log_dir
        self.systems = {s.id: s for s in systems}
        self.counts = counts
        self.a = args
        self.workers: dict[str, list[Proc]] = {}
        self.dropped: dict[str, str] = {}  # system id -> why it stopped being measured
        self.rows: list[dict] = []
        self.ceilings: list[dict] = []
        self.meta: list[dict] = []
        self.skipped: list[dict] = []
        self.peer: CeilingPeer | None = None
        self.redis_port = 0
        self.mooncake: dict = {}

    def procs(self, family: str, n: int) -> list[Proc]:
        ws = self.workers.setdefault(family, [])
        while len(ws) < n:
            ws.append(Proc(log_dir=self.log_dir, name=f"{family}-worker"))
        return ws[:n]

    def step(self, st: Step) -> None:
        if st.kind == "ceiling":
            self.ceiling(st)
        elif st.kind == "metadata":
            self.metadata(st)
        elif st.name not in self.dropped:
            self.system(st)

    def ceiling(self, st: Step) -> None:
        a = self.a
        try:
            if st.name == "memcpy":
                g = memcpy_gbps()
            elif st.name in ("tcp", "unix", "ucx"):
                g = self.peer.measure(st.name, "stream", a["chunk"], a["ceiling_bytes"], reps=2)
            else:  # tcp_rr_get / tcp_rr_put at the cell's object size, as many objects as one client's phase
                objs = max(1, min(a["max_objects"], a["total_bytes"] // st.size))
                g = self.peer.measure("tcp", st.name.rsplit("_", 1)[1], st.size,
                                      min(a["ceiling_bytes"], objs * st.size), reps=2)
        except (OSError, RuntimeError) as e:
            self.skipped.append({"ceiling": st.name, "size": st.size, "round": st.round,
                                 "why": f"{type(e).__name__}: {e}"})
            return
        self.ceilings.append({"round": st.round, "name": st.name, "size": st.size, "gbps": g})

    def system(self, st: Step) -> None:
        s, cell = self.systems[st.name], st.cell
        procs = self.procs(s.family, cell.clients)
        prefix = st.prefix(self.run_id)
        base = {"cmd": "cell", "system": s.to_dict(), "size": cell.size, "count": self.counts[cell],
                "batch": cell.batch, "replicas": cell.replicas, "master": self.master, "streams": self.a["streams"],
                "redis_port": self.redis_port, "mooncake": self.mooncake}
        try:
            broadcast(procs, [{**base, "prefix": f"{prefix}/w{i}"} for i in range(len(procs))])
            put = broadcast(procs, {"cmd": "put", "system": s.id})
            get = broadcast(procs, {"cmd": "get", "system": s.id})
            clean = broadcast(procs, {"cmd": "cleanup", "system": s.id})
        except RuntimeError as e:
            if s.family == "kvpool":
                raise
            self.dropped[s.id] = str(e)
            self.skipped.append({"system": s.id, "round": st.round, "cell": cell.label,
                                 "why": f"{s.name} failed and is left out from here on: {e}"})
            if any(p.p.poll() is not None for p in procs):  # a worker died: start fresh ones for the others
                for p in self.workers.pop(s.family, []):
                    p.stop()
            return
        for op, parts in (("put", put), ("get", get)):
            row = {"round": st.round, "system": s.id, "name": s.name, "group": s.group or s.id,
                   "family": s.family, "path": s.path, "op": op, "size": cell.size, "clients": cell.clients,
                   "batch": cell.batch, "replicas": cell.replicas, **summarise(parts, cell.size)}
            for k in ("errors", "misses", "not_fresh", "stale", "corrupt", "verified"):
                row[k] = sum(p.get(k, 0) for p in parts)
            row["first_error"] = next((p["first_error"] for p in parts if p.get("first_error")), "")
            if op == "get":
                row["cleanup_failed"] = sum(c["failed"] for c in clean)
            self.rows.append(row)

    def metadata(self, st: Step) -> None:
        nc, b = st.clients, st.batch
        procs = self.procs("kvpool", nc)
        n = max(b, self.a["meta_keys"] // nc // b * b) if b > 1 else max(1, self.a["meta_keys"] // 8 // nc)
        parts = broadcast(procs, [{"cmd": "meta", "master": self.master, "batch": b, "count": n,
                                   "prefix": f"bench/{self.run_id}/r{st.round}/meta/{nc}/{b}/w{i}"}
                                  for i in range(nc)])
        for op in ("put_start+put_end", "lookup", "remove"):
            s = summarise([p[op] for p in parts], 0, count_key="keys")
            self.meta.append({"round": st.round, "op": op, "clients": nc, "batch": b,
                              "keys_per_s": s["objects_per_s"], "calls_per_s": s["calls"] / s["seconds"],
                              "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"], "keys": s["objects"]})

    def close(self) -> None:
        procs = [p for ws in self.workers.values() for p in ws]
        if self.peer is not None:
            procs.append(self.peer.proc)
        stop_all(procs)


def run_bench(cfg, sizes: Sequence[int], clients: Sequence[int], total_bytes: int, transport: str = "auto",
              metadata: bool = False, progress: bool = True, *, batches: Sequence[int] = (1,),
              replicas: Sequence[int] = (1,), baseline: str | None = None, master: str | None = None,
              max_objects: int = 4096, meta_keys: int = 4096, ceiling_bytes: int | None = None, rounds: int = 5,
              streams: int = 1, reserve=None, spin_wait=None, max_batch_bytes: int | None = None,
              load: int = 0) -> dict:
    """Run the benchmark and return the report dict (see the module docstring and
    :mod:`cli.bench_report`).

    ``transport``: comma-separated kvpool paths among auto, tcp, unix, ucx. ``baseline``:
    comma-separated peers among redis, mooncake (None: none). ``total_bytes``: bytes one
    phase of a cell moves (split over its clients; at most ``max_objects`` objects and 40%
    of the cluster's capacity). ``master``: a running cluster to use; else a LocalCluster is
    started from ``cfg`` and stopped at the end. ``rounds``: rounds of every cell × system
    (≥ 1). ``spin_wait`` (seconds) and ``reserve`` (bytes): the kvpool clients' setting, or a
    list of settings, each measured as a system of its own (None: the client's default).
    ``streams``: the clients' ``streams_per_node``. ``max_batch_bytes``: leave out cells
    whose batch (> 1 object) holds more bytes. ``meta_keys``: keys per metadata op and
    client count; ``ceiling_bytes``: bytes per raw-socket ceiling repetition (default
    256 MiB). ``load``: CPU-burning processes during the rounds. Raises ConfigError naming
    the option for a bad value; a peer that cannot start or fails is left out with its
    reason in ``report["skipped"]``."""
    from kvpool.cli.bench_peers import MooncakeCluster, PeerUnavailable, RedisServer
    from kvpool.connector.client import KVPoolClient
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    paths = [t.strip() for t in transport.split(",") if t.strip()]
    baselines = [b.strip() for b in (baseline or "").split(",") if b.strip()]
    spins, reserves = _listify(spin_wait), _listify(reserve)
    _validate(paths, baselines, sizes, clients, batches, replicas, rounds, streams, load, spins, reserves,
              max_batch_bytes)
    paths = ["auto" if t == "shm" else t for t in paths]
    settings = [{"spin_wait_s": s, "reserve_bytes": r} for s, r in itertools.product(spins, reserves)]
    systems = kvpool_systems(paths, settings) + peer_systems(baselines)
    chunk = max(min(max(sizes), 16 << 20), 1 << 20)
    run_id = uuid.uuid4().hex[:8]
    log_dir = tempfile.mkdtemp(prefix="kvpool-bench-")
    report: dict[str, Any] = {
        "config": {"sizes": list(sizes), "clients": list(clients), "batches": list(batches),
                   "replicas": list(replicas), "total_bytes": total_bytes, "transports": paths,
                   "baselines": baselines, "rounds": rounds, "ceiling_chunk_bytes": chunk, "streams_per_node": streams,
                   "spin_wait_s": spins, "reserve_bytes": reserves, "max_batch_bytes": max_batch_bytes,
                   "max_objects": max_objects, "load_procs": load},
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "loadavg_start": os.getloadavg()},
        "systems": [s.to_dict() for s in systems], "skipped": []}
    lc = red = mc = None
    run: _Run | None = None
    burners: list[Proc] = []
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), transient=True, disable=not progress)
    try:
        with prog:
            task = prog.add_task("starting cluster", total=None)
            if master is None:
                from kvpool.cli.cluster import LocalCluster

                if "ucx" in paths:  # store nodes also serve ucx:// so that clients can pick it
                    cfg = msgspec.structs.replace(cfg, storenodes=[msgspec.structs.replace(n, ucx=True)
                                                                   for n in cfg.storenodes])
                lc = LocalCluster(cfg)
                lc.__enter__()
                master = lc.master_addr
            with KVPoolClient(master) as probe:
                st = probe.stats()
            capacity = st.capacity
            segments = [n.capacity for n in st.nodes if n.alive]
            share = int(CAPACITY_SHARE * capacity)
            cells, counts = [], {}
            for size, nc, b, nrep in itertools.product(sizes, clients, batches, replicas):
                cell = Cell(size, nc, b, nrep)
                why = ""
                if b > 1 and max_batch_bytes and b * size > max_batch_bytes:
                    why = "its batch holds more than --max-batch-bytes"
                elif b * size * nc * nrep > share:
                    why = "one batch per client does not fit 40% of the cluster"
                if why:
                    report["skipped"].append({"cell": cell.label, "why": why})
                    continue
                cells.append(cell)
                counts[cell] = max(b, min(max_objects, min(total_bytes, share) // (size * nrep)) // nc // b * b)
            for s in systems:
                if any(c.replicas > s.max_replicas for c in cells):
                    report["skipped"].append({"system": s.id, "why": f"{s.name} keeps one copy: cells of more "
                                                                     "replicas run without it"})
            args = {"chunk": chunk, "ceiling_bytes": ceiling_bytes or max(256 << 20, 8 * chunk),
                    "total_bytes": total_bytes, "max_objects": max_objects, "meta_keys": meta_keys,
                    "streams": streams}
            run = _Run(master, run_id, log_dir, systems, counts, args)
            prog.update(task, description="starting peers")
            if "redis" in baselines:
                try:
                    red = RedisServer(maxmemory=int(capacity))
                    run.redis_port = red.port
                except PeerUnavailable as e:
                    _drop(run, report, "redis", str(e))
            if "mooncake" in baselines:
                try:
                    mc = MooncakeCluster(segments, log_dir)
                    big = max((c.batch * c.size for c in cells), default=0)
                    run.mooncake = {"metadata_url": mc.metadata_url, "master_addr": mc.master_addr,
                                    "local_buffer": max(32 << 20, -(-2 * big // (1 << 20)) << 20)}
                except PeerUnavailable as e:
                    _drop(run, report, "mooncake", str(e))
            run.peer = CeilingPeer(log_dir)
            global_ceilings = ["memcpy", "tcp", "unix"] + (["ucx"] if "ucx" in paths else [])
            plan = plan_rounds(cells, [s for s in systems if s.id not in run.dropped], rounds, global_ceilings,
                               rr_ceilings=any(s.path == "tcp" for s in systems),
                               metadata=[(nc, b) for nc in clients for b in META_BATCHES] if metadata else [])
            report["plan"] = [[s.label for s in steps] for steps in plan]
            burners = [Proc("--burn", log_dir, "load") for _ in range(load)]
            prog.update(task, total=sum(len(p) for p in plan), completed=0)
            for r, steps in enumerate(plan):
                for s in steps:
                    prog.update(task, description=f"round {r + 1}/{rounds}: {s.label}")
                    run.step(s)
                    prog.advance(task)
    finally:
        stop_all(burners)
        if run is not None:
            run.close()
        if mc is not None:
            mc.close()
        if red is not None:
            red.close()
        if lc is not None:
            lc.__exit__(None, None, None)
        shutil.rmtree(log_dir, ignore_errors=True)
    rows = run.rows + group_rows(run.rows)
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["skipped"] += run.skipped
    report["rounds"] = {"rows": run.rows, "ceilings": run.ceilings, "metadata": run.meta}
    report["results"] = results(rows)
    report["ceilings"] = ceiling_summary(run.ceilings)
    report["ratios"] = ratio_summary(round_ratios(rows, run.ceilings))
    report["metadata"] = metadata_summary(run.meta)
    return report


def _drop(run: _Run, report: dict, family: str, why: str) -> None:
    for sid, s in run.systems.items():
        if s.family == family:
            run.dropped[sid] = why
    report["skipped"].append({"system": family, "why": f"{family} left out: {why}"})


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        from kvpool.cli.bench_worker import main

        main()
    else:
        print("usage: kvpool bench (this module's --worker mode is internal)", file=sys.stderr)
        sys.exit(2)
