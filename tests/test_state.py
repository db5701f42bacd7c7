"""The master's state machine, driven without sockets (time is a parameter)."""
import pytest

from kvpool.master.state import MasterSettings, MasterState
from kvpool.protocol import errors as E
from kvpool.protocol.errors import ErrorInfo
from kvpool.protocol.messages import EvictSelector, HandoffRecord, NodeCommit, NodeCopy, NodeDesc, NodeFree, PutItem

MiB = 1 << 20


def make(nodes=2, cap=10 * MiB, **kw):
    st = MasterState(MasterSettings(**kw))
    for i in range(nodes):
        st.node_up(NodeDesc(f"n{i}", f"inc{i}", f"tcp://127.0.0.1:{1000 + i}", "", "", f"h{i}", cap), 0.0)
    return st


def put(st, key, size=MiB, now=0.0, replicas=0, host="h0"):
    g = st.put_start([PutItem(key, size, 1)], host, replicas, now)[0]
    assert not isinstance(g, ErrorInfo), g
    if g.status == "write":
        assert st.put_end([key], [g.put_id], now) == [None]
    return g


def test_put_commit_lookup_and_existing_key_noop():
    st = make()
    g = put(st, "a")
    assert g.status == "write" and g.replicas[0].host_id == "h0"  # writer's host first
    assert st.put_start([PutItem("a", MiB, 1)], "h0", 0, 1.0)[0].status == "exists"
    info = st.lookup(["a"], lease=True, now=1.0)[0]
    assert info.size == MiB and info.lease_ttl_s == 5.0
    assert isinstance(st.lookup(["b"], True, 1.0)[0], ErrorInfo)
    assert st.exists(["a", "b"]) == [True, False]
    out = st.take_outbox()
    assert any(isinstance(m, NodeCommit) for m in out["n0"])


def test_replicas_on_distinct_nodes_and_hosts():
    st = make(nodes=3)
    g = put(st, "a", replicas=2)
    assert len({r.node_id for r in g.replicas}) == 2
    assert len({r.host_id for r in g.replicas}) == 2


def test_too_large_and_no_space():
    st = make(nodes=1, cap=4 * MiB)
    r = st.put_start([PutItem("big", 5 * MiB, 1)], "h0", 0, 0.0)[0]
    assert isinstance(r, ErrorInfo) and r.code == "object_too_large"
    put(st, "a", 3 * MiB)
    st.lookup(["a"], True, 0.0)  # leased: cannot be evicted
    r = st.put_start([PutItem("b", 3 * MiB, 1)], "h0", 0, 0.1)[0]
    assert isinstance(r, ErrorInfo) and r.code == "no_space"
    # once the lease lapses, allocation failure evicts and the put succeeds
    r = st.put_start([PutItem("b", 3 * MiB, 1)], "h0", 0, 10.0)[0]
    assert r.status == "write"
    assert "a" not in st.objects and st.counters["evictions_alloc"] == 1


def test_watermark_eviction_keeps_most_recently_used():
    st = make(nodes=1, cap=10 * MiB)
    for i in range(9):
        put(st, f"k{i}", now=float(i))
    # touch k0 and k1: they become most recently used
    st.lookup(["k0", "k1"], lease=False, now=20.0)
    put(st, "k9", now=21.0)  # 10 MiB used > 0.9 high watermark -> evict down to 8 MiB
    node = st.nodes["n0"]
    assert node.alloc.used <= 0.8 * node.alloc.capacity
    assert {"k0", "k1", "k9"} <= set(st.objects)
    assert "k2" not in st.objects and "k3" not in st.objects
    assert st.counters["evictions_watermark"] == 2


def test_exists_takes_no_lease_and_no_lru_touch():
    st = make(nodes=1, cap=10 * MiB)
    for i in range(9):
        put(st, f"k{i}", now=float(i))
    for _ in range(1000):
        st.exists(["k0"])
    put(st, "k9", now=30.0)
    assert "k0" not in st.objects  # probes did not keep it alive


