"""Observability never stalls service (issue 31, item 2): a master holding 300,000 objects is
scraped (``/metrics``, the ``Stats`` RPC behind ``kvpool status``) every second while
another process's ``Exists`` loop measures its worst request latency, which must stay
under 250 ms and near the same loop's worst without scrapes. The numbers the scrapes
return are checked too."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from kvpool.protocol import messages as M

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

OBJECTS = 300_000
BATCH = 4096
LOOP_S = 8.0  # seconds each Exists loop runs

# a client in its own process: Exists of one key in a loop for LOOP_S seconds; prints
# {"calls": n, "worst_s": s}
_LOOP = """
import json, sys, time
from kvpool.connector.client import KVPoolClient
from kvpool.protocol.auth import Security
from kvpool.protocol.config import SecurityConfig
master, secret_file, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
sec = Security.from_config(SecurityConfig(secret_file=secret_file or None))
with KVPoolClient(master, security=sec) as c:
    c.exists("fill/0")
    print("GO", flush=True)
    worst, n, end = 0.0, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        c.exists("fill/0")
        worst = max(worst, time.perf_counter() - t0)
        n += 1
print(json.dumps({"calls": n, "worst_s": worst}), flush=True)
"""


def _fill(lc, n: int) -> None:
    """Put ``n`` one-byte objects through the master's real RPC (grants and commits, no data
    written: the index is what is measured), ``BATCH`` per call."""
    with lc.client() as c:
        rpc = c.rpc
        for lo in range(0, n, BATCH):
            keys = [f"fill/{i}" for i in range(lo, min(lo + BATCH, n))]
            grants = rpc.call(M.PutStart([M.PutItem(k, 1, 0) for k in keys], c.host_id, 1), timeout_s=60)
            ok = [g for g in grants if isinstance(g, M.PutGrant) and g.status == "write"]
            assert len(ok) == len(keys), grants[:3]
            errs = rpc.call(M.PutEnd([g.key for g in ok], [g.put_id for g in ok]), timeout_s=60)
            assert not any(errs)


def _exists_loop(lc) -> dict:
    secret = getattr(lc.cfg.security, "secret_file", None) or ""
    p = subprocess.Popen([sys.executable, "-c", _LOOP, lc.master_addr, secret, str(LOOP_S)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "GO"
        return json.loads(p.stdout.readline())
    finally:
        p.wait(60)


def test_scrapes_of_a_big_index_do_not_stall_other_clients(make_cluster):
    lc = make_cluster(nodes=1, memory="64MiB", metrics=True, replicas=1)
    _fill(lc, OBJECTS)
    url = lc.metrics_urls["master-0"] + "/metrics"
    quiet = _exists_loop(lc)

    stop, scrapes, errors = threading.Event(), [], []

    def scrape() -> None:
        with lc.client() as c:
            while not stop.wait(0.5):
                try:
                    t0 = time.monotonic()
                    with urllib.request.urlopen(url, timeout=30) as r:
                        body = r.read().decode()
                    st = c.stats()
                    scrapes.append((time.monotonic() - t0, body, st))
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

    t = threading.Thread(target=scrape, daemon=True)
    t.start()
    try:
        busy = _exists_loop(lc)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert len(scrapes) >= 3, f"only {len(scrapes)} scrapes in {LOOP_S} s"
    print(f"\nworst Exists latency: {quiet['worst_s'] * 1e3:.1f} ms quiet ({quiet['calls']} calls), "
          f"{busy['worst_s'] * 1e3:.1f} ms with {len(scrapes)} scrapes ({busy['calls']} calls); "
          f"a scrape took {max(s[0] for s in scrapes):.2f} s at most")
    assert busy["worst_s"] < max(0.25, quiet["worst_s"] + 0.1), (quiet, busy)
    _, body, st = scrapes[-1]
    assert "kvpool_objects " + f"{float(OBJECTS)}" in body or f"kvpool_objects {OBJECTS}" in body, body[:500]
    assert st.objects == OBJECTS and st.nodes[0].objects == OBJECTS and st.under_replicated == 0
    assert st.held_bytes == 0 and st.pending == 0
