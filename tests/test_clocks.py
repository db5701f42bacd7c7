"""Leases, pins and hand-off holds are durations on the enforcing master's monotonic
clock (DESIGN.md §8 "Time"): stepping the master's wall clock, or a producer's wall clock
that is off, neither ends them early nor stretches them.

The real-process tests run the master (or the publishing client) under libfaketime
(Debian package ``faketime``): ``LD_PRELOAD`` of ``libfaketime.so.1`` with
``DONT_FAKE_MONOTONIC=1`` shifts only ``CLOCK_REALTIME``, and ``FAKETIME_NO_CACHE=1`` with
``FAKETIME_TIMESTAMP_FILE`` lets the test step the master's clock while it runs by
rewriting that file ("+0" → "+2h" → "-1h"). They fail, naming the cause, when
libfaketime is missing (CI installs it) or does not shift Python's clocks as expected.
libfaketime 0.9.10 (Debian 12) fails Python's
``time.sleep`` with EINVAL under ``DONT_FAKE_MONOTONIC=1`` (it mistranslates an absolute
``clock_nanosleep`` on CLOCK_MONOTONIC; fixed upstream in 0.9.11); the paths these
processes run here do not sleep that way (polls, events and asyncio timers work).
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

REPO = Path(__file__).resolve().parent.parent
from kvpool.connector.client import KVPoolClient
from kvpool.master.records import decode_records
from kvpool.protocol import errors as E
from kvpool.protocol import messages as M
from kvpool.protocol.layout import LayoutSpec, TensorSpec

from tests.conftest import wait_for

TTL = 3.0  # seconds of every lease, soft pin and hold measured here
EARLY, LATE = 1.0, 2.0  # slack: present until TTL - EARLY at least, gone by TTL + LATE at most
LAY = LayoutSpec(kind="raw", tokens_per_block=1, tensors=(TensorSpec("b", (4096,), "uint8"),))


def _libfaketime() -> str | None:
    for pat in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                "/usr/local/lib/faketime/libfaketime.so.1"):
        found = sorted(glob.glob(pat))
        if found:
            return found[0]
    return None


def _faketime_env(**extra: str) -> dict[str, str]:
    lib = _libfaketime()
    if lib is None:
        pytest.fail("libfaketime is not installed: `bash .ci/setup --test` installs Debian's faketime")
    return {"LD_PRELOAD": lib, "DONT_FAKE_MONOTONIC": "1", **extra}


def _clocks_under(env: dict[str, str]) -> tuple[float, float]:
    """(wall-clock offset, monotonic offset) of a Python process run with ``env``."""
    out = subprocess.run([sys.executable, "-c", "import time; print(time.time(), time.monotonic())"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=30, check=True)
    wall, mono = map(float, out.stdout.split())
    return wall - time.time(), mono - time.monotonic()


@pytest.fixture
def clock_file(tmp_path) -> Path:
    """A libfaketime timestamp file, checked to shift Python's wall clock and only that."""
    f = tmp_path / "faketime"
    f.write_text("+1h\n")
    env = _faketime_env(FAKETIME_NO_CACHE="1", FAKETIME_TIMESTAMP_FILE=str(f))
    wall, mono = _clocks_under(env)
    if not (abs(wall - 3600) < 30 and abs(mono) < 30):
        pytest.fail(f"libfaketime does not shift Python's clocks as expected here (wall {wall:+.0f}s, "
                    f"monotonic {mono:+.0f}s for +1h)")
    f.write_text("+0\n")
    return f


def _watch(c, prefix: str, present: dict, t0: float, limit_s: float = 30.0) -> dict[str, tuple[float, float]]:
    """Poll ``ls(prefix)`` from monotonic ``t0`` until every ``present[name](rows by key)``
    is false; per name (seconds it was last seen true, seconds it was first seen false),
    both since ``t0``."""
    last = dict.fromkeys(present, 0.0)
    gone: dict[str, float] = {}
    while len(gone) < len(present):
        rows = {r.key: r for r in c.ls(prefix)}
        now = time.monotonic() - t0
        for name, test in present.items():
            if name in gone:
                continue
            if test(rows):
                last[name] = now
            else:
                gone[name] = now
        if now > limit_s:
            raise AssertionError(f"{sorted(set(present) - set(gone))} still present after {limit_s:g}s")
        time.sleep(0.05)
    return {name: (last[name], gone[name]) for name in present}


