"""The connector's scheduler side against real vLLM objects (no engine): a lookup never
blocks vLLM's scheduler step, even when the master does not answer; the read leases its
lookups take are kept for the load or released, whatever becomes of the request (real
master and store node; 300 s leases, so a lease seen gone was released, not lapsed); a
hand-off record of another TP size is claimed as per-rank head pieces, or refused where
its heads cannot be regathered (a record handed over by a stand-in client)."""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import os

import msgspec
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


def _scheduler(master: str, lookup_timeout_s: float, *, tp: int = 1, heads: int = 2, role: str = "kv_both",
               client=None, **extra):
    """A scheduler of a one-layer model with ``heads`` KV heads per rank at TP size ``tp``;
    ``client``: its kvpool client (None: one of ``master``'s)."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvpool.connector.vllm.meta import ConnectorSettings
    from kvpool.connector.vllm.scheduler import KVPoolScheduler

    ktc = KVTransferConfig(kv_connector="KVPoolConnector", kv_role=role,
                           kv_connector_module_path="kvpool.connector.vllm.connector",
                           kv_connector_extra_config={"master": master, "lookup_timeout_s": lookup_timeout_s,
                                                      "rpc_timeout_s": 30, **extra})
    cfg = SimpleNamespace(kv_transfer_config=ktc, model_config=SimpleNamespace(model="/models/tiny"),
                          cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=True),
                          scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
                          parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                                          decode_context_parallel_size=1))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=32, dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVPoolScheduler(ConnectorSettings.from_vllm(cfg), cfg, kcc, client)


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


class _OneRecord:
    """A client whose only call is claiming one hand-off record."""

    def __init__(self, rec) -> None:
        self.rec = rec

    def handoff_claim(self, handoff_id: str):
        return self.rec

    def close(self) -> None:
        pass


def _tp2_record(req, heads: int = 1, n_blocks: int = 4):
    """The hand-off record a TP=2 producer with ``heads`` KV heads per rank publishes for
    ``req``'s first ``n_blocks`` blocks (its own scheduler computes keys and layouts)."""
    from kvpool.protocol.messages import HandoffRecord

    prod = _scheduler("tcp://127.0.0.1:9", 30, tp=2, heads=heads, role="kv_producer", client=_OneRecord(None))
    try:
        keys, layouts = prod._record_keys(prod._hashes(req, n_blocks), n_blocks)
    finally:
        prod.close()
    return HandoffRecord("h1", keys, layouts, producer="prod", ttl_s=60, num_tokens=n_blocks * 16)


def test_a_tp1_consumer_claims_a_tp2_handoff_as_head_pieces():
    """A TP=1 consumer (2 KV heads) claims a TP=2 producer's record (1 head per rank): the
    load reads both producer ranks' keys and places rank r's head at head r."""
    from kvpool.connector.vllm.meta import block_keys, source_group
    from kvpool.protocol.groups import ReadPiece

    req = _request("r-tp")
    rec = _tp2_record(req)
    assert set(rec.keys) == {"0/tp0", "0/tp1"}
    sched = _scheduler("tcp://127.0.0.1:9", 30, role="kv_consumer", client=_OneRecord(rec))
    try:
        hashes = sched._hashes(req, 6)
        n, reads = sched._claim("h1", hashes, 6)
        assert n == 4 and list(reads) == [0]
        read = reads[0]
        assert read.layout.tp_size == 2 and read.layout.num_kv_heads == 1 and read.ranks() == [0, 1]
        assert read.pieces == [[ReadPiece(0, 0, 1, 0), ReadPiece(1, 0, 1, 1)]]
        src = source_group(sched.groups[0], read.layout)
        assert [block_keys(sched.s, src, r, 0, hashes, list(range(4))) for r in (0, 1)] == \
            [rec.keys["0/tp0"], rec.keys["0/tp1"]]
        # the keys a load of blocks [1, 4) reads (and whose lookup leases it keeps): both ranks'
        assert sched._load_keys(hashes, 1, 4, reads) == {k for r in (0, 1) for k in rec.keys[f"0/tp{r}"][1:4]}
    finally:
        sched.close()


