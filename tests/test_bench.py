"""`kvpool bench` in a quick mode against the shared test cluster: the report has the
documented structure and positive numbers (no timing asserts: the machine is shared)."""
import io
import shutil

import pytest
from rich.console import Console

from kvpool.cli.bench import memcpy_gbps, render_bench, render_markdown, run_bench

KiB = 1 << 10


def _quick(cluster, **kw):
    args = dict(sizes=[64 * KiB], clients=[1], total_bytes=1 << 20, transport="auto,tcp", metadata=False,
                progress=False)
    args.update(kw)
    return run_bench(None, args.pop("sizes"), args.pop("clients"), args.pop("total_bytes"), args.pop("transport"),
                     args.pop("metadata"), args.pop("progress"), master=cluster.master_addr, max_objects=16,
                     meta_keys=128, ceiling_bytes=8 << 20, **args)


def _check_rows(rows, systems):
    assert {(r["system"], r["path"], r["op"]) for r in rows} == systems
    for r in rows:
        assert r["objects"] > 0 and r["bytes"] == r["objects"] * r["size"]
        assert r["gbps"] > 0 and r["objects_per_s"] > 0 and r["seconds"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["ratio"] > 0 and r["ceiling"] in ("memcpy", "tcp", "unix")
        assert r["errors"] == 0 and r["misses"] == 0, r["first_error"]


def test_quick_bench_report(cluster):
    rep = _quick(cluster, clients=[1, 2], batches=(1, 4), transport="auto,tcp,unix", metadata=True, repeat=2)
    c = rep["ceilings"]
    assert c["memcpy_gbps"] > 0 and c["tcp_gbps"] > 0 and c["unix_gbps"] > 0
    _check_rows(rep["results"], {("kvpool", p, op) for p in ("shm", "tcp", "unix") for op in ("put", "get")})
    assert len(rep["results"]) == 3 * 2 * 2 * 2  # paths × clients × batches × ops (best of 2 runs)
    assert {(m["op"], m["clients"], m["batch"]) for m in rep["metadata"]} == {
        (op, c, b) for op in ("put_start+put_end", "lookup", "remove") for c in (1, 2) for b in (1, 64, 256)}
    assert all(m["keys_per_s"] > 0 and m["calls_per_s"] > 0 for m in rep["metadata"])
    out = io.StringIO()
    render_bench(rep, Console(file=out, width=160))
    text = out.getvalue()
    assert "ceilings" in text and "memcpy" in text and "master metadata" in text
    md = render_markdown(rep)
    assert md.count("| kvpool |") == len(rep["results"]) and "| lookup |" in md
    with cluster.client() as cl:  # the bench cleaned up after itself
        assert not [o for o in cl.ls("bench/")]


def test_redis_baseline(cluster):
    assert shutil.which("redis-server"), "redis-server is installed by `.ci/setup --test`"
    rep = _quick(cluster, transport="auto", baseline="redis")
    _check_rows(rep["results"], {(s, p, op) for s, p in (("kvpool", "shm"), ("redis", "tcp"))
                                 for op in ("put", "get")})


def test_two_replicas(cluster):
    rep = _quick(cluster, transport="auto", replicas=(1, 2))
    _check_rows(rep["results"], {("kvpool", "shm", op) for op in ("put", "get")})
    assert sorted(r["replicas"] for r in rep["results"]) == [1, 1, 2, 2]


def test_bad_options_are_config_errors(cluster):
    from kvpool.protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="transport"):
        _quick(cluster, transport="carrier-pigeon")
    with pytest.raises(ConfigError, match="baseline"):
        _quick(cluster, baseline="memcached")


def test_memcpy_ceiling_positive():
    assert memcpy_gbps(4 << 20, reps=2) > 0
