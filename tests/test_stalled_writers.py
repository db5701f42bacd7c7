"""A revoked same-host writer never lands bytes in another object (DESIGN.md §8, Writers).

Writer A is a real process that maps the node's segment; it is frozen (SIGSTOP) at a
chosen instruction of its put, past ``put_timeout`` + ``quarantine``, while writer B stores
the same key; then A resumes (or is SIGKILLed). Real etcd, master and store node.
"""
import os
import select
import signal
import subprocess
import sys

import pytest

from kvpool.protocol import errors as E
from tests.conftest import stopped, wait_for

pytestmark = pytest.mark.chaos
KiB = 1 << 10

# Writer A: put KEY of SIZE bytes (0xAA), stopping itself (SIGSTOP) either before it asks the
# node for its extent ("before_claim") or after the node granted the claim, right before the
# copy into the shared mapping ("before_copy"). Prints "STALL <offset>", then "RESULT <error|ok>".
# RESERVE: the client's reserve_bytes (0: put_start/put_end; else the put goes into an extent
# reserved and claimed ahead of need, connector/reserved_puts.py).
_WRITER = r"""
import os, signal, sys
from kvpool.connector import dataclient, shmcopy
from kvpool.connector.client import KVPoolClient
from kvpool.protocol.config import load_config

cfg, master, key, size, where, reserve = sys.argv[1:7]
c = KVPoolClient.from_config(load_config(cfg, environ={}), master=master, reserve_bytes=int(reserve))

def stall(op):
    print("STALL", op.ref.offset, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)

write, write_shm = dataclient.DataPlane.write, shmcopy.ShmCopies.write
if where == "before_claim":
    def hooked(self, ops, deadline=None, **kw):
        stall(ops[0])
        return write(self, ops, deadline, **kw)
    dataclient.DataPlane.write = hooked
else:
    def hooked(self, op):
        stall(op)
        return write_shm(self, op)
    shmcopy.ShmCopies.write = hooked
try:
    c.put(key, b"\xaa" * int(size))
    print("RESULT ok", flush=True)
except Exception as e:
    print("RESULT", type(e).__name__, e, flush=True)
c.close()
"""


