"""Processes of different kvpool wire versions refuse each other with a clear error
(``protocol.messages.WIRE_VERSION``) instead of misreading frames: the master does not
place on a store node of another version and reports it in ``status``; a client refuses
a master of another version at once (a ConfigError, not a timeout)."""
import sys
import time

import pytest

from kvpool.cli import cluster as cluster_mod
from kvpool.connector.client import KVPoolClient
from kvpool.protocol import errors as E
from kvpool.protocol import messages as M
from kvpool.protocol.layout import LayoutSpec, TensorSpec

from tests.conftest import wait_for


def _release(wire: int):
    """``kvpool_argv`` for a release of another wire version: the same code, its version
    constant changed, as the other processes see it."""
    code = f"import kvpool.protocol.messages as M; M.WIRE_VERSION = {wire}; from kvpool.cli.app import main; main()"
    return lambda *args: [sys.executable, "-c", code, *args]


def _start_old_node(lc, monkeypatch) -> None:
    """Store node ``old-node`` of wire version 0 (a release from before versions)."""
    monkeypatch.setattr(cluster_mod, "kvpool_argv", _release(0))
    lc.start_node("old-node", "64MiB")
    monkeypatch.undo()


def test_a_store_node_of_another_version_is_not_placed_on(make_cluster, monkeypatch):
    lc = make_cluster(nodes=1)
    _start_old_node(lc, monkeypatch)
    with lc.client() as c:
        st = wait_for(lambda: (s := c.stats()).refused and s, what="the old node to be refused")
        assert st.refused == {"old-node": 0} and [n.node_id for n in st.nodes] == ["node-0"]
        for i in range(20):
            c.put(f"v/{i}", b"x" * 4096)
            assert c.lookup([f"v/{i}"])[0].replicas[0].node_id == "node-0"
    log = open(lc.masters[0].log_path).read()
    assert "store node old-node" in log and "speaks kvpool wire version 0" in log
    assert log.count("store node old-node") == 1  # reported once, not at every membership poll


def test_a_client_of_another_version_gets_a_config_error_at_once(make_cluster, monkeypatch):
    lc = make_cluster(nodes=1)
    monkeypatch.setattr(M, "WIRE_VERSION", M.WIRE_VERSION + 1)
    t0 = time.monotonic()
    with lc.client(rpc_timeout_s=10.0) as c:
        with pytest.raises(E.ConfigError, match=rf"speaks kvpool wire version {M.WIRE_VERSION - 1}, this client "
                                                rf"{M.WIRE_VERSION}; run one kvpool"):
            c.stats()
    assert time.monotonic() - t0 < 5.0  # refused, not retried until the RPC timeout


def test_a_leader_of_another_version_keeps_pins_and_holds_for_the_next(make_cluster, monkeypatch):
    """A master of another version that wins the election can index no node; it must not
    delete the pin records of the objects it cannot see, and a later leader of the nodes'
    version finds the pin and the hand-off hold in force."""
    lc = make_cluster(nodes=1, memory="64MiB", node_ttl="1s")
    lay = LayoutSpec(kind="raw", tokens_per_block=1, tensors=(TensorSpec("b", (4096,), "uint8"),))
    with lc.client() as c:
        c.put_batch(["pv/pinned", "pv/held", "pv/plain"], [b"p" * 4096, b"h" * 4096, b"x" * 4096], lay)
        c.pin("pv/pinned")
        c.handoff_publish("pv-req", {"0": ["pv/held"]}, {"0": lay}, ttl_s=120)
    monkeypatch.setattr(cluster_mod, "kvpool_argv", _release(M.WIRE_VERSION + 1))
    newer = lc.start_master(wait_leader=False)
    monkeypatch.undo()
    lc.masters[0].kill()
    newer.wait_line("KVPOOL_LEADER", 20)
    wait_for(lambda: "store node node-0" in open(newer.log_path).read(), 10, what="the newer leader to refuse node-0")
    same = lc.start_master(wait_leader=False)
    newer.kill()
    same.wait_line("KVPOOL_LEADER", 20)
    with KVPoolClient(etcd=lc.etcd_endpoint, cluster=lc.cfg.cluster, rpc_timeout_s=20) as c:
        wait_for(lambda: c.stats().objects == 3, 10, what="the objects to be indexed again")
        rep = c.evict(M.EvictSelector(prefix="pv/"))
        assert (rep.removed, rep.skipped_pinned, rep.skipped_held) == (1, 1, 1)
        assert c.exists("pv/pinned") and c.handoff_claim("pv-req").keys == {"0": ["pv/held"]}


def test_with_only_nodes_of_another_version_a_put_says_so(make_cluster, monkeypatch):
    lc = make_cluster(nodes=0)
    _start_old_node(lc, monkeypatch)
    with lc.client() as c:
        wait_for(lambda: c.stats().refused, 10, what="the old node to be refused")
        with pytest.raises(E.NoSpace, match=r"0 live, 0 draining, 1 of another kvpool version \(old-node"):
            c.put("v/k", b"x")
