"""Blocks of a SPLIT attention group assembled from the blocks another TP size stored
(connector/vllm/pages.py ``place_heads`` following protocol/groups.py ``tp_read_plan``):
real torch tensors in vLLM's stored page order (per layer ``[heads, tokens, K then V]``),
no engine. Each rank's stored block is cut from one whole-model block, so the assembled
block must be byte for byte the block a reader of that TP size would have stored itself."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.connector.vllm.pages import place_heads
from kvpool.protocol.groups import ReadPiece, tp_read_plan
from kvpool.protocol.layout import LayoutSpec, TensorSpec

HEADS, TOKENS, HEAD_SIZE, LAYERS = 4, 16, 8, 3


def _layout(tp: int, rank: int, dtype: str = "bfloat16") -> LayoutSpec:
    h = HEADS // tp
    page = (h, TOKENS, 2 * HEAD_SIZE)  # vLLM's logical page: content is K then V
    return LayoutSpec(kind="full_attention", tokens_per_block=TOKENS,
                      tensors=tuple(TensorSpec(f"model.layers.{i}.self_attn.attn", page, dtype) for i in range(LAYERS)),
                      num_kv_heads=h, head_size=HEAD_SIZE, tp_size=tp, tp_rank=rank)


def _rank_blocks(whole: torch.Tensor, tp: int) -> list[np.ndarray]:
    """Each rank's stored blocks ``[n, bytes]`` uint8, cut from ``whole`` ``[n, layers,
    heads, tokens, content]``: its heads of every layer, layers back to back."""
    h = HEADS // tp
    return [whole[:, :, r * h:(r + 1) * h].contiguous().view(torch.uint8).reshape(whole.shape[0], -1).numpy()
            for r in range(tp)]


@pytest.mark.parametrize("stored_tp,reader_tp", [(2, 1), (4, 1), (1, 2), (4, 2), (2, 4), (1, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_assembled_from_another_tp_size_are_the_readers_own(stored_tp, reader_tp, dtype):
    n = 5
    name = str(dtype).removeprefix("torch.")
    whole = torch.randn(n, LAYERS, HEADS, TOKENS, 2 * HEAD_SIZE).to(dtype)
    stored = _rank_blocks(whole, stored_tp)
    want = _rank_blocks(whole, reader_tp)
    for q in range(reader_tp):
        local = _layout(reader_tp, q, name)
        pieces = tp_read_plan(_layout(stored_tp, 0, name), local)
        dst = np.zeros((n, local.nbytes), dtype=np.uint8)
        srcs = {p.src_rank: stored[p.src_rank] for p in pieces}
        place_heads(dst, srcs, pieces, local, _layout(stored_tp, 0, name))
        assert np.array_equal(dst, want[q]), (stored_tp, reader_tp, q)


def test_assembly_into_a_staging_slice_writes_only_its_rows():
    """The worker assembles into rows of its staging arena: neighbouring rows keep their bytes."""
    whole = torch.randn(2, LAYERS, HEADS, TOKENS, 2 * HEAD_SIZE).to(torch.float16)
    local, stored = _layout(1, 0, "float16"), _layout(2, 0, "float16")
    arena = torch.full((4, local.nbytes), 7, dtype=torch.uint8)
    pieces = tp_read_plan(stored, local)
    assert pieces == [ReadPiece(0, 0, 2, 0), ReadPiece(1, 0, 2, 2)]
    parts = _rank_blocks(whole, 2)
    place_heads(arena[1:3].numpy(), {0: parts[0], 1: parts[1]}, pieces, local, stored)
    assert np.array_equal(arena[1:3].numpy(), _rank_blocks(whole, 1)[0])
    assert bool((arena[0] == 7).all()) and bool((arena[3] == 7).all())


def test_buffers_that_do_not_fit_the_layouts_are_refused():
    local, stored = _layout(1, 0), _layout(2, 0)
    pieces = tp_read_plan(stored, local)
    src = np.zeros((2, stored.nbytes), dtype=np.uint8)
    with pytest.raises(ValueError, match="destination"):
        place_heads(np.zeros((2, local.nbytes - 1), dtype=np.uint8), {0: src, 1: src}, pieces, local, stored)
    with pytest.raises(ValueError, match="source rank 1"):
        place_heads(np.zeros((2, local.nbytes), dtype=np.uint8), {0: src, 1: src[:1]}, pieces, local, stored)
    with pytest.raises(ValueError, match="outside"):
        place_heads(np.zeros((2, local.nbytes), dtype=np.uint8), {0: src}, [ReadPiece(0, 0, 2, 3)], local, stored)
