"""Re-replication and placement in the master's state machine, driven without sockets."""
from collections import Counter

import pytest

from kvpool.master.repair import REPAIR_RETRY_S
from kvpool.master.state import MasterSettings, MasterState
from kvpool.protocol.config import MasterConfig, load_config
from kvpool.protocol.errors import ConfigError
from kvpool.protocol.messages import HandoffRecord, NodeCopy, NodeDesc, NodeFree
from tests.test_state import put

MiB = 1 << 20


def desc(i, host=None, cap=64 * MiB, inc=None):
    return NodeDesc(f"n{i}", inc or f"inc{i}", f"tcp://127.0.0.1:{1000 + i}", "", "", host or f"h{i}", cap)


def make(nodes=3, cap=64 * MiB, hosts=None, seed=1, **kw):
    st = MasterState(MasterSettings(**kw), seed=seed)
    for i in range(nodes):
        st.node_up(desc(i, hosts[i] if hosts else None, cap), 0.0)
    return st




def copies(st):
    return [m for msgs in st.take_outbox().values() for m in msgs if isinstance(m, NodeCopy)]


def finish(st, now):
    """Complete every copy in flight (as the store nodes would), at ``now``."""
    st._now = now
    for key in list(st.repair.in_flight):
        st.repair.done(key, True)


def test_placement_spreads_by_room_and_keeps_the_writers_host_first():
    st = make(nodes=3, hosts=["h", "h", "h"])
    for n in ("n0", "n1"):  # half full
        st.nodes[n].alloc.alloc(32 * MiB)
    where = Counter(put(st, f"k{i}", 64 << 10, host="h").replicas[0].node_id for i in range(300))
    assert where["n2"] > max(where["n0"], where["n1"]) and where["n2"] < 0.8 * 300, where
    assert all(n.usage() <= st.s.high_watermark for n in st.nodes.values())
    # distinct hosts: the first replica on the writer's host whatever its room, the second elsewhere
    st = make(nodes=3)
    st.nodes["n1"].alloc.alloc(50 * MiB)
    for i in range(30):
        g = put(st, f"w{i}", 64 << 10, replicas=2, host="h1")
        assert g.replicas[0].node_id == "n1" and g.replicas[1].node_id != "n1"


def test_placement_skips_nodes_past_the_high_watermark_while_others_have_room():
    st = make(nodes=2, hosts=["h", "h"])
    st.nodes["n0"].alloc.alloc(60 * MiB)  # past 0.90
    assert {put(st, f"k{i}", 64 << 10, host="h").replicas[0].node_id for i in range(50)} == {"n1"}


def test_every_short_object_is_repaired_at_a_bounded_rate_held_and_pinned_first():
    st = make(nodes=3, replicas=2, repair_rate=10.0, repair_in_flight=4)
    for i in range(40):
        put(st, f"k{i}", 64 << 10)
    st.pin("k39", None, 0.0)
    st.handoff_publish(HandoffRecord("r", {"0": ["k38"]}, {}, "p", ttl_s=100.0), 0.0)
    victim = "n0"
    hit = sorted(k for k, o in st.objects.items() if any(r.node_id == victim for r in o.replicas))
    assert "k38" in hit and "k39" in hit
    st.take_outbox()
    st.node_down(victim, 1.0)
    assert st.stats().under_replicated == len(hit)
    first = copies(st)
    assert {c.key for c in first} == {"k38", "k39"}  # held and pinned: at once, ahead of the rest
    started, now = len(first), 1.0
    while st.stats().under_replicated:
        now += 0.25
        st.tick(now)
        assert len(st.repair.in_flight) <= 4  # in flight
        started += len(copies(st))
        assert started <= 10 + 10 * (now - 1.0)  # per second, after one second's burst
        finish(st, now)
        assert now < 60, "repair stalled"
    assert started == len(hit) and st.counters["repairs_done"] == len(hit)
    assert now - 1.0 >= (len(hit) - 10) / 10 - 0.25
    assert all(len(o.replicas) == 2 and victim not in [r.node_id for r in o.replicas] for o in st.objects.values())


def test_a_short_put_is_repaired_when_a_node_joins():
    st = make(nodes=1, replicas=2)
    g = put(st, "a")
    assert len(g.replicas) == 1 and g.replicas_wanted == 2
    st.tick(1.0)
    assert copies(st) == [] and st.stats().under_replicated == 1  # nowhere to copy to: parked
    st.node_up(desc(1), 2.0)
    st.tick(2.0)
    (c,) = copies(st)
    assert c.key == "a" and c.dst.node_id == "n1"
    finish(st, 2.0)
    assert st.stats().under_replicated == 0


