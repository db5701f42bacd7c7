import random

import pytest

from kvpool.master.allocator import ALIGN, RangeAllocator


def test_alloc_free_coalesce():
    a = RangeAllocator(1024)
    offs = [a.alloc(100) for _ in range(8)]
    assert offs == [i * 128 for i in range(8)] and a.used == 1024
    assert a.alloc(1) is None
    for o in offs[::2]:
        a.free(o, 100)
    assert a.free_ranges == 4 and a.largest_free() == 128
    for o in offs[1::2]:
        a.free(o, 100)
    assert a.free_ranges == 1 and a.used == 0 and a.largest_free() == 1024
    with pytest.raises(ValueError, match="double free"):
        a.free(0, 64)


def test_random_workload_conserves_bytes():
    rnd = random.Random(1)
    a = RangeAllocator(1 << 20)
    live = {}
    for _ in range(5000):
        if live and rnd.random() < 0.5:
            off, size = live.popitem()
            a.free(off, size)
        else:
            size = rnd.randint(1, 8192)
            off = a.alloc(size)
            if off is not None:
                assert off % ALIGN == 0
                live[off] = size
    spans = sorted((o, o + ((s + ALIGN - 1) // ALIGN) * ALIGN) for o, s in live.items())
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))  # no overlap
    for off, size in live.items():
        a.free(off, size)
    assert a.used == 0 and a.free_ranges == 1


def test_reserve():
    a = RangeAllocator(4096)
    a.reserve(1024, 100)
    a.reserve(0, 64)
    assert a.used == 192
    assert a.alloc(64) == 64
    with pytest.raises(ValueError):
        a.reserve(1024, 10)
