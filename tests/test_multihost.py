"""The multi-host tier: three "hosts" (network namespaces on one bridge, each with its own IP,
hostname and private run directory, so no Unix socket or memfd crosses hosts) and a client
on a fourth. etcd and the master on h0, a store node on each host, every server bound to
``0.0.0.0`` and published with ``--advertise`` on fixed ports. Puts with replicas=2 land on
two hosts; every host reads everything; h2's link is cut and restored: no acknowledged
write is lost, reads keep working from the surviving replica, and the node comes back and
takes new replicas.
Readers on h0..h2 carry the host id of that host's store node without sharing its files:
the client must prove a same-host node before mapping it, and fall back to TCP.

Prints one ``MULTIHOST ...`` line with the figures (run with ``-s``). Marked chaos."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.cli.cluster import Child, find_etcd, kvpool_argv

from tests import netns
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
TTL = "2s"  # the store nodes' registration lease
RPC_PORT, DATA_PORT, CONTROL_PORT = 7000, 7100, 7101


def _p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else float("nan")


@pytest.mark.chaos
def test_three_hosts_keep_every_acknowledged_write_across_a_cut_link(tmp_path):
    netns.require()
    with netns.Net("mh") as net:
        lan = net.bridge("lan", "10.202.0")
        hosts = {n: net.host(n) for n in ("h0", "h1", "h2", "cl")}
        ip = {n: net.link(h, lan) for n, h in hosts.items()}
        ep = f"http://{ip['h0']}:2379"
        run = tmp_path / "run"  # each host mounts its own tmpfs here: nothing shared between hosts
        run.mkdir()
        log_dir, kids = str(tmp_path), []

        def on(h: str, argv: list[str], private: tuple[str, ...] = ()) -> list[str]:
            return net.argv(hosts[h], netns.own_host(h, argv, private))

        def client(h: str, cmd: str, host_id: str, *args: str) -> dict:
            out = tmp_path / f"{cmd}-{h}-{time.monotonic_ns()}.json"
            r = subprocess.run(on(h, [sys.executable, "-m", "tests.multihost_client", cmd, ep, host_id, str(out),
                                      *args]), cwd=ROOT, capture_output=True, text=True, timeout=180)
            assert r.returncode == 0, f"{cmd} on {h} failed:\n{r.stderr[-3000:]}"
            res = json.loads(out.read_text())
            res["stderr"] = r.stderr
            return res

        def stats() -> dict:
            return {k: v for k, v in client("cl", "stats", "client-cl").items() if k != "stderr"}

        try:
            t0 = time.monotonic()
            kids.append(Child("etcd", on("h0", [
                find_etcd(), "--name", "e", "--data-dir", str(tmp_path / "etcd-data"),
                "--listen-client-urls", ep, "--advertise-client-urls", ep,
                "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380", "--initial-cluster", "e=http://127.0.0.1:2380"]), log_dir))
            common = ["--etcd", ep, "--node-ttl", TTL, "--host", "0.0.0.0"]
            master = Child("master", on("h0", kvpool_argv("master", *common, "--advertise", ip["h0"],
                                                          "--rpc-port", str(RPC_PORT), "--replicas", "2")), log_dir)
            kids.append(master)
            for i in range(3):
                h = f"h{i}"
                kids.append(Child(f"n{i}", on(h, kvpool_argv(
                    "storenode", *common, "--advertise", ip[h], "--name", f"n{i}", "--memory", "64MiB",
                    "--data-port", str(DATA_PORT), "--control-port", str(CONTROL_PORT), "--run-dir", str(run)),
                    (str(run),)), log_dir))
            assert master.wait_line("KVPOOL_READY master", 60).split()[-1] == f"tcp://{ip['h0']}:{RPC_PORT}"
            master.wait_line("KVPOOL_LEADER", 60)
            for i, k in enumerate(kids[2:]):
                assert k.wait_line("KVPOOL_READY storenode", 60).split()[-1] == f"tcp://{ip[f'h{i}']}:{DATA_PORT}"
            st = wait_for(lambda: next((s for s in [stats()] if sum(v["alive"] for v in s.values()) == 3), None),
                          60, 0.2, what="three store nodes up")
            bring_up_s = time.monotonic() - t0
            assert {n: v["data_addr"] for n, v in st.items()} == {
                f"n{i}": f"tcp://{ip[f'h{i}']}:{DATA_PORT}" for i in range(3)}
            host_id = {n: v["host_id"] for n, v in st.items()}
            assert len(set(host_id.values())) == 3, host_id  # each host's own hostname

            before = client("cl", "put", "client-cl", "mh/a", "60")
            assert len(before["acked"]) == 60, before["failed"]
            placed = [before["nodes"][k] for k in before["acked"]]
            assert all(len(set(ns)) == 2 for ns in placed), placed  # two replicas, two hosts
            assert {n for ns in placed for n in ns} == {"n0", "n1", "n2"}
            # every host reads everything; its reader shares the host id of that host's node but
            # not its files, so the node is reached over TCP after one warning
            for i in range(3):
                r = client(f"h{i}", "get", host_id[f"n{i}"], _keys(tmp_path, before["acked"]))
                assert (r["missing"], r["wrong"], r["errors"]) == (0, 0, []), r
                assert r["stderr"].count("did not prove it is on this host") == 1, r["stderr"][-2000:]

            net.cut(hosts["h2"], lan)
            cut = time.monotonic()
            during = client("cl", "get", "client-cl", _keys(tmp_path, before["acked"]))
            assert (during["missing"], during["wrong"], during["errors"]) == (0, 0, []), during
            more = client("cl", "put", "client-cl", "mh/b", "30")
            assert len(more["acked"]) >= 25, more["failed"]
            wait_for(lambda: not stats().get("n2", {"alive": False})["alive"], 60, 0.2, what="n2 dropped")
            net.restore(hosts["h2"], lan)
            restored = time.monotonic()
            wait_for(lambda: stats().get("n2", {}).get("alive"), 60, 0.2, what="n2 back")
            back_s = time.monotonic() - restored
            assert kids[4].alive(), kids[4].tail()

            again = client("cl", "put", "client-cl", "mh/c", "30")  # n2 takes new replicas again
            assert len(again["acked"]) == 30, again["failed"]
            assert any("n2" in again["nodes"][k] for k in again["acked"]), again["nodes"]
            acked = before["acked"] + more["acked"] + again["acked"]
            after = {}
            for h in ("cl", "h0", "h1", "h2"):
                after[h] = client(h, "get", "client-cl" if h == "cl" else host_id[f"n{h[1]}"], _keys(tmp_path, acked))
                assert (after[h]["missing"], after[h]["wrong"], after[h]["errors"]) == (0, 0, []), (h, after[h])
            print(f"\nMULTIHOST bring-up {bring_up_s:.2f}s (etcd start to 3 nodes registered); "
                  f"get p50/max ms: before cut {_p50(before['get_ms'])}/{max(before['get_ms']):.1f}, "
                  f"right after cut {_p50(during['get_ms'])}/{max(during['get_ms']):.1f}, "
                  f"after restore {_p50(after['cl']['get_ms'])}/{max(after['cl']['get_ms']):.1f}; "
                  f"acknowledged {len(acked)} ({len(before['acked'])} before, {len(more['acked'])} during the cut "
                  f"({len(more['failed'])} unacknowledged), {len(again['acked'])} after), readable after restore "
                  "from every host "
                  f"{min(a['checked'] - a['missing'] - a['wrong'] - len(a['errors']) for a in after.values())}; "
                  f"n2 dropped and back {back_s:.2f}s after restore (cut lasted {restored - cut:.2f}s); "
                  f"objects per node {({n: v['objects'] for n, v in sorted(stats().items())})}", flush=True)
        finally:
            for k in reversed(kids):
                k.stop()


def _keys(tmp_path: Path, keys: list[str]) -> str:
    path = tmp_path / f"keys-{len(keys)}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(keys))
    return str(path)