def test_a_failed_copy_is_retried_later_and_plain_copies_never_pass_the_high_watermark():
    st = make(nodes=3, replicas=2)
    put(st, "a", host="h0")
    src = {r.node_id for r in st.objects["a"].replicas}
    (spare,) = {"n0", "n1", "n2"} - src
    st.node_down(sorted(src)[1], 1.0)
    st.tick(1.0)
    (c,) = copies(st)
    st.repair.done("a", False)
    assert st.counters["repairs_failed"] == 1
    st.tick(1.5)
    assert copies(st) == []  # parked ...
    st.tick(1.0 + REPAIR_RETRY_S)
    (c,) = copies(st)  # ... and tried again
    assert c.dst.node_id == spare
    st.repair.done("a", False)
    st.nodes[spare].alloc.alloc(58 * MiB)  # 58 + 1 MiB of 64: past the 0.90 high watermark
    st.tick(1.0 + 3 * REPAIR_RETRY_S)
    assert copies(st) == [] and st.stats().under_replicated == 1


def test_a_node_back_with_copies_already_made_elsewhere_frees_them():
    st = make(nodes=3, replicas=2)
    put(st, "a")
    away = st.objects["a"].replicas[0]
    st.node_down(away.node_id, 1.0)
    st.tick(1.0)
    finish(st, 1.0)
    assert len(st.objects["a"].replicas) == 2
    st.take_outbox()
    st.node_up(desc(int(away.node_id[1:])), 2.0)  # the same incarnation: its memory is back
    st.restore_extent(away.node_id, "a", away.offset, away.size, away.gen, 1, None, 2.0, replicas=2)
    assert len(st.objects["a"].replicas) == 2 and away.node_id not in [r.node_id for r in st.objects["a"].replicas]
    assert NodeFree([(away.offset, away.gen)]) in st.take_outbox()[away.node_id]
    assert st.nodes[away.node_id].alloc.used == 0


def test_a_long_backlog_is_looked_at_a_bounded_amount_per_tick():
    st = make(nodes=2, replicas=2, repair_rate=1e6, repair_in_flight=10000)
    for i in range(2000):
        put(st, f"k{i}", 4096)
    st.node_down("n1", 1.0)  # nowhere to copy to
    st.tick(1.1)
    assert len(st.repair._back) >= 2000 - 2 * 256 and st.repair.in_flight == {}
    now = 1.1
    while st.repair._back:
        now += 0.25
        st.tick(now)
    assert len(st.repair._no_node) == 2000
    st.tick(now + 2 * REPAIR_RETRY_S)  # waiting for a node, not for time
    assert not st.repair._back and st.repair.in_flight == {}
    st.node_up(desc(2), now + 11)
    st.tick(now + 11)
    assert len(st.repair.in_flight) == 256  # at most REPAIR_SCAN looked at per pump


def test_a_copy_that_lands_after_the_node_came_back_with_its_own_is_freed():
    st = make(nodes=3, replicas=2)
    put(st, "a")
    away = st.objects["a"].replicas[0]
    st.node_down(away.node_id, 1.0)
    st.tick(1.0)
    (c,) = copies(st)
    st.node_up(desc(int(away.node_id[1:])), 1.5)
    st.restore_extent(away.node_id, "a", away.offset, away.size, away.gen, 1, None, 1.5, replicas=2)
    st.take_outbox()
    st.repair.done("a", True)
    assert sorted(r.node_id for r in st.objects["a"].replicas) == sorted(
        {"n0", "n1", "n2"} - {c.dst.node_id})
    assert NodeFree([(c.dst.offset, c.dst.gen)]) in st.take_outbox()[c.dst.node_id]
    assert st.nodes[c.dst.node_id].alloc.used == 0


def test_copies_of_a_node_that_leaves_are_cancelled_and_queued_again_at_once():
    st = make(nodes=4, replicas=2)
    put(st, "a", replicas=2)
    st.pin("a", None, 0.0)
    holders = [r.node_id for r in st.objects["a"].replicas]
    st.node_down(holders[0], 1.0)
    (c,) = copies(st)
    st.node_down(c.dst.node_id, 1.1)  # the receiving node goes too: its copy will never finish
    (c2,) = copies(st)  # queued again at once, not after the 30 s repair timeout
    assert c2.dst.node_id not in (c.dst.node_id, holders[0]) and st.counters["repairs_cancelled"] == 1
    st.repair.done("a", True)
    assert len(st.objects["a"].replicas) == 2


def test_repair_bounds_are_config_keys_with_checked_values():
    cfg = load_config(None, {"master": {"repair_rate": 5, "repair_in_flight": 2}}, environ={})
    assert (cfg.master.repair_rate, cfg.master.repair_in_flight) == (5.0, 2)
    assert MasterSettings().repair_rate == MasterConfig().repair_rate  # one default
    for bad in ({"repair_rate": 0}, {"repair_rate": float("nan")}, {"repair_in_flight": 0}):
        with pytest.raises(ConfigError, match=f"master.{next(iter(bad))}") as ei:
            load_config(None, {"master": bad}, environ={})
        assert ei.value.fields["key"] == f"master.{next(iter(bad))}"
