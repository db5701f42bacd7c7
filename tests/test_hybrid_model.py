"""The hybrid reference engine (attention, sliding window, MLA, KDA).

Pure model tests (weights, group layouts, TP forward, KDA checkpoints, guards) run
without a store. Everything that stores and restores goes through the real cluster
(``client`` fixture: etcd + master + 2 store nodes), each test in its own key namespace,
so the engine's export/import byte paths, the store glue and the wire layouts are all
exercised together; the restore is swept over many group mixes and prefix lengths.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from kvpool.connector.hybrid_store import HybridStore, pack_tensors
from kvpool.connector.demo_engine.hybrid import HybridCache, HybridConfig, HybridModel
from kvpool.connector.demo_engine.tokenizer import encode, load_text
from kvpool.protocol.errors import InvalidRequest, LayoutMismatch
from kvpool.protocol.groups import project

TOL = 1e-5
MIXES = [("attn",), ("mla",), ("kda",), ("swa",), ("attn", "mla"), ("attn", "kda"), ("mla", "kda"),
         ("attn", "kda", "mla", "kda"), ("swa", "kda", "mla", "attn")]


def ns() -> str:
    """A fresh key namespace: tests never see each other's blocks."""
    return f"hm-{uuid.uuid4().hex[:8]}"


def keys_under(client, space: str) -> list[str]:
    return [o.key for o in client.ls(prefix=space + "/")]


def cfg(pattern, **kw) -> HybridConfig:
    return HybridConfig(pattern=tuple(pattern), window=48, **kw)


TEXT = encode(load_text("gettysburg_address"))
P = TEXT[:200]
OTHER = encode("#" + load_text("moby_dick_ch1")[:60])  # '#' never occurs in P


