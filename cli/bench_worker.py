"""Worker processes of ``kvpool bench``, and the parent's handle on them.

``python -m kvpool.cli.bench_worker --worker`` reads one JSON command per line on stdin and
answers one JSON line on stdout (no pickle); it exits when stdin closes (so also when the
parent dies). Commands:

* ``cell``: make the system's client if new (kvpool, redis or Mooncake Store), size the
  rotating source/destination pools for the cell and warm the client (connections,
  mappings) before any clock starts;
* ``put`` / ``get``: one timed phase of the system's current cell (see :meth:`Worker.phase`);
* ``cleanup``: remove the cell's keys (force);
* ``meta``: master metadata ops through the real RPC;
* ``peer``: the far end of a raw-socket ceiling (:mod:`cli.bench_ceilings`);
* ``mooncake_store``: become a Mooncake Store node holding ``segment`` bytes, and stay
  alive until stdin closes (:mod:`cli.bench_peers`).

``--burn`` runs a CPU-burning loop (numpy copies and Python arithmetic) until stdin closes:
the background load of ``kvpool bench --load``.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from typing import Any

from kvpool.cli.bench_buffers import POOL_BYTES, aligned, pool_slots, slot_views

SAMPLE = 4  # objects per get phase whose bytes are compared with what was put
REPLY_TIMEOUT_S = 900.0  # the longest a worker may take to answer one command (a whole phase)
_names = itertools.count()


# ---- the parent's side ---------------------------------------------------------------------------

class Proc:
    """One worker process. ``log_dir``: its stderr goes to a file there (Mooncake's logs),
    whose tail an error names; None: this process's stderr."""

    def __init__(self, mode: str = "--worker", log_dir: str | None = None, name: str = "worker") -> None:
        self._buf = b""
        # UCX variables set in this process by an imported ucx transport would make the
        # child's UCX warn about them; the child sets its own when it needs UCX
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        self.log = os.path.join(log_dir, f"{name}-{next(_names)}.log") if log_dir else None
        err = open(self.log, "wb") if self.log else None  # noqa: SIM115 - the child holds it
        try:
            self.p = subprocess.Popen([sys.executable, "-m", "kvpool.cli.bench_worker", mode],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)
        finally:
            if err is not None:
                err.close()

    def send(self, msg: dict) -> None:
        try:
            self.p.stdin.write(json.dumps(msg).encode() + b"\n")
            self.p.stdin.flush()
        except OSError as e:  # it exited: a closed pipe
            raise RuntimeError(f"bench worker {self.p.pid} exited (code {self.p.wait()}): {e}" + self.tail()) from None

    def recv(self, timeout_s: float = REPLY_TIMEOUT_S) -> dict:
        """The next reply; RuntimeError when the worker exits first, answers with an error,
        or gives no reply within ``timeout_s`` (then it is killed: it is out of step)."""
        deadline = time.monotonic() + timeout_s
        fd = self.p.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.p.kill()
                    self.p.wait(5)
                    raise RuntimeError(f"bench worker {self.p.pid} gave no reply within {timeout_s:g} s" + self.tail())
                data = os.read(fd, 1 << 16)
                if not data:
                    raise RuntimeError(f"bench worker {self.p.pid} exited (code {self.p.wait()}) without a reply"
                                       + self.tail())
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"bench worker: {msg['error']}")
        return msg

    def call(self, msg: dict, timeout_s: float = REPLY_TIMEOUT_S) -> dict:
        self.send(msg)
        return self.recv(timeout_s)

    def tail(self, n: int = 600) -> str:
        if not self.log:
            return ""
        with contextlib.suppress(OSError), open(self.log, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return "; its log ends: " + f.read().decode(errors="replace").strip().replace("\n", " | ")
        return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_all([self], timeout_s)


def stop_all(procs: list[Proc], timeout_s: float = 10.0) -> None:
    """End workers together: close every stdin first (each then closes its clients, which
    takes Mooncake's a second or two), then wait; kill those still running after
    ``timeout_s``."""
    for w in procs:
        with contextlib.suppress(OSError, ValueError):
            w.p.stdin.close()
    deadline = time.monotonic() + timeout_s
    for w in procs:
        try:
            w.p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.p.kill()
            w.p.wait(5)


def broadcast(procs: list[Proc], msg: dict | list[dict]) -> list[dict]:
    """Send ``msg`` (or ``msg[i]`` to worker ``i``) to every worker first, so they start
    together, then collect every reply; raises the first worker's error after reading
    all replies (so the survivors stay in step)."""
    msgs = msg if isinstance(msg, list) else [msg] * len(procs)
    for p, m in zip(procs, msgs):
        p.send(m)
    out, err = [], None
    for p in procs:
        try:
            out.append(p.recv())
        except RuntimeError as e:
            err = err or e
    if err is not None:
        raise err
    return out


# ---- the worker's side -----------------------------------------------------------------------------

class Pools:
    """Rotating source and destination buffers, page-aligned, ≥ POOL_BYTES each (or
    ``count`` objects), written once so no page fault is timed; the sources hold random
    bytes, the destinations ones."""

    def __init__(self) -> None:
        self.src = self.dst = None
        self.gen = 0

    def fit(self, size: int, count: int) -> None:
        import numpy as np

        self.size = size
        self.slots = pool_slots(size, count)
        if self.src is None or len(self.src) < self.slots * size:
            rng = np.random.default_rng(os.getpid())
            self.src = aligned(self.slots * size)
            self.src[:] = rng.integers(0, 256, self.slots * size, dtype=np.uint8)
            self.dst = aligned(self.slots * size)
            self.dst[:] = 1
            self.gen += 1
        self.srcs = slot_views(self.src, size, self.slots)
        self.dsts = slot_views(self.dst, size, self.slots)
        base_s, base_d = self.src.ctypes.data, self.dst.ctypes.data
        self.src_ptrs = [base_s + i * size for i in range(self.slots)]
        self.dst_ptrs = [base_d + i * size for i in range(self.slots)]

    def stamp(self, nonce: bytes) -> None:
        """Write ``nonce`` at the head of every source slot: bytes read back with another
        nonce were put by an earlier phase (a put that stored nothing)."""
        n = min(len(nonce), self.size)
        for v in self.srcs:
            v[:n] = nonce[:n]


class Worker:
    def __init__(self) -> None:
        self.pools = Pools()
        self.drivers: dict[str, Any] = {}
        self.cells: dict[str, dict] = {}
        self.mc = None  # the process's MooncakeClient
        self.mc_store = None  # a Mooncake store node (``mooncake_store``)
        self.meta_client = None

    def handle(self, msg: dict) -> dict:
        cmd = msg["cmd"]
        if cmd == "cell":
            return self.cell(msg)
        if cmd in ("put", "get"):
            return self.phase(msg["system"], cmd)
        if cmd == "cleanup":
            c = self.cells[msg["system"]]
            return {"failed": self.drivers[msg["system"]].remove(c["keys"])}
        if cmd == "meta":
            return self.meta(msg)
        if cmd == "peer":
            return peer(msg)
        if cmd == "mooncake_store":
            return self.mooncake_store(msg)
        if cmd == "ping":
            return {"ok": True}
        raise ValueError(f"unknown worker command {cmd!r}")

    def driver(self, system: dict, msg: dict):
        d = self.drivers.get(system["id"])
        if d is not None:
            return d
        from kvpool.cli import bench_drivers as D

        fam = system["family"]
        if fam == "kvpool":
            d = D.KvpoolDriver(system, msg["master"], msg.get("streams", 1))
        elif fam == "redis":
            d = D.RedisDriver(msg["redis_port"])
        elif fam == "mooncake":
            if self.mc is None:
                m = msg["mooncake"]
                self.mc = D.MooncakeClient(m["metadata_url"], m["master_addr"], m["local_buffer"])
            d = D.MooncakeDriver(self.mc, system["variant"])
        else:
            raise ValueError(f"unknown system family {fam!r}")
        self.drivers[system["id"]] = d
        return d

    def cell(self, msg: dict) -> dict:
        system = msg["system"]
        d = self.driver(system, msg)
        size, count, batch = msg["size"], msg["count"], msg["batch"]
        self.pools.fit(size, count)
        if self.mc is not None and d.uses_ptrs:
            self.mc.register([self.pools.src, self.pools.dst])
        d.configure(size, batch, msg.get("replicas", 1))
        self.cells[system["id"]] = {**msg, "keys": [f"{msg['prefix']}/{i}" for i in range(count)]}
        d.warm(msg["prefix"], self.pools.srcs[0])
        return {"ok": True}

    def phase(self, sid: str, op: str) -> dict:
        """One timed phase: every key of the cell in calls of ``batch`` keys, sources and
        destinations rotating over the pools. The arguments of every call are built before
        the clock starts; each call's latency covers the call alone (its result is checked
        after it), the wall time the whole loop. A put first stamps the sources with a fresh nonce; a get then compares
        the last :data:`SAMPLE` objects with the sources, byte for byte (``stale``: bytes
        of an earlier phase, i.e. a put that stored nothing; ``corrupt``: any other)."""
        c, d, pools = self.cells[sid], self.drivers[sid], self.pools
        keys, b, size = c["keys"], c["batch"], c["size"]
        if op == "put":
            pools.stamp(os.urandom(8))
            bufs = pools.src_ptrs if d.uses_ptrs else pools.srcs
        else:
            bufs = pools.dst_ptrs if d.uses_ptrs else pools.dsts
        n = pools.slots
        calls = [(keys[i:i + b], [bufs[(i + j) % n] for j in range(min(b, len(keys) - i))])
                 for i in range(0, len(keys), b)]
        call = d.put if op == "put" else d.get
        errors = misses = not_fresh = 0
        first = ""
        kept: list[tuple[int, Any]] = []  # (index of its first key, result) of the last SAMPLE calls
        lat: list[float] = []
        perf = time.perf_counter
        i = 0
        t_start = time.monotonic()
        for ks, bs in calls:
            t0 = perf()
            res = call(ks, bs)
            lat.append(perf() - t0)
            if op == "put":
                e, nf, f = d.check_put(res, len(ks))
                not_fresh += nf
            else:
                m, e, f = d.check_get(res, size)
                misses += m
                kept.append((i, res))
                if len(kept) > SAMPLE:
                    del kept[0]
            errors += e
            first = first or f
            i += len(ks)
        t_end = time.monotonic()
        out = {"start": t_start, "end": t_end, "lat": lat, "objects": len(keys), "errors": errors, "misses": misses,
               "not_fresh": not_fresh, "first_error": first}
        if op == "get":
            out.update(self.verify(kept, d, len(keys)))
        return out

    def verify(self, kept: list[tuple[int, Any]], d, objects: int) -> dict:
        """Compare up to SAMPLE objects of the last calls with their sources."""
        import numpy as np

        pools, size = self.pools, self.pools.size
        stale = corrupt = checked = 0
        for i0, res in kept:
            for j, got in enumerate(res):
                if checked >= SAMPLE:
                    break
                slot = (i0 + j) % pools.slots
                if d.returns_values:
                    if got is None or isinstance(got, int) or len(got) != size:
                        continue  # counted as a miss or an error already
                    got = np.frombuffer(got, dtype=np.uint8)
                else:
                    if got != size or i0 + j + pools.slots < objects:
                        continue  # a miss, an error, or a destination a later object overwrote
                    got = np.frombuffer(pools.dsts[slot], dtype=np.uint8)
                want = np.frombuffer(pools.srcs[slot], dtype=np.uint8)
                if not np.array_equal(got, want):
                    if np.array_equal(got[8:], want[8:]):
                        stale += 1
                    else:
                        corrupt += 1
                checked += 1
        return {"stale": stale, "corrupt": corrupt, "verified": checked}

    def meta(self, msg: dict) -> dict:
        """Metadata ops through the real RPC: per op, keys/s over the wall time and latency."""
        from kvpool.connector.client import KVPoolClient
        from kvpool.protocol import messages as M

        if self.meta_client is None:
            self.meta_client = KVPoolClient(msg["master"])
        c = self.meta_client
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

    def mooncake_store(self, msg: dict) -> dict:
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", msg["metadata_url"], msg["segment"], msg["local_buffer"], "tcp", "",
                     msg["master_addr"])
        if rc != 0:
            raise RuntimeError(f"Mooncake store setup returned {rc}")
        self.mc_store = s
        return {"ok": True}

    def close(self) -> None:
        for d in self.drivers.values():
            with contextlib.suppress(Exception):
                d.close()
        for c in (self.mc, self.mc_store, self.meta_client):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()


