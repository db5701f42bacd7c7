"""KV cache pages as the connector moves them: torch dtypes by layout name, host cache
views as numpy bytes, a layer's sub-tensors inside a stored block, staging buffers, the
gather copy of saves, blocks assembled from another TP size's per-rank blocks, and
kernel-block caches seen as manager blocks. Pure tensor helpers, no I/O."""
from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvpool.protocol.groups import ReadPiece
from kvpool.protocol.layout import DTYPE_BYTES, LayoutSpec

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
                 "int32": torch.int32, "int64": torch.int64, "float8_e4m3fn": torch.float8_e4m3fn,
                 "float8_e5m2": torch.float8_e5m2}


def staging(n: int, nbytes: int, pin: bool) -> torch.Tensor:
    """A ``[n, nbytes]`` uint8 host buffer for ``n`` blocks of ``nbytes`` each: pinned
    (torch's caching host allocator) when ``pin`` (the caches are on a GPU), so the gather
    and scatter copies are DMA at full link speed (``benchmarks/gpu_paths.py``)."""
    return torch.empty((n, nbytes), dtype=torch.uint8, pin_memory=pin)


def block_parts(caches: dict[str, list], layer_pos: dict[str, tuple[int, int]], name: str):
    """``(cache view, byte offset, end, shape, dtype)`` of each sub-tensor of layer ``name``
    inside one stored block of its group: ``caches[name]`` holds the layer's ``(view, shape,
    dtype)`` per sub-tensor, ``layer_pos[name]`` its ``(group index, byte offset)``."""
    off = layer_pos[name][1]
    for view, shape, dtype in caches[name]:
        nb = math.prod(shape) * DTYPE_BYTES[dtype]
        yield view, off, off + nb, shape, dtype
        off += nb


def move_dtype(name: str) -> str:
    """The dtype the connector moves a layout dtype's pages as: one-byte formats (FP8,
    int8) as uint8, whatever the cache tensor's own dtype (vLLM keeps FP8 caches as uint8,
    some backends as float8; torch has no index copy for float8 on every device)."""
    return "uint8" if TORCH_DTYPES[name].itemsize == 1 else name

def copy_pages(src, dst, block_ids: list[int]) -> None:
    """Gather thread: ``dst[i] = src[block_ids[i]]`` as bytes. ``src``: a layer's host cache
    ``[blocks, ...]`` uint8 (last axis in bytes); ``dst``: ``[len(block_ids), page bytes]``
    uint8, a column range of the staging buffer. numpy copies without the GIL and without
    an OpenMP team beside the engine's."""
    for i, b in enumerate(block_ids):
        dst[i] = src[b].reshape(-1)


def place_heads(dst: np.ndarray, srcs: Mapping[int | None, np.ndarray], pieces: Sequence[ReadPiece],
                local: LayoutSpec, stored: LayoutSpec) -> None:
    """Assemble blocks of a SPLIT attention group from the blocks another TP size stored.

    ``dst``: ``[n, local.nbytes]`` uint8 numpy array, ``n`` blocks in this rank's layout
    ``local``; ``srcs[r]``: ``[n, stored.nbytes]`` uint8 numpy array, the same ``n``
    blocks as source rank ``r`` stored them (layout ``stored``, any ``tp_rank``);
    ``pieces``: :class:`~protocol.groups.ReadPiece` list of
    :func:`~protocol.groups.tp_read_plan` ``(stored, local)``. Both layouts hold the
    same tensors (one per layer, in order), each ``[..., heads, tokens, content]`` with
    the heads outermost in the page, so a piece is one byte range per tensor: heads
    ``[head_lo, head_hi)`` of ``srcs[src_rank]`` are copied, bytes unchanged, to heads
    ``[dst_lo, dst_lo + head_hi - head_lo)`` of ``dst``. Plain numpy copies (no OpenMP
    team). Raises ValueError when the buffers or pieces do not fit the layouts."""
    n = dst.shape[0]
    if dst.shape != (n, local.nbytes) or len(local.tensors) != len(stored.tensors):
        raise ValueError(f"place_heads: destination {dst.shape} is not [n, {local.nbytes}] or the layouts hold "
                         f"{len(local.tensors)} and {len(stored.tensors)} tensors")
    for p in pieces:
        src = srcs[p.src_rank]
        if src.shape != (n, stored.nbytes):
            raise ValueError(f"place_heads: source rank {p.src_rank} is {src.shape}, not [{n}, {stored.nbytes}]")
        if not (0 <= p.head_lo < p.head_hi <= stored.num_kv_heads
                and 0 <= p.dst_lo <= local.num_kv_heads - (p.head_hi - p.head_lo)):
            raise ValueError(f"place_heads: piece {p} outside {stored.num_kv_heads} stored and "
                             f"{local.num_kv_heads} local heads")
    s_off = d_off = 0
    for ts, td in zip(stored.tensors, local.tensors):
        s_nb = math.prod(ts.shape) * DTYPE_BYTES[ts.dtype]
        d_nb = math.prod(td.shape) * DTYPE_BYTES[td.dtype]
        outer = math.prod(td.shape[:-3])  # dims before the heads (none for vLLM's pages)
        hd, hs = td.shape[-3], ts.shape[-3]
        head = d_nb // (outer * hd)  # bytes of one head's tokens and content
        d = _heads(dst, d_off, outer, hd, head)
        for p in pieces:
            s = _heads(srcs[p.src_rank], s_off, outer, hs, head)
            d[:, :, p.dst_lo:p.dst_lo + p.head_hi - p.head_lo] = s[:, :, p.head_lo:p.head_hi]
        s_off += s_nb
        d_off += d_nb