def test_leased_object_survives_eviction_and_remove():
    st = make(nodes=1, cap=10 * MiB)
    put(st, "a")
    st.lookup(["a"], True, 1.0)
    err = st.remove(["a"], False, 2.0)[0]
    assert err.code == "has_lease"
    for i in range(9):
        put(st, f"k{i}", now=2.0 + i * 0.1)
    assert "a" in st.objects
    assert st.remove(["a"], False, 7.0)[0] is None  # lease lapsed at 6.0


def test_pins():
    st = make(nodes=1, cap=10 * MiB)
    put(st, "hard")
    put(st, "soft")
    st.pin("hard", None, 0.0)
    st.pin("soft", 100.0, 0.0)
    rep = st.eviction.admin(EvictSelector(all=True), dry_run=False, force=False, now=1.0)
    assert rep.removed == 0 and rep.skipped_pinned == 2
    # soft pins go last under pressure: fill until only soft-pinned can go
    for i in range(8):
        put(st, f"k{i}", now=2.0 + i)
    assert "hard" in st.objects and "soft" in st.objects
    assert st.remove(["hard"], False, 1.0)[0].code == "pinned"
    st.unpin("hard")
    assert st.remove(["hard"], False, 1.0)[0] is None
    with pytest.raises(E.NotFound):
        st.pin("nope", None, 0.0)


def test_admin_evict_selectors_and_dry_run():
    st = make()
    put(st, "ns/llama/0:f/aa", now=0.0)
    put(st, "ns/qwen/0:f/bb", now=100.0)
    rep = st.eviction.admin(EvictSelector(model="llama"), True, False, 101.0)
    assert rep.removed == 1 and rep.dry_run and "ns/llama/0:f/aa" in st.objects
    rep = st.eviction.admin(EvictSelector(older_than_s=50.0), False, False, 101.0)
    assert rep.keys == ["ns/llama/0:f/aa"] and "ns/llama/0:f/aa" not in st.objects
    with pytest.raises(E.InvalidRequest, match="exactly one"):
        st.eviction.admin(EvictSelector(prefix="a", all=True), False, False, 0.0)
    with pytest.raises(E.InvalidRequest, match="no such live node"):
        st.eviction.admin(EvictSelector(node="zz"), False, False, 0.0)


def test_stuck_writer_is_revoked_and_key_retaken():
    st = make(nodes=1, put_timeout_s=10.0, quarantine_s=5.0)
    g = st.put_start([PutItem("a", MiB, 1)], "h0", 0, 0.0)[0]
    assert st.put_start([PutItem("a", MiB, 1)], "h0", 0, 1.0)[0].status == "in_flight"
    st.tick(11.0)
    assert "a" not in st.pending
    node = st.nodes["n0"]
    assert node.alloc.used == MiB  # quarantined, not yet reusable
    st.tick(17.0)
    assert node.alloc.used == 0
    late = st.put_end(["a"], [g.put_id], 18.0)[0]
    assert late.code == "put_revoked"
    g2 = put(st, "a", now=19.0)
    assert g2.put_id != g.put_id and "a" in st.objects


def test_node_death_drops_replicas():
    st = make(nodes=2)
    put(st, "one", replicas=1, host="h1")
    put(st, "two", replicas=2)
    lost = st.node_down("n1", 1.0)
    assert lost == ["one"] and "one" not in st.objects
    assert [r.node_id for r in st.objects["two"].replicas] == ["n0"]


def test_restarted_node_new_incarnation_forgets_extents():
    st = make(nodes=1)
    put(st, "a")
    st.node_up(NodeDesc("n0", "inc-new", "tcp://x:1", "", "", "h0", 10 * MiB), 1.0)
    assert "a" not in st.objects and st.nodes["n0"].alloc.used == 0


