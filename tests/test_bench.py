"""`kvpool bench`: the round planner and the ratio summaries as pure functions, then quick
runs against the shared test cluster with redis-server and a real Mooncake Store cluster
(the `bench` extra) as peers. No timing asserts: the machine is shared."""
import io
import shutil

import psutil
import pytest
from kvpool.cli.bench import memcpy_gbps, render_bench, render_markdown, run_bench
from kvpool.cli.bench_plan import Cell, kvpool_systems, peer_systems, plan_rounds
from kvpool.cli.bench_stats import (
    group_rows,
    ratio_summary,
    results,
    round_ratios,
    spread,
)
from rich.console import Console
from typer.testing import CliRunner

KiB = 1 << 10


# ---- pure: the plan ---------------------------------------------------------------------------------

def _systems():
    return kvpool_systems(["auto", "tcp"], [{"spin_wait_s": 0.0}, {"spin_wait_s": 1e-4}]) + \
        peer_systems(["redis", "mooncake"])


def test_systems_are_named_by_what_differs():
    s = _systems()
    assert [x.id for x in s] == ["kvpool[spin=0]@auto", "kvpool[spin=100us]@auto", "kvpool[spin=0]@tcp",
                                 "kvpool[spin=100us]@tcp", "redis", "mooncake[py]", "mooncake[reg]"]
    assert {x.group or x.id for x in s if x.family == "mooncake"} == {"mooncake"}
    assert [x.name for x in kvpool_systems(["auto"], [{"spin_wait_s": None}])] == ["kvpool"]


def test_round_plan_interleaves_every_system_in_every_round_and_rotates():
    systems = _systems()
    cells = [Cell(64 * KiB, 1, 1, 1), Cell(64 * KiB, 1, 64, 1), Cell(4 << 20, 1, 1, 1), Cell(4 << 20, 1, 1, 2)]
    n = len(systems)
    plan = plan_rounds(cells, systems, n, ["memcpy", "tcp"], metadata=[(1, 1), (1, 64)])
    assert len(plan) == n
    prefixes = set()
    for r, steps in enumerate(plan):
        assert {s.round for s in steps} == {r}
        runs = [(s.name, s.cell) for s in steps if s.kind == "system"]
        want = {(x.id, c) for x in systems for c in cells if c.replicas <= x.max_replicas}
        assert sorted(runs, key=str) == sorted(want, key=str)  # every system on every cell, once
        # a cell's systems run next to each other (interleaved), not all cells of one system first
        for c in cells:
            at = [i for i, s in enumerate(steps) if s.cell == c]
            between = steps[at[0]:at[-1] + 1]
            assert all(s.cell == c or s.kind == "ceiling" and s.size == c.size for s in between)
        ceilings = [(s.name, s.size) for s in steps if s.kind == "ceiling"]
        assert sorted(ceilings) == sorted([("memcpy", 0), ("tcp", 0)] + [(k, sz) for sz in (64 * KiB, 4 << 20)
                                                                         for k in ("tcp_rr_get", "tcp_rr_put")])
        assert [s.kind for s in steps[-2:]] == ["metadata", "metadata"]
        prefixes |= {s.prefix("run") for s in steps if s.kind == "system"}
    assert len(prefixes) == sum(1 for steps in plan for s in steps if s.kind == "system")  # fresh keys
    # rotation: over n rounds every system opens the first cell's block once
    first_cell = [[s.name for s in steps if s.cell == Cell(64 * KiB, 1, 1, 1)] for steps in plan]
    assert sorted(order[0] for order in first_cell) == sorted(x.id for x in systems)
    # redis keeps one copy: it sits out the cell of two replicas
    assert not [s for steps in plan for s in steps if s.name == "redis" and s.cell.replicas == 2]


# ---- pure: ratios -----------------------------------------------------------------------------------

def _row(rnd, sid, name, group, family, path, op, gbps, **bad):
    return {"round": rnd, "system": sid, "name": name, "group": group, "family": family, "path": path, "op": op,
            "size": 64 * KiB, "clients": 1, "batch": 64, "replicas": 1, "gbps": gbps, "objects_per_s": gbps * 1e4,
            "p50_ms": 1.0, "p99_ms": 2.0, "objects": 64, "errors": 0, "misses": 0, "stale": 0, "corrupt": 0,
            "not_fresh": 0, "first_error": "", **bad}


