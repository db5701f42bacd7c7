"""Puts through extents reserved ahead of need (connector/reserved_puts.py), over real
etcd, master and store-node processes: what lands, what is given back, failover with
reservations outstanding, and refused input."""
import os
import signal
import threading

import pytest

from kvpool.connector.client import KVPoolClient
from kvpool.protocol import messages as M
from kvpool.protocol import transport
from kvpool.protocol.dataplane import DataRequest, frame
from kvpool.protocol.errors import InvalidRequest
from tests.conftest import wait_for

KiB = 1 << 10


@pytest.mark.parametrize("path", ["auto", "tcp"])
def test_puts_land_through_reservations_and_read_back(make_cluster, path):
    lc = make_cluster(nodes=2, memory="64MiB", replicas=2)
    data = {f"r/{i}": os.urandom(64 * KiB) for i in range(120)}
    with lc.client(transport=path) as c:
        keys = list(data)
        assert all(c.put(k, data[k]) for k in keys[:20])  # one by one
        assert c.put_batch(keys[20:], [data[k] for k in keys[20:]]) == [None] * 100
        st = c.stats()
        assert st.counters["puts_reserved"] == 120 and st.counters.get("puts", 0) == 120
        assert c.reservations_held() > 0 and st.reserved_bytes > 0
        assert c.put(keys[0], data[keys[0]]) is False  # stored already: the reservation stays the writer's
        held = c.reservations_held()
        assert c.put_batch_results(["r/odd"], [b"x" * 1000])[0].replicas == 2  # another size, 2 replicas
        for k, v in data.items():
            assert c.get(k) == v
        assert c.reservations_held() >= held
    with lc.client() as fresh:  # closing gave every reservation back
        wait_for(lambda: fresh.stats().reserved_bytes == 0, 10, what="reservations given back")
        info = fresh.lookup(["r/5"])[0]
        assert len(info.replicas) == 2


def test_unused_reservations_are_given_back_before_the_master_frees_them(make_cluster):
    lc = make_cluster(nodes=1, memory="32MiB", put_timeout="1s", quarantine="500ms")
    with lc.client() as c:
        for i in range(3):
            assert c.put(f"e/{i}", bytes([i]) * (64 * KiB))
        assert c.reservations_held() > 0
        wait_for(lambda: c.reservations_held() == 0, 10, what="the client's reaper to give them back")
        wait_for(lambda: c.stats().reserved_bytes == 0, 10, what="the master to free them")
        wait_for(lambda: c.stats().nodes[0].used == 3 * 64 * KiB, 10, what="quarantine over")
        assert c.put("e/late", b"z" * (64 * KiB)) and c.get("e/late") == b"z" * (64 * KiB)
        assert [c.get(f"e/{i}") for i in range(3)] == [bytes([i]) * (64 * KiB) for i in range(3)]


def test_failover_with_reservations_outstanding_loses_no_acknowledged_put(make_cluster):
    """Puts run in a loop while the leader is SIGKILLed; the new leader knows none of the
    old term's reservations. Every put that returned is readable afterwards with its bytes,
    and puts go on through reservations of the new term."""
    lc = make_cluster(nodes=1, memory="64MiB", node_ttl="1s")
    standby = lc.start_master(wait_leader=False)
    acked: dict[str, bytes] = {}
    errors: list[BaseException] = []
    stop = threading.Event()
    c = KVPoolClient(etcd=lc.etcd_endpoint, cluster=lc.cfg.cluster, rpc_timeout_s=20, security=lc.security)

    def writer():
        i = 0
        while not stop.is_set():
            k, v = f"f/{i}", os.urandom(32 * KiB)
            try:
                if c.put(k, v):
                    acked[k] = v
            except Exception as e:  # noqa: BLE001 - a put may fail during the election; never lie
                errors.append(e)
            i += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    wait_for(lambda: len(acked) >= 50, 30, what="puts before the failover")
    # (between a put that took the last one and the reply that grants more, the client holds none)
    wait_for(lambda: c.reservations_held() > 0, 30, what="reservations held by the writer")
    lc.masters[0].kill(signal.SIGKILL)
    standby.wait_line("KVPOOL_LEADER", 20)
    before = len(acked)
    wait_for(lambda: len(acked) >= before + 50, 60, what="puts after the failover")
    stop.set()
    t.join(30)
    st = c.stats()
    assert st.counters.get("puts_reserved", 0) > 0  # the new term's reservations are used
    c.close()
    with KVPoolClient(etcd=lc.etcd_endpoint, cluster=lc.cfg.cluster, rpc_timeout_s=20,
                      security=lc.security) as r:
        assert [k for k, v in acked.items() if r.get(k) != v] == []
    assert all(not isinstance(e, AssertionError) for e in errors), errors


