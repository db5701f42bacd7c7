"""Hardware ceilings of ``kvpool bench``, measured in the same rounds as the systems.

* ``memcpy``: ``numpy.copyto`` between two cold 64 MiB page-aligned buffers in this process
  (the ceiling of a same-host copy through shared memory);
* ``tcp`` / ``unix`` / ``ucx`` streams: a peer process sends ``chunk``-byte pieces, this one
  ``recv_into``s a rotating preallocated pool (socket buffers as the data plane's);
* ``tcp_rr_get``: request→reply shaped as a one-object get: ask for one object, receive it;
* ``tcp_rr_put``: shaped as a one-object put: send the object (header and bytes in one
  ``sendmsg``), receive an 8-byte answer.

Each is the best of a few repetitions within its round, in GB/s (1e9 bytes per second).
"""
from __future__ import annotations

import shutil
import tempfile
import time

from kvpool.cli.bench_buffers import POOL_BYTES, aligned
from kvpool.cli.bench_worker import Proc

_STREAM, _PUT, _STOP = 1, 2, 0


def memcpy_gbps(nbytes: int = POOL_BYTES, reps: int = 5) -> float:
    """Best-of-``reps`` bandwidth of ``numpy.copyto`` between two cold ``nbytes`` buffers."""
    import numpy as np

    src, dst = aligned(nbytes), aligned(nbytes)
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


def _head(op: int, n: int) -> bytes:
    return op.to_bytes(8, "little") + n.to_bytes(8, "little")


def _recv_exact(s, view: memoryview, n: int) -> None:
    got = 0
    while got < n:
        k = s.recv_into(view[got:n], n - got)
        if k == 0:
            raise ConnectionError("ceiling peer closed early")
        got += k


def _send_parts(s, parts: list) -> None:
    """Send ``parts`` in one ``sendmsg`` where the socket has it (as a header and its
    payload go out together), else one ``sendall`` each."""
    if not hasattr(s, "sendmsg"):
        for p in parts:
            s.sendall(p)
        return
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = s.sendmsg(views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class CeilingPeer:
    """One peer process for every socket ceiling of a run (started once, not per round)."""

    def __init__(self, log_dir: str | None = None) -> None:
        self.log_dir = log_dir
        self.proc = self._start()

    def _start(self) -> Proc:
        p = Proc(log_dir=self.log_dir, name="ceiling-peer")
        p.call({"cmd": "ping"}, timeout_s=60)
        return p

    def measure(self, kind: str, shape: str, chunk: int, total: int, reps: int = 2) -> float:
        """Best-of-``reps`` GB/s of ``total`` bytes over a raw ``kind`` ("tcp" | "unix" |
        "ucx") connection in ``chunk``-byte pieces; ``shape``: "stream" (one request for
        everything), "get" (ask for each piece and wait for it) or "put" (send each piece,
        wait for its answer)."""
        try:
            return self._measure(kind, shape, chunk, total, reps)
        except Exception:
            self.proc.p.kill()  # out of step with this process: the next measurement gets a fresh peer
            self.proc.stop()
            self.proc = self._start()
            raise

    def _measure(self, kind: str, shape: str, chunk: int, total: int, reps: int) -> float:
        from kvpool.protocol import transport

        tmp = tempfile.mkdtemp(prefix="kvpool-bench-")
        addr = f"unix://{tmp}/ceil.sock" if kind == "unix" else f"{kind}://127.0.0.1:0"
        lst = transport.listen(addr)
        try:
            if kind == "tcp":
                host, port = lst.getsockname()[:2]
                addr = f"tcp://{host}:{port}"
            elif hasattr(lst, "bound_addr"):
                addr = lst.bound_addr
            self.proc.send({"cmd": "peer", "addr": addr, "chunk": chunk})
            lst.settimeout(30)
            conn, _ = lst.accept()
            conn.settimeout(60)
            try:
                return self._run(conn, shape, chunk, total, reps)
            finally:
                try:
                    conn.sendall(_head(_STOP, 0))
                finally:
                    self.proc.recv(timeout_s=60)
                    conn.close()
        finally:
            lst.close()
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _run(conn, shape: str, chunk: int, total: int, reps: int) -> float:
        pool = aligned(max(chunk, min(POOL_BYTES, total)))  # like the bench's buffers
        pool[:] = 0 if shape != "put" else 1
        view = memoryview(pool)
        slots = max(1, len(pool) // chunk)
        total = max(chunk, total // chunk * chunk)
        ack = memoryview(bytearray(8))
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            if shape == "stream":
                conn.sendall(_head(_STREAM, total))
            for i in range(total // chunk):
                off = (i % slots) * chunk
                piece = view[off:off + chunk]
                if shape == "put":
                    _send_parts(conn, [_head(_PUT, chunk), piece])
                    _recv_exact(conn, ack, 8)
                    continue
                if shape == "get":
                    conn.sendall(_head(_STREAM, chunk))
                _recv_exact(conn, piece, chunk)
            best = min(best, time.perf_counter() - t0)
        return total / best / 1e9

    def close(self) -> None:
        self.proc.stop()


def socket_gbps(kind: str, chunk: int, total: int, reps: int = 3, per_request: bool = False) -> float:
    """Best-of-``reps`` throughput of a raw ``kind`` stream from a peer process into this one
    (``per_request``: get-shaped request→reply instead), with a peer of its own."""
    peer = CeilingPeer()
    try:
        return peer.measure(kind, "get" if per_request else "stream", chunk, total, reps)
    finally:
        peer.close()
