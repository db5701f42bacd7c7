"""Polling for a reply before sleeping (protocol/spin.py), on real socket pairs, and the
client setting that bounds it."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvpool.connector.client import KVPoolClient
from kvpool.protocol.config import ClusterConfig, ClientConfig
from kvpool.protocol.errors import ConfigError
from kvpool.protocol.dataplane import FrameReader
from kvpool.protocol.spin import BACKOFF_MAX, Spinner, spin_readable
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
    sender = threading.Timer(0.002, lambda: b.send(b"y"))
    sender.start()
    assert spin_readable(a, 5.0)  # returns once the byte lands, long before the bound
    sender.join()
    assert a.recv(1) == b"y"


def test_spin_gives_up_at_its_bound_and_on_what_it_cannot_poll(pair):
    a, b = pair
    assert not spin_readable(a, 0.001)
    assert not spin_readable(a, 0)
    assert not spin_readable(object(), 0.001)  # no descriptor (a ucx:// stream): the caller just blocks
    b.close()
    assert spin_readable(a, 0.001)  # end of stream is readable: the read that follows reports it


def test_spinner_backs_off_while_polls_go_unanswered_and_resets_on_an_answer(pair):
    a, b = pair
    a = FrameReader(a)  # what the client's streams and master connection read through
    s = Spinner(0.0005)
    s._busy, s._checked = False, float("inf")  # as on an idle host (the load gate is tested below)
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


def test_spinner_sleeps_at_once_on_a_busy_host(pair):
    """With every CPU taken a poll only delays the server that is to answer: no poll, and
    the backoff state stays as it was."""
    a, _ = pair
    a = FrameReader(a)
    s = Spinner(0.01)
    s._busy, s._checked = True, float("inf")
    t0 = time.perf_counter()
    s.wait(a)
    assert (s.skip, s.backoff) == (0, 1) and time.perf_counter() - t0 < 0.01
    s._checked = 0.0  # looked at again: the verdict follows the load average and the CPU count
    expect = os.getloadavg()[0] >= (os.cpu_count() or 1) - 0.5
    assert s.busy() in (expect, not expect)  # (the load may move between the two reads)
