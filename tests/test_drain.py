"""`kvpool drain`: no new placements on the node; pinned/held objects move off it."""
import subprocess
import sys

from tests.conftest import wait_for


def test_drain_moves_pinned_objects(make_cluster):
    lc = make_cluster(nodes=2, memory="32MiB")
    with lc.client() as c:
        for i in range(6):
            c.put(f"dr/{i}", bytes([i]) * 10000)
        on0 = [o.key for o in c.ls("dr/") if o.nodes == ["node-0"]]
        assert on0
        for k in on0:
            c.pin(k)
        p = subprocess.run([sys.executable, "-m", "kvpool.cli", "drain", "node-0", "--master", lc.master_addr],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "draining node-0" in p.stdout
        wait_for(lambda: all(o.nodes == ["node-1"] for o in c.ls("dr/") if o.key in on0), 10,
                 what="pinned objects moved to node-1")
        for k in on0:
            assert c.get(k) == bytes([int(k.split("/")[1])]) * 10000
        c.put("dr/new", b"placed elsewhere")
        assert c.ls("dr/new")[0].nodes == ["node-1"]
        st = c.stats()
        assert [n.draining for n in st.nodes if n.node_id == "node-0"] == [True]
        p = subprocess.run([sys.executable, "-m", "kvpool.cli", "drain", "node-0", "--undo", "--master", lc.master_addr],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and not any(n.draining for n in c.stats().nodes)
        p = subprocess.run([sys.executable, "-m", "kvpool.cli", "drain", "nope", "--master", lc.master_addr],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "no live node" in p.stderr