def test_ratios_are_per_round_and_summarised_as_min_median_max():
    rows, ceil = [], []
    kv = [1.0, 2.0, 3.0]
    for r in range(3):
        rows += [_row(r, "kvpool@auto", "kvpool", "kvpool@auto", "kvpool", "shm", "put", kv[r]),
                 _row(r, "mooncake[py]", "mooncake[py]", "mooncake", "mooncake", "tcp", "put", [1.0, 1.5, 3.0][r]),
                 _row(r, "mooncake[reg]", "mooncake[reg]", "mooncake", "mooncake", "tcp", "put", 2.0),
                 _row(r, "redis", "redis", "redis", "redis", "tcp", "put", 4.0,
                      **({"errors": 1, "first_error": "boom"} if r == 2 else {}))]
        ceil += [{"round": r, "name": "memcpy", "size": 0, "gbps": 10.0 * (r + 1)},
                 {"round": r, "name": "tcp", "size": 0, "gbps": 4.0},
                 {"round": r, "name": "tcp_rr_put", "size": 64 * KiB, "gbps": 2.0}]
    groups = group_rows(rows)
    assert [(g["round"], g["variant"], g["gbps"]) for g in sorted(groups, key=lambda g: g["round"])] == [
        (0, "mooncake[reg]", 2.0), (1, "mooncake[reg]", 2.0), (2, "mooncake[py]", 3.0)]  # the faster path per round
    allrows = rows + groups
    per = round_ratios(allrows, ceil)
    summ = {(x["system"], x["target"]): x for x in ratio_summary(per)}
    mc = summ[("kvpool@auto", "mooncake")]
    assert mc["rounds"] == [0.5, 1.0, 1.0] and (mc["min"], mc["median"], mc["max"]) == (0.5, 1.0, 1.0)
    red = summ[("kvpool@auto", "redis")]
    assert red["rounds"] == [0.25, 0.5, None] and red["n"] == 2  # the round with an error does not count
    mem = summ[("kvpool@auto", "memcpy")]
    assert mem["rounds"] == [0.1, 0.1, 0.1] and mem["kind"] == "ceiling"
    assert summ[("mooncake", "tcp_rr_put")]["rounds"] == [1.0, 1.0, 1.5]
    assert ("mooncake[py]", "tcp") not in summ  # a group's members are not reported on their own
    res = {(x["system"], x["op"]): x for x in results(allrows)}
    assert res[("redis", "put")]["errors"] == 1 and res[("redis", "put")]["gbps"]["n"] == 2
    assert res[("kvpool@auto", "put")]["gbps"] == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert spread([None, None]) == {"min": 0.0, "median": 0.0, "max": 0.0, "n": 0}


# ---- real runs --------------------------------------------------------------------------------------

def _quick(cluster, **kw):
    args = {"sizes": [64 * KiB], "clients": [1], "total_bytes": 1 << 20, "transport": "auto,tcp", "metadata": False,
            "progress": False, "rounds": 2}
    args.update(kw)
    return run_bench(None, args.pop("sizes"), args.pop("clients"), args.pop("total_bytes"), args.pop("transport"),
                     args.pop("metadata"), args.pop("progress"), master=cluster.master_addr, max_objects=16,
                     meta_keys=128, ceiling_bytes=4 << 20, **args)


def _check_rows(rep, rounds):
    for r in rep["rounds"]["rows"]:
        assert r["objects"] > 0 and r["bytes"] == r["objects"] * r["size"]
        assert r["gbps"] > 0 and r["objects_per_s"] > 0 and r["seconds"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]
        bad = {k: r[k] for k in ("errors", "misses", "not_fresh", "stale", "corrupt") if r[k]}
        assert not bad, (r["system"], r["op"], bad, r["first_error"])
        if r["op"] == "get":
            assert r["verified"] > 0 and r["cleanup_failed"] == 0, r
    for x in rep["results"]:
        assert x["gbps"]["n"] == rounds and len(x["rounds"]) == rounds