def _start_writer(lc, key: str, size: int, where: str, reserve: int = 0) -> tuple[subprocess.Popen, int]:
    """Writer A, frozen at ``where``; returns it and the offset of its grant."""
    a = subprocess.Popen([sys.executable, "-c", _WRITER, lc.write_config(), lc.master_addr, key, str(size), where,
                          str(reserve)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready, _, _ = select.select([a.stdout], [], [], 60)
    line = a.stdout.readline() if ready else ""
    assert line.startswith("STALL "), f"writer A did not reach its stall point: {line!r}"
    wait_for(lambda: stopped(a.pid), 10, what="writer A stopped")
    return a, int(line.split()[1])


def _finish(a: subprocess.Popen) -> str:
    os.kill(a.pid, signal.SIGCONT)
    out, _ = a.communicate(timeout=60)
    return out


@pytest.mark.parametrize("where,reserve", [("before_claim", 0), ("before_copy", 0), ("before_copy", 64 << 20)],
                         ids=["put_start-before_claim", "put_start-before_copy", "reserved-before_copy"])
def test_stalled_writer_never_lands_in_the_next_owner(make_cluster, where, reserve):
    """The issue's sequence: one node, put_timeout 1 s, quarantine 2 s; A put_starts k (or
    takes reserved extents, claimed at once) and stalls; once A's grant is revoked (the
    reservation expired) and its extent has left the master's quarantine, B puts k
    (acknowledged); A resumes and writes its grant. B's get(k) returns B's bytes. A's commit
    is refused (PutRevoked; through a reservation, the master no longer holds it), so A
    places the put again and finds k stored (False). Stalled before its claim, A is refused
    when it resumes (B's put took A's very extent); stalled after it, the node keeps A's
    range quarantined, so B's put lands elsewhere."""
    size = 256 * KiB
    lc = make_cluster(nodes=1, memory="16MiB", put_timeout="1s", quarantine="2s")
    a, a_off = _start_writer(lc, "k", size, where, reserve)
    try:
        with lc.client(in_flight_wait_s=0.2) as b:
            # A is revoked after put_timeout; its extent is free at the master after quarantine
            wait_for(lambda: b.stats().nodes[0].used == 0 and not b.exists("k"), 20,
                     what="A's grant revoked and released by the master")
            mine = os.urandom(size)
            assert b.put("k", mine)
            b_off = b.lookup(["k"])[0].replicas[0].offset
            out = _finish(a)
            assert "RESULT ok" in out, out  # A's revoked put is placed again and finds k stored: a no-op
            assert b.get("k") == mine
            if where == "before_claim":
                assert b_off == a_off  # the master placed B in A's extent: A was refused there
            else:
                assert b_off != a_off  # A's range stayed quarantined on the node until A said it was done
            # nothing leaked: A's range is usable again, by the same key's next owner too
            b.remove("k", force=True)
            wait_for(lambda: b.stats().nodes[0].used == 0, 20, what="B's extents freed")
            again = os.urandom(size)
            assert b.put("k", again) and b.get("k") == again
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(10)


@pytest.mark.parametrize("reserve", [0, 64 << 20], ids=["put_start", "reserved"])
def test_killed_writer_extents_are_reclaimed(make_cluster, reserve):
    """A writer SIGKILLed between its claim and its copy: while it is only stopped, its range
    stays quarantined on the node (a put that can only go there fails with a typed error);
    once the node sees the process gone, the range is reclaimed and the put lands there."""
    size = 3 << 20
    lc = make_cluster(nodes=1, memory="4MiB", put_timeout="1s", quarantine="2s")
    a, _ = _start_writer(lc, "victim", size, "before_copy", reserve)
    try:
        with lc.client(in_flight_wait_s=0.2) as b:
            wait_for(lambda: b.stats().nodes[0].used == 0, 20, what="A's grant revoked and released by the master")
            data = os.urandom(size)
            with pytest.raises((E.ExtentBusy, E.NoSpace)):
                b.put("other", data)  # only A's range can hold it, and A may still be copying
            a.kill()
            a.wait(10)

            def stored() -> bool:
                try:
                    return b.put("other", data)
                except (E.ExtentBusy, E.NoSpace):
                    return False

            wait_for(stored, 30, interval_s=0.3, what="A's range reclaimed after its process died")
            assert b.get("other") == data
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(10)


def test_claim_rules_of_the_node_table():
    """storenode/extents.py rules, without processes: a freed or superseded grant is refused
    (PutRevoked); a live claim keeps overlapping grants out (ExtentBusy) even after its own
    grant was freed, until its writer ends it."""
    from kvpool.storenode.extents import ExtentTable

    t, a, b = ExtentTable(1 << 20), object(), object()
    t.claim(0, 8192, 1, a)
    t.free(0, 1)  # the master revoked A while A may be copying
    with pytest.raises(E.ExtentBusy):
        t.claim(4096, 8192, 2, b)  # the master placed B over part of A's range
    assert t.release(0, 1, a) and not t.release(0, 1, a)
    t.claim(4096, 8192, 2, b)  # A said it was done: B may write
    with pytest.raises(E.PutRevoked):
        t.claim(0, 8192, 1, a)  # A again: freed
    t.release(4096, 2, b)
    t.record_write("k", 4096, 8192, 2, 0, None)
    with pytest.raises(E.PutRevoked):
        t.claim(0, 8192, 1, object())  # older than the overlapping row, whatever the free notices did
    t.claim(8192, 4096, 3, a)
    assert t.release_owner(a) == 1 and t.claims() == 0


def test_join_settings_are_config_keys():
    from kvpool.protocol.config import load_config

    m = load_config(None, {"master": {"join_timeout": "1s", "join_backoff": "250ms", "join_backoff_max": "8s"}},
                    environ={}).master
    assert m.join_settings() == (1.0, 0.25, 8.0)
    with pytest.raises(E.ConfigError, match="join_backoff_max"):
        load_config(None, {"master": {"join_timeout": "10s", "join_backoff_max": "5s"}}, environ={})


_HOARDER = r"""
import os, signal, sys
from kvpool.connector.client import KVPoolClient
from kvpool.protocol.config import load_config
cfg, master = sys.argv[1:3]
c = KVPoolClient.from_config(load_config(cfg, environ={}), master=master)
for r in range(2):
    assert c.put_batch([f"A/{r}/{i}" for i in range(300)], [os.urandom(4096) for _ in range(300)]) == [None] * 300
print("HELD", c.reservations_held(), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
c.close()
"""


def test_a_stopped_client_holding_reservations_does_not_fail_other_writers(make_cluster):
    """Client A holds hundreds of reservations and is frozen past put_timeout + quarantine,
    so the master frees them and places there again. A claims extents only a little ahead
    of use, so B's puts meet few of A's claims, and those that do are placed again: every
    put of B lands and reads back."""
    lc = make_cluster(nodes=1, memory="64MiB", put_timeout="1s", quarantine="1s")
    a = subprocess.Popen([sys.executable, "-c", _HOARDER, lc.write_config(), lc.master_addr],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready, _, _ = select.select([a.stdout], [], [], 120)
        line = a.stdout.readline() if ready else ""
        assert line.startswith("HELD ") and int(line.split()[1]) > 100, line
        wait_for(lambda: stopped(a.pid), 10, what="client A stopped")
        with lc.client() as b:
            wait_for(lambda: b.stats().reserved_bytes == 0, 20, what="A's reservations freed by the master")
            wait_for(lambda: b.stats().nodes[0].used == 600 * 4096, 20, what="and out of quarantine")
            data = [os.urandom(4096) for _ in range(50)]
            assert b.put_batch([f"B/{i}" for i in range(50)], data) == [None] * 50
            assert b.put("B/single", b"s" * 4096)
            assert [b.get(f"B/{i}") for i in range(50)] == data
        out = _finish(a)
        assert "Error" not in out, out
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(10)
