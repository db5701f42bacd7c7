"""The master's lean index (master/objects.py), its object-count bound (master.max_objects)
and the segregated-fit allocator, driven without sockets (time is a parameter)."""
import random

import pytest

from kvpool.master.allocator import ALIGN, RangeAllocator, align_up
from kvpool.master.state import MasterSettings, MasterState
from kvpool.protocol import errors as E
from kvpool.protocol.config import MasterConfig, load_config
from kvpool.protocol.errors import ErrorInfo
from kvpool.protocol.messages import ExtentRef, HandoffRecord, NodeDesc, PutItem

MiB = 1 << 20


def make(nodes=2, cap=64 * MiB, **kw):
    st = MasterState(MasterSettings(**kw), seed=1)
    for i in range(nodes):
        st.node_up(NodeDesc(f"n{i}", f"inc{i}", f"tcp://127.0.0.1:{1000 + i}", "", f"unix:///tmp/n{i}", f"h{i}",
                            cap, ucx_addr=f"ucx://10.0.0.{i}:1"), 0.0)
    return st


def put(st, key, size=4096, now=0.0, replicas=0):
    g = st.put_start([PutItem(key, size, 7)], "h0", replicas, now)[0]
    if isinstance(g, ErrorInfo) or g.status != "write":
        return g
    assert st.put_end([key], [g.put_id], now) == [None]
    return g


def check_node_keys(st):
    """Every key with a replica on a node is in exactly one of its lists, and no other."""
    for nid, node in st.nodes.items():
        have = node.all_keys()
        assert len(have) == len(set(have)), nid
        want = {k for d in (st.objects, st.pending) for k, o in d.items() if nid in o.node_ids()}
        assert set(have) == want, nid
        for k in node.lru:
            assert st.objects[k].evictable_kind() == ""
        for k in node.soft_lru:
            assert st.objects[k].evictable_kind() == "soft"


def test_replicas_round_trip_without_tokens_and_rare_fields_leave_no_trace():
    st = make()
    g = put(st, "a", 5000, replicas=2)
    obj = st.objects["a"]
    assert [(r.node_id, r.offset, r.gen, r.size) for r in obj.replicas] == [
        (r.node_id, r.offset, r.gen, r.size) for r in g.replicas]
    assert all(r.token for r in g.replicas) and not any(r.token for r in obj.replicas)
    assert {(r.shm_path, r.ucx_addr, r.incarnation) for r in obj.replicas} == {
        ("unix:///tmp/n0", "ucx://10.0.0.0:1", "inc0"), ("unix:///tmp/n1", "ucx://10.0.0.1:1", "inc1")}
    assert (obj.size, obj.checksum, obj.replicas_wanted, obj.put_id) == (5000, 7, 2, g.put_id)
    assert obj.ext is None  # committed, unpinned, unheld: nothing beyond the record
    st.pin("a", 30.0, 1.0)
    st.handoff_publish(HandoffRecord("r", {"0": ["a"]}, {}, "p", ttl_s=10.0), 1.0)
    assert obj.pin == "soft" and obj.holds == {"r"} and obj.evictable_kind() == "none"
    check_node_keys(st)
    st.handoff_finish("r", "acked")
    st.unpin("a")
    assert obj.ext is None and obj.holds == set() and obj.evictable_kind() == ""
    check_node_keys(st)


def test_layouts_are_shared_between_objects():
    from kvpool.protocol.layout import LayoutSpec, TensorSpec, raw_layout

    st = make()
    for k in ("x", "y"):
        lay = LayoutSpec(kind="full_attention", tokens_per_block=16, tensors=(TensorSpec("k", (16, 8, 16), "float16"),),
                         num_kv_heads=8, head_size=64)
        g = st.put_start([PutItem(k, 4096, 1, raw_layout(lay))], "h0", 1, 0.0)[0]
        st.put_end([k], [g.put_id], 0.0)
    assert st.objects["x"].layout is st.objects["y"].layout


def test_node_key_lists_stay_exact_through_random_operations():
    rnd = random.Random(3)
    st = make(nodes=3, cap=2 * MiB, replicas=2)
    now = 0.0
    for step in range(3000):
        now += 0.01
        k = f"k{rnd.randrange(200)}"
        op = rnd.random()
        if op < 0.35:
            put(st, k, rnd.choice((1000, 4096, 70000)), now)
        elif op < 0.45:
            st.put_start([PutItem(k, 4096, 1)], "h1", 0, now)  # left pending (revoked by tick later)
        elif op < 0.6:
            st.lookup([k], rnd.random() < 0.5, now)
        elif op < 0.7:
            st.remove([k], rnd.random() < 0.5, now)
        elif op < 0.78 and k in st.objects:
            st.pin(k, rnd.choice((None, 5.0)), now)
        elif op < 0.84 and k in st.objects:
            st.unpin(k)
        elif op < 0.9 and k in st.objects:
            st.handoff_publish(HandoffRecord(f"r{step}", {"0": [k]}, {}, "p", ttl_s=3.0), now)
        elif op < 0.93 and k in st.objects:
            r = st.objects[k].replicas[0]
            st.report_corrupt(k, r.node_id, r.gen)
        elif op < 0.94:
            st.node_down("n2", now)
            st.node_up(NodeDesc("n2", f"inc2-{step}", "tcp://127.0.0.1:1002", "", "", "h2", 2 * MiB), now)
        else:
            st.tick(now)
            for key in list(st.repair.in_flight):
                st.repair.done(key, ok=rnd.random() < 0.8)
        st.take_outbox()
        if step % 50 == 0:
            check_node_keys(st)
    check_node_keys(st)


