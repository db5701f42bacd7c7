"""Segregated-fit range allocator for one store node's segment (pure, no I/O).

Free space is a set of ``(offset, size)`` ranges, coalesced with both neighbours on free.
Each free range sits in a size bin: exact bins for ranges under 4 KiB (one per
``ALIGN`` step), then eight bins per doubling, and a bitmap of the bins that hold a range.
An allocation takes a range from the smallest bin whose every range fits (best fit to
within one eighth), splitting it at its start, so small objects reuse the holes small
objects left and large free ranges stay whole. Allocation and free cost O(1) in the
number of free ranges (a bitmap search and a few dict operations); random removals of
many small objects therefore leave put latency flat. Offsets are aligned to ``ALIGN``
bytes (64: one cache line). The allocator keeps nothing per allocated extent: its memory
grows with the number of free ranges only.
"""
from __future__ import annotations

ALIGN = 64
_EXACT = 64  # ranges under _EXACT * ALIGN bytes have one bin per ALIGN step
_SUB = 3  # 2**_SUB bins per doubling above that


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _bin(size: int) -> int:
    """The bin of a free range of ``size`` bytes (a multiple of ALIGN, > 0)."""
    u = size // ALIGN
    if u < _EXACT:
        return u
    e = u.bit_length() - 1
    return _EXACT + ((e - 6) << _SUB) + ((u >> (e - _SUB)) & ((1 << _SUB) - 1))


def _low(b: int) -> int:
    """The smallest size (bytes) in bin ``b``."""
    if b < _EXACT:
        return b * ALIGN
    e, sub = divmod(b - _EXACT, 1 << _SUB)
    e += 6
    return ((1 << e) + (sub << (e - _SUB))) * ALIGN


class RangeAllocator:
    """Allocate and free byte ranges of a segment of ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._by_off: dict[int, int] = {}  # free range start -> size (bytes)
        self._by_end: dict[int, int] = {}  # free range end -> start
        self._bins: dict[int, set[int]] = {}  # bin -> starts of its free ranges
        self._mask = 0  # bit b set: bin b holds a range
        self._hint = -1  # start of the range the last reserve left after it (rebuilds go in order)
        if capacity:
            self._add(0, capacity)

    # ---- free-range bookkeeping ---------------------------------------------------------

    def _add(self, off: int, size: int) -> None:
        self._by_off[off] = size
        self._by_end[off + size] = off
        b = _bin(size)
        s = self._bins.get(b)
        if s is None:
            s = self._bins[b] = set()
            self._mask |= 1 << b
        s.add(off)

    def _take(self, off: int) -> int:
        """Remove the free range starting at ``off``; returns its size."""
        size = self._by_off.pop(off)
        del self._by_end[off + size]
        b = _bin(size)
        s = self._bins[b]
        s.discard(off)
        if not s:
            del self._bins[b]
            self._mask &= ~(1 << b)
        return size

    def _find(self, need: int) -> int | None:
        """Start of a free range of at least ``need`` bytes (aligned), or None."""
        b = _bin(need)
        start = b if _low(b) >= need else b + 1
        m = self._mask >> start
        if m:
            return next(iter(self._bins[start + (m & -m).bit_length() - 1]))
        if start != b and b in self._bins:  # only ranges in need's own bin are left: any big enough?
            for off in self._bins[b]:
                if self._by_off[off] >= need:
                    return off
        return None

    # ---- public -------------------------------------------------------------------------

    def alloc(self, size: int) -> int | None:
        """Return the offset of a free range of ``size`` bytes (rounded up), or None."""
        need = align_up(max(size, 1))
        off = self._find(need)
        if off is None:
            return None
        free = self._take(off)
        if free > need:
            self._add(off + need, free - need)
        self.used += need
        return off

    def fits(self, size: int) -> bool:
        """True when :meth:`alloc` of ``size`` bytes would succeed now."""
        return self._find(align_up(max(size, 1))) is not None

    def free(self, offset: int, size: int) -> None:
        """Return ``[offset, offset+size)`` (size as passed to alloc) to the free list.
        Raises ValueError ("double free") when the range starts or ends a free range, or
        lies inside one next to it."""
        size = align_up(max(size, 1))
        end = offset + size
        if offset in self._by_off or end in self._by_end or end > self.capacity or offset < 0:
            raise ValueError(f"double free of range at {offset}")
        left = self._by_end.get(offset)
        if end in self._by_off:  # coalesce with the right neighbour ...
            end += self._take(end)
        if left is not None:  # ... and the left one
            self._take(left)
            offset = left
        self.used -= size
        self._add(offset, end - offset)

    def largest_free(self) -> int:
        """Bytes of the largest free range (0 when none)."""
        if not self._mask:
            return 0
        return max(self._by_off[o] for o in self._bins[self._mask.bit_length() - 1])

    @property
    def free_ranges(self) -> int:
        return len(self._by_off)

    def reserve(self, offset: int, size: int) -> None:
        """Mark ``[offset, offset+size)`` used (index rebuild after failover). Cost: O(1)
        when extents come in offset order, else a scan of the free ranges. Raises
        ValueError when the range is not wholly free."""
        size = align_up(max(size, 1))
        o = self._hint
        s = self._by_off.get(o, 0)
        if not o <= offset < o + s:
            o = next((o for o, s in self._by_off.items() if o <= offset < o + s), -1)
            s = self._by_off.get(o, 0)
        if o < 0 or offset + size > o + s:
            raise ValueError(f"range at {offset} (+{size}) is not free")
        self._take(o)
        if offset > o:
            self._add(o, offset - o)
        tail = o + s - offset - size
        self._hint = -1
        if tail > 0:
            self._add(offset + size, tail)
            self._hint = offset + size
        self.used += size
