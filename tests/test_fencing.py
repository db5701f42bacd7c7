"""Leader fencing (DESIGN.md §8): a leader that cannot renew its etcd lease stops
acknowledging before a standby can be elected, and terms make store nodes and clients
refuse a deposed leader. Real etcd, masters, store nodes and clients; the partition test
puts each host in its own network namespace (:mod:`tests.netns`). Marked chaos.

Each scenario prints one ``FENCING ...`` line with its figures (run with ``-s``)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvpool.cli.cluster import Child, find_etcd, free_port, kvpool_argv
from kvpool.protocol import messages as M
from kvpool.protocol.errors import StaleTerm
from kvpool.protocol.terms import first_gen, gen_term
from kvpool.storenode.extents import ExtentTable

from tests import netns
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
TTL = "2s"  # the masters' leadership lease (and the nodes' registration) TTL


# ---- pure pieces ------------------------------------------------------------------------

def test_a_grant_carries_its_term_and_a_node_refuses_older_terms():
    assert gen_term(first_gen(7)) == 7 and gen_term(first_gen(7) + 12345) == 7 and first_gen(0) == 1
    t = ExtentTable(1 << 20)
    t.check_write(0, first_gen(5))  # no term known yet: accepted
    t.term = 6
    with pytest.raises(StaleTerm, match="term 5.*term 6 has been elected"):
        t.check_write(0, first_gen(5) + 3)
    t.check_write(0, first_gen(6))
    t.check_write(0, first_gen(9))  # a newer leader's grant before its term reached us: fine


def test_a_leader_is_fenced_past_half_its_lease_ttl_and_when_deposed():
    from kvpool.master.fencing import Fence
    from kvpool.protocol.etcd import LeaseClock

    clock = LeaseClock()
    clock.renewed_at, clock.ttl_s = 100.0, 2.0
    f = Fence()
    f.lead(7, clock)
    assert not f.check(100.9) and f.check(101.1)  # half the TTL after the last renewal was sent
    clock.renewed_at = 101.0  # renewed again
    assert not f.check(101.5)
    f.deposed = True  # a store node saw a newer term
    assert f.check(101.5)
    f.lead(9, clock)
    assert not f.fenced(101.5)


def test_wire_messages_carry_the_term():
    for m in (M.NodeCommit([], 9), M.NodeFree([(0, 1)], 9), M.NodeList(9)):
        assert M.decode_node_request(M.encode(m)).term == 9
    assert M.decode_result(M.encode(M.Reply(term=11)), M.Reply).term == 11


def test_a_store_node_refuses_notices_and_grants_of_a_deposed_leader(make_cluster):
    """The node learns the leader's term (from the leader's table request and from etcd);
    a free notice stamped with an older term is refused with StaleTerm and frees nothing,
    and so is a write carrying a grant of an older term."""
    import msgspec
    import zmq

    from kvpool.protocol.dataplane import DataRequest, frame, recv_reply
    from kvpool.protocol.etcd import Keys, read_meta_sync
    from kvpool.protocol import transport

    lc = make_cluster(nodes=1, memory="32MiB")
    keys = Keys(lc.cfg.cluster)
    term = read_meta_sync(lc.etcd_endpoint, keys.leader)[1]
    desc = msgspec.msgpack.decode(read_meta_sync(lc.etcd_endpoint, keys.node("node-0"))[0], type=M.NodeDesc)
    with lc.client() as c:
        c.put("term/k", b"t" * 4096)
        ref = c.lookup(["term/k"])[0].replicas[0]
        assert gen_term(ref.gen) == term  # the grant carries the leader's term
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(desc.ctrl_addr)
            sock.send(M.encode(M.NodeFree([(ref.offset, ref.gen)], term - 1)))
            assert sock.poll(10_000), "no answer from the node"
            rep = msgspec.msgpack.decode(sock.recv(), type=M.Reply)
        finally:
            sock.close(0)
            ctx.term()
        assert rep.error is not None and rep.error.code == "stale_term", rep
        assert c.get("term/k") == b"t" * 4096  # nothing was freed
        old_gen = first_gen(term - 1) + 5  # a grant of the previous term (the token is checked first)
        from kvpool.protocol.grants import grant_token

        s = transport.connect(desc.data_addr, 5.0)
        try:
            tok = grant_token(desc.grant_key, desc.incarnation, ref.offset, 16, old_gen, "term/x")
            s.sendall(frame(DataRequest("write", desc.incarnation, ref.offset, 16, old_gen, "term/x", 0, None, tok)))
            s.sendall(b"x" * 16)
            got = recv_reply(s)
        finally:
            s.close()
        assert not got.ok and got.error.code == "stale_term", got
        assert c.get("term/k") == b"t" * 4096


# ---- helpers ----------------------------------------------------------------------------

def _acks(path: str) -> list[dict]:
    try:
        return [json.loads(line) for line in open(path) if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _load_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.fence_load", *args]


def _figures(acks: list[dict], cut: float, old: str, new: str) -> dict:
    ok = [a for a in acks if a["ok"]]
    after = sorted(a["t1"] for a in ok if a["t1"] > cut)
    by_old = [a["t1"] for a in ok if a["leader"] == old]
    by_new = [a["t1"] for a in ok if a["leader"] == new]
    return {
        "acked": len(ok), "acked_during_cut": sum(1 for a in ok if a["t1"] > cut),
        "old_acked_after_cut_s": round(max(by_old) - cut, 3) if by_old and max(by_old) > cut else 0.0,
        "new_first_ack_after_cut_s": round(min(by_new) - cut, 3) if by_new else None,
        "failed_puts": sum(1 for a in acks if not a["ok"]),
        "overlap_s": round(max(0.0, max(by_old) - min(by_new)), 3) if by_old and by_new else 0.0,
        # longest time without an acknowledgement after the cut (the client's view of the hand-over)
        "max_ack_gap_s": round(max((b - a for a, b in zip([cut] + after, after)), default=0.0), 3),
        "errors": sorted({a["err"].split(":")[0] for a in acks if a["err"]}),
    }


# ---- a leader cut off from etcd ---------------------------------------------------------

@pytest.mark.chaos
def test_a_leader_cut_off_from_etcd_loses_no_acknowledged_put(tmp_path):
    """etcd alone on its own subnet; master A, master B, two store nodes and a client on a
    LAN, each also linked to etcd's subnet. A leads under put load, then A's link to
    etcd's subnet goes down: clients and nodes still reach A. A must stop acknowledging
    before B is elected, every put acknowledged (by A or B) must read back intact from B,
    and A, once it sees etcd again, must not answer as leader."""
    netns.require()
    with netns.Net("fnc") as net:
        lan, back = net.bridge("lan", "10.201.0"), net.bridge("etcd", "10.201.1")
        hosts = {n: net.host(n) for n in ("etcd", "ma", "mb", "n0", "n1", "cl")}
        etcd_ip = net.link(hosts["etcd"], back)
        lan_ip = {}
        for n in ("ma", "mb", "n0", "n1", "cl"):
            lan_ip[n] = net.link(hosts[n], lan)
            net.link(hosts[n], back)
        ep = f"http://{etcd_ip}:2379"
        log_dir, kids = str(tmp_path), []
        try:
            kids.append(Child("etcd", net.argv(hosts["etcd"], [
                find_etcd(), "--name", "e", "--data-dir", str(tmp_path / "etcd-data"),
                "--listen-client-urls", ep, "--advertise-client-urls", ep,
                "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380", "--initial-cluster", "e=http://127.0.0.1:2380"]), log_dir))
            _wait_etcd(net, hosts["cl"], ep)
            common = ["--etcd", ep, "--node-ttl", TTL]
            ma = Child("master-a", net.argv(hosts["ma"], kvpool_argv(
                "master", *common, "--host", lan_ip["ma"], "--replicas", "1")), log_dir)
            kids.append(ma)
            a_addr = ma.wait_line("KVPOOL_READY master", 30).split()[-1]
            ma.wait_line("KVPOOL_LEADER", 30)
            mb = Child("master-b", net.argv(hosts["mb"], kvpool_argv(
                "master", *common, "--host", lan_ip["mb"], "--replicas", "1")), log_dir)
            kids.append(mb)
            b_addr = mb.wait_line("KVPOOL_READY master", 30).split()[-1]
            for n in ("n0", "n1"):
                kids.append(Child(n, net.argv(hosts[n], kvpool_argv(
                    "storenode", *common, "--name", n, "--memory", "256MiB", "--host", lan_ip[n],
                    "--host-id", f"host-{n}", "--run-dir", str(tmp_path))), log_dir))
            for k in kids[-2:]:
                k.wait_line("KVPOOL_READY storenode", 30)

            acks, stop = str(tmp_path / "acks.jsonl"), str(tmp_path / "stop")
            load = Child("load", net.argv(hosts["cl"], _load_argv("load", ep, acks, stop, "2")), log_dir)
            kids.append(load)
            wait_for(lambda: sum(a["ok"] for a in _acks(acks)) >= 40, 60, 0.1, what="40 puts acknowledged by A")
            cut = time.monotonic()
            net.cut(hosts["ma"], back)
            wait_for(lambda: any(line.startswith("KVPOOL_LEADER") for line in mb.lines), 60, 0.05,
                     what="master B to lead")
            lead_s = time.monotonic() - cut
            wait_for(lambda: sum(a["ok"] and a["leader"] == b_addr for a in _acks(acks)) >= 40, 60, 0.1,
                     what="40 puts acknowledged by B")
            Path(stop).touch()
            load.proc.wait(60)
            net.restore(hosts["ma"], back)

            out = str(tmp_path / "verify.json")
            v = Child("verify", net.argv(hosts["cl"], _load_argv("verify", ep, acks, out, a_addr)), log_dir)
            kids.append(v)
            assert v.proc.wait(120) == 0, v.tail()
            res = json.load(open(out))
            fig = _figures(_acks(acks), cut, a_addr, b_addr)
            print(f"\nFENCING partition: {fig}, B printed KVPOOL_LEADER {lead_s:.2f}s after the cut, "
                  f"read back {res}", flush=True)
            assert res["checked"] == fig["acked"] > 80
            assert (res["missing"], res["wrong"]) == (0, 0), res
            assert fig["overlap_s"] == 0.0, f"A acknowledged after B did: {fig}"
            assert res["old_refuses"], "master A still answers as leader after it saw etcd again"
            log_a = open(ma.log_path).read()
            assert "acknowledging no change" in log_a, log_a[-3000:]
        finally:
            for k in reversed(kids):
                k.stop()


def _wait_etcd(net: netns.Net, host: netns.Host, ep: str) -> None:
    code = ("import sys, time\nfrom kvpool.protocol.etcd import read_key_sync\nd = time.monotonic() + 30\n"
            "while True:\n  try:\n    read_key_sync(sys.argv[1], '/kvpool/ping', 1.0); break\n"
            "  except Exception:\n    assert time.monotonic() < d, 'etcd not ready'\n    time.sleep(0.1)\n")
    import subprocess

    subprocess.run(net.argv(host, [sys.executable, "-c", code, ep]), check=True, timeout=60)


# ---- a 3-member etcd losing the member the leader uses ----------------------------------

@pytest.mark.chaos
def test_losing_the_etcd_member_the_leader_uses_gives_no_second_leader(tmp_path):
    """Three etcd members; master A talks first to the member that is etcd's raft leader,
    master B, the store nodes and the client to the others. Under put load that member is
    SIGKILLed (etcd must elect a new raft leader too). A must fail over to
    another member and keep (or, if its lease lapsed, cleanly hand over) the leadership:
    at no time do both masters answer as leader, and every acknowledged put reads back."""
    binary, log_dir = find_etcd(), str(tmp_path)
    ports = [(free_port(), free_port()) for _ in range(3)]
    peers = ",".join(f"e{i}=http://127.0.0.1:{p}" for i, (_, p) in enumerate(ports))
    eps = [f"http://127.0.0.1:{c}" for c, _ in ports]
    kids: list[Child] = []
    try:
        members = []
        for i, (c, p) in enumerate(ports):
            members.append(Child(f"etcd-{i}", [
                binary, "--name", f"e{i}", "--data-dir", str(tmp_path / f"etcd-{i}"),
                "--listen-client-urls", eps[i], "--advertise-client-urls", eps[i],
                "--listen-peer-urls", f"http://127.0.0.1:{p}", "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{p}", "--initial-cluster", peers, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"fence-{os.getpid()}"], log_dir))
        kids += members
        from kvpool.protocol.etcd import read_key_sync

        wait_for(lambda: _answers(read_key_sync, eps[1]), 60, 0.2, what="the etcd cluster to answer")
        # the worst case: the member A uses is etcd's raft leader, so etcd elects a new one too
        lead = wait_for(lambda: (i := _raft_leader(eps)) is not None and (i,), 30, 0.2,
                        what="etcd to have a raft leader")[0]
        eps = [eps[lead]] + [e for i, e in enumerate(eps) if i != lead]
        members = [members[lead]] + [m for i, m in enumerate(members) if i != lead]
        a_list, others = ",".join(eps), ",".join([eps[1], eps[2], eps[0]])
        ma = Child("master-a", kvpool_argv("master", "--etcd", a_list, "--node-ttl", TTL, "--replicas", "1"), log_dir)
        kids.append(ma)
        a_addr = ma.wait_line("KVPOOL_READY master", 30).split()[-1]
        ma.wait_line("KVPOOL_LEADER", 30)
        mb = Child("master-b", kvpool_argv("master", "--etcd", others, "--node-ttl", TTL, "--replicas", "1"), log_dir)
        kids.append(mb)
        b_addr = mb.wait_line("KVPOOL_READY master", 30).split()[-1]
        for n in ("n0", "n1"):
            kids.append(Child(n, kvpool_argv("storenode", "--etcd", others, "--node-ttl", TTL, "--name", n,
                                             "--memory", "256MiB", "--host-id", f"host-{n}", "--run-dir",
                                             str(tmp_path)), log_dir))
        for k in kids[-2:]:
            k.wait_line("KVPOOL_READY storenode", 30)

        acks, stop = str(tmp_path / "acks.jsonl"), str(tmp_path / "stop")
        load = Child("load", _load_argv("load", others, acks, stop, "2"), log_dir)
        kids.append(load)
        wait_for(lambda: sum(a["ok"] for a in _acks(acks)) >= 40, 60, 0.1, what="40 puts acknowledged")
        probe = _LeaderProbe([a_addr, b_addr])
        probe.start()
        cut = time.monotonic()
        members[0].kill(signal.SIGKILL)
        # three lease TTLs and at least 60 more acknowledged puts after the kill
        wait_for(lambda: time.monotonic() - cut > 6 and sum(a["ok"] and a["t1"] > cut for a in _acks(acks)) >= 60,
                 60, 0.1, what="60 puts acknowledged after the kill")
        probe.stop()
        Path(stop).touch()
        load.proc.wait(60)
        out = str(tmp_path / "verify.json")
        v = Child("verify", _load_argv("verify", others, acks, out), log_dir)
        kids.append(v)
        assert v.proc.wait(120) == 0, v.tail()
        res = json.load(open(out))
        fig = _figures(_acks(acks), cut, a_addr, b_addr)
        both = probe.both_leading_s()
        print(f"\nFENCING etcd member loss: {fig}, both masters answering as leader for {both:.3f}s "
              f"(probe: {probe.summary()}), B led: {any(l.startswith('KVPOOL_LEADER') for l in mb.lines)}, "
              f"A fenced itself: {'acknowledging no change' in open(ma.log_path).read()}, "
              f"read back {res}", flush=True)
        assert (res["missing"], res["wrong"]) == (0, 0), res
        assert res["checked"] == fig["acked"]
        assert both == 0.0 and fig["overlap_s"] == 0.0, (both, fig)
    finally:
        for k in reversed(kids):
            k.stop()


def _raft_leader(eps: list[str]) -> int | None:
    """Index in ``eps`` of etcd's raft leader (asked through etcd's JSON gateway), or None."""
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    ids = []
    for ep in eps:
        try:
            with direct.open(urllib.request.Request(ep + "/v3/maintenance/status", b"{}"), timeout=2) as r:
                st = json.load(r)
        except (OSError, ValueError, KeyError):
            return None
        ids.append((st["header"]["member_id"], st.get("leader")))
    leaders = {lead for _, lead in ids}
    return next((i for i, (mid, _) in enumerate(ids) if leaders == {mid}), None)


def _answers(read_key_sync, ep: str) -> bool:
    try:
        read_key_sync(ep, "/kvpool/ping", 1.0)
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


class _LeaderProbe:
    """Asks each master ``stats`` directly every 50 ms from its own thread; records when
    each answered as leader (an answer, not NotLeader / a fenced timeout)."""

    def __init__(self, addrs: list[str]) -> None:
        import threading

        self.addrs = addrs
        self.ok: dict[str, list[tuple[float, float]]] = {a: [] for a in addrs}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(a,), daemon=True) for a in addrs]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def _run(self, addr: str) -> None:
        from kvpool.connector.client import KVPoolClient
        from kvpool.protocol.errors import KVPoolError

        with KVPoolClient(addr, host_id="fence-probe", rpc_timeout_s=0.5) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    c.stats()
                    self.ok[addr].append((t0, time.monotonic()))
                except KVPoolError:
                    pass
                self._stop.wait(0.05)

    def both_leading_s(self) -> float:
        """Seconds during which both masters answered as leader: the overlap of the spans
        from each master's first to last leader answer (0 when one never led, or when one's
        answers all came before the other's)."""
        spans = [(v[0][0], v[-1][1]) for v in self.ok.values() if v]
        if len(spans) < 2:
            return 0.0
        (a0, a1), (b0, b1) = spans
        return max(0.0, min(a1, b1) - max(a0, b0))

    def summary(self) -> dict:
        return {a: len(v) for a, v in self.ok.items()}
