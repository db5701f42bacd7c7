"""Hybrid (Kimi-K3 style) models through a real cluster: transfer groups, MLA, KDA state,
TP split/replicate, common-boundary hits, and `kvpool demo --hybrid` (issue 6)."""
from __future__ import annotations

import inspect
import re
import uuid

import pytest
import torch
from rich.console import Console

from kvpool.cli.demo import render_demo, run_demo
from kvpool.connector.hybrid_store import HybridEngineModel, HybridStore, pack_tensors, unpack_tensors
from kvpool.connector.demo_engine.hybrid import HybridConfig, HybridModel
from kvpool.connector.demo_engine.tokenizer import encode, load_text
from kvpool.protocol.errors import InvalidRequest, LayoutMismatch
from kvpool.protocol.keys import block_hashes, extra_bytes
from kvpool.protocol.layout import LayoutSpec, TensorSpec

TOL = 1e-5
TEXT = encode(load_text("declaration_of_independence"))
P = TEXT[:230]
OTHER = encode("#" + load_text("pride_and_prejudice_ch1")[:50])


def ns() -> str:
    return f"hy-{uuid.uuid4().hex[:8]}"


def test_pack_unpack_round_trip():
    """Stored bytes are the layout's sub-tensors back to back; unpack gives views of them
    with each spec's shape and dtype, whatever the buffer's own dtype."""
    lay = LayoutSpec(kind="mamba", tokens_per_block=64,
                     tensors=(TensorSpec("conv_state", (2, 3, 8), "bfloat16"),
                              TensorSpec("ssm_state", (2, 4, 4), "float32")), num_kv_heads=4, head_size=4)
    conv = torch.randn(2, 3, 8).to(torch.bfloat16)
    ssm = torch.randn(2, 4, 4)
    packed = pack_tensors([conv, ssm])
    assert packed.dtype == torch.uint8 and packed.numel() == lay.nbytes == 2 * 3 * 8 * 2 + 2 * 4 * 4 * 4
    a, b = unpack_tensors(packed, lay)
    assert a.dtype == torch.bfloat16 and torch.equal(a, conv) and torch.equal(b, ssm)
    b.zero_()  # views share the buffer
    assert not packed[conv.numel() * 2:].any()
    with pytest.raises(InvalidRequest, match="bytes hold no mamba block"):
        unpack_tensors(packed[:-1], lay)


def test_reference_model_implements_engine_interface():
    members = [n for n in vars(HybridEngineModel) if not n.startswith("_")]
    assert {"model_id", "tp_size", "cache_groups", "export_range", "state_slot_at", "empty_cache",
            "import_range", "import_state"} <= set(members)
    m = HybridModel()
    for name in members:
        assert hasattr(m, name), name
        want = getattr(HybridEngineModel, name)
        if inspect.isfunction(want):
            assert list(inspect.signature(getattr(m, name)).parameters) == \
                list(inspect.signature(want).parameters)[1:], name


@pytest.mark.parametrize("pattern", [("attn", "kda", "mla", "kda"), ("attn", "mla"), ("kda",), ("swa", "mla", "kda")],
                         ids=lambda p: "+".join(p))
def test_two_engines_restore_through_cluster(client, pattern):
    c = HybridConfig(pattern=pattern, window=48)
    space = ns()
    producer = HybridModel(c)
    st = HybridStore(client, producer, space).put(P, producer.prefill(P)[1])
    assert st["errors"] == [] and st["objects_put"] > 0 and st["bytes_put"] > 0
    # a second put of the same prompt stores nothing new
    assert HybridStore(client, producer, space).put(P, producer.prefill(P)[1])["objects_put"] == 0
    consumer = HybridModel(c)
    reader = HybridStore(client, consumer, space)
    kda = "kda" in pattern
    for s, want in ((45, 0 if kda else 32), (150, 128 if kda else 128), (229, 192 if kda else 224), (230, 230)):
        ids = P[:s] + OTHER
        lr = reader.load(ids)
        assert lr.tokens == want, (s, lr.per_group)
        assert lr.via_tail == (s == 230)
        ref, _ = consumer.prefill(ids)
        got, _ = consumer.prefill(ids, lr.cache)
        assert (got - ref).abs().max().item() <= TOL
        if want:
            assert lr.bytes_loaded > 0


def test_misaligned_groups_never_give_wrong_output(client):
    space = ns()
    m = HybridModel()
    HybridStore(client, m, space).put(P, m.prefill(P)[1])
    ids = P + OTHER
    for other in (HybridConfig(split_kda_groups=True), HybridConfig(group_order=("kda", "mla", "attn"))):
        with pytest.raises(LayoutMismatch) as e:
            HybridStore(client, HybridModel(other), space).load(ids)
        assert "transfer group" in e.value.message and e.value.fields["field"] == "name"