def test_after_a_failover_no_put_meets_the_claims_of_the_old_terms_reservations(make_cluster):
    """The leader dies while a batch is being committed; the writer holds more reservations
    claimed ahead. The new leader knows none of them, revokes the batch and places it again
    over their extents: the writer ends those claims as soon as it sees the new term, so no
    put fails on its own claims (ExtentBusy)."""
    lc = make_cluster(nodes=2, memory="256MiB", node_ttl="1s", replicas=1)
    standby = lc.start_master(wait_leader=False)
    data = [os.urandom(64 * KiB) for _ in range(64)]
    with KVPoolClient(etcd=lc.etcd_endpoint, cluster=lc.cfg.cluster, rpc_timeout_s=20, security=lc.security) as c:
        for b in range(14):
            assert c.put_batch([f"fo/{b}/{i}" for i in range(64)], data) == [None] * 64
        assert c.reservations_held() > 0
        call = c.rpc.call

        def failover_then(req, *a, **k):  # the leader dies with this batch copied, not committed
            if isinstance(req, M.PutReserved) and lc.masters[0].alive():
                lc.masters[0].kill(signal.SIGKILL)
                standby.wait_line("KVPOOL_LEADER", 20)
            return call(req, *a, **k)

        c.rpc.call = failover_then
        for b in range(14, 18):
            assert c.put_batch([f"fo/{b}/{i}" for i in range(64)], data) == [None] * 64, b
        assert c.get_batch([f"fo/{b}/{i}" for b in range(18) for i in range(64)]) == data * 18


def test_refused_reservation_input(make_cluster):
    lc = make_cluster(nodes=1, memory="16MiB")
    with lc.client() as c:
        with pytest.raises(InvalidRequest):
            c.rpc.call(M.Reserve(64 * KiB, 5000, c.host_id))
        with pytest.raises(InvalidRequest):
            c.rpc.call(M.Reserve(-1, 1, c.host_id))
        got = c.rpc.call(M.Reserve(64 * KiB, 2, c.host_id))
        rid = got.reservations[0].res_id
        rep = c.rpc.call(M.PutReserved([M.ReservedPut("bad/unknown", 987654321, 64 * KiB, 1),
                                        M.ReservedPut("bad/size", rid, 1000, 1)]))
        assert [e.code for e in rep.results] == ["put_revoked", "invalid_request"]
        assert not c.exists("bad/unknown") and not c.exists("bad/size")
        # a reservation's keyless grant commits nothing on the node: a commit frame naming no
        # key, or naming a key with the keyless token, is dropped
        ref = got.reservations[1].replicas[0]
        s = transport.connect(ref.shm_path, 5.0, lc.security)
        try:
            s.sendall(frame(DataRequest("commit", ref.incarnation, ref.offset, ref.size, ref.gen, "", 1, None,
                                        ref.token)) +
                      frame(DataRequest("commit", ref.incarnation, ref.offset, ref.size, ref.gen, "bad/forged", 1,
                                        None, ref.token)) +
                      frame(DataRequest("ping", ref.incarnation)))
            s.settimeout(5.0)
            assert s.recv(4096)  # the node answered the ping: it is serving
        finally:
            s.close()
        c.rpc.call(M.Reserve(0, 0, c.host_id, 0, [r.res_id for r in got.reservations]))
        wait_for(lambda: c.stats().reserved_bytes == 0, 10, what="reservations given back")
        assert c.put("ok", b"fine") and c.get("ok") == b"fine"
        assert not c.exists("bad/forged")
        late = c.rpc.call(M.PutReserved([M.ReservedPut("bad/again", rid, 64 * KiB, 1)])).results
        assert late[0].code == "put_revoked"  # given back: this master holds it no more


