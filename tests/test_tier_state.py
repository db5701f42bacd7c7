"""The master's disk-tier decisions (master/tiers.py), driven without sockets: demotion,
its confirmation and abort, promotion, disk eviction, pins and holds across tiers,
restore from a node's table, and a node's death with moves in flight."""
from kvpool.master.state import MasterSettings, MasterState
from kvpool.master.tiers import DEMOTE_IN_FLIGHT
from kvpool.protocol.errors import ErrorInfo
from kvpool.protocol.messages import (DISK, MEMORY, HandoffRecord, NodeDemote, NodeDesc, NodeDiskFree, NodeFree,
                                      NodePromote, PutItem, TierDone)

MiB = 1 << 20


def make(nodes=1, cap=10 * MiB, disk=100 * MiB, **kw):
    st = MasterState(MasterSettings(**kw))
    for i in range(nodes):
        st.node_up(desc(i, cap, disk), 0.0)
    return st


def desc(i, cap=10 * MiB, disk=100 * MiB, inc=None):
    return NodeDesc(f"n{i}", inc or f"inc{i}", f"tcp://127.0.0.1:{1000 + i}", "", f"unix:///n{i}.sock", f"h{i}",
                    cap, disk_capacity=disk, disk_high_watermark=0.9, disk_low_watermark=0.8,
                    disk_addr=f"tcp://127.0.0.1:{2000 + i}", disk_path=f"unix:///n{i}.disk.sock")


def put(st, key, size=MiB, now=0.0, replicas=0):
    g = st.put_start([PutItem(key, size, 7)], "h0", replicas, now)[0]
    assert not isinstance(g, ErrorInfo), g
    assert st.put_end([key], [g.put_id], now) == [None]
    return g


def sent(st, typ, node="n0"):
    return [m for m in st.outbox.get(node, []) if isinstance(m, typ)]


def answer_demotions(st, now, node="n0", error=None, first_id=1):
    """Answer every demotion in flight on ``node`` as the node would; returns the disk ids given."""
    ids = []
    for i, ((nid, key), (ref, _, _)) in enumerate([j for j in st.tiers.demotions.items() if j[0][0] == node]):
        ids.append(first_id + i)
        st.tier_done(node, TierDone("demote", key, ref.gen, first_id + i, 0.01), error, now)
    st.take_outbox()
    return ids


def tiers(st, key):
    return [(r.node_id, r.tier) for r in st.objects[key].replicas]


def test_watermark_demotes_instead_of_evicting_and_keeps_the_replica_until_confirmed():
    st = make()
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    node = st.nodes["n0"]
    dem = sent(st, NodeDemote)
    assert [m.key for m in dem] == ["k0", "k1"]  # LRU first, down to the low watermark (8 MiB)
    assert st.counters["evictions_watermark"] == 0 and len(st.objects) == 10
    # in flight: the memory replica stays, readable under a lease, and memory stays used
    info = st.lookup(["k0"], lease=False, now=10.0)[0]
    assert info.replicas[0].tier == MEMORY and node.alloc.used == 10 * MiB
    st.take_outbox()
    answer_demotions(st, 10.0)  # k0 was touched at 10.0 (the lookup above): given up, k1 is demoted
    assert tiers(st, "k0") == [("n0", MEMORY)] and tiers(st, "k1") == [("n0", DISK)]
    assert st.counters["demotions"] == 1 and st.counters["demotions_aborted"] == 1
    r = st.objects["k1"].replicas[0]
    assert (r.offset, r.data_addr, r.shm_path) == (0, "tcp://127.0.0.1:2000", "unix:///n0.disk.sock")
    assert node.disk.used == MiB and node.alloc.used == 9 * MiB
    # the answer to the aborted one frees its file, the confirmed one frees its memory extent
    st2 = make()
    for i in range(10):
        put(st2, f"k{i}", now=float(i))
    st2.take_outbox()
    st2.tier_done("n0", TierDone("demote", "k0", st2.tiers.demotions[("n0", "k0")][0].gen, 5, 0.0), None, 20.0)
    out = st2.take_outbox()["n0"]
    assert any(isinstance(m, NodeFree) for m in out)