def test_quick_bench_against_redis_and_mooncake(cluster):
    assert shutil.which("redis-server"), "redis-server is installed by `.ci/setup --test`"
    rep = _quick(cluster, batches=(1, 4), baseline="redis,mooncake", spin_wait=(0.0, 1e-4), metadata=True)
    assert rep["skipped"] == [], rep["skipped"]
    _check_rows(rep, 2)
    kv = ["kvpool[spin=0]@auto", "kvpool[spin=100us]@auto", "kvpool[spin=0]@tcp", "kvpool[spin=100us]@tcp"]
    reported = {"redis", "mooncake", *kv}
    assert {x["system"] for x in rep["results"]} == reported | {"mooncake[py]", "mooncake[reg]"}
    assert {(x["system"], x["op"], x["batch"]) for x in rep["results"]} == {
        (s, op, b) for s in reported | {"mooncake[py]", "mooncake[reg]"} for op in ("put", "get") for b in (1, 4)}
    assert {(c["name"], c["size"]) for c in rep["ceilings"]} == {
        ("memcpy", 0), ("tcp", 0), ("unix", 0), ("tcp_rr_get", 64 * KiB), ("tcp_rr_put", 64 * KiB)}
    assert all(c["gbps"]["n"] == 2 and c["gbps"]["min"] > 0 for c in rep["ceilings"])
    targets = {(x["system"], x["op"], x["batch"], x["target"]): x for x in rep["ratios"]}
    for s in kv:
        other = s.replace("spin=0]", "spin=X]").replace("spin=100us]", "spin=0]").replace("spin=X]", "spin=100us]")
        tcp = s.endswith("@tcp")
        for op in ("put", "get"):
            for b in (1, 4):
                want = {"redis", "mooncake", other.split("@")[0]} | (
                    {"tcp", f"tcp_rr_{op}"} if tcp else {"memcpy"})
                got = {t for (sy, o, bb, t) in targets if (sy, o, bb) == (s, op, b)}
                assert got == want, (s, op, b, got)
                assert all(targets[(s, op, b, t)]["n"] == 2 and targets[(s, op, b, t)]["median"] > 0 for t in want)
    # interleaved and rotated: round 1 does not repeat round 0's order
    assert rep["plan"][0] != rep["plan"][1] and sorted(rep["plan"][0]) == sorted(rep["plan"][1])
    assert {(m["op"], m["batch"]) for m in rep["metadata"]} == {
        (op, b) for op in ("put_start+put_end", "lookup", "remove") for b in (1, 64, 256)}
    out = io.StringIO()
    render_bench(rep, Console(file=out, width=200))
    text = out.getvalue()
    assert "kvpool[spin=100us]" in text and "mooncake" in text and "raw TCP put-shaped" in text
    md = render_markdown(rep)
    assert "| mooncake | tcp |" in md and "| kvpool[spin=0] | shm |" in md and "| ÷ | ratio |" in md
    with cluster.client() as cl:  # every round removed its keys
        assert not cl.ls("bench/")


def test_a_put_of_an_existing_key_is_caught(cluster, tmp_path):
    """Why every phase writes fresh keys: a second put of the same keys stores nothing in
    kvpool (``not_fresh``) and in Mooncake Store, which still answers 0 per key, so only the
    bytes read back (stamped per phase) show it (``stale``)."""
    from kvpool.cli.bench_peers import MooncakeCluster
    from kvpool.cli.bench_plan import System
    from kvpool.cli.bench_worker import Proc

    mc = MooncakeCluster([64 << 20], str(tmp_path))
    w = Proc()
    try:
        base = {"cmd": "cell", "size": 64 * KiB, "count": 8, "batch": 4, "replicas": 1, "prefix": "bench/again",
                "master": cluster.master_addr, "mooncake": {"metadata_url": mc.metadata_url,
                                                            "master_addr": mc.master_addr, "local_buffer": 32 << 20}}
        for s in (System("kvpool", "kvpool", "shm", "auto"),
                  System("mooncake[py]", "mooncake", "tcp", "mooncake", variant="py", group="mooncake"),
                  System("mooncake[reg]", "mooncake", "tcp", "mooncake", variant="reg", group="mooncake")):
            w.call({**base, "system": s.to_dict()})
            first = [w.call({"cmd": op, "system": s.id}) for op in ("put", "get")]
            assert first[0]["errors"] == first[0]["not_fresh"] == 0 and first[1]["stale"] == 0, first
            again = [w.call({"cmd": op, "system": s.id}) for op in ("put", "get")]
            assert again[0]["errors"] == 0  # neither store calls it an error
            if s.family == "kvpool":
                assert again[0]["not_fresh"] == 8
            assert again[1]["stale"] == again[1]["verified"] > 0, (s.id, again[1])
            assert w.call({"cmd": "cleanup", "system": s.id})["failed"] == 0
    finally:
        w.stop()
        mc.close()