def test_state_without_conv_history_or_speculative_is_rejected_at_put(client):
    space = ns()
    m = HybridModel()
    store = HybridStore(client, m, space)
    _, cache = m.prefill(P)
    spec = next(g for g in m.cache_groups() if g.name == "kda")
    h = block_hashes(P, 64, extra_bytes(m.model_id))[0]
    slot = m.state_slot(cache.checkpoints[64], spec, 0, 64)
    del slot.tensors["conv_state"]
    with pytest.raises(InvalidRequest, match="conv history"):
        store.put_slot("kda", h, slot)
    slot = m.state_slot(cache.checkpoints[64], spec, 0, 64)
    slot.speculative = True
    with pytest.raises(InvalidRequest, match="speculative"):
        store.put_slot("kda", h, slot)
    assert client.ls(prefix=space) == []
    slot.speculative = False
    assert store.put_slot("kda", h, slot) is None
    assert [o.key.rsplit("@", 1)[1] for o in client.ls(prefix=space)] == ["64"]


def test_mla_tp2_one_copy_and_attention_tp_1_to_2(client):
    c = HybridConfig(pattern=("attn", "mla"))
    tp1, tp2 = HybridModel(c), HybridModel(c, tp_size=2)
    ids = P + OTHER
    ref, _ = tp1.prefill(ids)
    # TP=2 producer: MLA pages stored once, both ranks load that copy
    space = ns()
    HybridStore(client, tp2, space, tails=False).put(P, tp2.prefill(P)[1])
    keys = [o.key for o in client.ls(prefix=space)]
    mla = [k for k in keys if "/1:" in k]
    attn = [k for k in keys if "/0:" in k]
    assert len(mla) == len(P) // 32 and not any("/tp" in k for k in mla)
    assert len(attn) == 2 * (len(P) // 16) and {k.split("/")[3] for k in attn} == {"tp0", "tp1"}
    lr = HybridStore(client, tp2, space).load(ids)
    got, _ = tp2.prefill(ids, lr.cache)
    assert lr.tokens == 224 and (got - ref).abs().max().item() <= TOL
    # TP=1 producer, TP=2 consumer: head slicing gives the TP=1 logits
    space = ns()
    HybridStore(client, tp1, space).put(P, tp1.prefill(P)[1])
    lr = HybridStore(client, tp2, space, source_tp=1).load(ids)
    got, _ = tp2.prefill(ids, lr.cache)
    assert lr.tokens == len(P) and (got - ref).abs().max().item() <= TOL
    # KDA state is not resliced across TP sizes
    m1, m2 = HybridModel(), HybridModel(tp_size=2)
    space = ns()
    HybridStore(client, m1, space).put(P, m1.prefill(P)[1])
    with pytest.raises(LayoutMismatch, match="split differently"):
        HybridStore(client, m2, space, source_tp=1).load(ids)


def test_common_boundary_attention_120_mamba_96(client):
    c = HybridConfig(pattern=("attn", "kda", "mla"), attn_block=8, mla_block=16, kda_block=32)
    m = HybridModel(c)
    space = ns()
    HybridStore(client, m, space, tails=False).put(TEXT[:125], m.prefill(TEXT[:125])[1])
    ids = TEXT[:122] + OTHER
    store = HybridStore(client, m, space)
    hit, tail = store.lookup(ids)
    assert hit.tokens == 96 and tail is None
    assert hit.per_group == {"attn": 120, "kda": 96, "mla": 112}
    lr = store.load(ids)
    ref, _ = m.prefill(ids)
    got, _ = m.prefill(ids, lr.cache)
    assert lr.tokens == 96 and (got - ref).abs().max().item() <= TOL


def test_demo_hybrid(cluster):
    rep = run_demo(cluster.master_addr, quick=True, hybrid=True)
    h = rep["hybrid"]
    assert rep["all_match"] and h["all_match"]
    assert [g["kind"] for g in h["engine"]["groups"]] == ["full_attention", "mamba", "mla"]
    rows = {r["kind"]: r for r in h["requests"]}
    assert set(rows) == {"repeat", "new q", "continue", "miss"}
    assert rows["continue"]["via_tail"] and rows["continue"]["hit_tokens"] > rows["repeat"]["hit_tokens"]
    assert rows["repeat"]["hit_tokens"] % 64 == 0 and rows["repeat"]["hit_tokens"] > 1000
    assert rows["miss"]["hit_tokens"] == 0
    for r in h["requests"]:
        assert r["max_abs_diff"] <= TOL
    # the report reads in an 80-column terminal: no clipped headers or cells (only the
    # long question lines are cut, on purpose)
    con = Console(width=80, record=True)
    render_demo(rep, console=con)
    text = con.export_text()
    lines = text.splitlines()
    assert all(len(x.rstrip()) <= 80 for x in lines)
    assert [x for x in lines if "…" in x and not re.match(r"  [bh]\d+: ", x)] == []
    for header in ("prompt", "tokens", "TTFT ms", "speed-", "|Δlogit|", "continue", "via tails"):
        assert header in text