def test_a_demotion_of_an_object_read_leased_or_pinned_meanwhile_is_given_up():
    st = make()
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    st.take_outbox()
    st.pin("k1", None, 10.0)  # hard pin while in flight: it stays in memory
    gen0 = st.tiers.demotions[("n0", "k0")][0].gen
    gen1 = st.tiers.demotions[("n0", "k1")][0].gen
    st.tier_done("n0", TierDone("demote", "k1", gen1, 3, 0.0), None, 11.0)
    assert tiers(st, "k1") == [("n0", MEMORY)]
    assert [m.ids for m in sent(st, NodeDiskFree)] == [[3]]
    st.take_outbox()
    # an answer that names another extent generation is not this demotion: its file goes
    st.tier_done("n0", TierDone("demote", "k0", gen0 + 99, 4, 0.0), None, 11.0)
    assert [m.ids for m in sent(st, NodeDiskFree)] == [[4]] and ("n0", "k0") in st.tiers.demotions


def test_a_failed_demotion_leaves_memory_as_it_was_and_falls_back_to_eviction():
    st = make()
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    st.take_outbox()
    answer_demotions(st, 10.0, error=ErrorInfo("internal", "disk write failed: EIO"))
    assert tiers(st, "k0") == [("n0", MEMORY)] and st.counters["demotions_failed"] == 2
    assert st.nodes["n0"].disk.paused_until > 10.0
    put(st, "k10", now=11.0)  # paused: the watermark evicts as without a disk tier
    assert st.counters["evictions_watermark"] >= 1 and not sent(st, NodeDemote)


def test_demotions_in_flight_are_bounded_per_node():
    st = make(cap=200 * MiB, disk=1000 * MiB)
    for i in range(200):
        put(st, f"k{i}", now=float(i))
    assert len(sent(st, NodeDemote)) == DEMOTE_IN_FLIGHT


def test_disk_watermark_evicts_least_recently_used_disk_objects_not_held_or_leased_ones():
    st = make(disk=4 * MiB)  # disk high 3.6 MiB, low 3.2 MiB
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    st.take_outbox()
    answer_demotions(st, 10.0)
    assert all(tiers(st, k) == [("n0", DISK)] for k in ("k0", "k1"))
    rec = HandoffRecord("r1", {"0": ["k0"]}, {}, "p", 60.0)
    st.handoff_publish(rec, 11.0)  # k0 held on disk: never evicted
    st.lookup(["k1"], lease=True, now=11.0)  # k1 leased
    for i in range(10, 14):
        put(st, f"k{i}", now=12.0 + i)
        answer_demotions(st, 30.0 + i, first_id=100 * i)
    d = st.nodes["n0"].disk
    assert d.used <= 0.9 * d.capacity
    assert "k0" in st.objects and tiers(st, "k0") == [("n0", DISK)]
    assert st.counters["evictions_disk"] >= 1


def test_second_read_of_a_disk_object_promotes_it_and_its_file_waits_for_the_lease():
    st = make()
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    st.take_outbox()
    answer_demotions(st, 10.0)
    st.lookup(["k0"], lease=True, now=20.0)
    assert not sent(st, NodePromote)  # a first read: served from disk
    info = st.lookup(["k0"], lease=True, now=21.0)[0]
    assert info.replicas[0].tier == DISK
    (p,) = sent(st, NodePromote)
    assert p.key == "k0" and p.disk_id == info.replicas[0].gen and p.dst.size == MiB and p.dst.token
    st.take_outbox()
    st.tier_done("n0", TierDone("promote", "k0", p.dst.gen, p.disk_id, 0.01), None, 22.0)
    assert tiers(st, "k0") == [("n0", MEMORY)] and st.counters["promotions"] == 1
    assert not sent(st, NodeDiskFree)  # the reader's lease (until 26.0) may be reading the file
    st.tick(30.0)
    assert [m.ids for m in sent(st, NodeDiskFree)] == [[p.disk_id]]
    assert st.nodes["n0"].disk.used == MiB  # k1 is still on disk


