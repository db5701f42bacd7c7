"""Extents reserved ahead of need: the master's bookkeeping and the writer's pool, without
sockets (time is a parameter). The puts through them, over real processes, are in
tests/test_reserved_puts.py."""
import itertools

import pytest

from kvpool.connector.reservations import MIN_DEPTH, ReservationPool, Slot
from kvpool.master.reservations import MAX_PER_CALL
from kvpool.master.state import MasterSettings, MasterState
from kvpool.protocol import errors as E
from kvpool.protocol.errors import ErrorInfo
from kvpool.protocol.grants import check_token
from kvpool.protocol.messages import NodeCommit, NodeDesc, NodeFree, PutItem, Reservation, ReservedPut

MiB = 1 << 20
KEYS = {f"n{i}": bytes([i + 1]) * 32 for i in range(3)}


def make(nodes=2, cap=10 * MiB, **kw):
    st = MasterState(MasterSettings(**kw))
    for i in range(nodes):
        st.node_up(NodeDesc(f"n{i}", f"inc{i}", f"tcp://127.0.0.1:{1000 + i}", "", "", f"h{i}", cap,
                            grant_key=KEYS[f"n{i}"]), 0.0)
    return st


def test_reserve_places_keyless_grants_and_commit_indexes_the_object():
    st = make()
    got = st.reservations.reserve(MiB, 3, "h0", 0, now=0.0)
    assert len(got.reservations) == 3 and got.ttl_s == st.s.put_timeout_s and got.error is None
    r = got.reservations[0].replicas[0]
    assert r.host_id == "h0"  # the writer's host first, as for a put
    assert check_token(KEYS[r.node_id], r.incarnation, r.offset, r.size, r.gen, "", r.token)  # names no key
    assert st.nodes["n0"].alloc.used == 3 * MiB  # reserved bytes are used memory
    res, toks = st.reservations.put([ReservedPut("a", got.reservations[0].res_id, MiB, 77)], 0.1)
    assert res == [None] and len(toks[0]) == 1
    assert check_token(KEYS[r.node_id], r.incarnation, r.offset, r.size, r.gen, "a", toks[0][0])  # keyed now
    info = st.lookup(["a"], True, 0.2)[0]
    assert info.checksum == 77 and info.replicas[0].offset == r.offset
    out = st.take_outbox()
    assert any(isinstance(m, NodeCommit) and m.rows[0].key == "a" for m in out["n0"])
    assert len(st.reservations.held) == 2 and st.counters["puts_reserved"] == 1


def test_commit_repeat_is_idempotent_and_an_unknown_reservation_is_revoked():
    st = make()
    rid = st.reservations.reserve(MiB, 1, "h0", 0, 0.0).reservations[0].res_id
    first = st.reservations.put([ReservedPut("a", rid, MiB, 5)], 0.1)
    assert first[0] == [None]
    assert st.reservations.put([ReservedPut("a", rid, MiB, 5)], 0.2) == first  # the reply was lost: same answer
    res, toks = st.reservations.put([ReservedPut("b", rid, MiB, 5), ReservedPut("c", 12345, MiB, 5)], 0.3)
    assert [e.code for e in res] == ["put_revoked", "put_revoked"] and toks == [[], []]


def test_existing_key_keeps_the_reservation_and_a_wrong_size_is_refused():
    st = make()
    rid = st.reservations.reserve(MiB, 1, "h0", 0, 0.0).reservations[0].res_id
    g = st.put_start([PutItem("a", MiB, 1)], "h0", 0, 0.0)[0]
    assert st.reservations.put([ReservedPut("a", rid, MiB, 5)], 0.1)[0] == ["in_flight"]
    st.put_end(["a"], [g.put_id], 0.1)
    assert st.reservations.put([ReservedPut("a", rid, MiB, 5)], 0.2)[0] == ["exists"]
    res = st.reservations.put([ReservedPut("b", rid, MiB - 1, 5)], 0.3)[0]
    assert res[0].code == "invalid_request"
    assert rid in st.reservations.held  # still the writer's: the next object goes there
    assert st.reservations.put([ReservedPut("b", rid, MiB, 5)], 0.4)[0] == [None]


def test_expired_or_given_back_reservations_are_freed_after_quarantine():
    st = make(nodes=1, put_timeout_s=1.0, quarantine_s=2.0)
    got = st.reservations.reserve(MiB, 2, "h0", 0, 0.0)
    a, b = (r.res_id for r in got.reservations)
    st.reservations.release([a, 999], 0.5)  # an unknown id is ignored
    st.tick(1.5)  # b expired
    assert not st.reservations.held
    frees = [m for m in st.take_outbox()["n0"] if isinstance(m, NodeFree)]
    assert len(frees) == 2  # the node raises the floor: a late write of either is refused
    assert st.nodes["n0"].alloc.used == 2 * MiB  # quarantined: its writer may still be copying
    st.tick(4.0)
    assert st.nodes["n0"].alloc.used == 0
    assert st.reservations.put([ReservedPut("x", b, MiB, 1)], 4.0)[0][0].code == "put_revoked"


