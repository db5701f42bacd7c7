"""protocol.groups: transfer projection, TP read plans, state-slot validation, common boundary."""
from __future__ import annotations

import msgspec
import pytest

from kvpool.protocol.errors import InvalidRequest, LayoutMismatch
from kvpool.protocol.groups import (CacheGroupSpec, ReadPiece, SlotInfo, TransferProjection, check_projection,
                             common_prefix, hit_alignment, layout_at_tp, project, slot_key, storage_layout, tail_hash,
                             tail_key, tail_layout, tp_read_plan, validate_state_slot)
from kvpool.protocol.keys import group_key
from kvpool.protocol.layout import LayoutSpec, TensorSpec


def attn(heads=4, tp=1, rank=0, block=16, layers=1, kind="full_attention"):
    return LayoutSpec(kind=kind, tokens_per_block=block,
                      tensors=(TensorSpec("kv", (layers, 2, heads, block, 32), "float32"),),
                      num_kv_heads=heads, head_size=32, tp_size=tp, tp_rank=rank)


def mla(tp=1, rank=0, block=32):
    return LayoutSpec(kind="mla", tokens_per_block=block,
                      tensors=(TensorSpec("kv_c", (1, block, 64), "float32"),
                               TensorSpec("k_pe", (1, block, 16), "float32")),
                      num_kv_heads=1, head_size=80, latent_dim=64, parallel="replicate", tp_size=tp, tp_rank=rank)


def mamba(heads=4, tp=1, rank=0, block=64, names=("conv_state", "ssm_state")):
    return LayoutSpec(kind="mamba", tokens_per_block=block,
                      tensors=(TensorSpec(names[0], (2, 3, 3 * heads * 32), "float32"),
                               TensorSpec(names[1], (2, heads, 32, 32), "float32")),
                      num_kv_heads=heads, head_size=32, tp_size=tp, tp_rank=rank)