def test_handoff_hold_ack_release_expire_and_repair():
    st = make(nodes=3, replicas=2)
    put(st, "b0")
    put(st, "b1")
    rec = HandoffRecord("r1", {"0": ["b0", "b1"]}, {}, "p", ttl_s=100.0)
    st.handoff_publish(rec, 0.0)
    assert st.handoff_publish(rec, 0.0) == rec  # idempotent
    assert st.stats().held_bytes == 4 * MiB
    rep = st.eviction.admin(EvictSelector(all=True), False, False, 1.0)
    assert rep.skipped_held == 2 and rep.removed == 0
    # a node holding a held replica dies: repair is queued to restore 2 replicas
    victim = st.objects["b0"].replicas[0].node_id
    st.take_outbox()
    st.node_down(victim, 2.0)
    st.repair.pump()
    copies = [m for msgs in st.take_outbox().values() for m in msgs if isinstance(m, NodeCopy)]
    assert {c.key for c in copies} == {"b0", "b1"} or {c.key for c in copies} <= {"b0", "b1"}
    for c in copies:
        st.repair.done(c.key, True)
        assert len(st.objects[c.key].replicas) == 2
    assert st.handoff_claim("r1", 3.0) == rec
    assert st.handoff_finish("r1", "acked") and not st.handoff_finish("r1", "acked")
    assert st.stats().held_bytes == 0
    with pytest.raises(E.HandoffNotFound):
        st.handoff_claim("nope", 0.0)
    # deadline passes: hold released, claim says expired
    st.handoff_publish(HandoffRecord("r2", {"0": ["b0"]}, {}, "p", ttl_s=5.0), 5.0)  # held until 10.0
    st.tick(9.9)
    st.handoff_claim("r2", 9.9)
    assert st.tick(11.0) == ["r2"]
    with pytest.raises(E.HandoffExpired):
        st.handoff_claim("r2", 11.0)
    assert st.stats().held_bytes == 0
    with pytest.raises(E.NotFound, match="not stored"):
        st.handoff_publish(HandoffRecord("r3", {"0": ["missing"]}, {}, "p", 100.0), 0.0)
    assert "r3" not in st.handoffs


def test_handoff_hold_times_by_outcome():
    """Each closed hold is observed once, in seconds from its publish on the master's
    clock, under its outcome (the ``kvpool_handoff_hold_seconds`` histogram)."""
    from kvpool.master.handoffs import HOLD_BUCKETS

    st = make()
    put(st, "b0")
    for rid, at in (("acked", 0.0), ("released", 1.0), ("expired", 2.0)):
        st.handoff_publish(HandoffRecord(rid, {"0": ["b0"]}, {}, "p", ttl_s=30.0), at)
    assert st.handoff_finish("acked", "acked", 0.004)
    assert st.handoff_finish("released", "released", 8.0)
    assert not st.handoff_finish("released", "released", 9.0)  # a repeat is not observed again
    assert st.tick(40.0) == ["expired"]
    hist = st.hold_histogram()
    assert set(hist) == {"acked", "released", "expired"}

    def bucket(seconds):
        return next(i for i, le in enumerate(HOLD_BUCKETS) if seconds <= le)

    for outcome, seconds in (("acked", 0.004), ("released", 7.0), ("expired", 38.0)):
        counts, total = hist[outcome]
        assert sum(counts) == 1 and counts[bucket(seconds)] == 1 and total == pytest.approx(seconds)


def test_remove_frees_space_and_notifies_node():
    st = make(nodes=1)
    put(st, "a")
    st.take_outbox()
    assert st.remove(["a"], False, 1.0) == [None]
    assert st.nodes["n0"].alloc.used == 0
    assert any(isinstance(m, NodeFree) for m in st.take_outbox()["n0"])
    assert st.remove(["a"], False, 1.0)[0].code == "not_found"


def test_released_lease_lapses_at_once_but_other_readers_keep_it():
    st = make()
    put(st, "a")
    st.lookup(["a"], True, 1.0)
    st.lookup(["a"], True, 1.0)
    st.release_leases(["a"], 1.5)
    assert st.remove(["a"], False, 1.6)[0].code == "has_lease"  # one reader still holds it
    st.release_leases(["a"], 1.7)
    assert st.remove(["a"], False, 1.8)[0] is None


