"""First-fit range allocator for one store node's segment (pure, no I/O).

Free space is a list of ``(offset, size)`` ranges kept sorted by offset and coalesced on
free. Offsets are aligned to ``ALIGN`` bytes (64: one cache line). Allocation cost is
linear in the number of free ranges, which coalescing keeps small for cache workloads.
"""
from __future__ import annotations

import bisect

ALIGN = 64


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RangeAllocator:
    """Allocate and free byte ranges of a segment of ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._offs: list[int] = [0] if capacity else []
        self._sizes: list[int] = [capacity] if capacity else []
        self.used = 0

    def alloc(self, size: int) -> int | None:
        """Return the offset of a free range of ``size`` bytes (rounded up), or None."""
        need = align_up(max(size, 1))
        for i, free in enumerate(self._sizes):
            if free >= need:
                off = self._offs[i]
                if free == need:
                    del self._offs[i], self._sizes[i]
                else:
                    self._offs[i] = off + need
                    self._sizes[i] = free - need
                self.used += need
                return off
        return None

    def free(self, offset: int, size: int) -> None:
        """Return ``[offset, offset+size)`` (size as passed to alloc) to the free list."""
        size = align_up(max(size, 1))
        i = bisect.bisect_left(self._offs, offset)
        if i < len(self._offs) and self._offs[i] < offset + size or i > 0 and \
                self._offs[i - 1] + self._sizes[i - 1] > offset:
            raise ValueError(f"double free of range at {offset}")
        self.used -= size
        # coalesce with the right neighbour, then the left
        if i < len(self._offs) and self._offs[i] == offset + size:
            size += self._sizes[i]
            del self._offs[i], self._sizes[i]
        if i > 0 and self._offs[i - 1] + self._sizes[i - 1] == offset:
            self._sizes[i - 1] += size
            return
        self._offs.insert(i, offset)
        self._sizes.insert(i, size)

    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    @property
    def free_ranges(self) -> int:
        return len(self._offs)

    def reserve(self, offset: int, size: int) -> None:
        """Mark ``[offset, offset+size)`` used (index rebuild after failover).
        Raises ValueError when the range is not wholly free."""
        size = align_up(max(size, 1))
        i = bisect.bisect_right(self._offs, offset) - 1
        if i < 0 or offset + size > self._offs[i] + self._sizes[i]:
            raise ValueError(f"range at {offset} (+{size}) is not free")
        o, s = self._offs[i], self._sizes[i]
        del self._offs[i], self._sizes[i]
        for po, ps in ((offset + size, o + s - offset - size), (o, offset - o)):
            if ps > 0:
                self._offs.insert(i, po)
                self._sizes.insert(i, ps)
        self.used += size
