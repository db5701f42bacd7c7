"""Disk tier speed against the device's ceiling, measured in the same run on the same directory.

Each round, interleaved (ceilings first, then kvpool, then the ceilings again; the best of
each kept per round):

* **ceilings** on ``--dir``: ``dd`` writing ``--total`` bytes in 4 MiB blocks with
  ``oflag=direct conv=fsync`` and reading them back with ``iflag=direct`` (the device's
  sequential speed without the page cache); and the same bytes as one file per object of
  each ``--sizes`` size, written in groups of 32, each file then ``fsync``'ed and renamed,
  the directory ``fsync``'ed once per group, then read back cold (``POSIX_FADV_DONTNEED``):
  what a durable file per object can reach at best (the "files" ceiling);
* **tier**, in process: :class:`~storenode.disk_tier.DiskTier` writing the objects from a
  memory buffer the way a store node's demotions do (:mod:`storenode.demotion`: hashed as
  written, ``fsync``, groups of 32 published with one directory ``fsync``) and reading them
  back with :meth:`DiskTier.read_into` (checksum verified);
* **cluster**, real processes: one store node with ``--memory`` of memory and a disk tier
  on ``--dir``; ``--total`` bytes are put in batches (8% of memory each), and after each
  batch the writer waits until the node's demotions settle (no move in flight, memory under
  the high watermark). Write rate: the demoted bytes over the time spent in those waits
  (from a batch's acknowledgement to its demotions' last answer at the master: the
  master's decision, the node's write, fsync and publish, the answer, and one poll of
  ``Stats``), and also over the whole run, puts included ("sustained", in the JSON). Then
  every disk-resident object is read once with ``get_batch`` (16 keys a call) over the
  node's disk-read socket (a first read: no promotion).

Rows are GB/s (10**9 bytes per second) and ratios to ``dd`` and to the files ceiling.

    python benchmarks/disk_tier.py [--dir /path/on/the/disk] [--sizes 256KiB,4MiB] [--total 256MiB]
                                   [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvpool.protocol.units import parse_size  # noqa: E402

GROUP = 32  # files per directory fsync, as storenode/demotion.py publishes


def _dd(path: str, total: int) -> tuple[float, float]:
    """(write, read) GB/s of dd in 4 MiB blocks, direct I/O, fsync'ed."""
    f = os.path.join(path, "dd-ceiling")
    count = max(1, total // (4 << 20))

    def run(args: list[str]) -> float:
        t0 = time.perf_counter()
        out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
        secs = time.perf_counter() - t0
        m = re.search(r"(\d+) bytes .* copied, ([0-9.]+) s", out.stderr)
        return int(m.group(1)) / float(m.group(2)) / 1e9 if m else count * (4 << 20) / secs / 1e9

    try:
        w = run(["if=/dev/zero", f"of={f}", "bs=4M", f"count={count}", "oflag=direct", "conv=fsync"])
        r = run([f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"])
    finally:
        with contextlib.suppress(OSError):
            os.unlink(f)
    return w, r


def _files(path: str, size: int, total: int, payload: memoryview) -> tuple[float, float]:
    """(write, read) GB/s of one plain file per object: a GROUP written, then each fsync'ed
    and renamed, one directory fsync per GROUP; then cold reads (page cache dropped per file)."""
    d = tempfile.mkdtemp(dir=path, prefix="files-")
    n = max(1, total // size)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        t0 = time.perf_counter()
        pending = []
        for i in range(n):
            tmp = os.path.join(d, f"{i}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            view = payload[:size]
            while len(view):
                view = view[os.write(fd, view):]
            pending.append((tmp, fd))
            if len(pending) == GROUP or i == n - 1:
                for t, fd in pending:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                for t, _ in pending:
                    os.rename(t, t[:-4])
                os.fsync(dfd)
                pending = []
        w = n * size / (time.perf_counter() - t0) / 1e9
        buf = bytearray(size)
        t0 = time.perf_counter()
        for i in range(n):
            fd = os.open(os.path.join(d, str(i)), os.O_RDONLY)
            mv, off = memoryview(buf), 0
            while off < size:
                off += os.preadv(fd, [mv[off:]], off)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        r = n * size / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(dfd)
        shutil.rmtree(d, ignore_errors=True)
    return w, r


def _tier(path: str, size: int, total: int, payload: memoryview) -> tuple[float, float]:
    """(write, read) GB/s of DiskTier as a node's demotions and disk reads use it."""
    import xxhash

    from kvpool.protocol.messages import ExtentEntry
    from kvpool.storenode.disk_tier import DiskTier

    d = tempfile.mkdtemp(dir=path, prefix="tier-")
    tier = DiskTier(d, total + (64 << 20))
    try:
        n = max(1, total // size)
        rows = [ExtentEntry(f"bench/{i}", 0, size, 0, xxhash.xxh3_64_intdigest(payload[:size]), None, True, 1)
                for i in range(n)]
        t0 = time.perf_counter()
        group = []
        ids = []
        for row in rows:
            disk_id = tier.reserve(size)
            group.append((disk_id, row, tier.write(disk_id, row, payload[:size])))
            ids.append(disk_id)
            if len(group) == GROUP:
                tier.publish(group)
                group = []
        if group:
            tier.publish(group)
        w = n * size / (time.perf_counter() - t0) / 1e9
        out = memoryview(bytearray(size))
        t0 = time.perf_counter()
        for disk_id in ids:
            tier.read_into(disk_id, out)
        r = n * size / (time.perf_counter() - t0) / 1e9
    finally:
        tier.close()
        shutil.rmtree(d, ignore_errors=True)
    return w, r


def _cluster(path: str, size: int, total: int, memory: int) -> tuple[float, float, dict]:
    """(demotion, disk get) GB/s through a real store node (see the module docstring)."""
    from kvpool.cli.cluster import LocalCluster
    from kvpool.protocol.config import load_config

    d = tempfile.mkdtemp(dir=path, prefix="node-")
    cfg = load_config(None, {"storenodes": [{"name": "node-0", "memory": memory, "disk_dir": d,
                                             "disk_capacity": total * 2 + (64 << 20)}]}, environ={})
    n = max(1, total // size)
    per = max(1, int(0.08 * memory) // size)  # a batch: what fits between the watermarks
    data = [os.urandom(size) for _ in range(min(n, 64))]
    try:
        with LocalCluster(cfg) as lc, lc.client() as c:
            keys = [f"bench/{i}" for i in range(n)]
            t0 = time.perf_counter()
            waited = 0.0
            for a in range(0, n, per):
                part = keys[a:a + per]
                assert c.put_batch(part, [data[i % len(data)] for i in range(a, a + len(part))]) == [None] * len(part)
                t_put = time.perf_counter()
                deadline = time.monotonic() + 60
                while True:
                    st = c.stats()
                    node = st.nodes[0]
                    if node.tier_moves == 0 and node.used <= 0.9 * node.capacity:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"demotions did not settle: {st}")
                    time.sleep(0.002)
                waited += time.perf_counter() - t_put
            secs = time.perf_counter() - t0
            st = c.stats()
            demoted = st.counters.get("demoted_bytes", 0)
            on_disk = [r.key for r in c.ls(limit=n + 10) if r.tiers == ["disk"]]
            t0 = time.perf_counter()
            got = 0
            for a in range(0, len(on_disk), 16):
                for r in c.get_batch(on_disk[a:a + 16]):
                    assert isinstance(r, bytes) and len(r) == size, r
                    got += size
            rsecs = time.perf_counter() - t0
            info = {"demoted_bytes": demoted, "disk_objects": len(on_disk), "evictions": {
                k: v for k, v in st.counters.items() if k.startswith("evictions_")},
                "demotion_latency_s_sum": st.nodes[0].demotion_s, "demotions": st.nodes[0].demotions,
                "sustained_gbps": demoted / secs / 1e9}
            return demoted / waited / 1e9, got / rsecs / 1e9 if rsecs else 0.0, info
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "kvpool-disk-bench"))
    ap.add_argument("--sizes", default="256KiB,4MiB")
    ap.add_argument("--total", default="256MiB")
    ap.add_argument("--memory", default="64MiB", help="the cluster row's store node memory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    total, memory = parse_size(a.total), parse_size(a.memory)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    payload = memoryview(os.urandom(max(sizes)))
    rounds = []
    for r in range(a.rounds):
        row: dict = {"round": r, "dd": [], "sizes": {}}
        row["dd"].append(_dd(a.dir, total))
        for size in sizes:
            files = _files(a.dir, size, total, payload)
            tier = _tier(a.dir, size, total, payload)
            cluster = _cluster(a.dir, size, total, memory)
            files2 = _files(a.dir, size, total, payload)
            row["sizes"][size] = {"files": [files, files2], "tier": tier, "cluster": cluster[:2], "info": cluster[2]}
        row["dd"].append(_dd(a.dir, total))
        rounds.append(row)
        if not a.json:
            print(f"round {r}: dd w/r {max(x[0] for x in row['dd']):.2f}/{max(x[1] for x in row['dd']):.2f} GB/s",
                  file=sys.stderr)
    report = {"dir": a.dir, "total": total, "memory": memory, "rounds": rounds}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(render(report))


def render(report: dict) -> str:
    """A markdown table of a report: per size and path, min / median / max over rounds of
    GB/s and of the ratios to dd and to the files ceiling of the same round."""
    def mmm(xs: list[float]) -> str:
        xs = sorted(xs)
        return f"{xs[0]:.2f} / {xs[len(xs) // 2]:.2f} / {xs[-1]:.2f}"

    lines = ["| size | op | path | GB/s (min / median / max) | × dd (same round) | × files ceiling |",
             "|---|---|---|---:|---:|---:|"]
    sizes = sorted({int(s) for r in report["rounds"] for s in r["sizes"]})
    for size in sizes:
        for op, k in (("write", 0), ("read", 1)):
            for path in ("files", "tier", "cluster"):
                vals, to_dd, to_files = [], [], []
                for r in report["rounds"]:
                    cell = r["sizes"].get(size, r["sizes"].get(str(size)))
                    dd = max(x[k] for x in r["dd"])
                    files = max(x[k] for x in cell["files"])
                    v = files if path == "files" else cell[path][k]
                    vals.append(v)
                    to_dd.append(v / dd)
                    to_files.append(v / files)
                label = {"files": "file per object (ceiling)", "tier": "DiskTier (in process)",
                         "cluster": "demotions / disk gets (store node)"}[path]
                lines.append(f"| {size >> 10} KiB | {op} | {label} | {mmm(vals)} | {mmm(to_dd)} | {mmm(to_files)} |")
    dds = [max(x[0] for x in r["dd"]) for r in report["rounds"]], [max(x[1] for x in r["dd"]) for r in report["rounds"]]
    lines.append(f"\ndd 4 MiB direct: write {mmm(dds[0])} GB/s, read {mmm(dds[1])} GB/s (min / median / max of rounds)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