def test_node_death_drops_its_reservations():
    st = make(nodes=2)
    got = st.reservations.reserve(MiB, 4, "h0", 2, 0.0)
    assert all(len(r.replicas) == 2 for r in got.reservations)
    st.node_down("n1", 1.0)
    assert not st.reservations.held
    assert st.nodes["n0"].alloc.used == 4 * MiB  # the surviving replicas' extents: quarantined, then free
    st.tick(100.0)
    assert st.nodes["n0"].alloc.used == 0


def test_reservations_ahead_take_only_free_memory_under_the_high_watermark():
    st = make(nodes=1, cap=32 * MiB, high_watermark=0.25)
    for i in range(7):
        put_id = st.put_start([PutItem(f"d{i}", MiB, 1)], "h0", 0, 0.0)[0].put_id
        st.put_end([f"d{i}"], [put_id], 0.0)
    got = st.reservations.reserve(MiB, 0, "h0", 0, 0.0, ahead=5)
    assert len(got.reservations) == 1 and len(st.objects) == 7  # 8 MiB = the watermark; nothing evicted
    got = st.reservations.reserve(MiB, 2, "h0", 0, 0.0, ahead=3)
    assert len(got.reservations) == 2  # needed now: placed as a put (may evict); none ahead past the mark
    st = make(nodes=1, cap=32 * MiB)
    assert len(st.reservations.reserve(MiB, 0, "h0", 0, 0.0, ahead=5).reservations) == 2  # 1/16 of the segment
    assert st.stats().nodes[0].reserved == 2 * MiB == st.stats().reserved_bytes


def test_reserve_bounds_and_partial_grants():
    st = make(nodes=1, cap=4 * MiB)
    with pytest.raises(E.InvalidRequest):
        st.reservations.reserve(0, 1, "h0", 0, 0.0)
    with pytest.raises(E.InvalidRequest):
        st.reservations.reserve(1, MAX_PER_CALL + 1, "h0", 0, 0.0)
    with pytest.raises(E.InvalidRequest):
        st.reservations.reserve(64 * MiB, 32, "h0", 0, 0.0)  # over the bytes one call may ask for
    got = st.reservations.reserve(MiB, 10, "h0", 0, 0.0)
    assert len(got.reservations) == 4  # what fits; the writer puts the rest the long way
    none = st.reservations.reserve(MiB, 1, "h0", 0, 0.0)
    assert none.reservations == [] and none.error.code == "no_space"
    assert st.reservations.reserve(8 * MiB, 1, "h0", 0, 0.0).error.code == "object_too_large"


def test_max_objects_bound_applies_to_reserved_puts():
    st = make(nodes=1, max_objects=1)
    rids = [r.res_id for r in st.reservations.reserve(MiB, 2, "h0", 0, 0.0).reservations]
    assert st.reservations.put([ReservedPut("a", rids[0], MiB, 1)], 0.0)[0] == [None]
    st.lookup(["a"], True, 0.0)  # leased: cannot be evicted
    res = st.reservations.put([ReservedPut("b", rids[1], MiB, 1)], 0.1)[0]
    assert isinstance(res[0], ErrorInfo) and res[0].code == "no_space" and rids[1] in st.reservations.held
    assert st.reservations.put([ReservedPut("b", rids[1], MiB, 1)], 10.0)[0] == [None]  # lease over: a is evicted
    assert "a" not in st.objects


# ---- the writer's pool ------------------------------------------------------------------

def _slots(n, size=MiB, term=1, use_by=10.0):
    return [Slot(Reservation(i, []), size, 0, 1, term, use_by) for i in range(n)]


def test_pool_takes_fresh_slots_and_sets_expired_or_stale_ones_aside():
    pool = ReservationPool(64 * MiB)
    pool.take(MiB, 0, 1, 0.0, 1)  # the size is known from now on
    pool.add(_slots(2, use_by=1.0) + _slots(2, term=0) + _slots(3))
    got = pool.take(MiB, 0, 3, now=2.0, term=1)
    assert len(got) == 3 and all(s.term == 1 and s.use_by == 10.0 for s in got)
    assert len(pool.take_dead()) == 4  # expired (2) and of a deposed leader's term (2)
    pool.give_back(got[:1])
    assert pool.held() == 1
    assert len(pool.take_dead(now=11.0)) == 1 and pool.held() == 0


