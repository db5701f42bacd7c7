"""Polling for a reply before sleeping (protocol/spin.py), on real socket pairs, and the
client setting that bounds it."""
from __future__ import annotations

import os
import socket
import time

import msgspec
import psutil
import pytest

from kvpool.connector.client import KVPoolClient
from kvpool.protocol.config import ClusterConfig, ClientConfig
from kvpool.protocol.errors import ConfigError
from kvpool.protocol.dataplane import FrameReader
from kvpool.protocol import spin
from kvpool.protocol.spin import BACKOFF_MAX, HOG_S, HOLD_S, STOLEN_IN_A_ROW, Spinner, Stolen, spin_readable
from kvpool.protocol.units import parse_duration


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_spin_sees_bytes_already_there_and_ones_that_arrive_while_it_polls(pair):
    a, b = pair
    b.send(b"x")
    assert spin_readable(a, 0.001)
    a.recv(1)
    pid = os.fork()  # the sender is another process, as a server is (a thread of ours would take our GIL)
    if pid == 0:
        try:
            time.sleep(0.002)
            b.send(b"y")
        finally:
            os._exit(0)
    try:
        got = spin_readable(a, 5.0)  # returns once the byte lands, long before the bound
        if isinstance(got, Stolen):  # the poll gave way to another task (a busy host): the read blocks
            assert not got
            a.settimeout(5.0)
    finally:
        os.waitpid(pid, 0)
    assert a.recv(1) == b"y"


def test_polls_that_keep_losing_their_yields_to_cpu_bound_tasks_stop_polling(pair, monkeypatch):
    """A yield that keeps the CPU away past HOG_S (a task running whole time slices) ends
    the poll with a falsy Stolen; a shorter one (a peer that ran briefly) does not. Two such
    polls in a row make the Spinner poll nothing for HOLD_S; one alone only backs off."""
    a, b = pair
    clock = [0.0]  # the poll's clock, moved only by its yields: each is away `away` seconds
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    away = HOG_S / 5

    def pause() -> None:
        clock[0] += away

    monkeypatch.setattr(os, "sched_yield", pause)
    assert spin_readable(a, 0.003) is False  # brief absences: polled to the bound
    away = HOG_S * 2
    got = spin_readable(a, 5.0)
    assert isinstance(got, Stolen) and not got and got > HOG_S
    s = Spinner(0.01)
    s.wait(FrameReader(a))  # once: backs off as for no answer, no hold
    assert (s.skip, s.backoff, s.stolen, s.busy()) == (1, 2, 1, False)
    b.send(b"x")
    s.skip = 0
    s.wait(FrameReader(a))  # an answer in between: the count starts again
    a.recv(1)
    assert (s.stolen, s.backoff) == (0, 1)
    for _ in range(STOLEN_IN_A_ROW):
        s.skip = 0
        s.wait(FrameReader(a))
    assert s.busy() and s.held_until - time.monotonic() == pytest.approx(HOLD_S, abs=0.5)
    monkeypatch.undo()  # the real clock again
    yields = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    s.skip = 0
    s.wait(FrameReader(a))  # held: no poll, the read sleeps at once
    assert s.spin(lambda: False, 0.01) is None
    assert s.skip == 0 and not yields
    s.held_until = time.monotonic() - 1  # the hold over: polled again
    s.wait(FrameReader(a))
    assert yields


def test_spinner_backs_off_while_polls_go_unanswered_and_resets_on_an_answer(pair, monkeypatch):
    monkeypatch.setattr(spin, "HOG_S", float("inf"))  # a busy test machine's long yields: not what this tests
    a, b = pair
    a = FrameReader(a)  # what the client's streams and master connection read through
    s = Spinner(0.0005)
    s.wait(a)  # nothing comes: the next wait sleeps at once, then 2, then 4 ...
    assert (s.skip, s.backoff) == (1, 2)
    s.wait(a)
    assert s.skip == 0
    s.wait(a)
    assert (s.skip, s.backoff) == (2, 4)
    for _ in range(10):
        s.skip = 0
        s.wait(a)
    assert (s.skip, s.backoff) == (BACKOFF_MAX, BACKOFF_MAX)  # capped
    s.skip = 0
    b.send(b"x")
    s.wait(a)
    assert (s.skip, s.backoff) == (0, 1)
    a.lo, a.hi = 0, 1  # a byte already buffered: no poll at all, nothing changes
    s.skip = 3
    s.wait(a)
    assert s.skip == 3
    Spinner(0).wait(a)  # off


def test_spin_wait_setting_is_checked():
    assert parse_duration(ClientConfig().spin_wait) == pytest.approx(100e-6)
    assert parse_duration("250us") == pytest.approx(250e-6)
    with pytest.raises(ConfigError, match="client.spin_wait"):
        ClusterConfig(client=ClientConfig(spin_wait="1s")).validate()
    with pytest.raises(ConfigError, match="spin_wait"):
        KVPoolClient("tcp://127.0.0.1:1", spin_wait_s=-1.0)


def test_spinner_spin_returns_what_became_ready_and_backs_off_like_waits():
    """The master's poll for its next request: ready's result as soon as it is truthy;
    None when nothing came within the bound (and the next polls back off), or when off."""
    s = Spinner(0.001)
    calls = []
    assert s.spin(lambda: calls.append(1) or (len(calls) >= 3 and ["event"]), 1.0) == ["event"]
    assert (s.skip, s.backoff) == (0, 1)
    assert s.spin(lambda: [], 0.0005) is None
    assert (s.skip, s.backoff) == (1, 2)
    assert s.spin(lambda: ["never asked"], 1.0) is None and s.skip == 0  # skipped: the caller sleeps
    assert s.spin(lambda: ["x"], 0) is None  # no time left in the window
    assert Spinner(0).spin(lambda: ["x"], 1.0) is None  # off


def test_master_spin_wait_setting_is_checked_and_reaches_the_master():
    from kvpool.master.server_settings import MasterServerSettings
    from kvpool.protocol.config import MasterConfig

    assert MasterConfig().spin_wait == pytest.approx(300e-6)
    for bad in ("1s", "-1us"):
        with pytest.raises(ConfigError, match="master.spin_wait"):
            ClusterConfig(master=MasterConfig(spin_wait=bad)).validate()
    cfg = ClusterConfig(master=MasterConfig(spin_wait="0"))
    cfg.validate()
    cfg = msgspec.structs.replace(cfg, etcd=msgspec.structs.replace(cfg.etcd, endpoint="http://127.0.0.1:2379"),
                                  security=msgspec.structs.replace(cfg.security, insecure=True))
    assert MasterServerSettings.from_config(cfg).spin_wait_s == 0


@pytest.mark.parametrize("spin_wait", ["300us", "0"])
def test_a_master_serves_while_polling_or_not_and_polls_nothing_when_idle(make_cluster, spin_wait):
    """One request per reply, as a writer of single objects sends them, through a master
    that polls for the next request (the default) and one that sleeps at once; once the
    requests stop, the polling one stops too: over 2 s of silence it uses a small fraction
    of the CPU that polling throughout would (2 s)."""
    lc = make_cluster(spin_wait=spin_wait)
    with lc.client() as c:
        for i in range(300):
            assert c.put(f"spin/{i}", bytes([i % 251]) * 4096)
        assert [bytes(c.get(f"spin/{i}"))[:1] for i in range(0, 300, 37)] == [bytes([i % 251]) for i in range(0, 300, 37)]
        master = psutil.Process(lc.masters[0].proc.pid)
        before = sum(master.cpu_times()[:2])
        time.sleep(2.0)
        assert sum(master.cpu_times()[:2]) - before < 0.5
