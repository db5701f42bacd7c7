"""Client side of the multi-host tier (tests/test_multihost.py), run as a script inside a
host's network namespace: ``python -m tests.multihost_client CMD ETCD HOST_ID OUT ...``.

``put PREFIX N``: put ``PREFIX<i>`` (:func:`payload`) for i < N with replicas=2, then read
each back once; OUT gets ``{"acked": [keys], "failed": [errors], "nodes": {key: [node ids]},
"get_ms": [latencies]}``.
``get KEYS``: read every key listed in the JSON file KEYS; OUT gets ``{"checked", "missing",
"wrong", "errors", "get_ms"}``.
``stats``: OUT gets ``{node id: {"alive", "host_id", "data_addr", "objects"}}`` as the leader
reports them.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time


def payload(key: str) -> bytes:
    """16 KiB to 64 KiB, a function of ``key`` alone."""
    block = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return block * (256 * (1 + len(key) % 4))


def _client(etcd: str, host_id: str):
    from kvpool.connector.client import KVPoolClient

    return KVPoolClient(etcd=etcd, host_id=host_id, rpc_timeout_s=20.0, io_timeout_s=10.0)


def _timed_get(c, key: str) -> tuple[bytes | None, float]:
    t0 = time.perf_counter()
    got = c.get(key)
    return got, (time.perf_counter() - t0) * 1000


def main(cmd: str, etcd: str, host_id: str, out: str, *args: str) -> None:
    res: dict = {}
    with _client(etcd, host_id) as c:
        if cmd == "put":
            prefix, n = args[0], int(args[1])
            acked, failed = [], []
            for i in range(n):
                key = f"{prefix}{i}"
                try:
                    r = c.put_batch_results([key], [payload(key)], replicas=2)[0]
                    if r.error is not None:
                        raise r.error
                    acked.append(key)
                except Exception as e:  # noqa: BLE001 - recorded: an unacknowledged put
                    failed.append(f"{type(e).__name__}: {e}")
            lat = [_timed_get(c, k)[1] for k in acked]
            res = {"acked": acked, "failed": failed, "get_ms": lat,
                   "nodes": {m.key: list(m.nodes) for m in c.ls(prefix)}}
        elif cmd == "get":
            keys = json.load(open(args[0]))
            missing = wrong = 0
            errors, lat = [], []
            for k in keys:
                try:
                    got, ms = _timed_get(c, k)
                except Exception as e:  # noqa: BLE001 - counted
                    errors.append(f"{type(e).__name__}: {e}")
                    continue
                lat.append(ms)
                if got is None:
                    missing += 1
                elif bytes(got) != payload(k):
                    wrong += 1
            res = {"checked": len(keys), "missing": missing, "wrong": wrong, "errors": errors, "get_ms": lat}
        elif cmd == "stats":
            res = {n.node_id: {"alive": n.alive, "host_id": n.host_id, "data_addr": n.data_addr, "objects": n.objects}
                   for n in c.stats().nodes}
        else:
            raise SystemExit(f"unknown command {cmd!r}; accepted: put, get, stats")
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