def test_drain_moves_pinned_objects_off():
    st = make(nodes=2)
    put(st, "pinned", host="h0")
    put(st, "plain", host="h0")
    st.pin("pinned", None, 0.0)
    st.take_outbox()
    st.repair.drain("n0")
    copies = [m for m in st.take_outbox()["n0"] if isinstance(m, NodeCopy)]
    assert [c.key for c in copies] == ["pinned"] and copies[0].dst.node_id == "n1"
    st.repair.done("pinned", True)
    assert [r.node_id for r in st.objects["pinned"].replicas] == ["n1"]
    assert st.put_start([PutItem("new", MiB, 1)], "h0", 0, 1.0)[0].replicas[0].node_id == "n1"
    with pytest.raises(E.InvalidRequest):
        st.repair.drain("zz")


def test_bad_replicas_ttls_and_selectors_are_refused():
    st = make()
    for bad in (-1, 17):
        with pytest.raises(E.InvalidRequest, match="replicas"):
            st.put_start([PutItem("r", 1, 1)], "h0", bad, 0.0)
    with pytest.raises(E.InvalidRequest, match="ttl"):
        st.handoff_publish(HandoffRecord("h", {}, {}, "p", ttl_s=float("inf")), 0.0)
    with pytest.raises(E.InvalidRequest, match="ttl"):
        st.handoff_publish(HandoffRecord("h", {}, {}, "p", ttl_s=-5.0), 0.0)
    put(st, "a")
    with pytest.raises(E.InvalidRequest, match="finite"):
        st.pin("a", float("nan"), 0.0)
    with pytest.raises(E.InvalidRequest, match="--all"):
        st.eviction.admin(EvictSelector(prefix=""), False, False, 0.0)
    with pytest.raises(E.InvalidRequest, match="limit"):
        st.list_objects("", 0, 0.0)


def test_suspect_nodes_get_no_new_placements():
    st = make(nodes=2, suspect_s=3.0)
    st.report_dead("n0", "inc0", 10.0)
    assert put(st, "a", now=11.0, host="h0").replicas[0].node_id == "n1"
    assert put(st, "b", now=14.0, host="h0").replicas[0].node_id == "n0"  # suspicion lapsed
    st.report_dead("n0", "inc-old", 20.0)  # an older incarnation: ignored
    assert put(st, "c", now=20.5, host="h0").replicas[0].node_id == "n0"


def test_corrupt_replica_is_dropped_and_key_heals():
    st = make(nodes=2)
    g = put(st, "two", replicas=2)
    r0 = g.replicas[0]
    st.report_corrupt("two", r0.node_id, r0.gen)
    assert [r.node_id for r in st.objects["two"].replicas] == [g.replicas[1].node_id]
    g1 = put(st, "one")
    st.report_corrupt("one", g1.replicas[0].node_id, g1.replicas[0].gen + 1)  # wrong gen: ignored
    assert "one" in st.objects
    st.report_corrupt("one", g1.replicas[0].node_id, g1.replicas[0].gen)
    assert "one" not in st.objects and put(st, "one").status == "write"


def test_a_client_credentials_corruption_report_cannot_remove_a_pinned_object():
    """A client credential may not remove a pinned object, so neither may its corruption
    report of the object's last replica; the holders of the cluster secret still can."""
    st = make(nodes=2)
    g = put(st, "p")
    st.pin("p", None, 0.0)
    r = g.replicas[0]
    st.report_corrupt("p", r.node_id, r.gen, trusted=False)
    assert "p" in st.objects and st.counters["corrupt_reports_kept"] == 1
    g2 = put(st, "plain")
    st.report_corrupt("plain", g2.replicas[0].node_id, g2.replicas[0].gen, trusted=False)
    assert "plain" not in st.objects  # an unpinned object: a client could remove it anyway
    st.report_corrupt("p", r.node_id, r.gen)
    assert "p" not in st.objects


def test_stuck_repair_times_out_and_frees_its_extent():
    st = make(nodes=2, replicas=2)
    put(st, "p", replicas=1, host="h0")
    st.objects["p"].replicas_wanted = 2
    st.pin("p", None, 0.0)
    assert "p" in st.repair.in_flight
    dst = st.repair.in_flight["p"][0]
    used = st.nodes[dst.node_id].alloc.used
    st.tick(31.0)
    assert "p" not in st.repair.in_flight and st.nodes[dst.node_id].alloc.used == used - MiB
    assert st.counters["repairs_timed_out"] == 1