def _assert_lasted(what: str, span: tuple[float, float]) -> None:
    last, gone = span
    assert last >= TTL - EARLY and gone <= TTL + LATE, (
        f"{what}: seen until {last:.2f}s, gone at {gone:.2f}s; want about {TTL:g}s")


@pytest.mark.slow
def test_stepping_the_masters_wall_clock_neither_ends_nor_stretches_leases_pins_and_holds(make_cluster,
                                                                                          clock_file):
    lc = make_cluster(nodes=1, memory="64MiB", lease_ttl=f"{TTL:g}s",
                      master_env=_faketime_env(FAKETIME_NO_CACHE="1", FAKETIME_TIMESTAMP_FILE=str(clock_file)))
    spans = {}
    with lc.client() as c:
        for step, offset in (("+2h", 7200.0), ("-1h", -3600.0)):  # forward, then 3 h back
            keys = [f"clk{offset:+.0f}/{k}" for k in ("leased", "pinned", "held")]
            c.put_batch(keys, [bytes([i]) * 4096 for i in range(3)], LAY)
            t0 = time.monotonic()
            c.rpc.call(M.Lookup([keys[0]], lease=True))  # a reader mid-read: the lease runs its TTL
            c.pin(keys[1], ttl_s=TTL)
            rid = f"clk{offset:+.0f}-req"
            c.handoff_publish(rid, {"0": [keys[2]]}, {"0": LAY}, ttl_s=TTL)
            time.sleep(0.5)
            clock_file.write_text(f"{step}\n")  # the master's wall clock jumps while they run
            c.put(f"clk{offset:+.0f}/probe", b"p")
            probe = c.ls(f"clk{offset:+.0f}/probe")[0]  # created: the master's wall clock, for display
            assert abs(probe.created - (time.time() + offset)) < 60, f"the master's clock did not move {step}"
            assert c.handoff_claim(rid).ttl_s == TTL
            for what, (last, gone) in _watch(c, f"clk{offset:+.0f}/", {
                    "lease": lambda rows: rows[keys[0]].leased,
                    "pin": lambda rows: rows[keys[1]].pin == "soft",
                    "hold": lambda rows: rows[keys[2]].held}, t0).items():
                spans[step, what] = (last, gone)
            with pytest.raises(E.HandoffExpired):
                c.handoff_claim(rid)
            assert 0 <= c.ls(keys[1])[0].age_s < 60  # ages: the master's monotonic clock
    print({k: f"{last:.2f}-{gone:.2f}s" for k, (last, gone) in spans.items()})
    for (step, what), span in spans.items():
        _assert_lasted(f"{what} across a {step} step", span)