def test_a_peer_that_fails_is_left_out_with_its_reason(cluster, monkeypatch):
    from kvpool.cli import bench_peers

    monkeypatch.setattr(bench_peers, "mooncake_master_binary", lambda: "/bin/false")
    rep = _quick(cluster, transport="auto", baseline="mooncake", rounds=1)
    assert [s["system"] for s in rep["skipped"]] == ["mooncake"]
    assert "mooncake_master exited" in rep["skipped"][0]["why"]
    assert {x["system"] for x in rep["results"]} == {"kvpool@auto"}
    out = io.StringIO()
    render_bench(rep, Console(file=out, width=200))
    assert "left out" in out.getvalue()


def test_replicas_and_background_load(cluster):
    rep = _quick(cluster, transport="auto", replicas=(1, 2), baseline="redis", load=1, rounds=1)
    _check_rows(rep, 1)
    assert sorted((x["system"], x["replicas"]) for x in rep["results"] if x["op"] == "put") == [
        ("kvpool@auto", 1), ("kvpool@auto", 2), ("redis", 1)]
    assert [s["system"] for s in rep["skipped"]] == ["redis"]  # one copy only: it sits out replicas 2
    assert rep["config"]["load_procs"] == 1
    burners = [p for p in psutil.Process().children(recursive=True) if "--burn" in " ".join(p.cmdline())]
    assert not burners


def test_bad_options_are_config_errors(cluster):
    from kvpool.protocol.errors import ConfigError

    for kw, key in (({"transport": "carrier-pigeon"}, "transport"), ({"baseline": "redis,memcached"}, "baseline"),
                    ({"rounds": 0}, "rounds"), ({"load": -1}, "load"), ({"streams": 0}, "streams"),
                    ({"spin_wait": (0.0, 1.0)}, "spin-wait"), ({"sizes": [0]}, "sizes")):
        with pytest.raises(ConfigError, match=key):
            _quick(cluster, **kw)


def test_cli_names_a_bad_option():
    from kvpool.cli.app import app

    res = CliRunner().invoke(app, ["bench", "--baseline", "memcached"])
    assert res.exit_code != 0 and "baseline" in res.output and "mooncake" in res.output
    res = CliRunner().invoke(app, ["bench", "--spin-wait", "0,soon"])
    assert res.exit_code != 0 and "spin-wait" in res.output


def test_a_silent_or_dead_worker_is_an_error_within_its_deadline():
    from kvpool.cli.bench_worker import Proc

    w = Proc()
    assert w.call({"cmd": "ping"}) == {"ok": True}
    with pytest.raises(RuntimeError, match="no reply within 0.3 s"):
        w.recv(timeout_s=0.3)  # nothing asked: nothing comes
    assert w.p.poll() is not None  # killed: it would be out of step
    with pytest.raises(RuntimeError, match="exited"):
        w.call({"cmd": "ping"})
    w.stop()
    w = Proc()
    with pytest.raises(RuntimeError, match="unknown worker command"):
        w.call({"cmd": "fly"})
    assert w.call({"cmd": "ping"}) == {"ok": True}  # an error reply keeps it in step
    w.stop()


def test_memcpy_ceiling_positive():
    assert memcpy_gbps(4 << 20, reps=2) > 0