def test_put_end_checksums_replace_put_start_and_reach_the_commit_notice():
    st = make()
    g = st.put_start([PutItem("c", MiB, 0)], "h0", 2, 0.0)[0]
    st.take_outbox()
    with pytest.raises(E.InvalidRequest, match="1 keys but 2 checksums"):
        st.put_end(["c"], [g.put_id], 0.0, [1, 2])
    assert st.put_end(["c"], [g.put_id], 0.0, [0xABCDEF]) == [None]
    assert st.lookup(["c"], False, 0.0)[0].checksum == 0xABCDEF
    rows = [e for msgs in st.take_outbox().values() for m in msgs if isinstance(m, NodeCommit) for e in m.rows]
    assert sorted((e.key, e.offset, e.gen, e.checksum, e.committed) for e in rows) == sorted(
        ("c", r.offset, r.gen, 0xABCDEF, True) for r in g.replicas)


def test_node_extent_table_records_committed_rows_and_ignores_stale_ones():
    from kvpool.protocol.messages import ExtentEntry
    from kvpool.storenode.extents import ExtentTable

    t = ExtentTable(10 * MiB)
    t.commit(ExtentEntry("a", 0, MiB, 2, 7, None, True))  # a same-host write: no row before the commit
    assert t.check_read(0, MiB, 2).checksum == 7 and t.committed()[0].key == "a"
    t.commit(ExtentEntry("old", 0, MiB, 1, 9, None, True))  # an older generation's late commit
    assert t.check_read(0, MiB, 2).key == "a"
    with pytest.raises(E.InvalidRequest, match="outside"):
        t.commit(ExtentEntry("x", 10 * MiB, 1, 3, 0, None, True))


def test_node_serves_a_claimed_grant_before_its_commit_notice_but_no_unseen_one():
    from kvpool.protocol.messages import ExtentEntry
    from kvpool.storenode.extents import ExtentTable

    t = ExtentTable(10 * MiB)
    t.commit(ExtentEntry("old", 0, MiB, 1, 9, None, True))
    owner = object()
    t.claim(0, MiB, 3, owner)  # a same-host writer over memory the master freed (notice on its way)
    t.release(0, 3, owner)
    assert t.check_read(0, MiB, 3) is None  # served on the reader's checksum until the commit lands
    with pytest.raises(E.StaleExtent):
        t.check_read(0, MiB, 4)  # a generation this node never saw
    t.free(0, 3)
    with pytest.raises(E.StaleExtent):
        t.check_read(0, MiB, 3)  # freed since


def test_node_notices_keep_their_order_when_coalesced():
    from kvpool.master.nodes import _coalesce
    from kvpool.protocol.messages import ExtentEntry

    row = ExtentEntry("a", 0, MiB, 1, 7, None, True)
    msgs = [NodeCommit([row]), NodeCommit([row]), NodeFree([(0, 1)]), NodeFree([(MiB, 2)]), NodeCommit([row])]
    out = _coalesce(msgs)
    assert [type(m).__name__ for m in out] == ["NodeCommit", "NodeFree", "NodeCommit"]
    assert len(out[0].rows) == 2 and out[1].extents == [(0, 1), (MiB, 2)]


def test_pins_restore_from_records_and_report_dropped_pinned_keys():
    from kvpool.protocol.messages import PinRecord

    st = make()
    put(st, "hard")
    put(st, "soft")
    put(st, "gone")
    assert st.restore_pin(PinRecord("hard", None, MiB, 2), 10.0) is False  # same key, other bytes
    assert st.restore_pin(PinRecord("hard", None, MiB, 1), 10.0) is True
    assert st.restore_pin(PinRecord("soft", 40.0, MiB, 1), 10.0) is True  # re-armed: pinned until 50.0
    assert st.restore_pin(PinRecord("gone", 0.0, MiB, 1), 10.0) is False  # the soft pin has no time left
    assert st.list_objects("", 10, 10.0) and {m.key: m.pin for m in st.list_objects("", 10, 10.0)} == {
        "hard": "hard", "soft": "soft", "gone": ""}
    assert st.eviction.admin(EvictSelector(all=True), False, False, 20.0).skipped_pinned == 2
    assert st.take_unpinned() == []
    st.remove(["hard"], True, 20.0)  # a forced remove of a pinned object: its record must go
    assert st.take_unpinned() == ["hard"] and st.take_unpinned() == []