def test_pool_depth_follows_batches_within_the_budget():
    pool = ReservationPool(64 * MiB)
    assert pool.take(64 << 10, 0, 1, 0.0, 1) == []
    assert pool.target(64 << 10, 0) == 0  # a size put once: nothing held ahead
    pool.take(64 << 10, 0, 1, 0.0, 1)
    assert pool.target(64 << 10, 0) == MIN_DEPTH
    assert pool.refill(64 << 10, 0) == MIN_DEPTH  # nothing held: ask for the target
    pool.take(64 << 10, 0, 100, 0.0, 1)
    assert pool.target(64 << 10, 0) == 300  # three batches
    pool.take(4 * MiB, 0, 1, 0.0, 1), pool.take(4 * MiB, 0, 1, 0.0, 1)
    assert pool.target(4 * MiB, 0) == 16  # 64 MiB of 4 MiB objects
    pool.add([Slot(Reservation(i, []), 64 << 10, 0, 1, 1, 10.0) for i in range(150)])
    assert pool.refill(64 << 10, 0) == 0  # covers the next batch: nothing to ask for yet
    assert len(pool.drain()) == 150 and pool.held() == 0


def test_reservations_ahead_spread_over_the_writers_nodes_in_turn():
    st = MasterState(MasterSettings())
    for i in range(2):  # both on the writer's host
        st.node_up(NodeDesc(f"n{i}", f"inc{i}", f"tcp://127.0.0.1:{1000 + i}", "", "", "h0", 64 * MiB,
                            grant_key=KEYS[f"n{i}"]), 0.0)
    got = st.reservations.reserve(64 << 10, 0, "h0", 0, 0.0, ahead=8)
    nodes = [r.replicas[0].node_id for r in got.reservations]
    assert len(nodes) == 8 and all(a != b for a, b in zip(nodes, nodes[1:]))  # consecutive puts alternate
    offs = sorted(r.replicas[0].offset for r in got.reservations if r.replicas[0].node_id == "n0")
    assert offs == [offs[0] + i * (64 << 10) for i in range(4)]  # one range per node, cut into extents
    for r in got.reservations:  # each extent is freed on its own
        st.reservations.release([r.res_id], 0.0)
    st.tick(100.0)
    assert all(n.alloc.used == 0 and n.reserved == 0 for n in st.nodes.values())


def test_reservations_ahead_follow_each_nodes_room_not_an_even_split():
    """An empty node beside two half-full ones takes the largest share of the extents
    reserved ahead, but not all, as a put's placement would (master/placement.py)."""
    st = MasterState(MasterSettings(high_watermark=0.9))
    for i in range(3):
        st.node_up(NodeDesc(f"n{i}", f"inc{i}", f"tcp://127.0.0.1:{1000 + i}", "", "", "h0", 64 * MiB,
                            grant_key=KEYS[f"n{i}"]), 0.0)
    for i in (0, 1):
        assert st.nodes[f"n{i}"].alloc.alloc(32 * MiB) is not None  # half full
    got = st.reservations.reserve(64 << 10, 0, "h0", 0, 0.0, ahead=60)
    per = [r.replicas[0].node_id for r in got.reservations]
    share = {n: per.count(n) for n in ("n0", "n1", "n2")}
    assert len(per) == 60 and share["n0"] + share["n1"] + share["n2"] == 60
    assert share["n2"] == 32 and share["n0"] == share["n1"] == 14, share  # rooms 25.6 : 25.6 : 57.6 MiB
    assert max(len(list(g)) for _, g in itertools.groupby(per)) <= 3  # interleaved, not one run per node


def test_batched_data_frames_split_under_the_header_limit():
    import msgspec

    from kvpool.protocol.dataplane import MAX_HEADER, DataRequest, HeldExtent, batch_frames

    items = [HeldExtent(i * 4096, 4096, i + 1, bytes(16), f"k/{i:0200d}", i, b"\x01" * 100, 1) for i in range(1500)]
    frames = batch_frames("commits", "inc", items)
    assert len(frames) > 1 and all(len(f) - 4 <= MAX_HEADER for f in frames)
    back = [it for f in frames for it in msgspec.msgpack.decode(f[4:], type=DataRequest).items]
    assert back == items
    with pytest.raises(E.InvalidRequest):
        batch_frames("commits", "inc", [HeldExtent(0, 1, 1, b"", "k" * (MAX_HEADER + 1))])


def test_slots_are_claimed_a_little_ahead_and_pending_ones_are_not_handed_out():
    pool = ReservationPool(64 * MiB)
    pool.take(MiB, 0, 1, 0.0, 1)
    pool.add(_slots(5))
    ahead = pool.claim_ahead(MiB, 0, 3)
    assert len(ahead) == 3 and all(s.pending for s in ahead)
    got = pool.take(MiB, 0, 5, 0.0, 1)  # another thread: the pending ones are skipped, not lost
    assert [s.res.res_id for s in got] == [3, 4]
    pool.claimed(ahead[:2], ahead[2:])  # the third was refused: it leaves the pool
    again = pool.take(MiB, 0, 5, 0.0, 1)
    assert [s.res.res_id for s in again] == [0, 1] and all(s.claimed and not s.pending for s in again)
