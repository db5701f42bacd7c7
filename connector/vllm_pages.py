"""KV cache pages as the connector moves them: torch dtypes by layout name, host cache
views as numpy bytes, the gather copy of saves, and kernel-block caches seen as manager
blocks. Pure tensor helpers, no I/O."""
from __future__ import annotations

import torch

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
                 "int32": torch.int32, "int64": torch.int64}

def copy_pages(src, dst, block_ids: list[int]) -> None:
    """Gather thread: ``dst[i] = src[block_ids[i]]`` as bytes. ``src``: a layer's host cache
    ``[blocks, ...]`` uint8 (last axis in bytes); ``dst``: ``[len(block_ids), page bytes]``
    uint8, a column range of the staging buffer. numpy copies without the GIL and without
    an OpenMP team beside the engine's."""
    for i, b in enumerate(block_ids):
        dst[i] = src[b].reshape(-1)


def host_bytes(view):
    """A host cache view as a numpy uint8 array (the last axis in bytes), or None where
    that is not possible (device memory, kernel-block views, a strided last axis)."""
    if not isinstance(view, torch.Tensor) or view.device.type != "cpu":
        return None
    try:
        return view.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None


class MergedPages:
    """A ``[B, H, r, Nk, C]`` cache (kernel blocks) used as ``[B, H, r*Nk, C]`` pages."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        b, h, r, nk, c = t.shape
        self.shape = (b, h, r * nk, c)
        self.device = t.device
        self.dtype = t.dtype

    def index_select(self, dim: int, idx: torch.Tensor) -> torch.Tensor:
        sel = self.t.index_select(dim, idx)
        return sel.reshape(len(idx), *self.shape[1:])

    def index_copy_(self, dim: int, idx: torch.Tensor, src: torch.Tensor) -> None:
        b, h, r, nk, c = self.t.shape
        self.t.index_copy_(dim, idx, src.reshape(len(idx), h, r, nk, c))