def test_node_table_refuses_writes_of_a_revoked_generation():
    from kvpool.protocol.messages import ExtentEntry
    from kvpool.storenode.extents import ExtentTable

    t = ExtentTable(10 * MiB)
    t.check_write(0, 1)
    t.record_write("stale", 0, 4096, 1, 0, None)
    t.free(0, 1)  # the master revoked that put
    with pytest.raises(E.PutRevoked, match="older than"):
        t.check_write(0, 1)  # the stalled writer comes back
    t.check_write(0, 2)  # the extent's next owner writes
    t.record_write("victim", 0, 8192, 2, 0, None)
    t.record_write("stale", 0, 4096, 1, 0, None)  # even unchecked, it does not replace the row
    assert t.check_read(0, 8192, 2).key == "victim"
    t.commit(ExtentEntry("stale", 0, 4096, 1, 5, None, True))  # a late commit of the freed generation
    assert t.check_read(0, 8192, 2).key == "victim" and t.max_gen == 2


def test_a_returning_node_does_not_bring_back_what_was_removed_meanwhile():
    st = make(nodes=2)
    for k in ("kept", "removed", "only-there"):
        put(st, k, replicas=2 if k != "only-there" else 1, host="h1" if k == "only-there" else "h0")
    desc = st.nodes["n1"].desc
    rows = [(k, r) for k in ("kept", "removed", "only-there") for r in st.objects[k].replicas if r.node_id == "n1"]
    st.node_down("n1", 1.0)  # its etcd lease lapsed
    st.remove(["removed"], True, 2.0)
    st.take_outbox()
    st.node_up(desc, 3.0)  # the same memory registers again
    for k, r in rows:
        st.restore_extent("n1", k, r.offset, r.size, r.gen, 1, None, 3.0, replicas=2)
    assert sorted(st.objects) == ["kept", "only-there"]
    assert st.objects["kept"].replicas_wanted == 2 and len(st.objects["kept"].replicas) == 2
    freed = [e for m in st.take_outbox()["n1"] if isinstance(m, NodeFree) for e in m.extents]
    assert freed == [(r.offset, r.gen) for k, r in rows if k == "removed"]


def test_writer_commit_copy_never_replaces_the_masters_row():
    """The writer's copy of a commit (sent for master failover) fills in a missing row but
    never overrides what the master committed (e.g. the resolved replica count)."""
    from kvpool.protocol.messages import ExtentEntry
    from kvpool.storenode.extents import ExtentTable

    t = ExtentTable(1 << 20)
    me = object()  # the writer's connection
    t.record_write("k", 0, 100, 3, 7, None)
    t.commit(ExtentEntry("k", 0, 100, 3, 7, None, True, 2))
    t.commit(ExtentEntry("k", 0, 100, 3, 7, None, True, 0), writer=me)
    assert [(r.key, r.replicas) for r in t.committed()] == [("k", 2)]
    t.commit(ExtentEntry("j", 4096, 100, 4, 9, None, True, 0), writer=me)  # the master's notice was lost
    assert sorted((r.key, r.replicas) for r in t.committed()) == [("j", 0), ("k", 2)]
    t.commit(ExtentEntry("j", 4096, 100, 4, 9, None, True, 3))  # ... or comes later: it wins
    assert sorted((r.key, r.replicas) for r in t.committed()) == [("j", 3), ("k", 2)]


