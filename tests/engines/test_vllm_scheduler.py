"""The connector's scheduler side against real vLLM objects (no engine): a lookup never
blocks vLLM's scheduler step, even when the master does not answer."""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture
def silent_master():
    """A TCP peer that accepts connections and never answers (a frozen master)."""
    srv = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"tcp://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    srv.close()


def _scheduler(master: str, lookup_timeout_s: float):
    import torch
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvpool.connector.vllm_meta import ConnectorSettings
    from kvpool.connector.vllm_scheduler import KVPoolScheduler

    ktc = KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_both",
                           kv_connector_module_path="kvpool.connector.vllm_connector",
                           kv_connector_extra_config={"master": master, "lookup_timeout_s": lookup_timeout_s,
                                                      "rpc_timeout_s": 30})
    cfg = SimpleNamespace(kv_transfer_config=ktc, model_config=SimpleNamespace(model="/models/tiny"),
                          cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=True),
                          scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
                          parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                          decode_context_parallel_size=1))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVPoolScheduler(ConnectorSettings.from_vllm(cfg), cfg, kcc)


def test_a_master_that_does_not_answer_never_blocks_a_scheduler_step(silent_master):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    deadline = 0.5
    sched = _scheduler(silent_master, deadline)
    try:
        req = Request("r1", list(range(100, 200)), SamplingParams(max_tokens=1), None)
        calls, t_start = [], time.monotonic()
        while True:
            t0 = time.monotonic()
            ans = sched.get_num_new_matched_tokens(req, 0)
            calls.append(time.monotonic() - t0)
            if ans[0] is not None:
                break
            assert time.monotonic() - t_start < 20, "the lookup never gave up"
            time.sleep(0.01)
        waited = time.monotonic() - t_start
        # "not yet" while the lookup runs, then a miss once the deadline passed; no call
        # waited on the network (the master would have held it for rpc_timeout_s = 30 s)
        assert ans == (0, False) and len(calls) > 1
        assert max(calls) < deadline, calls
        assert deadline <= waited < 10, waited
        st = sched.take_stats()
        assert st.data["lookups"] == 1 and st.data["lookups_timed_out"] == 1
        # asked again (vLLM may ask several times for one request): counted once
        assert sched.get_num_new_matched_tokens(req, 0)[0] is None
    finally:
        sched.close()
