"""Readiness that means something (issue 31, item 3), on real etcd, master and store nodes:
a store node whose etcd key is deleted under its live lease registers again and the master
re-indexes what it holds (nothing stays under-replicated); a store node's ``/readyz`` goes
503 while etcd does not answer and 200 once it does, and the master's too."""
from __future__ import annotations

import asyncio
import signal
import urllib.error
import urllib.request

from kvpool.protocol.etcd import Etcd, Keys
from tests.conftest import freeze, wait_for

N = 40


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def _etcd(lc, fn):
    async def go():
        async with Etcd(lc.etcd_endpoint) as e:
            return await fn(e)
    return asyncio.run(go())


def test_a_node_whose_key_is_deleted_registers_again(make_cluster):
    lc = make_cluster(nodes=2, memory="16MiB", metrics=True, replicas=2)
    key = Keys(lc.cfg.cluster).node("node-1")
    ready = lc.metrics_urls["node-1"] + "/readyz"
    with lc.client() as c:
        wait_for(lambda: len(c.stats().nodes) == 2, 20, what="both nodes joined")
        for i in range(N):
            c.put(f"reg/{i}", bytes([i]) * 1000)
        assert c.stats().under_replicated == 0
        before = _etcd(lc, lambda e: e.get_meta(key))
        _etcd(lc, lambda e: e.delete(key))  # an operator's `etcdctl del`: the lease lives on
        # the node notices and publishes itself again, under the same lease
        again = wait_for(lambda: _etcd(lc, lambda e: e.get_meta(key)), 15, what="the key published again")
        assert again.value == before.value and again.lease == before.lease
        wait_for(lambda: "registered again" in open(lc.nodes["node-1"].log_path).read(), 10,
                 what="the node's log line")
        # the master (which may have dropped the node meanwhile) has every replica back
        wait_for(lambda: (st := c.stats()).under_replicated == 0 and len(st.nodes) == 2
                 and all(n.objects == N for n in st.nodes), 30, what="every object on both nodes again")
        assert all(c.get(f"reg/{i}") == bytes([i]) * 1000 for i in range(N))
    assert _get(ready)[0] == 200


def test_readiness_follows_etcd(make_cluster):
    lc = make_cluster(nodes=1, memory="16MiB", metrics=True)
    node, master = lc.metrics_urls["node-0"] + "/readyz", lc.metrics_urls["master-0"] + "/readyz"
    wait_for(lambda: _get(node)[0] == 200 and _get(master)[0] == 200, 20, what="both ready")
    freeze(lc.etcd.proc.pid)
    try:
        code, body = wait_for(lambda: (r := _get(node))[0] == 503 and r, 15, what="the node not ready")
        assert "etcd has not answered" in body, body
        assert wait_for(lambda: _get(master)[0] == 503, 15, what="the master not ready")
        assert _get(lc.metrics_urls["node-0"] + "/healthz")[0] == 200  # alive all the same
    finally:
        lc.etcd.kill(signal.SIGCONT)
    wait_for(lambda: _get(node)[0] == 200, 30, what="the node ready again")
    wait_for(lambda: _get(master)[0] == 200, 30, what="the master ready again")