class _Reads:
    """A worker's client whose reads fill each block with its stored rank's number (1 + rank)
    and answer ``bad[key]`` (an error, or None: missing) for the keys named there."""

    def __init__(self, rank_keys: dict[int, list[str]], bad: dict) -> None:
        self.rank = {k: r for r, keys in rank_keys.items() for k in keys}
        self.bad = bad

    def get_into_batch(self, keys, outs, layouts, leases=None):
        res = []
        for k, out in zip(keys, outs):
            if k in self.bad:
                res.append(self.bad[k])
                continue
            out[:] = bytes([1 + self.rank[k]]) * len(out)
            res.append(len(out))
        return res


def test_a_block_one_stored_rank_cannot_give_is_not_loaded_and_stops_the_load():
    """A TP=1 worker assembling a TP=2 producer's blocks: rank 1's object of block 2 fails
    its checksum and rank 0's of block 3 is gone. Blocks 0 and 1 hold both ranks' heads and
    load; the load stops at block 2 (its error, counted corrupt), never assembling a block
    from one rank."""
    from concurrent.futures import ThreadPoolExecutor

    from kvpool.connector.vllm.loads import WorkerLoads
    from kvpool.connector.vllm.meta import GroupBlocks, LoadJob, WorkerTally
    from kvpool.protocol.errors import ChecksumMismatch

    req = _request("r-tp")
    rec = _tp2_record(req)
    sched = _scheduler("tcp://127.0.0.1:9", 30, role="kv_consumer", client=_OneRecord(rec))
    pools = [ThreadPoolExecutor(1) for _ in range(2)]
    try:
        hashes = sched._hashes(req, 6)
        _, reads = sched._claim("h1", hashes, 6)
        bad = {rec.keys["0/tp1"][2]: ChecksumMismatch("flipped"), rec.keys["0/tp0"][3]: None}
        client = _Reads({r: rec.keys[f"0/tp{r}"] for r in (0, 1)}, bad)
        loads = WorkerLoads(sched.s, client, sched.groups, False, 0, *pools, WorkerTally(), 1 << 20)
        loads.registered({}, {}, [None], False)
        job = LoadJob("r-tp", 0, hashes[:4], [GroupBlocks([0, 1, 2, 3], [5, 6, 7, 8])], 4 * 16, reads=reads)
        fetched, _ = loads._fetch([job])
        plan = loads._plan(job, fetched["r-tp"])
        assert plan.ok_upto == 2 and "ChecksumMismatch" in plan.reason and plan.n_corrupt == 1
        buf, k = plan.spans[0]
        assert k == 2
        heads = buf[:2].numpy().reshape(2, 2, -1)  # one layer: [blocks, heads, bytes of a head]
        assert (heads[:, 0] == 1).all() and (heads[:, 1] == 2).all()  # head r from stored rank r
    finally:
        sched.close()
        for p in pools:
            p.shutdown()