def test_a_commit_ends_the_claim_of_its_grant():
    """The master's commit of a grant ends the claim on it, whoever holds it (the writer
    committed only after its copy returned); the writer's own copy ends only its own claim,
    and one arriving after the master's notice just does that (settled)."""
    from kvpool.protocol.messages import ExtentEntry
    from kvpool.storenode.extents import ExtentTable

    t = ExtentTable(1 << 20)
    a, b = object(), object()
    t.claim(0, 100, 3, a)
    t.commit(ExtentEntry("k", 0, 100, 3, 7, None, True, 1))
    assert t.claims() == 0
    t.claim(4096, 100, 4, a)
    t.commit(ExtentEntry("j", 4096, 100, 4, 9, None, True, 1), writer=b)  # not b's claim: it stays
    assert t.claims(a) == 1
    assert t.settled(4096, 4, a) and t.claims() == 0
    assert not t.settled(8192, 5, a)  # nothing committed there


def test_put_ids_do_not_repeat_across_leaders():
    a, b = make(), make()
    ga = a.put_start([PutItem("x", 10, 1)], "h", 1, 0.0)[0]
    gb = b.put_start([PutItem("x", 10, 1)], "h", 1, 0.0)[0]
    assert ga.put_id != gb.put_id
    assert b.put_end(["x"], [ga.put_id], 0.0)[0] is not None  # the other leader's grant is not this put


def test_nodes_of_another_wire_version_are_screened_out_and_reported_once():
    from kvpool.protocol.messages import WIRE_VERSION

    st = make(nodes=0)

    def desc(nid, wire):
        return NodeDesc(nid, f"inc-{nid}", "tcp://x:1", "", "", "h0", 10 * MiB, wire=wire)

    same, old, new = desc("same", WIRE_VERSION), desc("old", 0), desc("new", WIRE_VERSION + 1)
    ok, refused = st.screen([same, old, new])
    assert ok == [same] and refused == [old, new]
    assert st.stats().refused == {"old": 0, "new": WIRE_VERSION + 1}
    ok, refused = st.screen([same, old, new])  # the next membership poll: nothing new to report
    assert ok == [same] and refused == []
    ok, refused = st.screen([same, desc("old", WIRE_VERSION)])  # upgraded and restarted; "new" left
    assert ok == [same, desc("old", WIRE_VERSION)] and refused == [] and st.stats().refused == {}


def test_pins_and_holds_wait_for_a_node_that_is_away():
    """Objects that leave with their store node keep their pin and hand-off holds waiting
    (a rebuild does the same for records naming objects it has not indexed): applied when
    the node brings the extents back or the key is put again with the same bytes; a re-put
    with other bytes makes the pin record stale; an unpin cancels a waiting pin; a waiting
    pin is forgotten after DEPARTED_KEEP_S or when its soft pin lapses; closed hand-offs
    hold nothing."""
    from kvpool.master.state import DEPARTED_KEEP_S
    from kvpool.protocol.messages import PinRecord

    st = make(nodes=1)
    away = NodeDesc("away", "inc-away", "tcp://x:2", "", "", "h1", 10 * MiB)
    st.node_up(away, 0.0)
    keys = ["hard", "soft", "same", "other", "cancel", "held", "closed"]
    for i, key in enumerate(keys):
        st.restore_extent("away", key, i * MiB, MiB, 1, 7, None, 0.0)
    for key in ("hard", "same", "other", "cancel"):
        st.pin(key, None, 0.0)
    st.pin("soft", 50.0, 0.0)
    st.handoff_publish(HandoffRecord("open", {"0": ["held"]}, {}, "p", ttl_s=1000.0), 0.0)
    st.handoff_publish(HandoffRecord("done", {"0": ["closed"]}, {}, "p", ttl_s=1000.0), 0.0)
    assert sorted(st.node_down("away", 1.0)) == sorted(keys)
    assert st.take_unpinned() == [] and set(st.waiting_pins) == {"hard", "soft", "same", "other", "cancel"}
    st.handoff_finish("done", "acked")
    st.check_unpin("cancel")
    st.unpin("cancel")
    for key, checksum in (("same", 7), ("other", 8)):  # put again while the node is away
        g = st.put_start([PutItem(key, MiB, checksum)], "h0", 1, 2.0)[0]
        assert st.put_end([key], [g.put_id], 2.0, [checksum]) == [None]
    assert st.objects["same"].pin == "hard" and st.objects["other"].pin == ""
    assert st.take_unpinned() == ["other"]
    st.node_up(away, 3.0)  # back with its memory: the same incarnation
    for i, key in enumerate(keys):
        st.restore_extent("away", key, i * MiB, MiB, 1, 7, None, 3.0)
    pins = {m.key: m.pin for m in st.list_objects("", 20, 3.0)}
    assert pins == {"hard": "hard", "soft": "soft", "same": "hard", "other": "", "cancel": "", "held": "",
                    "closed": ""}
    assert st.objects["held"].holds == {"open"} and st.objects["closed"].holds == set()
    assert len(st.objects["same"].replicas) == 2 and st.waiting_pins == {} and st.waiting_holds == {}
    # a rebuild's records: wait, then forgotten after DEPARTED_KEEP_S or when a soft pin lapses
    assert st.restore_pin(PinRecord("soft", 0.0, MiB, 7), 10.0) is False  # no time left
    assert st.restore_pin(PinRecord("hard", None, MiB, 9), 10.0) is False  # other bytes under the key
    assert st.restore_pin(PinRecord("nowhere", None, MiB, 7), 10.0) is True
    assert st.restore_pin(PinRecord("brief", 10.0, MiB, 7), 10.0) is True  # waits until 20.0 at most
    st.tick(21.0)
    assert st.take_unpinned() == ["brief"] and set(st.waiting_pins) == {"nowhere"}
    st.tick(10.0 + DEPARTED_KEEP_S)
    assert st.take_unpinned() == ["nowhere"] and st.waiting_pins == {}