def groups(tp=1, rank=0, heads=4):
    return [CacheGroupSpec(name="attn", layers=(0,), layout=attn(heads // tp, tp, rank)),
            CacheGroupSpec(name="kda", layers=(1, 3), layout=mamba(heads // tp, tp, rank)),
            CacheGroupSpec(name="mla", layers=(2,), layout=mla(tp, rank)),
            CacheGroupSpec(name="draft", layers=(4,), layout=attn(heads // tp, tp, rank), enable_kv_transfer=False)]


def test_projection_keeps_transfer_groups_in_declared_order():
    p = project(groups())
    assert p.names == ("attn", "kda", "mla")  # the non-transfer draft cache is not stored
    assert [g.index for g in p.groups] == [0, 1, 2]
    assert p.group("mla").tokens_per_block == 32
    # stable, round-trips, and every rank of one TP setup agrees
    assert p.fingerprint() == project(groups()).fingerprint()
    assert TransferProjection.decode(p.encode()) == p
    assert project(groups(tp=2, rank=0)).fingerprint() == project(groups(tp=2, rank=1)).fingerprint()
    assert project(groups(tp=2)).fingerprint() != p.fingerprint()
    with pytest.raises(InvalidRequest, match="malformed"):
        TransferProjection.decode(b"\x01\x02")


def test_projection_rejects_bad_declarations():
    g = groups()
    with pytest.raises(InvalidRequest, match="declared twice"):
        project([g[0], g[0]])
    with pytest.raises(InvalidRequest, match="layer 0"):
        project([g[0], CacheGroupSpec(name="x", layers=(0,), layout=attn())])
    with pytest.raises(InvalidRequest, match="ascending"):
        project([CacheGroupSpec(name="x", layers=(3, 1), layout=attn())])
    with pytest.raises(InvalidRequest, match="conv history|conv-history"):
        project([CacheGroupSpec(name="m", layers=(1,), layout=mamba(names=("x", "ssm_state")))])
    bad = msgspec.structs.replace(attn(), tensors=(TensorSpec("kv", (1, 2, 16, 4, 32), "float32"),))
    with pytest.raises(InvalidRequest, match="must end in"):
        project([CacheGroupSpec(name="a", layers=(0,), layout=bad)])


def test_misaligned_projection_is_a_layout_mismatch():
    stored = project(groups())
    # consumer registers 4 transfer groups (the seed's misalignment case)
    four = groups()[:3] + [CacheGroupSpec(name="swa", layers=(5,), layout=attn(kind="sliding_window"))]
    with pytest.raises(LayoutMismatch) as e:
        check_projection(stored, project(four))
    assert e.value.fields["field"] == "groups" and e.value.fields["index"] == 3
    assert "swa" in e.value.message
    # the same groups in a different order
    g = groups()
    with pytest.raises(LayoutMismatch) as e:
        check_projection(stored, project([g[2], g[0], g[1]]))
    assert e.value.fields["index"] == 0 and e.value.fields["field"] == "name"
    # same names, a group covering other layers
    moved = [g[0], CacheGroupSpec(name="kda", layers=(1,), layout=mamba()), g[2]]
    with pytest.raises(LayoutMismatch) as e:
        check_projection(stored, project(moved))
    assert e.value.fields == {"field": "layers", "group": "kda", "index": 1}
    # same everything but the block size of MLA pages
    other = [g[0], g[1], CacheGroupSpec(name="mla", layers=(2,), layout=mla(block=64))]
    with pytest.raises(LayoutMismatch, match="tokens_per_block"):
        check_projection(stored, project(other))
    # identical projections pass and give per-group read plans
    plans = check_projection(stored, project(groups()))
    assert plans["attn"] == [ReadPiece(0, 0, 4, 0)] and plans["mla"] == [ReadPiece(None, 0, 0, 0)]


def test_tp_read_plans():
    # SPLIT attention TP=1 -> TP=2: each rank slices its heads from rank 0's blocks
    assert tp_read_plan(attn(4, 1, 0), attn(2, 2, 0)) == [ReadPiece(0, 0, 2, 0)]
    assert tp_read_plan(attn(4, 1, 0), attn(2, 2, 1)) == [ReadPiece(0, 2, 4, 0)]
    # TP=2 -> TP=1: gather both ranks
    assert tp_read_plan(attn(2, 2, 0), attn(4, 1, 0)) == [ReadPiece(0, 0, 2, 0), ReadPiece(1, 0, 2, 2)]
    # TP=4 -> TP=2
    assert tp_read_plan(attn(1, 4, 0), attn(2, 2, 1)) == [ReadPiece(2, 0, 1, 0), ReadPiece(3, 0, 1, 1)]
    # same TP: own rank
    assert tp_read_plan(attn(2, 2, 0), attn(2, 2, 1)) == [ReadPiece(1, 0, 2, 0)]
    # REPLICATE: one copy for any TP size and rank
    for tp in (1, 2, 8):
        for r in range(tp):
            assert tp_read_plan(mla(1, 0), mla(tp, r)) == [ReadPiece(None, 0, 0, 0)]
    assert storage_layout(mla(2, 1)) == storage_layout(mla(1, 0))
    assert storage_layout(mla(4, 3)).fingerprint() == mla().fingerprint()
    assert storage_layout(attn(2, 2, 1)) == attn(2, 2, 1)  # SPLIT: each rank's object says its rank
    assert storage_layout(mla(4, 3)) == mla(4, 3).canonical() == mla()
    # a group's fingerprint is its layout's: REPLICATE ones agree across TP sizes, SPLIT ones do not
    assert project(groups(tp=2, rank=1)).group("mla").fingerprint == project(groups()).group("mla").fingerprint
    assert project(groups(tp=2, rank=1)).group("attn").fingerprint != project(groups()).group("attn").fingerprint


def test_layout_at_tp_is_what_that_tp_size_stores():
    # the layout an engine of the other size computes itself: same fingerprint, so the same keys
    for heads, tp, to in ((4, 1, 2), (2, 2, 1), (1, 4, 2), (2, 2, 4), (4, 1, 4)):
        total = heads * tp
        other = layout_at_tp(attn(heads, tp, 0), to)
        assert other == attn(total // to, to, 0)
        assert other.fingerprint() == attn(total // to, to, to - 1).fingerprint()
        # and its blocks are read back into this layout
        assert tp_read_plan(other, attn(heads, tp, 0))
    assert layout_at_tp(attn(2, 2, 1, kind="sliding_window"), 1) == attn(4, 1, 0, kind="sliding_window")
    with pytest.raises(LayoutMismatch, match="replicated"):
        layout_at_tp(mla(), 2)
    with pytest.raises(LayoutMismatch, match="mamba"):
        layout_at_tp(mamba(4), 2, "kda")
    with pytest.raises(LayoutMismatch, match="shared evenly") as e:
        layout_at_tp(attn(3), 2, "attn")
    assert e.value.fields == {"field": "num_kv_heads", "group": "attn"}
    with pytest.raises(LayoutMismatch, match="head axis"):
        layout_at_tp(msgspec.structs.replace(attn(4), tensors=(TensorSpec("kv", (4, 32), "float32"),)), 2)


def test_tp_read_plan_rejections():
    with pytest.raises(LayoutMismatch, match="split differently") as e:
        tp_read_plan(mamba(4, 1, 0), mamba(2, 2, 0), "kda")
    assert e.value.fields == {"field": "tp_size", "group": "kda"}
    with pytest.raises(LayoutMismatch, match="KV heads in total"):
        tp_read_plan(attn(4, 1, 0), attn(4, 2, 0))
    with pytest.raises(LayoutMismatch, match="parallel"):
        tp_read_plan(mla(), attn())
    with pytest.raises(LayoutMismatch, match="tokens_per_block"):
        tp_read_plan(attn(4, 1, 0, block=16), attn(2, 2, 0, block=32))
    with pytest.raises(LayoutMismatch, match="head_size"):
        tp_read_plan(attn(4), msgspec.structs.replace(attn(4), head_size=64,
                                                      tensors=(TensorSpec("kv", (1, 2, 4, 16, 64), "float32"),)))
    # a stored layout whose pages hold another number of heads than it declares (a forged
    # record): its bytes are not cut up by the declared count
    for axis in (2, 3):
        forged = msgspec.structs.replace(attn(1, 2, 0), tensors=(TensorSpec("kv", (1, 2, axis, 16, 32), "float32"),))
        with pytest.raises(LayoutMismatch, match="without a head axis of 1") as e:
            tp_read_plan(forged, attn(2, 1, 0), "attn")
        assert e.value.fields == {"field": "tensors", "group": "attn"}
    with pytest.raises(LayoutMismatch):
        check_projection(project(groups(tp=1)), project(groups(tp=2)), allow_tp_reshard=False)
    # the whole projection with a KDA group cannot be resharded 1 -> 2
    with pytest.raises(LayoutMismatch, match="transfer group 1.*split differently"):
        check_projection(project(groups(tp=1)), project(groups(tp=2, rank=1)))


def test_state_slot_validation():
    lay = mamba()
    shapes = {t.name: t.shape for t in lay.tensors}
    validate_state_slot(lay, SlotInfo(tensors=shapes, tokens=128))
    validate_state_slot(lay, SlotInfo(tensors=shapes, tokens=100, tail=True))
    with pytest.raises(InvalidRequest, match="without its conv history"):
        validate_state_slot(lay, SlotInfo(tensors={"ssm_state": shapes["ssm_state"]}, tokens=128))
    with pytest.raises(InvalidRequest, match="without its recurrent state"):
        validate_state_slot(lay, SlotInfo(tensors={"conv_state": shapes["conv_state"]}, tokens=128))
    with pytest.raises(InvalidRequest, match="speculative"):
        validate_state_slot(lay, SlotInfo(tensors=shapes, tokens=128, speculative=True))
    with pytest.raises(InvalidRequest, match="not on a 64-token boundary"):
        validate_state_slot(lay, SlotInfo(tensors=shapes, tokens=100))
    with pytest.raises(InvalidRequest, match="on a boundary"):
        validate_state_slot(lay, SlotInfo(tensors=shapes, tokens=128, tail=True))
    with pytest.raises(InvalidRequest, match="shape"):
        validate_state_slot(lay, SlotInfo(tensors={**shapes, "ssm_state": (2, 4, 32, 16)}, tokens=64))
    with pytest.raises(InvalidRequest, match="does not declare"):
        validate_state_slot(lay, SlotInfo(tensors={**shapes, "extra": (1,)}, tokens=64))
    with pytest.raises(InvalidRequest, match="at least one token"):
        validate_state_slot(lay, SlotInfo(tensors=shapes, tokens=0))
    with pytest.raises(InvalidRequest, match="not a mamba"):
        validate_state_slot(attn(), SlotInfo(tensors=shapes, tokens=64))


def _proj(attn_block=16, mla_block=32, kda_block=64):
    return project([CacheGroupSpec(name="attn", layers=(0,), layout=attn(block=attn_block)),
                    CacheGroupSpec(name="kda", layers=(1, 3), layout=mamba(block=kda_block)),
                    CacheGroupSpec(name="mla", layers=(2,), layout=mla(block=mla_block))])


def test_common_boundary_hit():
    # attention has 120 tokens stored (15 blocks of 8), MLA 128 (8 pages of 16), and the
    # mamba state has checkpoints at 32, 64, 96: the hit is 96
    p = _proj(8, 16, 32)
    stored = {"attn": [True] * 15 + [False], "mla": [True] * 8, "kda": [True, True, True, False]}
    hit = common_prefix(p, stored)
    assert hit.tokens == 96
    assert hit.per_group == {"attn": 120, "mla": 128, "kda": 96}
    # divergent answer: every group's own length, the common one unchanged
    long_kda = {**stored, "kda": [True] * 6}
    assert common_prefix(p, long_kda).per_group["kda"] == 96
    hit = common_prefix(p, long_kda, divergent=True)
    assert hit.per_group == {"attn": 120, "mla": 128, "kda": 192} and hit.tokens == 96
    # a checkpoint missing in the middle: only exact checkpoints count
    hit = common_prefix(p, {"attn": [True] * 15, "mla": [True] * 8, "kda": [True, True, False]})
    assert hit.tokens == 64
    # attention gap: nothing past the gap counts
    hit = common_prefix(p, {"attn": [True, True, False] + [True] * 12, "mla": [True] * 8, "kda": [True] * 4})
    assert hit.tokens == 0 and hit.per_group["attn"] == 16
    # capped at len - 1 so the last token is computed
    hit = common_prefix(p, {"attn": [True] * 16, "mla": [True] * 8, "kda": [True] * 4}, max_tokens=127)
    assert hit.tokens == 96
    # a stored tail state gives an exact extra point, to an engine restoring attention at any token
    hit = common_prefix(p, {"attn": [True] * 15, "mla": [True] * 8, "kda": [True] * 3},
                        extra_points={"kda": [117]}, alignment=1)
    assert hit.tokens == 117
    # vLLM's rule (the default) ends a hit on every group's block boundary: not at the tail
    assert common_prefix(p, {"attn": [True] * 15, "mla": [True] * 8, "kda": [True] * 3},
                         extra_points={"kda": [117]}).tokens == 96
    # paged-only projection: the shortest run
    pp = project([CacheGroupSpec(name="attn", layers=(0,), layout=attn(block=16)),
                  CacheGroupSpec(name="mla", layers=(2,), layout=mla(block=32))])
    assert common_prefix(pp, {"attn": [True] * 7, "mla": [True] * 5}, alignment=1).tokens == 112
    assert common_prefix(pp, {"attn": [True] * 7, "mla": [True] * 5}).tokens == 96  # lcm(16, 32) = 32
    assert common_prefix(pp, {"attn": [], "mla": []}).tokens == 0


def test_common_boundary_takes_the_engines_alignment():
    """Attention blocks of 32 stored up to 64 tokens, state checkpoints (16-token blocks)
    at 32 and 48: vLLM ends a hybrid hit on a block boundary of every group (the least
    common multiple of their block sizes, 32), so the hit is 32, not 48; an engine that
    restores attention at any token gets 48."""
    p = project([CacheGroupSpec(name="attn", layers=(0,), layout=attn(block=32)),
                 CacheGroupSpec(name="ssm", layers=(1,), layout=mamba(block=16))])
    stored = {"attn": [True, True], "ssm": [False, True, True]}
    assert hit_alignment(p) == 32
    assert common_prefix(p, stored).tokens == 32
    assert common_prefix(p, stored, alignment=1).tokens == 48
    assert common_prefix(p, stored, alignment=48).tokens == 48
    with pytest.raises(InvalidRequest, match="alignment"):
        common_prefix(p, stored, alignment=0)


def test_slot_and_tail_keys_never_alias_blocks():
    p = _proj()
    g = p.group("attn")
    h = bytes(range(16))
    block = group_key("ns", "m", g.index, g.fingerprint, h, 0)
    tail = tail_key("ns", "m", g, h, 37, 0)
    assert tail != block and "/tail/" in tail and tail.endswith("@37")
    k = p.group("kda")
    assert slot_key("ns", "m", k, h, 128, 0).endswith(f"{h.hex()}@128")
    tl = tail_layout(attn(), 5)
    assert tl.tokens_per_block == 5 and tl.tensors[0].shape == (1, 2, 4, 5, 32)
    assert tl.fingerprint() != attn().fingerprint()
    assert tail_layout(mla(), 7).tensors[1].shape == (1, 7, 16)
    assert tail_layout(mamba(), 7) == mamba()
    with pytest.raises(InvalidRequest):
        tail_layout(attn(), 16)
    assert tail_hash(h, [1, 2, 3]) != tail_hash(h, [1, 2, 4]) != tail_hash(h, [1, 2])
