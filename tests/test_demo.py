"""The shared-prefix demo: two engine processes, real text, logits check through a real cluster."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from kvpool.cli.demo import render_demo, run_demo
from kvpool.connector.demo_engine import ReferenceModel

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report(cluster):
    return run_demo(cluster.master_addr, quick=True)


def test_quick_demo_logits_match(report):
    assert report["all_match"] is True
    assert report["errors"] == []
    assert report["totals"]["max_abs_diff"] <= report["tolerance"] == 1e-5
    for r in report["requests"]:
        assert r["match"] and r["max_abs_diff"] <= 1e-5, r
        assert r["same_next_token"]


def test_quick_demo_hits(report):
    bs, block_bytes = 16, ReferenceModel().block_nbytes
    rows = {r["kind"]: r for r in report["requests"]}
    assert set(rows) == {"repeat", "new q", "miss"}
    for r in report["requests"]:
        assert r["bytes_loaded"] == r["hit_blocks"] * block_bytes
        assert r["hit_tokens"] == r["hit_blocks"] * bs
        assert r["ttft_store_ms"] > 0 and r["ttft_no_store_ms"] > 0
        if r["kind"] == "repeat":  # every full block was stored by engine A
            assert r["hit_tokens"] == r["prompt_tokens"] // bs * bs
            assert r["computed_tokens"] == r["prompt_tokens"] - r["hit_tokens"]
    assert 0 < rows["new q"]["hit_tokens"] < rows["new q"]["prompt_tokens"] - bs
    assert rows["miss"]["hit_tokens"] == 0 and rows["miss"]["bytes_loaded"] == 0
    # engine A stored each shared block once: its second prompt found the prefix stored
    prod = report["producer"]["rows"]
    assert prod[0]["already_stored_blocks"] == 0
    assert prod[1]["already_stored_blocks"] > 0.9 * prod[1]["full_blocks"]
    assert report["totals"]["bytes_put"] == sum(r["blocks_put"] for r in prod) * block_bytes


def test_quick_demo_separate_processes(report):
    a, b = report["producer"]["pid"], report["consumer"]["pid"]
    assert a != b and os.getpid() not in (a, b)
    assert report["producer"]["exited_before_consumer"] is True
    for pid in (a, b):  # both engines are gone after the run
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert report["model"]["weights_digest"] == ReferenceModel().weights_digest()


def test_report_is_json_and_renders(report):
    assert json.loads(json.dumps(report)) == report
    con = Console(record=True, width=120)
    render_demo(report, console=con)
    text = con.export_text()
    assert "all outputs matched" in text
    for r in report["requests"]:
        assert r["request_id"] in text


@pytest.mark.slow
def test_namespaces_isolate_runs(cluster, report):
    # a second run gets its own namespace, so engine A stores everything afresh
    again = run_demo(cluster.master_addr, quick=True)
    assert again["namespace"] != report["namespace"]
    assert again["producer"]["rows"][0]["already_stored_blocks"] == 0
    assert again["all_match"]


def test_bad_master_fails_cleanly():
    from kvpool.protocol.errors import KVPoolError

    with pytest.raises(KVPoolError, match="engine"):
        run_demo("tcp://127.0.0.1:9", quick=True, timeout_s=60, rpc_timeout_s=1.0)


@pytest.mark.slow
def test_cli_demo_quick_json():
    """`kvpool demo --quick --json` brings up its own cluster, runs, tears down."""
    p = subprocess.run([sys.executable, "-m", "kvpool.cli", "demo", "--quick", "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout[p.stdout.index("{"):])
    assert rep["all_match"] is True and rep["quick"] is True
    assert any(r["hit_tokens"] > 0 for r in rep["requests"])