def expected_hit(model: HybridModel, s: int, p: int, n: int) -> int:
    """The common boundary for a prompt of ``n`` tokens sharing ``s`` with a stored ``p``-token
    prompt (blocks, checkpoints and the tail at ``p``)."""
    c = model.config
    kinds = set(c.pattern)
    cap = n - 1
    paged = [c.block_of(k) for k in kinds if k != "kda"]
    lim = min([min(s, p) // b * b for b in paged] + [cap])
    if "kda" in kinds:
        lim = min(lim, s, p) // c.kda_block * c.kda_block
    if s >= p and p <= cap and p > lim:
        return p  # continuation through the stored partial tails
    return lim


def test_weights_and_identity():
    a, b = HybridModel(), HybridModel()
    assert a.weights_digest() == b.weights_digest() and a.model_id == b.model_id
    # cache geometry and grouping are not model identity; layer pattern and seed are
    assert HybridModel(HybridConfig(kda_block=32, split_kda_groups=True)).model_id == a.model_id
    assert HybridModel(HybridConfig(pattern=("attn",))).model_id != a.model_id
    assert HybridModel(HybridConfig(seed=1)).weights_digest() != a.weights_digest()
    assert HybridModel(tp_size=2).weights_digest() == a.weights_digest()


@pytest.mark.parametrize("pattern", MIXES, ids=["+".join(m) for m in MIXES])
@pytest.mark.parametrize("tp", [1, 2])
def test_group_layouts_project(pattern, tp):
    m = HybridModel(cfg(pattern), tp)
    for r in range(tp):
        p = project(m.cache_groups(r))
        kinds = {g.name: g.kind for g in p.groups}
        assert set(kinds) == {k for k in pattern}
        want = {"attn": "full_attention", "swa": "sliding_window", "mla": "mla", "kda": "mamba"}
        assert all(want[name] == kind for name, kind in kinds.items())
        for g in p.groups:
            assert g.layout.tp_size == tp and g.layout.tp_rank == r
            assert g.layout.parallel == ("replicate" if g.kind == "mla" else "split")
            assert g.tokens_per_block == m.config.block_of(g.name)


def test_tp2_forward_matches_tp1():
    ids = TEXT[:300]
    ref, _ = HybridModel().prefill(ids)
    got, _ = HybridModel(tp_size=2).prefill(ids)
    assert (got - ref).abs().max().item() <= TOL


def test_kda_checkpoints_are_exact_states():
    m = HybridModel(cfg(("kda",)))
    _, full = m.prefill(TEXT[:200])
    assert sorted(full.checkpoints) == [64, 128, 192]
    _, part = m.prefill(TEXT[:128])
    for li, (conv, st) in part.kda.items():
        assert torch.equal(full.checkpoints[128][li][0], conv) and torch.equal(full.checkpoints[128][li][1], st)


@pytest.mark.parametrize("pattern", MIXES, ids=["+".join(m) for m in MIXES])
def test_restore_many_prefix_lengths(client, pattern):
    """Engine B restoring from the store == full recompute, for shared prefixes of many
    lengths (most not a multiple of any block size), and the hit is the common boundary."""
    m = HybridModel(cfg(pattern))
    space = ns()
    _, cache = m.prefill(P)
    st = HybridStore(client, m, space).put(P, cache)
    assert st["errors"] == [] and st["objects_put"] > 0
    reader = HybridStore(client, HybridModel(cfg(pattern)), space)
    for s in (0, 7, 16, 31, 64, 100, 129, 150, 199, 200):
        ids = P[:s] + OTHER if s < len(P) else P + OTHER
        ref, _ = m.prefill(ids)
        lr = reader.load(ids)
        assert lr.tokens == expected_hit(m, s, len(P), len(ids)), (s, lr.per_group)
        if lr.via_tail:
            assert s >= len(P) and lr.tokens == len(P)
        got, after = m.prefill(ids, lr.cache)
        assert (got - ref).abs().max().item() <= TOL, (pattern, s)
        assert after.n_tokens == len(ids)


def test_tail_only_as_continuation(client):
    m = HybridModel()
    space = ns()
    HybridStore(client, m, space).put(P, m.prefill(P)[1])
    reader = HybridStore(client, m, space)
    # continuation: restored exactly at len(P) through the tails
    lr = reader.load(P + OTHER)
    assert lr.tokens == len(P) and lr.via_tail
    # the same prompt (the last token must be computed) and a prompt diverging inside the
    # tail's block never use it
    assert reader.load(P).via_tail is False
    diverge = P[:198] + OTHER
    lr = reader.load(diverge)
    assert not lr.via_tail and lr.tokens == 192
    # tails are not blocks: the block lookup of the first 208 tokens stops at 192
    assert reader.lookup(P + OTHER)[0].per_group["attn"] == 192
    # tail objects sit under tail/, never where a block key would be
    tails = [k for k in keys_under(client, space) if "/tail/" in k]
    assert sorted(k.rsplit("@", 1)[1] for k in tails) == ["200"] * 3  # one per group


def test_put_time_rejections(client):
    m = HybridModel()
    space = ns()
    store = HybridStore(client, m, space)
    _, cache = m.prefill(P)
    spec = next(g for g in m.cache_groups() if g.name == "kda")
    good = m.state_slot(cache.checkpoints[128], spec, 0, 128)
    from kvpool.protocol.keys import block_hashes, extra_bytes

    h = block_hashes(P, 64, extra_bytes(m.model_id))[1]
    no_conv = m.state_slot(cache.checkpoints[128], spec, 0, 128)
    del no_conv.tensors["conv_state"]
    with pytest.raises(InvalidRequest, match="without its conv history"):
        store.put_slot("kda", h, no_conv)
    spec_slot = m.state_slot(cache.checkpoints[128], spec, 0, 128)
    spec_slot.speculative = True
    with pytest.raises(InvalidRequest, match="speculative"):
        store.put_slot("kda", h, spec_slot)
    off = m.state_slot(cache.kda, spec, 0, 200)
    with pytest.raises(InvalidRequest, match="boundary"):
        store.put_slot("kda", h, off)
    wide = m.state_slot(cache.checkpoints[128], spec, 0, 128)
    wide.tensors["ssm_state"] = wide.tensors["ssm_state"].double()  # same shape, other bytes
    with pytest.raises(InvalidRequest, match="float64, layout says float32"):
        store.put_slot("kda", h, wide)
    assert keys_under(client, space) == []  # nothing was stored
    assert store.put_slot("kda", h, good) is None
    (key,) = keys_under(client, space)
    assert key.endswith("@128")
    # the stored slot is its sub-tensors back to back, in layout order
    assert client.get(key) == pack_tensors([good.tensors["conv_state"], good.tensors["ssm_state"]]).numpy().tobytes()


def test_misaligned_consumers_get_layout_mismatch(client):
    m = HybridModel()
    space = ns()
    HybridStore(client, m, space).put(P, m.prefill(P)[1])
    ids = P + OTHER
    four = HybridModel(HybridConfig(split_kda_groups=True))  # 4 transfer groups vs 3
    assert four.model_id == m.model_id
    with pytest.raises(LayoutMismatch, match="transfer group 1"):
        HybridStore(client, four, space).load(ids)
    reordered = HybridModel(HybridConfig(group_order=("mla", "attn", "kda")))
    with pytest.raises(LayoutMismatch, match="transfer group 0: stored name='attn'"):
        HybridStore(client, reordered, space).load(ids)
    # a producer with another projection cannot publish under the same model either
    with pytest.raises(LayoutMismatch):
        HybridStore(client, reordered, space).publish_projection()


def test_heterogeneous_tp(client):
    c = cfg(("attn", "mla"))
    m1, m2 = HybridModel(c), HybridModel(c, tp_size=2)
    ids = P + OTHER
    ref, _ = m1.prefill(ids)
    # TP=1 producer, TP=2 consumer: each rank slices its heads of the attention blocks
    space = ns()
    HybridStore(client, m1, space).put(P, m1.prefill(P)[1])
    lr = HybridStore(client, m2, space, source_tp=1).load(ids)
    assert lr.tokens == len(P)
    got, _ = m2.prefill(ids, lr.cache)
    assert (got - ref).abs().max().item() <= TOL
    # TP=2 producer: MLA stored once (REPLICATE), attention once per rank
    space = ns()
    HybridStore(client, m2, space).put(P, m2.prefill(P)[1])
    keys = keys_under(client, space)
    mla_keys = [k for k in keys if "/1:" in k and "/tail/" not in k]
    attn_keys = [k for k in keys if "/0:" in k and "/tail/" not in k]
    assert len(mla_keys) == len(P) // 32 and not any("/tp" in k for k in mla_keys)
    assert len(attn_keys) == 2 * (len(P) // 16)
    # both TP=2 ranks and a TP=1 reader (gathering both ranks' heads) restore from it
    for reader, tp in ((m2, None), (m1, 2)):
        lr = HybridStore(client, reader, space, source_tp=tp).load(ids)
        got, _ = reader.prefill(ids, lr.cache)
        assert lr.tokens == len(P) and (got - ref).abs().max().item() <= TOL
    # KDA state is split by heads: TP 1 -> 2 is refused, not converted
    m3, m4 = HybridModel(), HybridModel(tp_size=2)
    space = ns()
    HybridStore(client, m3, space).put(P, m3.prefill(P)[1])
    with pytest.raises(LayoutMismatch, match="split differently"):
        HybridStore(client, m4, space, source_tp=1).load(ids)


def test_prefill_guards():
    m = HybridModel()
    with pytest.raises(ValueError):
        m.prefill([])
    with pytest.raises(ValueError, match="last token"):
        m.prefill(P[:64], HybridCache(n_tokens=64))
    with pytest.raises(ValueError, match="no cache for layer"):
        m.prefill(P, HybridCache(n_tokens=64))
    with pytest.raises(ValueError):
        HybridModel(HybridConfig(pattern=("rnn",)))
    with pytest.raises(ValueError):
        HybridModel(tp_size=3)
