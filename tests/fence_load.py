"""Put load and read-back for the fencing tests (run as a script, possibly inside a network
namespace: ``python -m tests.fence_load load|verify ...``).

``load ETCD OUT STOP NODES``: wait (up to 30 s) until the leader has taken NODES store nodes
in, then put ``fence/<i>`` (payload :func:`payload`) one after another until
the file STOP exists, at most 200 a second (a paced load: the figures are about
correctness, and the test machine is shared); one JSON line per put in OUT: ``{"i", "ok", "t0", "t1", "leader",
"err"}`` with ``t0``/``t1`` on the (host-wide) monotonic clock and ``leader`` the master the
put was acknowledged by.

``verify ETCD ACKS OUT [OLD_MASTER]``: read back every key whose line in ACKS says ``ok``
through the current leader, and write ``{"checked", "missing", "wrong", "old_refuses"}`` to
OUT; with OLD_MASTER, also wait (up to 20 s) until that master refuses to answer as leader.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time


def payload(i: int) -> bytes:
    """Bytes of ``fence/<i>``: 4 KiB to 16 KiB, a function of ``i`` alone."""
    block = hashlib.blake2b(str(i).encode(), digest_size=64).digest()
    return block * (64 + (i % 4) * 64)


def load(etcd: str, out: str, stop: str, nodes: str) -> None:
    from kvpool.connector.client import KVPoolClient

    with KVPoolClient(etcd=etcd, host_id=f"fence-client-{os.getpid()}", rpc_timeout_s=30.0) as c, \
            open(out, "a") as f:
        deadline = time.monotonic() + 30.0
        while len(c.stats().nodes) < int(nodes):
            assert time.monotonic() < deadline, f"the leader did not take {nodes} store nodes in within 30s"
            time.sleep(0.05)
        i = 0
        while not os.path.exists(stop):
            t0 = time.monotonic()
            try:
                ok, err = bool(c.put(f"fence/{i}", payload(i))), None
            except Exception as e:  # noqa: BLE001 - recorded: an unacknowledged put
                ok, err = False, f"{type(e).__name__}: {e}"
            f.write(json.dumps({"i": i, "ok": ok, "t0": t0, "t1": time.monotonic(), "leader": c.rpc._addr,
                                "err": err}) + "\n")
            f.flush()
            i += 1
            time.sleep(max(0.0, t0 + 0.005 - time.monotonic()))


def verify(etcd: str, acks: str, out: str, old_master: str | None) -> None:
    from kvpool.connector.client import KVPoolClient
    from kvpool.protocol.errors import NotLeader, Timeout

    acked = [r["i"] for r in map(json.loads, open(acks)) if r["ok"]]
    missing = wrong = 0
    with KVPoolClient(etcd=etcd, host_id=f"fence-verify-{os.getpid()}", rpc_timeout_s=30.0) as c:
        for i in acked:
            got = c.get(f"fence/{i}")
            if got is None:
                missing += 1
            elif bytes(got) != payload(i):
                wrong += 1
    refuses = None
    if old_master:
        refuses = False
        deadline = time.monotonic() + 20.0
        with KVPoolClient(old_master, host_id="fence-probe", rpc_timeout_s=1.0) as old:
            while time.monotonic() < deadline and not refuses:
                try:
                    old.stats()
                except (NotLeader, Timeout):
                    refuses = True
                else:
                    time.sleep(0.2)
    with open(out, "w") as f:
        json.dump({"checked": len(acked), "missing": missing, "wrong": wrong, "old_refuses": refuses}, f)


if __name__ == "__main__":
    if sys.argv[1] == "load":
        load(*sys.argv[2:6])
    else:
        verify(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] if len(sys.argv) > 5 else None)
