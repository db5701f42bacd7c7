"""The connector's scheduler side against real vLLM objects (no engine): a lookup never
blocks vLLM's scheduler step, even when the master does not answer; the read leases its
lookups take are kept for the load or released, whatever becomes of the request (real
master and store node; 300 s leases, so a lease seen gone was released, not lapsed)."""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import os

import pytest

from tests.conftest import wait_for

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


def _scheduler(master: str, lookup_timeout_s: float, **extra):
    import torch
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvpool.connector.vllm.meta import ConnectorSettings
    from kvpool.connector.vllm.scheduler import KVPoolScheduler

    ktc = KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_both",
                           kv_connector_module_path="kvpool.connector.vllm.connector",
                           kv_connector_extra_config={"master": master, "lookup_timeout_s": lookup_timeout_s,
                                                      "rpc_timeout_s": 30, **extra})
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
        # asked again in the same step (a wrapper may ask twice): the same answer, counted once
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.take_stats() is None
        # asked in a later step: a fresh lookup ("not yet" while it runs)
        sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={},
                                                   scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
                                                       req_ids=[], num_computed_tokens=[])))
        assert sched.get_num_new_matched_tokens(req, 0)[0] is None
    finally:
        sched.close()


@pytest.fixture
def long_leases(make_cluster):
    return make_cluster(nodes=1, memory="64MiB", lease_ttl="300s")


def _request(rid: str, n_tokens: int = 100):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, list(range(100, 100 + n_tokens)), SamplingParams(max_tokens=1), None)


def _store_blocks(sched, client, req, n_blocks: int) -> list[str]:
    """Put stand-in bytes under the keys of ``req``'s first ``n_blocks`` blocks (the
    scheduler only checks that they exist); returns the keys of every full block."""
    from kvpool.connector.vllm.meta import keys_for

    g = sched.groups[0]
    keys = keys_for(sched.s, g, sched._hashes(req, (req.num_tokens - 1) // 16), 0)
    assert client.put_batch(keys[:n_blocks], [os.urandom(4096) for _ in keys[:n_blocks]]) == [None] * n_blocks
    return keys


def _answer(sched, req, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while (ans := sched.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.01)
    return ans


def _leased(client, keys) -> list[bool]:
    by_key = {m.key: m.leased for m in client.ls("")}
    return [by_key.get(k, False) for k in keys]


def test_a_request_finished_after_its_hit_releases_its_lookup_leases(long_leases):
    sched = _scheduler(long_leases.master_addr, 30)
    try:
        with long_leases.client() as c:
            req = _request("r-done")
            keys = _store_blocks(sched, c, req, 6)
            assert _answer(sched, req)[0] == 96
            assert _leased(c, keys) == [True] * 6  # kept for the load
            sched.request_finished(req, ([],))  # aborted before vLLM allocated its blocks
            wait_for(lambda: not any(_leased(c, keys)), 30, what="every lookup lease released")
    finally:
        sched.close()


def test_lookups_go_in_slices_and_leases_the_load_does_not_need_are_released(long_leases, monkeypatch):
    import kvpool.connector.vllm.scheduler as vs

    monkeypatch.setattr(vs, "LOOKUP_KEYS", 4)
    sched = _scheduler(long_leases.master_addr, 30)
    sizes: list[int] = []
    lookup = sched.client.lookup_leased
    monkeypatch.setattr(sched.client, "lookup_leased", lambda keys: sizes.append(len(keys)) or lookup(keys))
    try:
        with long_leases.client() as c:
            req = _request("r-sliced")
            keys = _store_blocks(sched, c, req, 6)
            c.remove(keys[3])  # the hit ends before block 3: blocks 4 and 5 are not loaded
            assert _answer(sched, req)[0] == 48
            assert sizes == [4, 2]
            wait_for(lambda: _leased(c, keys) == [True] * 3 + [False] * 3, 30,
                     what="the leases of blocks 4 and 5 released, 0-2 kept for the load")
            sched.request_finished(req, ([],))
            wait_for(lambda: not any(_leased(c, keys)), 30, what="every lookup lease released")
    finally:
        sched.close()


def test_a_lookup_given_up_on_releases_its_leases_when_it_comes_back(long_leases, monkeypatch):
    sched = _scheduler(long_leases.master_addr, 0.2)
    back = threading.Event()
    lookup = sched.client.lookup_leased

    def slow(keys):
        time.sleep(1.0)  # past the scheduler's 0.2 s lookup deadline
        try:
            return lookup(keys)
        finally:
            back.set()

    monkeypatch.setattr(sched.client, "lookup_leased", slow)
    try:
        with long_leases.client() as c:
            req = _request("r-late")
            keys = _store_blocks(sched, c, req, 6)
            assert _answer(sched, req) == (0, False)  # a miss: computed locally
            assert back.wait(30)
            wait_for(lambda: not any(_leased(c, keys)), 30, what="the late lookup's leases released")
    finally:
        sched.close()


def _end_step(sched) -> None:
    sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={},
                                               scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
                                                   req_ids=[], num_computed_tokens=[])))


def test_a_lookup_back_within_the_steps_wait_is_answered_in_that_step(long_leases, monkeypatch):
    """The first ask waits for its lookup within the step's ``lookup_wait_s`` and answers
    the hit at once; once the step's budget is spent, the next request's first ask answers
    "not yet" (None) without waiting, and a new step brings a new budget."""
    sched = _scheduler(long_leases.master_addr, 60, lookup_wait_s=30)
    lookup = sched.client.lookup_leased
    gate = threading.Event()

    def held(keys):
        assert gate.wait(60)
        return lookup(keys)

    try:
        with long_leases.client() as c:
            first, second = _request("r-now"), _request("r-next", 120)
            _store_blocks(sched, c, first, 6)
            assert sched.get_num_new_matched_tokens(first, 0) == (96, False)  # answered in the step that asked
            sched.request_finished(first, ([],))
            monkeypatch.setattr(sched.client, "lookup_leased", held)
            sched._wait_left = 0.0  # the step's budget spent (by other requests' lookups)
            assert sched.get_num_new_matched_tokens(second, 0) == (None, False)
            gate.set()
            _end_step(sched)  # a new step: its budget covers the lookup
            assert sched.get_num_new_matched_tokens(second, 0) == (96, False)  # its first 6 blocks are r-now's
    finally:
        sched.close()
