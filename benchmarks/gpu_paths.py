"""GPU data paths: CUDA tensors into and out of kvpool, and store nodes whose segment is
device memory (``--device cuda:0``), against the copy ceilings measured in the same run.

Ceilings (no store involved), each the median of ``--reps`` timed copies after a warm-up:

* host ``memcpy`` (numpy ``copyto`` between two prefaulted buffers);
* pinned host ↔ device copies (``torch`` ``copy_`` with a ``pin_memory=True`` buffer) and
  pageable host ↔ device copies;
* the cost of making a pinned buffer (``torch.empty(..., pin_memory=True)``, milliseconds)
  and of registering an existing shared mapping with CUDA (``cudaHostRegister`` on a
  memfd ``mmap``, the way a same-host client could pin a store node's segment), plus the
  copy rate into and out of that registered mapping.

Store paths, one cluster per segment kind (one store node each, so every object lands on
it), each through ``transport="auto"`` (shared memory for a host segment — CUDA tensors
by DMA into and out of the registered mapping; the Unix socket for a device segment,
which cannot be mapped), ``auto-staged`` (a host segment, CUDA tensors staged through
pinned memory: ``cuda_direct=False``) and ``transport="tcp"``: ``put`` of a fresh key and
``get_into`` of host and CUDA tensors, GB/s, each read checked once against the tensor
it came from; a batch row (``--batch`` objects of ``--batch-size`` bytes, one
``get_into_batch``, the vLLM block pattern); and the first direct read of a fresh client
(maps the segment and registers one window).

Without CUDA the script still runs the host rows (use it to check the script itself).

    python benchmarks/gpu_paths.py [--sizes 4MiB,64MiB] [--reps 8] [--batch 32] [--batch-size 1MiB] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvpool.cli.cluster import LocalCluster  # noqa: E402
from kvpool.protocol.config import load_config, parse_size  # noqa: E402


def _median_s(fn, reps: int, sync: bool) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gbps(n: int, s: float) -> float:
    return n / s / 1e9


def ceilings(sizes: list[int], reps: int) -> list[dict]:
    cuda = torch.cuda.is_available()
    rows = []
    for n in sizes:
        a, b = np.ones(n, np.uint8), np.zeros(n, np.uint8)
        rows.append({"what": "host memcpy", "bytes": n, "gbps": _gbps(n, _median_s(lambda: np.copyto(b, a), reps, False))})
        if not cuda:
            continue
        dev = torch.ones(n, dtype=torch.uint8, device="cuda")
        pinned = torch.zeros(n, dtype=torch.uint8, pin_memory=True)
        pageable = torch.zeros(n, dtype=torch.uint8)
        for name, host in (("pinned", pinned), ("pageable", pageable)):
            rows.append({"what": f"{name} device→host", "bytes": n,
                         "gbps": _gbps(n, _median_s(lambda h=host: h.copy_(dev), reps, True))})
            rows.append({"what": f"{name} host→device", "bytes": n,
                         "gbps": _gbps(n, _median_s(lambda h=host: dev.copy_(h), reps, True))})
        alloc = _median_s(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True), reps, True)
        rows.append({"what": "make a pinned buffer", "bytes": n, "ms": alloc * 1e3})
        rows.extend(_registered(n, dev, reps))
    return rows


def _registered(n: int, dev, reps: int) -> list[dict]:
    """cudaHostRegister on a memfd shared mapping (what a same-host client maps)."""
    fd = os.memfd_create("kvpool-gpu-bench")
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
        arr = np.frombuffer(mm, dtype=np.uint8)
        arr[:] = 0  # fault every page in
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        rc = cudart.cudaHostRegister(arr.ctypes.data, n, 0)
        reg_ms = (time.perf_counter() - t0) * 1e3
        code = int(rc.value) if hasattr(rc, "value") else int(rc)
        rows = [{"what": "cudaHostRegister a shared mapping", "bytes": n, "ms": reg_ms, "rc": code}]
        if code == 0:
            host = torch.from_numpy(arr)
            rows.append({"what": "registered device→host", "bytes": n, "pinned": bool(host.is_pinned()),
                         "gbps": _gbps(n, _median_s(lambda: host.copy_(dev), reps, True))})
            rows.append({"what": "registered host→device", "bytes": n,
                         "gbps": _gbps(n, _median_s(lambda: dev.copy_(host), reps, True))})
            del host
            cudart.cudaHostUnregister(arr.ctypes.data)
        del arr
        mm.close()
        return rows
    finally:
        os.close(fd)


_CLIENTS = {"auto": {"transport": "auto"}, "auto-staged": {"transport": "auto", "cuda_direct": False},
            "tcp": {"transport": "tcp"}}


def store_paths(sizes: list[int], reps: int, batch: int, batch_size: int) -> list[dict]:
    cuda = torch.cuda.is_available()
    segs = ["cpu"] + (["cuda:0"] if cuda else [])
    kinds = ["cpu"] + (["cuda"] if cuda else [])
    memory = (max(sizes) * len(kinds) * 6 + batch * batch_size * 6) * (reps + 2) + (64 << 20)
    rows = []
    for seg in segs:
        lc = LocalCluster(load_config(None, {"storenodes": []}, environ={}))
        with lc:
            lc.start_node("bench-node", memory, device=seg)
            lc.wait_nodes(1)
            for transport, kw in _CLIENTS.items():
                if transport == "auto-staged" and (seg != "cpu" or not cuda):
                    continue  # only a mapped host segment has a direct path to compare with
                with lc.client(**kw) as c:
                    if transport != "tcp":
                        rows.extend(_batch(c, seg, transport, kinds, batch, batch_size, reps))
                    for n in sizes:
                        for kind in kinds:
                            if transport == "auto-staged" and kind == "cpu":
                                continue
                            src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=kind)
                            count = iter(range(10**9))
                            key = f"bench/{transport}/{kind}/{n}"

                            def put(src=src, key=key, count=count):
                                assert c.put(f"{key}/{next(count)}", src) is True

                            out = torch.empty_like(src)
                            t_put = _median_s(put, reps, cuda)
                            t_get = _median_s(lambda out=out, key=key: c.get_into(f"{key}/0", out), reps, cuda)
                            assert torch.equal(out, src), "read back differs"
                            for op, t in (("put", t_put), ("get_into", t_get)):
                                rows.append({"segment": seg, "transport": transport, "tensor": kind, "bytes": n,
                                             "op": op, "gbps": _gbps(n, t), "ms": t * 1e3})
            if seg == "cpu" and cuda:
                rows.append(_first_direct_read(lc, min(sizes)))
    return rows


def _batch(c, seg: str, transport: str, kinds: list[str], batch: int, size: int, reps: int) -> list[dict]:
    """put_batch then get_into_batch of ``batch`` objects of ``size`` bytes per tensor kind."""
    rows = []
    for kind in kinds:
        if transport == "auto-staged" and kind == "cpu":
            continue
        srcs = [torch.randint(0, 256, (size,), dtype=torch.uint8, device=kind) for _ in range(batch)]
        count = iter(range(10**9))
        keys: list[str] = []

        def put():
            nonlocal keys
            keys = [f"batch/{transport}/{kind}/{next(count)}/{i}" for i in range(batch)]
            assert c.put_batch(keys, srcs) == [None] * batch

        t_put = _median_s(put, reps, kind == "cuda")
        outs = [torch.empty_like(s) for s in srcs]
        t_get = _median_s(lambda: c.get_into_batch(keys, outs), reps, kind == "cuda")
        assert all(torch.equal(o, s) for o, s in zip(outs, srcs)), "batch read back differs"
        for op, t in (("put_batch", t_put), ("get_into_batch", t_get)):
            rows.append({"segment": seg, "transport": transport, "tensor": kind, "bytes": size, "batch": batch,
                         "op": op, "gbps": _gbps(size * batch, t), "objects_per_s": batch / t})
    return rows


def _first_direct_read(lc, n: int) -> dict:
    """A fresh client's first get_into of a CUDA tensor (maps the segment and registers the
    window the extent lies in), then its second."""
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    with lc.client() as w:
        w.put("first/obj", src)
    out = torch.empty_like(src)
    with lc.client() as c:
        c.exists("first/obj")  # the master connection is made outside the timing
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            c.get_into("first/obj", out)
            times.append(time.perf_counter() - t0)
    assert torch.equal(out, src)
    return {"segment": "cpu", "transport": "auto", "tensor": "cuda", "bytes": n, "op": "first get_into",
            "first_ms": times[0] * 1e3, "second_ms": times[1] * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4MiB,64MiB")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="objects in the batch rows")
    ap.add_argument("--batch-size", default="1MiB", help="bytes per object in the batch rows")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    print(json.dumps(info))
    ceil = ceilings(sizes, a.reps)
    for r in ceil:
        print(json.dumps(r))
    paths = store_paths(sizes, a.reps, a.batch, parse_size(a.batch_size))
    for r in paths:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "ceilings": ceil, "paths": paths}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
