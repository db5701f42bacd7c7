"""Buffers of ``kvpool bench``: page-aligned, rotating over more memory than the L3 cache.

Every buffer of the bench and of its ceilings comes from here, so every system and every
ceiling moves bytes between buffers of the same kind.
"""
from __future__ import annotations

POOL_BYTES = 64 << 20  # rotate sources/destinations over this much memory (> L3)


def aligned(n: int):
    """A page-aligned numpy uint8 array of ``n`` bytes.

    Page alignment matters on x86: a copy (user-space ``memcpy`` or the kernel's copy into a
    ``recv_into`` buffer) whose destination lies 1–63 bytes past its source modulo 4 KiB runs
    several times slower (4K aliasing; benchmarks/RESULTS.md, "Measurements behind choices
    in the code"), and numpy's own allocations sit at page offset 16."""
    import numpy as np

    raw = np.empty(n + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + n]


def pool_slots(size: int, count: int) -> int:
    """How many ``size``-byte buffers a rotating pool holds: enough for POOL_BYTES (more
    than the L3 cache), at most ``count`` (the objects moved)."""
    return max(1, min(count, -(-POOL_BYTES // max(size, 1))))


def slot_views(buf, size: int, slots: int) -> list[memoryview]:
    """The first ``slots`` consecutive ``size``-byte views of ``buf``."""
    mv = memoryview(buf)
    return [mv[i * size:(i + 1) * size] for i in range(slots)]