def test_max_objects_evicts_least_recently_used_across_nodes():
    st = make(max_objects=4)
    for i, k in enumerate("abcd"):
        put(st, k, now=float(i))
    st.lookup(["a"], False, 10.0)  # a is the most recently used now
    put(st, "e", now=11.0)
    assert sorted(st.objects) == ["a", "c", "d", "e"]  # b went: least recently used, on whichever node
    assert st.counters["evictions_max_objects"] == 1
    st.lookup(["c"], True, 12.0)  # leased: skipped, d goes instead
    put(st, "f", now=12.5)
    assert sorted(st.objects) == ["a", "c", "e", "f"]
    check_node_keys(st)


def test_max_objects_refuses_with_no_space_when_nothing_can_be_evicted():
    st = make(max_objects=2)
    put(st, "a")
    st.pin("a", None, 0.0)
    g = st.put_start([PutItem("b", 4096, 1)], "h0", 1, 0.0)[0]  # pending: counted, never evicted
    err = put(st, "c")
    assert isinstance(err, ErrorInfo) and err.code == "no_space", err
    assert "master.max_objects = 2" in err.message and err.fields["key"] == "c"
    assert sorted(st.objects) == ["a"] and sorted(st.pending) == ["b"]  # nothing lost
    st.put_end(["b"], [g.put_id], 0.0)
    st.unpin("a")  # back in the LRU, at its hot end
    assert put(st, "c", now=1.0).status == "write" and sorted(st.objects) == ["a", "c"]


def test_max_objects_config_key():
    cfg = load_config(None, overrides={"master": {"max_objects": 1000}}, environ={})
    assert cfg.master.max_objects == 1000
    assert MasterConfig().max_objects > 0  # bounded by default
    with pytest.raises(E.ConfigError, match="max_objects"):
        MasterConfig(max_objects=-1).check_repair()


# ---- allocator ----------------------------------------------------------------------------


def test_allocator_matches_a_brute_force_model_and_never_misses_a_fit():
    rnd = random.Random(7)
    cap = 1 << 18
    a = RangeAllocator(cap)
    used = bytearray(cap // ALIGN)  # one flag per ALIGN block
    live = {}
    for _ in range(3000):
        if live and rnd.random() < 0.45:
            off = rnd.choice(list(live))
            size = live.pop(off)
            a.free(off, size)
            used[off // ALIGN:(off + align_up(size)) // ALIGN] = bytes(align_up(size) // ALIGN)
            continue
        size = rnd.choice((64, 100, 4096, 8192, 9000, 20000))
        blocks = align_up(size) // ALIGN
        run = best = 0
        for f in used:  # the longest free run, brute force
            run = 0 if f else run + 1
            best = max(best, run)
        assert a.largest_free() == best * ALIGN
        assert a.fits(size) == (best >= blocks)
        off = a.alloc(size)
        assert (off is not None) == (best >= blocks), (size, best)
        if off is not None:
            assert off % ALIGN == 0 and not any(used[off // ALIGN:off // ALIGN + blocks])
            used[off // ALIGN:off // ALIGN + blocks] = b"\1" * blocks
            live[off] = size
        assert a.used == sum(align_up(s) for s in live.values())
    for off, size in live.items():
        a.free(off, size)
    assert a.used == 0 and a.free_ranges == 1 and a.largest_free() == cap


def test_small_holes_are_reused_before_large_ranges_are_split():
    a = RangeAllocator(1 << 20)
    offs = [a.alloc(4096) for _ in range(64)]
    for o in offs[::2]:
        a.free(o, 4096)  # 32 holes of 4 KiB, then the 768 KiB tail
    got = sorted(a.alloc(4096) for _ in range(32))
    assert got == sorted(offs[::2]) and a.largest_free() == (1 << 20) - 64 * 4096


def test_reserve_in_any_order_and_refuses_overlaps():
    a = RangeAllocator(1 << 16)
    spots = [(i * 1024, 1000) for i in range(64)]
    random.Random(2).shuffle(spots)
    for off, size in spots:
        a.reserve(off, size)
    assert a.used == 64 * 1024 and a.alloc(1) is None
    with pytest.raises(ValueError):
        a.reserve(2048, 64)
    a.free(2048, 1000)
    a.reserve(2048, 64)
    assert a.used == 63 * 1024 + 64


def test_refs_compare_equal_after_packing():
    st = make(nodes=1)
    g = put(st, "k", 123)
    r = st.objects["k"].replicas[0]
    assert isinstance(r, ExtentRef) and r == ExtentRef(
        g.replicas[0].node_id, g.replicas[0].incarnation, g.replicas[0].data_addr, g.replicas[0].shm_path,
        g.replicas[0].host_id, g.replicas[0].offset, 123, g.replicas[0].gen, b"", g.replicas[0].ucx_addr)
