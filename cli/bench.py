"""``kvpool bench``: put/get throughput and latency beside the ceilings measured in the same run.

What one run measures, in this order:

* **ceilings**: memcpy bandwidth of large (cold, 64 MiB) buffers in this process; raw
  loopback TCP and Unix-socket throughput between two processes (``sendall`` of object-
  sized chunks in one, ``recv_into`` a preallocated buffer in the other, same socket
  buffer sizes as the data plane); the same TCP stream asked for 4 MiB at a time
  (request → reply, the shape of a get; informative); a raw ``ucx://`` stream when the
  extra is installed. Best of three, measured again at the end (best of both kept).
* **the matrix**: for each path (``auto`` = same-host shared memory, ``tcp``, ``unix``,
  ``ucx``) ×
  object size × concurrent client *processes* × batch size: a put phase (every client
  writes its own keys) and a get phase (``get_into_batch`` into preallocated buffers),
  started together; GB/s and objects/s over the wall time from the first client's start to
  the last one's end, p50/p99 of per-call latency, and the ratio to the path's ceiling
  (shm → memcpy, tcp → raw TCP, unix → raw Unix socket, ucx → raw UCX). Sources and destinations rotate
  over ≥ 64 MiB pools, so neither side is cache-hot (the memcpy ceiling is cold too).
* ``metadata=True``: master metadata ops/s through the real RPC (lookup,
  put_start+put_end, remove), single-key and batched (64 and 256 keys per call).
* ``baseline="redis"``: the same put/get workload against a local ``redis-server`` on a free
  loopback port (SET/GET, pipelined for batches), ratio to raw TCP.

Client processes are ``python -m cli.bench --worker``: commands and results are JSON lines
over their stdin/stdout (no pickle). The report is a plain dict (``--json`` prints it).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

POOL_BYTES = 64 << 20  # rotate sources/destinations over this much memory (> L3)
META_BATCHES = (1, 64, 256)  # keys per metadata call
CEILING_OF = {"shm": "memcpy", "tcp": "tcp", "unix": "unix", "ucx": "ucx"}
PATH_OF = {"auto": "shm", "shm": "shm", "tcp": "tcp", "unix": "unix", "ucx": "ucx", "redis": "tcp"}


# ---- ceilings ---------------------------------------------------------------------------------

def memcpy_gbps(nbytes: int = POOL_BYTES, reps: int = 5) -> float:
    """Best-of-``reps`` bandwidth of ``numpy.copyto`` between two cold ``nbytes`` buffers."""
    import numpy as np

    src, dst = _aligned(nbytes), _aligned(nbytes)
    src[:] = 1
    dst[:] = 0
    pair = [src, dst]
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(pair[1], pair[0])
        best = min(best, time.perf_counter() - t0)
        pair.reverse()
    return nbytes / best / 1e9


def socket_gbps(kind: str, chunk: int, total: int, reps: int = 3, per_request: bool = False) -> float:
    """Best-of-``reps`` throughput of a raw ``kind`` ("tcp" | "unix" | "ucx") stream from a sender
    process into this one: ``recv_into`` a rotating preallocated pool, ``chunk``-byte sends.
    ``per_request``: ask for each chunk separately and wait for it (request → reply, the
    shape of a one-object get) instead of one request for the whole stream."""
    from kvpool.protocol import transport

    tmp = tempfile.mkdtemp(prefix="kvpool-bench-")
    addr = f"unix://{tmp}/ceil.sock" if kind == "unix" else f"{kind}://127.0.0.1:0"
    lst = transport.listen(addr)
    if kind == "tcp":
        addr = "tcp://%s:%d" % lst.getsockname()[:2]
    elif hasattr(lst, "bound_addr"):
        addr = lst.bound_addr
    proc = _spawn_worker()
    try:
        _send(proc, {"cmd": "sender", "addr": addr, "chunk": chunk})
        lst.settimeout(30)
        conn, _ = lst.accept()
        conn.settimeout(60)
        pool = _aligned(max(chunk, min(POOL_BYTES, total)))  # like the bench's buffers (see _aligned)
        pool[:] = 0
        view = memoryview(pool)
        slots = max(1, len(pool) // chunk)
        best = float("inf")
        total = max(chunk, total // chunk * chunk)
        for _ in range(reps):
            t0 = time.perf_counter()
            if not per_request:
                conn.sendall(total.to_bytes(8, "little"))
            left, i = total, 0
            while left:
                off = (i % slots) * chunk
                if per_request:
                    conn.sendall(chunk.to_bytes(8, "little"))
                got = 0
                while got < chunk:
                    n = conn.recv_into(view[off + got:off + chunk], chunk - got)
                    if n == 0:
                        raise ConnectionError("ceiling sender closed early")
                    got += n
                left -= chunk
                i += 1
            best = min(best, time.perf_counter() - t0)
        conn.sendall((0).to_bytes(8, "little"))
        _recv(proc)
        conn.close()
        return total / best / 1e9
    finally:
        lst.close()
        _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


# ---- worker processes ------------------------------------------------------------------------

def _spawn_worker() -> subprocess.Popen:
    # UCX variables set in this process by an imported ucx transport would make the child's
    # UCX warn about them; the child sets its own when it needs UCX
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    return subprocess.Popen([sys.executable, "-m", "kvpool.cli.bench", "--worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)


def _send(proc: subprocess.Popen, msg: dict) -> None:
    proc.stdin.write(json.dumps(msg).encode() + b"\n")
    proc.stdin.flush()


def _recv(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"bench worker {proc.pid} exited (code {proc.wait()}) without a reply")
    msg = json.loads(line)
    if "error" in msg:
        raise RuntimeError(f"bench worker: {msg['error']}")
    return msg


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError, ValueError):
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _all(procs: Sequence[subprocess.Popen], msg: dict) -> list[dict]:
    """Send ``msg`` to every worker (so they start together), then collect every reply."""
    for p in procs:
        _send(p, msg)
    return [_recv(p) for p in procs]


class _Worker:
    """The worker side: one KVPoolClient per transport (or one redis client), key lists kept
    between the put and get phases of a cell."""

    def __init__(self) -> None:
        self.clients: dict[str, Any] = {}
        self.keys: list[str] = []
        self.src = self.dst = None

    def client(self, msg: dict):
        name = msg["transport"]
        c = self.clients.get(name)
        if c is None:
            if name == "redis":
                import redis

                c = redis.Redis(host="127.0.0.1", port=msg["redis_port"])
            else:
                from kvpool.connector.client import KVPoolClient

                extra = {} if msg.get("reserve") is None else {"reserve_bytes": msg["reserve"]}
                if msg.get("spin_wait") is not None:
                    extra["spin_wait_s"] = msg["spin_wait"]
                c = KVPoolClient(msg["master"], transport=name, streams_per_node=msg.get("streams", 1), **extra)
            self.clients[name] = c
        return c

    def pools(self, size: int, count: int):
        """Rotating source/destination views: ≥ POOL_BYTES (or ``count`` objects) each,
        page-aligned like an engine's KV-cache pages (and written once, so no page faults
        are timed)."""
        import numpy as np

        slots = pool_slots(size, count)
        if self.src is None or len(self.src) < slots * size:
            rng = np.random.default_rng(os.getpid())
            self.src = _aligned(slots * size)
            self.src[:] = rng.integers(0, 256, slots * size, dtype=np.uint8)
            self.dst = _aligned(slots * size)
            self.dst[:] = 1
        return slot_views(self.src, size, slots), slot_views(self.dst, size, slots)

    def handle(self, msg: dict) -> dict:
        cmd = msg["cmd"]
        if cmd == "sender":
            return self.sender(msg)
        if cmd == "cell":
            self.keys = [f"{msg['prefix']}/{i}" for i in range(msg["count"])]
            self.cell = msg
            c = self.client(msg)
            self.srcs, self.dsts = self.pools(msg["size"], msg["count"])
            self.warm(c, msg)
            return {"ok": True}
        if cmd in ("put", "get"):
            return self.run(cmd)
        if cmd == "cleanup":
            self.cleanup()
            return {"ok": True}
        if cmd == "meta":
            return self.meta(msg)
        raise ValueError(f"unknown worker command {cmd!r}")

    def warm(self, c, msg: dict) -> None:
        """Open connections and map segments (both nodes) before the clock starts."""
        keys = [f"{msg['prefix']}/warm/{i}" for i in range(4)]
        data = bytes(min(msg["size"], 1 << 16))
        if msg["transport"] == "redis":
            c.ping()
            return
        c.put_batch(keys, [data] * len(keys))
        out = [bytearray(len(data)) for _ in keys]
        c.get_into_batch(keys, out)
        c.remove_batch(keys, force=True)

    def run(self, op: str) -> dict:
        msg = self.cell
        c = self.client(msg)
        redis = msg["transport"] == "redis"
        b, keys, srcs, dsts = msg["batch"], self.keys, self.srcs, self.dsts
        lat: list[float] = []
        misses = errors = 0
        first_err = ""
        t_start = time.monotonic()
        for i in range(0, len(keys), b):
            ks = keys[i:i + b]
            t0 = time.perf_counter()
            if redis:
                if op == "put":
                    if b == 1:
                        c.set(ks[0], srcs[i % len(srcs)])
                    else:
                        c.mset({k: srcs[(i + j) % len(srcs)] for j, k in enumerate(ks)})
                else:
                    res = [c.get(ks[0])] if b == 1 else c.mget(ks)
                    misses += sum(r is None for r in res)
            elif op == "put":
                res = c.put_batch(ks, [srcs[(i + j) % len(srcs)] for j in range(len(ks))],
                                  replicas=msg.get("replicas", 1))
                bad = [r for r in res if r is not None]
                errors += len(bad)
                first_err = first_err or (str(bad[0]) if bad else "")
            else:
                res = c.get_into_batch(ks, [dsts[(i + j) % len(dsts)] for j in range(len(ks))])
                misses += sum(r is None for r in res)
                bad = [r for r in res if r is not None and not isinstance(r, int)]
                errors += len(bad)
                first_err = first_err or (str(bad[0]) if bad else "")
            lat.append(time.perf_counter() - t0)
        t_end = time.monotonic()
        return {"start": t_start, "end": t_end, "lat": lat, "objects": len(keys), "misses": misses,
                "errors": errors, "first_error": first_err}

    def cleanup(self) -> None:
        c = self.client(self.cell)
        for i in range(0, len(self.keys), 1024):
            if self.cell["transport"] == "redis":
                c.delete(*self.keys[i:i + 1024])
            else:
                c.remove_batch(self.keys[i:i + 1024], force=True)

    def meta(self, msg: dict) -> dict:
        """Metadata ops through the real RPC: per op, keys/s over the wall time and latency."""
        from kvpool.protocol import messages as M

        c = self.client(msg)
        rpc, b, n = c.rpc, msg["batch"], msg["count"]
        keys = [f"{msg['prefix']}/{i}" for i in range(n)]
        out: dict[str, dict] = {}

        def timed(name: str, fn) -> None:
            lat = []
            t_start = time.monotonic()
            for i in range(0, n, b):
                t0 = time.perf_counter()
                fn(keys[i:i + b])
                lat.append(time.perf_counter() - t0)
            out[name] = {"start": t_start, "end": time.monotonic(), "lat": lat, "keys": n}

        def put(ks: list[str]) -> None:
            grants = rpc.call(M.PutStart([M.PutItem(k, 1, 0) for k in ks], c.host_id, 1))
            ok = [g for g in grants if isinstance(g, M.PutGrant) and g.status == "write"]
            rpc.call(M.PutEnd([g.key for g in ok], [g.put_id for g in ok]))

        timed("put_start+put_end", put)
        timed("lookup", lambda ks: rpc.call(M.Lookup(ks, lease=False)))
        timed("remove", lambda ks: rpc.call(M.Remove(ks, True)))
        return out

    def sender(self, msg: dict) -> dict:
        """Ceiling sender: connect, then for each 8-byte request send that many bytes."""
        from kvpool.protocol import transport

        chunk = msg["chunk"]
        pool = _aligned(max(chunk, POOL_BYTES))
        pool[:] = 1
        view = memoryview(pool)
        slots = len(pool) // chunk
        s = transport.connect(msg["addr"], 30.0)
        s.settimeout(60)
        head = bytearray(8)
        try:
            while True:
                got = 0
                while got < 8:
                    n = s.recv_into(memoryview(head)[got:], 8 - got)
                    if n == 0:
                        return {"ok": True}
                    got += n
                left = int.from_bytes(head, "little")
                if left == 0:
                    return {"ok": True}
                i = 0
                while left > 0:
                    s.sendall(view[(i % slots) * chunk:(i % slots + 1) * chunk])
                    left -= chunk
                    i += 1
        finally:
            s.close()


def _has_ucx() -> bool:
    try:  # through our module: it sets the UCX_* environment before ucxx loads UCX
        import kvpool.protocol.ucx_transport  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means the extra is not usable
        return False
    return True


def pool_slots(size: int, count: int) -> int:
    """How many ``size``-byte buffers a rotating pool holds: enough for POOL_BYTES (more
    than the L3 cache), at most ``count`` (the objects moved)."""
    return max(1, min(count, -(-POOL_BYTES // max(size, 1))))


def slot_views(buf, size: int, slots: int) -> list[memoryview]:
    """The first ``slots`` consecutive ``size``-byte views of ``buf``."""
    mv = memoryview(buf)
    return [mv[i * size:(i + 1) * size] for i in range(slots)]


def _aligned(n: int):
    """A page-aligned numpy uint8 array of ``n`` bytes.

    Every buffer of the bench and of its ceilings is page-aligned, because alignment changes
    the results on x86 machines: a copy (user-space ``memcpy`` or the kernel's copy into a
    ``recv_into`` buffer) whose destination lies 1–63 bytes past its source modulo 4 KiB
    runs several times slower (4K aliasing; benchmarks/RESULTS.md, "Measurements behind
    choices in the code"), and numpy's own allocations sit at page offset 16."""
    import numpy as np

    raw = np.empty(n + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + n]


def _worker_main() -> None:
    # replies go to the parent on the original stdout; anything else a library prints
    # there (UCX logs to fd 1) goes to stderr instead of corrupting the JSON lines
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    w = _Worker()
    for line in sys.stdin.buffer:
        try:
            reply = w.handle(json.loads(line))
        except Exception as e:  # noqa: BLE001 - reported to the parent as one JSON line
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for c in w.clients.values():
        with contextlib.suppress(Exception):
            c.close()


# ---- aggregation -----------------------------------------------------------------------------

def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return sorted_vals[i]


def _summarise(parts: list[dict], nbytes_per_obj: int, count_key: str = "objects") -> dict:
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    wall = max(wall, 1e-9)
    objs = sum(p[count_key] for p in parts)
    lat = sorted(x for p in parts for x in p["lat"])
    return {"seconds": round(wall, 6), "objects": objs, "bytes": objs * nbytes_per_obj,
            "gbps": objs * nbytes_per_obj / wall / 1e9, "objects_per_s": objs / wall,
            "p50_ms": _pct(lat, 0.50) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3, "calls": len(lat)}


# ---- redis baseline ------------------------------------------------------------------------

class _Redis:
    """A throwaway redis-server on a free loopback port, no persistence."""

    def __init__(self, maxmemory: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        from kvpool.cli.cluster import free_port

        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.dir, "--maxmemory", str(maxmemory),
                                      "--proto-max-bulk-len", str(max(512 << 20, 2 * maxmemory))],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- the run -----------------------------------------------------------------------------------

def run_bench(cfg, sizes: Sequence[int], clients: Sequence[int], total_bytes: int, transport: str = "auto",
              metadata: bool = False, progress: bool = True, *, batches: Sequence[int] = (1,),
              replicas: Sequence[int] = (1,),
              baseline: str | None = None, master: str | None = None, max_objects: int = 4096,
              meta_keys: int = 4096, ceiling_bytes: int | None = None, repeat: int = 1, streams: int = 1,
              reserve: int | None = None, spin_wait: float | None = None) -> dict:
    """Run the benchmark and return the report dict (see the module docstring).

    ``transport``: comma-separated paths among ``auto`` (same-host shared memory), ``tcp``,
    ``unix``. ``total_bytes``: bytes moved per cell (split over the clients, at most
    ``max_objects`` objects and 40% of the cluster's capacity). ``master``: reuse a running
    cluster; else a LocalCluster is started from ``cfg`` and stopped at the end.
    ``baseline="redis"`` adds the same workload against a local redis-server.
    ``meta_keys``: keys per metadata op and client count; ``ceiling_bytes``: bytes per raw
    socket ceiling run (default 256 MiB). Small values of these make a quick run for tests.
    ``repeat``: run each cell's put+get that many times and keep the best (shared machines).
    ``streams``: the clients' ``streams_per_node`` (network connections per node per batch).
    ``reserve``: the clients' ``reserve_bytes`` (extents reserved ahead of need; 0: every
    put asks the master first; None: the client's default). ``spin_wait``: the clients'
    ``spin_wait_s`` (seconds a wait for a reply polls before it sleeps; None: the default).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvpool.protocol.errors import ConfigError

    paths = [t.strip() for t in transport.split(",") if t.strip()]
    for t in paths:
        if t not in ("auto", "shm", "tcp", "unix", "ucx"):
            raise ConfigError(f"bench --transport: {t!r}; accepted: auto, tcp, unix, ucx (comma separated)",
                              key="transport")
    if "ucx" in paths and not _has_ucx():
        raise ConfigError("bench --transport ucx needs the ucx extra: pip install 'kvpool[ucx]'", key="transport")
    if baseline not in (None, "", "redis"):
        raise ConfigError(f"bench --baseline: {baseline!r}; accepted: redis", key="baseline")
    if not sizes or not clients or min(sizes) <= 0 or min(clients) <= 0 or min(batches) <= 0 \
            or not replicas or min(replicas) <= 0:
        raise ConfigError("bench: sizes, clients, batches and replicas must be positive", key="sizes")
    systems = [("kvpool", p) for p in paths] + ([("redis", "redis")] if baseline == "redis" else [])
    cells = [(sysname, t, s, c, b, r) for sysname, t in systems for s in sizes for c in clients for b in batches
             for r in (replicas if sysname == "kvpool" else (1,))]
    n_steps = 4 + len(cells) + (len(clients) * len(META_BATCHES) if metadata else 0)
    chunk = max(min(max(sizes), 16 << 20), 1 << 20)

    lc = None
    workers: list[subprocess.Popen] = []
    red: _Redis | None = None
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), transient=True, disable=not progress)
    run_id = uuid.uuid4().hex[:8]
    report: dict[str, Any] = {"ceilings": {}, "results": [], "metadata": [], "skipped": [],
                              "config": {"sizes": list(sizes), "clients": list(clients), "batches": list(batches),
                                         "replicas": list(replicas), "total_bytes": total_bytes, "transports": paths,
                                         "baseline": baseline, "repeat": repeat, "ceiling_chunk_bytes": chunk,
                                         "streams_per_node": streams, "reserve_bytes": reserve,
                                         "spin_wait_s": spin_wait},
                              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    try:
        with prog:
            task = prog.add_task("ceilings: memcpy", total=n_steps)
            ceil = report["ceilings"]
            ceil["memcpy_gbps"] = memcpy_gbps()
            prog.update(task, advance=1, description="ceilings: raw TCP")
            cbytes = ceiling_bytes or max(256 << 20, 8 * chunk)
            ceil["tcp_gbps"] = socket_gbps("tcp", chunk, cbytes)
            # informative: the same bytes asked for one 4 MiB chunk at a time, as gets do
            ceil["tcp_rr_gbps"] = socket_gbps("tcp", 4 << 20, cbytes, per_request=True)
            prog.update(task, advance=1, description="ceilings: raw Unix socket")
            ceil["unix_gbps"] = socket_gbps("unix", chunk, cbytes)
            if _has_ucx():  # informative: what the optional ucx:// transport moves between processes
                with contextlib.suppress(Exception):
                    ceil["ucx_gbps"] = socket_gbps("ucx", chunk, cbytes)
            prog.update(task, advance=1, description="starting cluster")
            if master is None:
                from kvpool.cli.cluster import LocalCluster

                if "ucx" in paths:  # store nodes also serve ucx:// so that clients can pick it
                    cfg = msgspec.structs.replace(cfg, storenodes=[msgspec.structs.replace(n, ucx=True)
                                                                   for n in cfg.storenodes])
                lc = LocalCluster(cfg)
                lc.__enter__()
                master = lc.master_addr
            from kvpool.connector.client import KVPoolClient

            with KVPoolClient(master) as probe:
                capacity = probe.stats().capacity
            if baseline == "redis":
                red = _Redis(maxmemory=int(capacity))
            workers = [_spawn_worker() for _ in range(max(clients))]
            for sysname, t, size, nc, b, nrep in cells:
                prog.update(task, description=f"{sysname} {PATH_OF[t]} {_fmt_size(size)} ×{nc} batch {b} "
                                              f"replicas {nrep}")
                budget = min(total_bytes, int(0.4 * capacity))
                if b * size * nc * nrep > int(0.4 * capacity):
                    report["skipped"].append({"system": sysname, "transport": t, "size": size, "clients": nc,
                                              "batch": b, "replicas": nrep,
                                              "why": "one batch per client does not fit 40% of the cluster"})
                    prog.update(task, advance=1)
                    continue
                per = max(b, min(max_objects, budget // (size * nrep)) // nc // b * b)
                base = {"transport": t, "master": master, "size": size, "count": per, "batch": b, "replicas": nrep,
                        "redis_port": red.port if red else 0, "streams": streams, "reserve": reserve,
                        "spin_wait": spin_wait}
                procs = workers[:nc]
                for w_i, p in enumerate(procs):
                    _send(p, {**base, "cmd": "cell", "prefix": f"bench/{run_id}/{t}/{size}/{nc}/{b}/{nrep}/{w_i}"})
                for p in procs:
                    _recv(p)
                best: dict[str, dict] = {}
                for _ in range(max(1, repeat)):
                    for op in ("put", "get"):
                        parts = _all(procs, {"cmd": op})
                        row = {"system": sysname, "transport": t, "path": PATH_OF[t], "op": op, "size": size,
                               "clients": nc, "batch": b, "replicas": nrep, **_summarise(parts, size),
                               "misses": sum(p["misses"] for p in parts),
                               "errors": sum(p["errors"] for p in parts),
                               "first_error": next((p["first_error"] for p in parts if p["first_error"]), "")}
                        row["ceiling"] = CEILING_OF[row["path"]]
                        if op not in best or row["gbps"] > best[op]["gbps"] or row["errors"] or row["misses"]:
                            best[op] = row
                    _all(procs, {"cmd": "cleanup"})
                report["results"] += [best["put"], best["get"]]
                prog.update(task, advance=1)
            if metadata:
                for nc in clients:
                    for b in META_BATCHES:
                        prog.update(task, description=f"metadata ×{nc} batch {b}")
                        n = max(b, meta_keys // nc // b * b) if b > 1 else max(1, meta_keys // 8 // nc)
                        mbest: dict[str, dict] = {}
                        for _ in range(max(1, repeat)):
                            parts = _all(workers[:nc], {"cmd": "meta", "transport": "auto", "master": master,
                                                        "batch": b, "count": n,
                                                        "prefix": f"bench/{run_id}/meta/{nc}/{b}"})
                            for op in ("put_start+put_end", "lookup", "remove"):
                                s = _summarise([p[op] for p in parts], 0, count_key="keys")
                                row = {"op": op, "clients": nc, "batch": b, "keys_per_s": s["objects_per_s"],
                                       "calls_per_s": s["calls"] / s["seconds"], "p50_ms": s["p50_ms"],
                                       "p99_ms": s["p99_ms"], "keys": s["objects"]}
                                if op not in mbest or row["keys_per_s"] > mbest[op]["keys_per_s"]:
                                    mbest[op] = row
                        report["metadata"] += list(mbest.values())
                        prog.update(task, advance=1)
            # ceilings again at the end (the machine may be shared): keep the best of both
            prog.update(task, description="ceilings again")
            ceil["memcpy_gbps"] = max(ceil["memcpy_gbps"], memcpy_gbps())
            ceil["tcp_gbps"] = max(ceil["tcp_gbps"], socket_gbps("tcp", chunk, cbytes))
            ceil["tcp_rr_gbps"] = max(ceil["tcp_rr_gbps"], socket_gbps("tcp", 4 << 20, cbytes, per_request=True))
            ceil["unix_gbps"] = max(ceil["unix_gbps"], socket_gbps("unix", chunk, cbytes))
            prog.update(task, advance=1)
            for row in report["results"]:
                c = ceil.get(f"{row['ceiling']}_gbps", 0.0)
                row["ratio"] = row["gbps"] / c if c else 0.0
    finally:
        for p in workers:
            _stop(p)
        if red is not None:
            red.close()
        if lc is not None:
            lc.__exit__(None, None, None)
    return report


# ---- rendering ---------------------------------------------------------------------------------

def _fmt_size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def render_bench(report: dict, console=None) -> None:
    """Rich tables: ceilings, put/get results with ratios, metadata ops."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=140)  # a pipe or file: do not squeeze the table to 80 columns
    c = report["ceilings"]
    t = Table(title="ceilings (same run)")
    cols = [("memcpy", "memcpy_gbps"), ("raw TCP", "tcp_gbps"), ("raw TCP 4 MiB req→reply", "tcp_rr_gbps"),
            ("raw Unix socket", "unix_gbps"), ("raw UCX stream", "ucx_gbps")]
    cols = [(name, k) for name, k in cols if k in c]
    for name, _ in cols:
        t.add_column(name, justify="right")
    t.add_row(*[f"{c[k]:.2f} GB/s" for _, k in cols])
    console.print(t)
    t = Table(title="put / get")
    for col in ("system", "op", "path", "size", "clients", "batch", "replicas", "GB/s", "objects/s", "p50 ms",
                "p99 ms", "× ceiling"):
        t.add_column(col, justify="right" if col not in ("system", "op", "path") else "left")
    for r in report["results"]:
        flag = f" [red]{r['errors']} err / {r['misses']} miss[/]" if r["errors"] or r["misses"] else ""
        t.add_row(r["system"], r["op"], r["path"], _fmt_size(r["size"]), str(r["clients"]), str(r["batch"]),
                  str(r.get("replicas", 1)),
                  f"{r['gbps']:.2f}", f"{r['objects_per_s']:,.0f}", f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
                  f"{r['ratio']:.2f} {r['ceiling']}{flag}")
    console.print(t)
    if report.get("metadata"):
        t = Table(title="master metadata (real RPC)")
        for col in ("op", "clients", "batch", "keys/s", "calls/s", "p50 ms", "p99 ms"):
            t.add_column(col, justify="left" if col == "op" else "right")
        for r in report["metadata"]:
            t.add_row(r["op"], str(r["clients"]), str(r["batch"]), f"{r['keys_per_s']:,.0f}",
                      f"{r['calls_per_s']:,.0f}", f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}")
        console.print(t)


def render_markdown(report: dict) -> str:
    """The report as Markdown tables (for the README and release notes)."""
    c = report["ceilings"]
    names = [("memcpy", "memcpy_gbps"), ("raw TCP", "tcp_gbps"), ("raw TCP 4 MiB req→reply", "tcp_rr_gbps"),
             ("raw Unix socket", "unix_gbps"), ("raw UCX stream", "ucx_gbps")]
    names = [(n, k) for n, k in names if k in c]
    lines = ["| " + " | ".join(n for n, _ in names) + " |", "|" + "---:|" * len(names),
             "| " + " | ".join(f"{c[k]:.2f} GB/s" for _, k in names) + " |", "",
             "| system | op | path | size | clients | batch | replicas | GB/s | objects/s | p50 ms | p99 ms "
             "| × ceiling |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["results"]:
        lines.append(f"| {r['system']} | {r['op']} | {r['path']} | {_fmt_size(r['size'])} | {r['clients']} | "
                     f"{r['batch']} | {r.get('replicas', 1)} | {r['gbps']:.2f} | {r['objects_per_s']:,.0f} | "
                     f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['ratio']:.2f} {r['ceiling']} |")
    if report.get("metadata"):
        lines += ["", "| metadata op | clients | batch | keys/s | calls/s | p50 ms | p99 ms |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in report["metadata"]:
            lines.append(f"| {r['op']} | {r['clients']} | {r['batch']} | {r['keys_per_s']:,.0f} | "
                         f"{r['calls_per_s']:,.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker_main()
    else:
        print("usage: kvpool bench (this module's --worker mode is internal)", file=sys.stderr)
        sys.exit(2)