def test_reservations_off_uses_put_start(make_cluster):
    lc = make_cluster(nodes=1, memory="16MiB")
    with lc.client(reserve_bytes=0) as c:
        assert c.put_batch([f"o/{i}" for i in range(5)], [b"v" * 4096] * 5) == [None] * 5
        assert c.reservations_held() == 0
        st = c.stats()
        assert st.counters.get("puts_reserved", 0) == 0 and st.reserved_bytes == 0


def test_a_batch_ends_its_claims_when_it_returns_and_a_single_put_queues_them(make_cluster):
    """The claim ends and commit copies of a committed batch leave with its answer (the
    node takes them in while the caller makes its next batch); a single put's wait up to
    5 ms to go out with later ones."""
    lc = make_cluster(nodes=1, memory="64MiB")
    with lc.client(transport="auto") as c:
        data = [os.urandom(64 * KiB) for _ in range(16)]
        for b in range(3):
            assert c.put_batch([f"fb/{b}/{i}" for i in range(16)], data) == [None] * 16
            assert not c.reserved.ends_pending
        assert c.put("fb/single", data[0]) and c.reserved.ends_pending
        wait_for(lambda: not c.reserved.ends_pending, 5, what="the queued ends sent by the reaper")
        assert c.get_batch([f"fb/{b}/{i}" for b in range(3) for i in range(16)]) == data * 3


_CLAIMER = r"""
import sys
import msgspec
from kvpool.protocol import transport
from kvpool.protocol.auth import Security
from kvpool.protocol.config import load_config
from kvpool.protocol.dataplane import DataReply, HeldExtent, batch_frames
cfg, path, inc, off, size, gen, token = sys.argv[1:8]
s = transport.connect(path, 5.0, Security.from_config(load_config(cfg, environ={}).security))
s.settimeout(5.0)
s.sendall(b"".join(batch_frames("claims", inc, [HeldExtent(int(off), int(size), int(gen), bytes.fromhex(token))])))
n = int.from_bytes(s.recv(4), "little")
body = b""
while len(body) < n:
    body += s.recv(65536)
e = msgspec.msgpack.decode(body, type=DataReply).errors[0]
print(e.code if e is not None else "claimed")
"""


def _other_process_claims(lc, ref) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CLAIMER, lc.write_config(), ref.shm_path, ref.incarnation,
                          str(ref.offset), str(ref.size), str(ref.gen), ref.token.hex()],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_writer_that_reconnects_owns_the_claims_its_closed_connection_left(make_cluster):
    """A node owns claims per connection; when a live writer's connection closes with claims
    outstanding, they stay (it may still be copying), and its next connection takes them
    over, so it can end them there instead of the range staying busy until it exits."""
    from kvpool.protocol.dataplane import HeldExtent, batch_frames

    lc = make_cluster(nodes=1, memory="16MiB")
    with lc.client(reserve_bytes=0) as c:
        ref = c.rpc.call(M.Reserve(64 * KiB, 1, c.host_id)).reservations[0].replicas[0]
        held = [HeldExtent(ref.offset, ref.size, ref.gen, ref.token)]
        first = transport.connect(ref.shm_path, 5.0, lc.security)
        first.settimeout(5.0)
        first.sendall(b"".join(batch_frames("claims", ref.incarnation, held)))
        assert first.recv(4)  # the node answered the claim
        first.close()
        assert _other_process_claims(lc, ref) == "extent_busy"  # left behind, not ended
        again = transport.connect(ref.shm_path, 5.0, lc.security)
        try:
            again.sendall(b"".join(batch_frames("written_all", ref.incarnation, held)))  # ended from a new connection
            assert wait_for(lambda: _other_process_claims(lc, ref) == "claimed", 10, interval_s=0.2,
                            what="the range claimable by another process")
        finally:
            again.close()