def test_holds_and_soft_pins_are_durations_rearmed_in_full_at_a_rebuild():
    """A hold runs ttl_s from its publish; a leader rebuilding from the record holds for the
    full ttl_s again from the rebuild (never shorter), and so re-arms a soft pin."""
    from kvpool.protocol.messages import PinRecord

    st = make()
    put(st, "b", now=100.0)
    rec = HandoffRecord("r", {"0": ["b"]}, {}, "p", ttl_s=30.0)
    st.handoff_publish(rec, 100.0)
    assert st.tick(129.9) == [] and st.handoff_claim("r", 129.9) == rec
    assert st.tick(130.0) == ["r"]
    with pytest.raises(E.InvalidRequest, match=r"ttl must be finite, > 0 and at most 60s"):
        make(max_handoff_ttl_s=60.0).handoff_publish(HandoffRecord("long", {}, {}, "p", ttl_s=61.0), 0.0)
    st2 = make()  # the next leader, its monotonic clock far from the first one's
    put(st2, "b", now=5000.0)
    st2.restore_handoff(rec, 5000.0)
    assert st2.restore_pin(PinRecord("b", 20.0, MiB, 1, 1.7e9), 5000.0) is True
    assert st2.objects["b"].holds == {"r"} and st2.objects["b"].pin_until == 5020.0
    assert st2.tick(5029.9) == [] and st2.tick(5030.0) == ["r"] and st2.objects["b"].holds == set()


def test_listing_shows_wall_clock_times_and_monotonic_ages():
    st = make()
    put(st, "a", now=100.0)
    st.lookup(["a"], True, 150.0)
    m = st.list_objects("", 10, 160.0, wall=1_700_000_000.0)[0]
    assert (m.created, m.last_access) == (1_700_000_000.0 - 60.0, 1_700_000_000.0 - 10.0)
    assert (m.age_s, m.idle_s) == (60.0, 10.0)


def test_silent_writers_are_revoked_a_bounded_number_per_tick():
    from kvpool.master.state import REVOKES_PER_TICK

    st = make(cap=1 << 30, put_timeout_s=1.0)
    n = 2 * REVOKES_PER_TICK + 5
    grants = st.put_start([PutItem(f"p{i}", 4096, 1) for i in range(n)], "h0", 1, 0.0)
    assert all(g.status == "write" for g in grants) and len(st.pending) == n
    st.tick(5.0)
    assert len(st.pending) == n - REVOKES_PER_TICK  # the oldest first; a tick holds the request thread
    st.tick(5.1)
    st.tick(5.2)
    assert not st.pending and st.counters["puts_revoked"] == n