def test_a_tp2_handoff_a_tp1_consumer_cannot_convert_is_refused():
    """Refused, never reinterpreted: a producer whose heads do not add up to the consumer's
    (2 ranks x 2 heads for 2 heads), and a record of another prompt."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvpool.protocol.errors import KVPoolError, LayoutMismatch

    req = _request("r-tp")
    sched = _scheduler("tcp://127.0.0.1:9", 30, role="kv_consumer", client=_OneRecord(_tp2_record(req, heads=2)))
    try:
        with pytest.raises(LayoutMismatch, match="KV heads in total") as e:
            sched._claim("h1", sched._hashes(req, 6), 6)
        assert e.value.fields["field"] == "num_kv_heads" and e.value.fields["request_id"] == "h1"
        # a forged TP size is refused at once, not spelled out rank by rank
        forged = _tp2_record(req)
        lay = forged.layouts["0/tp0"]
        forged.layouts["0/tp0"] = msgspec.structs.replace(lay, tp_size=10 ** 12)
        sched.client.rec = forged
        with pytest.raises(LayoutMismatch, match="TP size 1000000000000"):
            sched._claim("h1", sched._hashes(req, 6), 6)
        other = Request("r-other", list(range(500, 600)), SamplingParams(max_tokens=1), None)
        sched.client.rec = _tp2_record(other)
        with pytest.raises(KVPoolError, match="other blocks"):
            sched._claim("h1", sched._hashes(req, 6), 6)
    finally:
        sched.close()


def _forge(rec, other, how: str, sched, hashes):
    """``rec`` (a TP=2 producer's record) changed as ``how`` says; ``other``: a record of
    another prompt; ``sched``, ``hashes``: the consumer and its prompt's block hashes."""
    keys, lay = dict(rec.keys), dict(rec.layouts)
    l1 = lay["0/tp1"]
    if how == "rank 1 of another prompt":
        keys["0/tp1"] = other.keys["0/tp1"]
    elif how == "rank 1 with another head size":
        t = l1.tensors[0]
        lay["0/tp1"] = msgspec.structs.replace(
            l1, head_size=64, tensors=(msgspec.structs.replace(t, shape=(*t.shape[:-1], 64)),))
    elif how == "rank 1 with another dtype":
        lay["0/tp1"] = msgspec.structs.replace(l1, tensors=(msgspec.structs.replace(l1.tensors[0], dtype="float16"),))
    elif how == "head axis unlike num_kv_heads":  # keys named by the forged layout, as a forger would
        from kvpool.connector.vllm.meta import block_keys, source_group

        t = l1.tensors[0]
        forged = msgspec.structs.replace(l1, tensors=(msgspec.structs.replace(t, shape=(2, *t.shape[1:])),))
        src = source_group(sched.groups[0], msgspec.structs.replace(forged, tp_rank=0))
        for r in (0, 1):
            lay[f"0/tp{r}"] = msgspec.structs.replace(forged, tp_rank=r)
            keys[f"0/tp{r}"] = block_keys(sched.s, src, r, 0, hashes, list(range(len(keys["0/tp0"]))))
    elif how == "a third rank":
        keys["0/tp2"], lay["0/tp2"] = keys["0/tp1"], l1
    elif how == "rank 1 missing":
        del keys["0/tp1"], lay["0/tp1"]
    elif how == "rank 0 saying TP size 1":
        lay["0/tp0"] = msgspec.structs.replace(lay["0/tp0"], tp_size=1)
    elif how == "rank 0 saying TP size 3":
        lay["0/tp0"] = msgspec.structs.replace(lay["0/tp0"], tp_size=3)
    elif how == "more blocks than keys":
        keys = {name: k[:3] for name, k in keys.items()}
    return msgspec.structs.replace(rec, keys=keys, layouts=lay)


@pytest.mark.parametrize("how", ["rank 1 of another prompt", "rank 1 with another head size",
                                 "rank 1 with another dtype", "head axis unlike num_kv_heads", "a third rank",
                                 "rank 1 missing", "rank 0 saying TP size 1", "rank 0 saying TP size 3",
                                 "more blocks than keys"])
def test_a_forged_tp2_record_is_refused_by_a_tp1_consumer(how):
    """A record that passes for a TP=2 producer's but is not: refused at the claim with a
    typed error (the consumer then applies its load-failure policy), never turned into a
    load; the genuine record is claimed."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvpool.protocol.errors import KVPoolError

    req = _request("r-tp")
    rec = _tp2_record(req)
    other = _tp2_record(Request("r-other", list(range(500, 600)), SamplingParams(max_tokens=1), None))
    sched = _scheduler("tcp://127.0.0.1:9", 30, role="kv_consumer", client=_OneRecord(rec))
    try:
        hashes = sched._hashes(req, 6)
        assert sched._claim("h1", hashes, 6)[0] == 4
        sched.client.rec = _forge(rec, other, how, sched, hashes)
        with pytest.raises(KVPoolError) as e:
            sched._claim("h1", hashes, 6)
        assert "h1" in str(e.value) or e.value.fields.get("request_id") == "h1", e.value
    finally:
        sched.close()


@pytest.mark.parametrize("value", ["2", True, [True], [0], [-2], [1025], [10 ** 30], [2.0], ["2"], [None], [[2]],
                                   {"2": 1}, None])
def test_a_malformed_share_tp_sizes_is_refused_at_start(value):
    from kvpool.protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="share_tp_sizes") as e:
        _scheduler("tcp://127.0.0.1:9", 30, role="kv_consumer", share_tp_sizes=value, client=_OneRecord(None))
    assert e.value.fields["key"] == "share_tp_sizes"


@pytest.mark.parametrize("tp, value, kept", [(1, [1], []), (1, [2, 2, 1, 2], [2]), (1, [1024, 4, 3], []),
                                              (2, [2, 1, 1], [1]), (2, [4], [])])
def test_share_tp_sizes_keeps_only_sizes_it_can_read(tp, value, kept, caplog):
    """The engine's own size and duplicates are dropped; a size the model's heads cannot
    be spread over (2 KV heads in all) is left out with a warning; the engine starts."""
    sched = _scheduler("tcp://127.0.0.1:9", 30, tp=tp, heads=2 // tp, role="kv_consumer", share_tp_sizes=value,
                       client=_OneRecord(None))
    try:
        assert [t for t, _ in sched.tp_shares] == kept
        for t in set(value) - set(kept) - {tp}:
            assert f"cannot read blocks stored at TP size {t}" in caplog.text
    finally:
        sched.close()


def test_a_lookup_finds_blocks_another_tp_size_stored(long_leases, caplog):
    """``share_tp_sizes``: a TP=1 engine whose own keys reach 2 blocks finds 5 under a TP=2
    engine's per-rank keys (both ranks stored), plans the load from those with both ranks'
    heads gathered, keeps the leases of exactly the blocks that load reads and releases
    the rest; a size whose heads do not divide is left out with a warning, and a malformed
    setting is refused."""
    from kvpool.connector.vllm.meta import block_keys, keys_for, source_group
    from kvpool.protocol.errors import ConfigError
    from kvpool.protocol.groups import ReadPiece

    sched = _scheduler(long_leases.master_addr, 30, role="kv_consumer", share_tp_sizes=[3, 2])
    try:
        assert [tp for tp, _ in sched.tp_shares] == [2]  # 2 heads cannot be shared by 3 ranks
        assert "cannot read blocks stored at TP size 3" in caplog.text
        with long_leases.client() as c:
            req = _request("r-share")
            hashes = sched._hashes(req, 6)
            own = _store_blocks(sched, c, req, 2)
            read = sched.tp_shares[0][1][0]
            assert read.pieces == [[ReadPiece(0, 0, 1, 0), ReadPiece(1, 0, 1, 1)]]
            src = source_group(sched.groups[0], read.layout)
            theirs = [block_keys(sched.s, src, r, 0, hashes, list(range(6))) for r in (0, 1)]
            for keys in theirs:
                assert c.put_batch(keys[:5], [os.urandom(2048) for _ in range(5)]) == [None] * 5
            assert _answer(sched, req)[0] == 5 * 16
            m = sched.matches[req.request_id]
            assert m.reads is not None and m.reads[0].layout == read.layout
            wait_for(lambda: _leased(c, theirs[0][:5] + theirs[1][:5]) == [True] * 10 and not any(_leased(c, own)),
                     30, what="the TP=2 blocks' leases kept, this engine's own released")
            sched.request_finished(req, ([],))
            wait_for(lambda: not any(_leased(c, theirs[0] + theirs[1])), 30, what="every lookup lease released")
        assert keys_for(sched.s, sched.groups[0], hashes[:2], 0) == own[:2]
    finally:
        sched.close()
    with pytest.raises(ConfigError, match="share_tp_sizes"):
        _scheduler("tcp://127.0.0.1:9", 30, share_tp_sizes="2", client=_OneRecord(None))


def test_a_layer_wait_names_a_failed_loader_apart_from_a_deadline(caplog):
    """The forward pass's wait on a layer ends early when the loader fails (it cancels and
    releases every layer): logged as a stopped load, not as a lapsed deadline; a wait that
    runs out its deadline is logged as that."""
    import threading
    from types import SimpleNamespace

    from kvpool.connector.vllm.layer_loads import LayerLoads
    from kvpool.connector.vllm.loads import WorkerLoads
    from kvpool.connector.vllm.meta import monotonic

    s = SimpleNamespace(rpc_timeout_s=10.0, io_timeout_s=30.0)
    ll = LayerLoads(["l0"], monotonic() + 60)
    failed = threading.Timer(0.05, lambda: (ll.cancel(), ll.finish()))
    failed.start()
    WorkerLoads.wait_for_layer(SimpleNamespace(layered=(ll, None, ["job"]), s=s), "l0")
    failed.join()
    assert "stopped before layer l0 (the loader failed)" in caplog.text
    assert "within" not in caplog.text
    caplog.clear()
    late = LayerLoads(["l0"], monotonic() + 0.05)
    WorkerLoads.wait_for_layer(SimpleNamespace(layered=(late, None, ["job"]), s=s), "l0")
    assert "did not reach layer l0 within 40s" in caplog.text and late.cancelled