def _recv_exact(s, view: memoryview, n: int) -> bool:
    got = 0
    while got < n:
        k = s.recv_into(view[got:n], n - got)
        if k == 0:
            return False
        got += k
    return True


def peer(msg: dict) -> dict:
    """Far end of a raw-socket ceiling: connect to ``addr``; for each 16-byte request
    (op, n little-endian): op 1 sends ``n`` bytes in ``chunk``-byte pieces; op 2 receives
    ``n`` bytes and answers 8 bytes; op 0 or a close ends it."""
    from kvpool.protocol import transport

    chunk = msg["chunk"]
    pool = aligned(max(chunk, POOL_BYTES))
    pool[:] = 1
    view = memoryview(pool)
    slots = len(pool) // chunk
    s = transport.connect(msg["addr"], 30.0)
    s.settimeout(60)
    head = bytearray(16)
    hv = memoryview(head)
    ack = (1).to_bytes(8, "little")
    i = 0
    try:
        while _recv_exact(s, hv, 16):
            op, left = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
            if op == 0:
                break
            while left > 0:
                off = (i % slots) * chunk
                n = min(chunk, left)
                if op == 1:
                    s.sendall(view[off:off + n])
                elif not _recv_exact(s, view[off:off + n], n):
                    return {"ok": True}
                left -= n
                i += 1
            if op == 2:
                s.sendall(ack)
    finally:
        s.close()
    return {"ok": True}


def _exit_on_eof() -> None:
    with contextlib.suppress(Exception):
        sys.stdin.buffer.read()
    os._exit(0)


def burn() -> None:
    """Burn one CPU until stdin closes: copies between two 32 MiB buffers (memory
    bandwidth) alternating with a Python loop (the interpreter's own work)."""
    import numpy as np

    threading.Thread(target=_exit_on_eof, daemon=True).start()
    a, b = aligned(32 << 20), aligned(32 << 20)
    a[:] = 3
    while True:
        np.copyto(b, a)
        x = 0
        for k in range(20000):
            x += k * k


def main() -> None:
    if sys.argv[1:] == ["--burn"]:
        burn()
        return
    # replies go to the parent on the original stdout; anything else a library prints
    # there (UCX logs to fd 1) goes to stderr instead of corrupting the JSON lines
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    w = Worker()
    for line in sys.stdin.buffer:
        try:
            reply = w.handle(json.loads(line))
        except Exception as e:  # noqa: BLE001 - reported to the parent as one JSON line
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    w.close()


if __name__ == "__main__":
    main()