_PUBLISH = """
import sys, time
from kvpool.connector.client import KVPoolClient
from kvpool.protocol.layout import LayoutSpec, TensorSpec
lay = LayoutSpec(kind="raw", tokens_per_block=1, tensors=(TensorSpec("b", (4096,), "uint8"),))
master, key, rid, ttl = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
with KVPoolClient(master) as c:
    c.put(key, b"h" * 4096, lay)
    c.handoff_publish(rid, {"0": [key]}, {"0": lay}, ttl_s=ttl)
    print("PUBLISHED", time.time(), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("skew", ["+90s", "-90s"])
def test_a_producers_skewed_wall_clock_does_not_change_its_holds(make_cluster, skew):
    env = _faketime_env(FAKETIME=skew)
    wall, mono = _clocks_under(env)
    want = float(skew.rstrip("s"))
    if not (abs(wall - want) < 10 and abs(mono) < 10):
        pytest.fail(f"libfaketime does not shift Python's clocks as expected here (wall {wall:+.0f}s for {skew})")
    lc = make_cluster(nodes=1, memory="64MiB")
    key, rid = f"skew{skew}/held", f"skew{skew}-req"
    proc = subprocess.Popen([sys.executable, "-c", _PUBLISH, lc.master_addr, key, rid, str(TTL)],
                            env={**os.environ, **env}, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        t0 = time.monotonic()  # the master accepted the publish a little before this
        assert line.startswith("PUBLISHED"), f"the producer failed: {line}{proc.stderr.read()}"
        assert abs(float(line.split()[1]) - time.time() - want) < 10  # its clock really was off
    finally:
        proc.wait(30)
    with lc.client() as c:
        span = _watch(c, key, {"hold": lambda rows: rows[key].held}, t0)["hold"]
        with pytest.raises(E.HandoffExpired):
            c.handoff_claim(rid)
    print(f"hold published with a {skew} clock: seen until {span[0]:.2f}s, gone at {span[1]:.2f}s")
    _assert_lasted(f"hold published by a producer {skew} off", span)


@pytest.mark.chaos
def test_a_new_leader_rearms_holds_and_soft_pins_for_their_full_ttl(make_cluster):
    """Never shortened by a failover: a hold and a soft pin of 6 s, 2 s into them the leader
    dies; the new leader holds them for 6 s from its rebuild (past 6 s from the publish)."""
    ttl = 6.0
    lc = make_cluster(nodes=1, memory="64MiB", node_ttl="1s")
    standby = lc.start_master(wait_leader=False)
    with lc.client() as c:
        c.put_batch(["fo/held", "fo/pinned"], [b"h" * 4096, b"p" * 4096], LAY)
        t0 = time.monotonic()
        c.handoff_publish("fo-req", {"0": ["fo/held"]}, {"0": LAY}, ttl_s=ttl)
        c.pin("fo/pinned", ttl_s=ttl)
    time.sleep(2.0)
    lc.masters[0].kill()
    standby.wait_line("KVPOOL_LEADER", 20)
    t_lead = time.monotonic()
    with KVPoolClient(etcd=lc.etcd_endpoint, cluster=lc.cfg.cluster, rpc_timeout_s=20) as c:
        wait_for(lambda: c.stats().objects == 2, 10, what="the objects to be indexed again")
        spans = _watch(c, "fo/", {"hold": lambda rows: rows["fo/held"].held,
                                  "pin": lambda rows: rows["fo/pinned"].pin == "soft"}, t_lead)
    held, pinned = spans["hold"], spans["pin"]
    print(f"after the failover: hold {held[0]:.2f}-{held[1]:.2f}s, pin {pinned[0]:.2f}-{pinned[1]:.2f}s from the "
          f"new leader's start ({t_lead - t0:.2f}s after the publish)")
    for what, (last, gone) in (("hold", held), ("pin", pinned)):
        assert t_lead - t0 + last >= ttl, f"{what} shortened by the failover"
        assert last >= ttl - EARLY - 0.5 and gone <= ttl + LATE, f"{what}: {last:.2f}-{gone:.2f}s after the rebuild"


def test_records_of_an_older_release_are_held_for_the_time_left_on_the_wall_clock():
    """Wire-version-1 records carry absolute Unix-time deadlines: converted to the time left
    (never negative); new records keep their durations."""
    now = time.time()
    old_h = msgspec.msgpack.encode({"request_id": "old", "keys": {"0": ["k"]}, "layouts": {}, "producer": "p",
                                    "deadline": now + 100.0, "num_tokens": 3, "extra": {}})
    old_past = msgspec.msgpack.encode({"request_id": "past", "keys": {}, "layouts": {}, "producer": "p",
                                       "deadline": now - 100.0})
    new_h = M.encode(M.HandoffRecord("new", {"0": ["k"]}, {"0": LAY}, "p", 30.0, published_at=now))
    old_p = msgspec.msgpack.encode(["soft", now + 50.0, 1, 2])  # [key, until, size, checksum]
    old_hard = msgspec.msgpack.encode(["hard", None, 1, 2])
    new_p = M.encode(M.PinRecord("new", 20.0, 1, 2, now))
    hs, ps = decode_records([old_h, old_past, new_h, b"junk"], [old_p, old_hard, new_p, b"junk"])
    by = {h.request_id: h for h in hs}
    assert set(by) == {"old", "past", "new"} and by["past"].ttl_s == 0.0 and by["new"].ttl_s == 30.0
    assert 95 < by["old"].ttl_s <= 100 and by["old"].num_tokens == 3 and by["new"].layouts == {"0": LAY}
    pins = {p.key: p.ttl_s for p in ps}
    assert 45 < pins["soft"] <= 50 and pins["hard"] is None and pins["new"] == 20.0
