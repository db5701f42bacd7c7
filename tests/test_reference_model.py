"""The demo's reference engine: paged KV cache restore == full recompute (no store needed)."""
from __future__ import annotations

import pytest
import torch

from kvpool.connector.demo_engine import ModelConfig, ReferenceModel, decode, demo_requests, encode, system_prompt
from kvpool.connector.demo_engine.tokenizer import DOCUMENTS, TEXT_DIR, load_text
from kvpool.protocol.keys import block_hashes, extra_bytes
from kvpool.protocol.layout import LayoutSpec, TensorSpec

TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    # 1768 tokens: not a multiple of the 16-token block
    return demo_requests(quick=True)[0][0].token_ids


@pytest.fixture(scope="module")
def full(model, prompt):
    return model.prefill(prompt)


def test_weights_are_deterministic(model):
    other = ReferenceModel()
    assert other.weights_digest() == model.weights_digest()
    assert other.model_id == model.model_id
    assert ReferenceModel(ModelConfig(seed=7)).weights_digest() != model.weights_digest()
    assert ReferenceModel(ModelConfig(seed=7)).model_id != model.model_id


def test_layout(model):
    lay = model.layout()
    assert lay == LayoutSpec(kind="full_attention", tokens_per_block=16,
                             tensors=(TensorSpec("kv", (2, 2, 4, 16, 32), "float32"),),
                             num_kv_heads=4, head_size=32)
    assert lay.nbytes == model.block_nbytes == 2 * 2 * 4 * 16 * 32 * 4


def test_blocks_shape_and_roundtrip(model, prompt, full):
    logits, kv = full
    assert logits.shape == (256,) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert kv.n_tokens == len(prompt)
    blocks = model.kv_to_blocks(kv, len(prompt))
    assert len(blocks) == len(prompt) // 16
    for b in blocks:
        assert b.shape == (2, 2, 4, 16, 32) and b.dtype == torch.float32 and b.is_contiguous()
    kv2 = model.blocks_to_kv(blocks)
    assert kv2.n_tokens == len(blocks) * 16
    assert torch.equal(kv2.pages, kv.pages[: len(blocks)])
    assert len(model.kv_to_blocks(kv, 40)) == 2
    with pytest.raises(ValueError):
        model.kv_to_blocks(kv, len(prompt) + 1)


@pytest.mark.parametrize("k", [0, 1, 2, 17, 50, "all"])
def test_restore_first_k_blocks_matches_full_recompute(model, prompt, full, k):
    logits, kv = full
    blocks = model.kv_to_blocks(kv)
    k = len(blocks) if k == "all" else k
    # copies through bytes, as a store would hand them back
    restored = [torch.frombuffer(bytearray(b.numpy().tobytes()), dtype=torch.float32).view(b.shape)
                for b in blocks[:k]]
    logits2, kv2 = model.prefill(prompt, model.blocks_to_kv(restored) if k else None)
    assert (logits2 - logits).abs().max().item() <= TOL
    assert kv2.n_tokens == len(prompt)
    # restored pages are kept bit-exact, the suffix K/V agree to rounding
    assert torch.equal(kv2.pages[:k], kv.pages[:k])
    assert (kv2.pages - kv.pages).abs().max().item() <= TOL


def test_shared_prefix_across_prompts(model):
    """Engine A's blocks of one question serve engine B's different question."""
    a, b = demo_requests(quick=True)
    pa, pb = a[0].token_ids, b[-2].token_ids   # same documents, different question
    extra = extra_bytes(model.model_id)
    ha, hb = block_hashes(pa, 16, extra), block_hashes(pb, 16, extra)
    common = 0
    while common < min(len(ha), len(hb)) and ha[common] == hb[common]:
        common += 1
    shared = next(i for i, (x, y) in enumerate(zip(pa, pb)) if x != y)  # common token prefix
    assert shared > len(system_prompt(("gettysburg_address",)))
    assert common == shared // 16
    assert common > 50
    _, kva = model.prefill(pa)
    blocks = model.kv_to_blocks(kva)[:common]
    ref, _ = model.prefill(pb)
    got, _ = model.prefill(pb, model.blocks_to_kv(blocks))
    assert (got - ref).abs().max().item() <= TOL
    # the different-document prompt shares no block
    hc = block_hashes(b[-1].token_ids, 16, extra)
    assert hc[0] != ha[0]


def test_cache_covering_whole_prompt(model):
    ids = encode(load_text("gettysburg_address"))[:320]  # exactly 20 blocks
    ref, kv = model.prefill(ids)
    got, kv2 = model.prefill(ids, model.blocks_to_kv(model.kv_to_blocks(kv)))
    assert (got - ref).abs().max().item() <= TOL  # last token recomputed from the cache
    assert kv2.n_tokens == 320


def test_partial_block_cache(model):
    ids = encode(load_text("moby_dick_ch1"))[:300]
    ref, kv = model.prefill(ids)
    got, _ = model.prefill(ids, kv.truncate(123))
    assert (got - ref).abs().max().item() <= TOL


def test_bad_inputs(model):
    with pytest.raises(ValueError):
        model.prefill([])
    with pytest.raises(ValueError):
        model.prefill([1, 2, 300])
    with pytest.raises(ValueError):
        model.blocks_to_kv([torch.zeros(2, 2, 4, 8, 32)])
    with pytest.raises(ValueError):
        model.blocks_to_kv([torch.zeros(2, 2, 4, 16, 32, dtype=torch.float16)])
    other = ReferenceModel(ModelConfig(heads=2, head_dim=64))
    _, kv = other.prefill([1, 2, 3] * 11)
    with pytest.raises(ValueError):
        model.prefill([1, 2, 3] * 11, kv)


def test_texts_and_tokenizer():
    texts = sorted(p.stem for p in TEXT_DIR.glob("*.txt"))
    assert set(DOCUMENTS) <= set(texts)
    for name in texts:
        t = load_text(name)
        assert len(t) > 1000 and t.isascii()
        assert decode(encode(t)) == t
    with pytest.raises(FileNotFoundError, match="shipped texts"):
        load_text("nope")
    a, b = demo_requests(quick=False)
    assert len(a) >= 3 and len(b) > len(a)
    assert all(len(r.token_ids) > 6000 for r in a)