def _heads(a, off: int, outer: int, heads: int, head: int):
    """The view ``[n, outer, heads, head]`` of the tensor starting at byte ``off`` of each
    row of ``a`` (``[n, bytes]`` uint8, rows contiguous): a view, never a copy."""
    if a.strides[1] != 1:
        raise ValueError(f"place_heads: rows of a {a.shape} buffer with strides {a.strides} are not contiguous")
    return np.lib.stride_tricks.as_strided(a[:, off:], shape=(a.shape[0], outer, heads, head),
                                           strides=(a.strides[0], heads * head, head, 1))


def host_bytes(view):
    """A host cache view as a numpy uint8 array (the last axis in bytes), or None where
    that is not possible (device memory, kernel-block views, a strided last axis)."""
    if not isinstance(view, torch.Tensor) or view.device.type != "cpu":
        return None
    try:
        return view.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None


class PageRuns:
    """Where one group's stored block lies in host caches: per sub-tensor of each layer,
    in the block's byte order, a flat byte memoryview over that cache's storage, the
    bytes from one block's page to the next (the first axis' stride) and the page's
    bytes. :meth:`pages` gives one block's pages, the pieces a
    :class:`~connector.scatter_out.ScatterOut` fills.

    The views point into the caches' storage, which the arrays kept in :attr:`owners`
    hold alive; an engine that reallocates its caches registers them again (new runs)."""

    __slots__ = ("runs", "num_blocks", "owners")

    def __init__(self, runs: list[tuple[memoryview, int, int]], num_blocks: int, owners: list) -> None:
        self.runs = runs
        self.num_blocks = num_blocks
        self.owners = owners  # the cache arrays the views point into, kept alive with them

    @classmethod
    def of(cls, parts, num_blocks: int, nbytes: int) -> "PageRuns | None":
        """``parts``: ``(cache view, byte offset, end)`` of each sub-tensor of every layer
        of a group, in order; ``nbytes``: a stored block's bytes. None unless the parts
        cover ``[0, nbytes)`` back to back and every view is a host cache of at least
        ``num_blocks`` pages, each page one contiguous run of ``end - offset`` bytes."""
        runs, owners, at = [], [], 0
        for view, lo, hi in parts:
            arr = host_bytes(view)
            if arr is None or lo != at or arr.ndim < 1 or arr.shape[0] < num_blocks or num_blocks < 1:
                return None
            page = arr[0]
            if not page.flags.c_contiguous or page.nbytes != hi - lo or arr.strides[0] < hi - lo:
                return None
            span = (num_blocks - 1) * arr.strides[0] + page.nbytes
            flat = memoryview((ctypes.c_char * span).from_address(arr.ctypes.data)).cast("B")
            runs.append((flat, arr.strides[0], page.nbytes))
            owners.append(arr)
            at = hi
        return cls(runs, num_blocks, owners) if runs and at == nbytes else None

    def pages(self, block: int) -> list[memoryview]:
        """Block ``block``'s pages, in the stored block's byte order. Raises IndexError
        for a block outside ``[0, num_blocks)``."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is outside the KV cache's {self.num_blocks} blocks")
        return [flat[block * step:block * step + n] for flat, step, n in self.runs]


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