def test_a_failed_promotion_frees_its_extent_and_a_missing_file_drops_the_replica():
    st = make(nodes=2, replicas=1)
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    st.take_outbox()
    for n in ("n0", "n1"):
        answer_demotions(st, 10.0, node=n)
    key = next(k for k, o in st.objects.items() if o.replicas[0].tier == DISK)
    nid = st.objects[key].replicas[0].node_id
    st.lookup([key], lease=True, now=20.0)
    st.lookup([key], lease=True, now=21.0)
    (p,) = sent(st, NodePromote, nid)
    used = st.nodes[nid].alloc.used
    st.take_outbox()
    st.tier_done(nid, TierDone("promote", key, p.dst.gen, p.disk_id), ErrorInfo("stale_extent", "gone"), 22.0)
    assert st.nodes[nid].alloc.used == used - MiB
    assert key not in st.objects  # its only replica's file is gone: a miss, a later put stores it again


def test_restore_indexes_disk_rows_once_per_node_and_skips_keys_removed_while_away():
    st = make(nodes=1)
    st.tiers.restore_extent("n0", "a", MiB, 5, 7, None, 1.0, 1)
    st.tiers.restore_extent("n0", "a", MiB, 6, 7, None, 1.0, 2)  # a second copy on the same node: freed
    assert tiers(st, "a") == [("n0", DISK)] and st.nodes["n0"].disk.used == MiB
    assert [m.ids for m in sent(st, NodeDiskFree)] == [[6]]
    st.take_outbox()
    # the node dies; "a" is removed meanwhile (it is gone with the node, so it is put and
    # removed again); the restarted node (a new incarnation) brings its file back: not indexed
    st.node_down("n0", 2.0)
    st.node_up(desc(1), 2.0)
    put(st, "a", now=3.0)
    assert st.remove(["a"], False, 4.0) == [None]
    st.node_up(desc(0, inc="inc0-new"), 5.0)
    st.tiers.restore_extent("n0", "a", MiB, 5, 7, None, 5.0, 1)
    st.tiers.restore_extent("n0", "b", MiB, 9, 8, None, 5.0, 1)
    assert "a" not in st.objects and tiers(st, "b") == [("n0", DISK)]
    assert [m.ids for m in sent(st, NodeDiskFree)] == [[5]]


def test_node_death_with_moves_in_flight_and_disk_objects_in_stats_and_ls():
    st = make(nodes=1)
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    st.take_outbox()
    answer_demotions(st, 10.0)
    put(st, "k10", now=11.0)
    put(st, "k11", now=11.0)
    assert st.tiers.demotions
    s = st.stats()
    n = s.nodes[0]
    assert (n.disk_objects, n.objects, n.demotions, s.disk_objects) == (2, 10, 2, 2)
    assert n.disk_used == 2 * MiB and n.tier_moves == len(st.tiers.demotions)
    rows = {r.key: r for r in st.list_objects("", 100, 12.0)}
    assert rows["k0"].tiers == ["disk"] and rows["k10"].tiers == ["memory"]
    st.node_down("n0", 12.0)
    assert not st.tiers.demotions and st.lru.disk_nodes == 0 and not st.objects


def test_without_a_disk_tier_nothing_changes():
    st = make(disk=0)
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    assert st.lru.disk_nodes == 0 and not sent(st, NodeDemote)
    assert st.counters["evictions_watermark"] == 2
    assert st.list_objects("", 10, 11.0)[0].tiers == []


def test_an_unanswered_move_times_out_and_its_late_answer_is_cleaned_up():
    st = make()
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    st.take_outbox()
    gen = st.tiers.demotions[("n0", "k0")][0].gen
    st.tick(100.0)  # no answer within TIER_TIMEOUT_S
    assert not st.tiers.demotions and st.counters["demotions_failed"] == 2
    assert tiers(st, "k0") == [("n0", MEMORY)] and st.nodes["n0"].disk.jobs == 0
    st.take_outbox()
    st.tier_done("n0", TierDone("demote", "k0", gen, 42), None, 101.0)  # the lost answer arrives after all
    assert [m.ids for m in sent(st, NodeDiskFree)] == [[42]] and tiers(st, "k0") == [("n0", MEMORY)]


def test_max_objects_evicts_disk_objects_first():
    st = make(max_objects=11)
    for i in range(10):
        put(st, f"k{i}", now=float(i))
    st.take_outbox()
    answer_demotions(st, 10.0)  # k0, k1 on disk
    st.lookup(["k0"], lease=False, now=11.0)  # the most recently used, but on disk
    put(st, "k10", now=12.0)
    put(st, "k11", now=13.0)  # past max_objects: the least recently used disk object goes first
    assert "k1" not in st.objects and "k0" in st.objects and "k2" in st.objects
