"""An object's story (master/story.py, `kvpool story`): the leading master records each
decision about an object, and an operator can ask why it was evicted, repaired or lost.
Real etcd, master and store nodes; the bounded log itself is checked without sockets."""
from __future__ import annotations

import os
import subprocess
import sys

from kvpool.master.story import Story
from tests.conftest import wait_for


def test_the_log_is_bounded_and_keeps_the_newest():
    s = Story(maxlen=5, clock=iter(range(100)).__next__)
    for i in range(4):
        s.add("a", "stored", ("n0", "n1"))
        s.add("b", "evicted", f"why {i}")
    assert [e for _, e, _ in s.of("b")] == ["evicted"] * 3  # the oldest two entries of all keys went
    assert s.of("a") == [(4, "stored", "n0, n1"), (6, "stored", "n0, n1")]
    assert s.of("b", limit=1) == [(7, "evicted", "why 3")] and s.of("never") == []


def test_story_of_a_replicated_object_through_a_node_loss_and_a_remove(make_cluster):
    lc = make_cluster(nodes=3, memory="32MiB", replicas=2, node_ttl="1s")
    with lc.client() as c:
        assert c.put("story/k", b"s" * 4096) is True
        c.pin("story/k", ttl_s=60)
        first = c.story("story/k")
        assert [e.event for e in first] == ["stored", "pinned"], first
        victim = first[0].detail.split(", ")[0]
        lc.kill_node(victim)
        wait_for(lambda: "repair done" in [e.event for e in c.story("story/k")], 30, what="the repair")
        c.unpin("story/k")
        c.remove("story/k")
        events = [e.event for e in c.story("story/k")]
        assert events == ["stored", "pinned", "replica lost", "repair started", "repair done", "unpinned",
                          "removed"], events
        lost = next(e for e in c.story("story/k") if e.event == "replica lost")
        assert lost.detail == victim
        assert all(a.t <= b.t for a, b in zip(first, first[1:]))


def test_watermark_evictions_say_why_and_the_cli_prints_the_story(make_cluster):
    lc = make_cluster(nodes=1, memory="8MiB", high_watermark=0.5, low_watermark=0.3)
    with lc.client() as c:
        for i in range(12):  # 12 x 512 KiB into 8 MiB: past the 50 % watermark
            c.put(f"wm/{i}", os.urandom(512 << 10))
        gone = [e for e in c.story("wm/0") if e.event == "evicted"]
        assert gone and "high watermark" in gone[0].detail, c.story("wm/0")
    env = {**os.environ, "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "story", "wm/0", "--master", lc.master_addr],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "stored" in r.stdout and "evicted" in r.stdout and "high watermark" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "story", "wm/none", "--master", lc.master_addr],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "no story" in r.stdout, r.stdout + r.stderr
