"""Read leases handed from one lookup to another reader (connector/read_leases.py): the
vLLM scheduler's lookup leases the blocks, the worker reads them without a lookup of its
own and releases them. Real master, store node and clients over real sockets; the leases
last 300 s, so a lease seen gone was released, not lapsed."""
import os
import time

import pytest

from kvpool.connector.client import LEASE_MARGIN
from kvpool.connector.read_leases import ReadLeases, boot_id
from kvpool.protocol import messages as M
from kvpool.protocol.errors import ChecksumMismatch
from tests.conftest import wait_for

KiB = 1 << 10


@pytest.fixture
def long_leases(make_cluster):
    return make_cluster(nodes=1, memory="64MiB", lease_ttl="300s")


def _hits(c) -> int:
    return c.stats().counters.get("hits", 0)


def _leased(c, prefix: str) -> dict[str, bool]:
    return {m.key: m.leased for m in c.ls(prefix)}


def test_a_reader_reads_under_another_clients_leases_and_releases_them(long_leases):
    keys = [f"rl/{i}" for i in range(8)]
    blobs = [os.urandom(16 * KiB) for _ in keys]
    with long_leases.client() as sched, long_leases.client() as worker:
        assert sched.put_batch(keys, blobs) == [None] * 8
        leases = sched.lookup_leased(keys[:6] + ["rl/missing"])
        assert sorted(leases.infos) == sorted(keys[:6]) and leases.boot == boot_id()
        assert [v for k, v in sorted(_leased(sched, "rl/").items())] == [True] * 6 + [False] * 2
        before = _hits(sched)
        outs = [bytearray(16 * KiB) for _ in keys]
        assert worker.get_into_batch(keys, outs, None, leases) == [16 * KiB] * 8
        assert [bytes(o) for o in outs] == blobs
        assert not leases.infos  # each answer used once
        assert _hits(sched) == before + 2  # only the two keys without a lease were looked up
        wait_for(lambda: not any(_leased(sched, "rl/").values()), 30, what="every lease released")


def test_lookup_leases_that_cannot_be_used_are_neither_used_nor_released(long_leases):
    """Answers from another host's clock, or older than LEASE_MARGIN of the TTL, are not
    read under: the reader looks the keys up itself and leaves the handed-over leases
    alone (releasing a lapsed lease could end another reader's)."""
    keys = [f"rs/{i}" for i in range(4)]
    blobs = [os.urandom(8 * KiB) for _ in keys]
    with long_leases.client() as sched, long_leases.client() as worker:
        assert sched.put_batch(keys, blobs) == [None] * 4
        fresh = sched.lookup_leased(keys)
        foreign = ReadLeases(dict(fresh.infos), fresh.sent_at, "another-host", fresh.ttl)
        stale = ReadLeases(dict(fresh.infos), time.monotonic() - 1000, fresh.boot, fresh.ttl)
        assert fresh.usable(time.monotonic(), LEASE_MARGIN) and fresh.ttl == 300
        for handed in (foreign, stale):
            assert not handed.usable(time.monotonic(), LEASE_MARGIN)
            before = _hits(sched)
            outs = [bytearray(8 * KiB) for _ in keys]
            assert worker.get_into_batch(keys, outs, None, handed) == [8 * KiB] * 4
            assert [bytes(o) for o in outs] == blobs and len(handed.infos) == 4
            assert _hits(sched) == before + 4
        time.sleep(0.5)  # the worker's own releases have landed (one-way messages)
        assert all(_leased(sched, "rs/").values())  # the scheduler's leases: still held
        sched.release_leases(keys)
        wait_for(lambda: not any(_leased(sched, "rs/").values()), 30, what="the scheduler's leases released")


def test_an_object_force_removed_under_a_handed_over_lease_is_never_served_wrong(long_leases):
    """``rm --force`` ends a lease: the extent may hold another object by the time the
    reader reads under the handed-over answer. The reader gets the removed object's own
    bytes (read before its extent was reused) or a miss: None, or the ChecksumMismatch that
    names why (the checksum failed, the lookup again found nothing; connector/client.py
    ``_missing``), never the new object's bytes."""
    with long_leases.client() as sched, long_leases.client() as worker:
        for rnd in range(4):
            old, new = bytes([rnd]) * 4096, bytes([rnd + 100]) * 4096
            assert sched.put(f"rr/a{rnd}", old)
            leases = sched.lookup_leased([f"rr/a{rnd}"])
            sched.remove(f"rr/a{rnd}", force=True)
            assert sched.put(f"rr/b{rnd}", new)  # same size: likely the freed extent
            out = bytearray(4096)
            got = worker.get_into_batch([f"rr/a{rnd}"], [out], None, leases)
            missed = got == [None] or isinstance(got[0], ChecksumMismatch)
            assert missed or got == [4096] and bytes(out) == old, got


# ---- pure state --------------------------------------------------------------------------

def _info(key: str, ttl: float = 5.0) -> M.ObjectInfo:
    return M.ObjectInfo(key, 1, 0, M.NO_LAYOUT, [], ttl)


def _leases(keys: str, sent_at: float, ttl: float = 5.0, boot: str | None = None) -> ReadLeases:
    r = ReadLeases.of([_info(k, ttl) for k in keys] + [M.ErrorInfo("NotFound", "gone", {})], sent_at)
    if boot is not None:
        r.boot = boot
    return r


def test_read_leases_keep_take_merge_usable():
    a = _leases("abc", 100.0)
    assert a.boot == boot_id() and a.ttl == 5.0 and sorted(a.infos) == ["a", "b", "c"]  # the miss is absent
    assert a.keep({"a", "b", "z"}) == ["c"] and sorted(a.infos) == ["a", "b"]
    assert a.take("a").key == "a" and a.take("a") is None
    b = _leases("d", 90.0, ttl=2.0)
    assert a.merge(b) == []
    assert sorted(a.infos) == ["b", "d"] and (a.sent_at, a.ttl) == (90.0, 2.0)  # the earliest, the shortest
    assert a.until(0.9) == 90.0 + 2.0 * 0.9
    assert a.usable(a.until(0.9) - 0.01, 0.9) and not a.usable(a.until(0.9), 0.9)
    a.merge(_leases("e", 10.0, boot="another-host"))
    assert "e" not in a.infos and a.sent_at == 90.0  # another clock: not comparable, not taken
    assert not _leases("f", 0.0, boot="another-host").usable(0.0, 0.9)
    empty = ReadLeases()
    assert not empty.usable(0.0, 0.9)
    empty.merge(b)
    assert (empty.sent_at, empty.ttl) == (90.0, 2.0) and sorted(empty.infos) == ["d"]
    assert empty.merge(_leases("df", 95.0)) == ["d"]  # a second lease on d
    assert sorted(empty.infos) == ["d", "f"] and empty.sent_at == 90.0
    assert not _leases("x", 0.0, ttl=0.0).usable(0.0, 0.9)  # no lease granted
