"""P/D hand-off across real processes (DESIGN.md §7): producer exits, store keeps the KV."""
import json
import subprocess
import sys

import pytest
import torch

from kvpool.connector.handoff import HandoffConsumer, HandoffProducer
from kvpool.protocol import errors as E
from kvpool.protocol.layout import LayoutSpec, TensorSpec
from kvpool.protocol.messages import EvictSelector
from tests.conftest import wait_for

LAYOUT = LayoutSpec(kind="full_attention", tokens_per_block=16,
                    tensors=(TensorSpec("kv", (2, 2, 4, 16, 32), "float32"),), num_kv_heads=4, head_size=32)
N = 8


def block(i: int) -> torch.Tensor:
    """Block i stamped with its index everywhere, so misplacement is visible."""
    return torch.full((2, 2, 4, 16, 32), float(i)) + torch.arange(32).float() / 100


def keys(rid: str) -> list[str]:
    return [f"pd/{rid}/{i}" for i in range(N)]


PRODUCER = r"""
import json, sys
from kvpool.connector.client import KVPoolClient
from kvpool.connector.handoff import HandoffProducer
from tests.test_handoff import LAYOUT, block, keys, N
master, rid, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
with KVPoolClient(master) as c:
    params = HandoffProducer(c, ttl_s=ttl).publish(rid, {"0": (LAYOUT, keys(rid), [block(i) for i in range(N)])},
                                                  num_tokens=N * 16)
print(json.dumps(params), flush=True)
"""

CONSUMER = r"""
import json, sys, torch
from kvpool.connector.client import KVPoolClient
from kvpool.connector.handoff import HandoffConsumer
from tests.test_handoff import block
master, params = sys.argv[1], json.loads(sys.argv[2])
with KVPoolClient(master) as c:
    cons = HandoffConsumer(c, policy="fail")
    rec = cons.claim(params["request_id"], wait_s=10)
    outs = [torch.empty(2, 2, 4, 16, 32) for _ in rec.keys["0"]]
    res = cons.load(rec, "0", outs)
    same = all(torch.equal(o, block(i)) for i, o in enumerate(outs))
    cons.ack(params["request_id"])
print(json.dumps({"same": same, "loaded": res.loaded, "bytes": res.bytes_loaded}), flush=True)
"""


def run(script: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_producer_exits_consumer_loads_and_acks(cluster):
    params = run(PRODUCER, cluster.master_addr, "req-1", "60")
    assert params["num_tokens"] == N * 16 and len(params["keys"]["0"]) == N
    with cluster.client() as c:
        assert c.stats().held_bytes == N * LAYOUT.nbytes
        assert all(o.held for o in c.ls("pd/req-1/"))
        evicted = c.evict(EvictSelector(prefix="pd/req-1/"))
        assert evicted.removed == 0 and evicted.skipped_held == N  # held: not evictable
    out = run(CONSUMER, cluster.master_addr, json.dumps(params))
    assert out == {"same": True, "loaded": list(range(N)), "bytes": N * LAYOUT.nbytes}
    with cluster.client() as c:
        assert c.stats().held_bytes == 0
        assert not any(o.held for o in c.ls("pd/req-1/"))
        c.handoff_ack("req-1")  # idempotent
        with pytest.raises(E.HandoffNotFound, match="already acked"):
            c.handoff_claim("req-1")


def test_unacked_hold_expires_and_ls_shows_it(cluster):
    with cluster.client() as c:
        HandoffProducer(c, ttl_s=4.0).publish("req-exp", {"0": (LAYOUT, keys("req-exp"), [block(i) for i in range(N)])})
        p = subprocess.run([sys.executable, "-m", "kvpool.cli", "ls", "--prefix", "pd/req-exp/", "--json",
                            "--master", cluster.master_addr], capture_output=True, text=True, timeout=60)
        rows = json.loads(p.stdout)
        assert len(rows) == N and all(r["held"] for r in rows)
        wait_for(lambda: c.stats().held_bytes == 0, 15, what="hold released at the deadline")
        p = subprocess.run([sys.executable, "-m", "kvpool.cli", "ls", "--prefix", "pd/req-exp/", "--json",
                            "--master", cluster.master_addr], capture_output=True, text=True, timeout=60)
        assert not any(r["held"] for r in json.loads(p.stdout))
        with pytest.raises(E.HandoffExpired):
            c.handoff_claim("req-exp")
        # now ordinary cache entries: evictable
        rep = c.evict(EvictSelector(prefix="pd/req-exp/"))
        assert rep.removed == N


def test_release_before_load_leaks_nothing(cluster):
    with cluster.client() as c:
        HandoffProducer(c).publish("req-abort", {"0": (LAYOUT, keys("req-abort"), [block(i) for i in range(N)])})
        cons = HandoffConsumer(c)
        cons.claim("req-abort")
        cons.release("req-abort")
        cons.release("req-abort")  # idempotent
        assert c.stats().held_bytes == 0
        assert c.remove_batch(keys("req-abort")) == [None] * N
        with pytest.raises(E.HandoffNotFound):
            cons.claim("never-published")
        with pytest.raises(E.Timeout, match="not published within"):
            cons.claim("never-published", wait_s=0.3)


def test_partial_hit_loads_the_tail_in_place(cluster):
    with cluster.client() as c:
        HandoffProducer(c).publish("req-part", {"0": (LAYOUT, keys("req-part"), [block(i) for i in range(N)])})
        cons = HandoffConsumer(c)
        rec = cons.claim("req-part")
        k = 3  # the consumer already holds blocks 0..2 locally
        outs = [torch.empty(2, 2, 4, 16, 32) for _ in range(N - k)]
        res = cons.load(rec, "0", outs, local_blocks=k)
        assert res.loaded == list(range(k, N)) and res.failed == []
        for j, o in enumerate(outs):
            assert torch.equal(o, block(k + j)), f"block {k + j} landed in the wrong place"
        with pytest.raises(E.InvalidRequest, match="buffers"):
            cons.load(rec, "0", outs[:-1], local_blocks=k)
        cons.ack("req-part")


def test_consumer_failure_policies(cluster):
    with cluster.client() as c:
        HandoffProducer(c).publish("req-pol", {"0": (LAYOUT, keys("req-pol"), [block(i) for i in range(N)])})
        c.remove(keys("req-pol")[5], force=True)  # a block is lost behind the consumer's back
        rec = HandoffConsumer(c).claim("req-pol")
        outs = [torch.empty(2, 2, 4, 16, 32) for _ in range(N)]
        with pytest.raises(E.HandoffLoadFailed, match="req-pol") as ei:
            HandoffConsumer(c, policy="fail").load(rec, "0", outs)
        assert ei.value.fields["failed"] == [keys("req-pol")[5]]
        res = HandoffConsumer(c, policy="recompute").load(rec, "0", outs)
        assert res.failed == [5] and res.loaded == [0, 1, 2, 3, 4, 6, 7]
        other = LayoutSpec(kind="full_attention", tokens_per_block=32,
                           tensors=(TensorSpec("kv", (2, 2, 4, 32, 16), "float32"),), num_kv_heads=4, head_size=16)
        res = HandoffConsumer(c, policy="recompute").load(rec, "0", outs, layout=other)
        assert len(res.failed) == N  # layout mismatch: nothing reinterpreted
        c.handoff_release("req-pol")
        with pytest.raises(E.InvalidRequest, match="policy"):
            HandoffConsumer(c, policy="maybe")
        with pytest.raises(E.NotFound, match="not stored"):
            c.handoff_publish("req-missing", {"0": ["pd/none/0"]}, {"0": LAYOUT}, 10)
