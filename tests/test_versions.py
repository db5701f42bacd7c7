"""Processes of different kvpool wire versions refuse each other with a clear error
(``protocol.messages.WIRE_VERSION``) instead of misreading frames: the master does not
place on a store node of another version and reports it in ``status``; a client refuses
a master of another version at once (a ConfigError, not a timeout)."""
import sys
import time

import pytest

from cli.cluster import Child, kvpool_argv
from protocol import errors as E
from protocol import messages as M
from protocol.config import parse_size

from tests.conftest import wait_for


def test_a_store_node_of_another_version_is_not_placed_on(make_cluster):
    lc = make_cluster(nodes=1)
    argv = kvpool_argv("storenode", *lc._common(), "--name", "old-node", "--memory", str(parse_size("64MiB")),
                       "--run-dir", lc.run_dir)
    # the same code with its version constant changed: an older release, as the master sees it
    code = "import sys; import protocol.messages as M; M.WIRE_VERSION = 0; from cli.app import main; main()"
    old = Child("old-node", [sys.executable, "-c", code, *argv[3:]], lc.run_dir)
    lc.nodes["old-node"] = old
    old.wait_line("KVPOOL_READY storenode", 30)
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
        with pytest.raises(E.ConfigError, match=r"speaks kvpool wire version 1, this client 2; run one kvpool"):
            c.stats()
    assert time.monotonic() - t0 < 5.0  # refused, not retried until the RPC timeout
