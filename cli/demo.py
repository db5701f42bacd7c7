"""``kvpool demo``: a shared-prefix workload on real text through a running cluster.

Two engine processes run the reference decoder (``connector.demo_engine``). Engine A
prefills prompts made of a shared system prompt (public-domain documents) plus a
question, and stores its full KV blocks in kvpool; it exits. Engine B, a separate
process, asks those prompts again, new questions over the same documents, and one
prompt over different text: for each it looks up the stored prefix, loads the hit
blocks into its own cache tensors, computes only the suffix, and compares the
next-token logits with its own full recompute (float32, max abs diff <= 1e-5).

Results come back from the workers as one JSON line each over stdout; the report is a
plain dict (``kvpool demo --json`` prints it) rendered by :func:`render_demo`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from kvpool.protocol.errors import KVPoolError, Timeout

TOLERANCE = 1e-5


class _Worker:
    """An engine child process speaking the worker's stdin/stdout JSON protocol."""

    def __init__(self, role: str, master: str, namespace: str, engine: str, log_path: str,
                 rpc_timeout_s: float = 10.0) -> None:
        from kvpool.connector.demo_engine.worker import READY_LINE, RESULT_PREFIX

        self.role, self.ready_line, self.prefix = role, READY_LINE, RESULT_PREFIX
        self.log_path = log_path
        self._err = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.connector.demo_engine.worker", "--role", role, "--master", master,
             "--namespace", namespace, "--engine", engine, "--rpc-timeout", str(rpc_timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env)

    def _stderr_tail(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _read_line(self, want: str, deadline: float) -> str:
        # the worker prints only protocol lines on stdout; readline blocks, so the deadline is
        # enforced by the caller's overall timeout killing the process (see run()).
        while True:
            raw = self.proc.stdout.readline()
            if not raw:
                self.proc.wait(5)
                raise KVPoolError(f"demo engine {self.role} exited with code {self.proc.returncode} before "
                                  f"sending {want.strip()!r}:\n{self._stderr_tail()}")
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(want):
                return line
            if time.monotonic() > deadline:
                raise Timeout(f"demo engine {self.role} did not answer in time")

    def wait_ready(self, deadline: float) -> None:
        self._read_line(self.ready_line, deadline)

    def run(self, requests: list[dict], timeout_s: float, reps: int = 1) -> dict:
        """Send the requests, wait for the result (killing the worker past ``timeout_s``)."""
        import threading

        deadline = time.monotonic() + timeout_s
        killer = threading.Timer(timeout_s, self.kill)
        killer.start()
        try:
            self.wait_ready(deadline)
            self.proc.stdin.write((json.dumps({"requests": requests, "reps": reps}) + "\n").encode())
            self.proc.stdin.flush()
            self.proc.stdin.close()
            line = self._read_line(self.prefix, deadline)
            self.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise Timeout(f"demo engine {self.role} did not exit after answering") from None
        finally:
            killer.cancel()
        if self.proc.returncode != 0:
            raise KVPoolError(f"demo engine {self.role} failed (code {self.proc.returncode}):\n"
                              f"{self._stderr_tail()}")
        return json.loads(line[len(self.prefix):])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        self.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self._err.close()


def _describe(prompt: str) -> str:
    """Short label of a prompt: its question, or its start."""
    if "Question: " in prompt:
        return prompt.rsplit("Question: ", 1)[1].split("\n", 1)[0]
    return prompt[:60]


def _run_pair(master_addr: str, namespace: str, engine: str, reqs_a: list, reqs_b: list,
              timeout_s: float, log_dir: str, reps: int = 1, rpc_timeout_s: float = 10.0
              ) -> tuple[dict, dict, float]:
    """Start both engines (B imports while A works), run A to exit, then B."""
    a = _Worker("producer", master_addr, namespace, engine, os.path.join(log_dir, f"{engine}-engine-a.log"),
                rpc_timeout_s)
    b = _Worker("consumer", master_addr, namespace, engine, os.path.join(log_dir, f"{engine}-engine-b.log"),
                rpc_timeout_s)
    try:
        t0 = time.perf_counter()
        res_a = a.run([{"request_id": r.request_id, "prompt": r.prompt} for r in reqs_a], timeout_s)
        a_exited = a.proc.poll() is not None
        res_b = b.run([{"request_id": r.request_id, "prompt": r.prompt} for r in reqs_b], timeout_s, reps)
        wall = time.perf_counter() - t0
    finally:
        a.close()
        b.close()
    res_a["exited_before_consumer"] = a_exited
    return res_a, res_b, wall


def _rows(reqs_b: list, res_b: dict, seen: set[str]) -> list[dict]:
    rows = []
    for req, r in zip(reqs_b, res_b["rows"]):
        no, yes = r["ttft_no_store_ms"], r["ttft_store_ms"]
        rows.append({**r, "question": req.label or _describe(req.prompt),
                     "kind": "repeat" if req.prompt in seen else ("new q" if r["hit_tokens"] else "miss"),
                     "speedup": round(no / yes, 2) if yes > 0 else None})
    return rows


def run_demo(master_addr: str, quick: bool, hybrid: bool = False, *, namespace: str | None = None,
             timeout_s: float = 300.0, rpc_timeout_s: float = 10.0) -> dict:
    """Run the demo against the cluster whose master is at ``master_addr`` (``tcp://h:p``).

    Returns the report dict: ``model`` (geometry, id, weights digest, layout
    fingerprint), ``producer`` (engine A's per-request prefill/put rows), ``requests``
    (engine B's rows: prompt/hit/computed tokens, bytes loaded, TTFT with and without the
    store in ms, max abs logit diff, match), ``totals``, ``all_match`` and, with
    ``hybrid``, the same for the hybrid engine under ``hybrid``. ``quick`` uses one
    document (~1.8k-token prompts) instead of four (~8k). ``namespace`` defaults to a
    fresh ``demo-<8 hex>`` so runs never see each other's blocks. ``timeout_s`` bounds each
    engine process (it is killed past it); ``rpc_timeout_s`` is the engines' client RPC timeout.
    """
    import tempfile

    from kvpool.connector.demo_engine.model import ReferenceModel
    from kvpool.connector.demo_engine.tokenizer import demo_requests

    t_start = time.perf_counter()
    namespace = namespace or f"demo-{uuid.uuid4().hex[:8]}"
    model = ReferenceModel()
    cfg = model.config
    reqs_a, reqs_b = demo_requests(quick)
    seen = {r.prompt for r in reqs_a}
    with tempfile.TemporaryDirectory(prefix="kvpool-demo-") as log_dir:
        res_a, res_b, _ = _run_pair(master_addr, namespace, "dense", reqs_a, reqs_b, timeout_s, log_dir,
                                    reps=3 if quick else 2, rpc_timeout_s=rpc_timeout_s)
        hybrid_part = None
        if hybrid:
            from kvpool.connector.demo_engine.hybrid import hybrid_demo_section

            hybrid_part = hybrid_demo_section(master_addr, namespace, quick, _run_pair, timeout_s, log_dir,
                                              rpc_timeout_s)
    if res_a["weights_digest"] != res_b["weights_digest"] or res_a["weights_digest"] != model.weights_digest():
        raise KVPoolError("engine A and engine B built different weights "
                          f"({res_a['weights_digest']} vs {res_b['weights_digest']}); the logits check "
                          "would be meaningless. Run both with the same torch version.")
    rows = _rows(reqs_b, res_b, seen)
    hits = [r for r in rows if r["hit_tokens"]]
    totals = {
        "requests": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "hit_tokens": sum(r["hit_tokens"] for r in rows),
        "bytes_loaded": sum(r["bytes_loaded"] for r in rows),
        "bytes_put": sum(r["bytes_put"] for r in res_a["rows"]),
        "ttft_store_ms": round(sum(r["ttft_store_ms"] for r in rows), 3),
        "ttft_no_store_ms": round(sum(r["ttft_no_store_ms"] for r in rows), 3),
        "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=0.0),
        "hit_rate": round(sum(r["hit_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows)), 4),
        "mean_speedup_on_hits": (round(sum(r["speedup"] for r in hits) / len(hits), 2) if hits else None),
    }
    all_match = all(r["match"] for r in rows) and (hybrid_part is None or hybrid_part["all_match"])
    report: dict[str, Any] = {
        "quick": quick,
        "master": master_addr,
        "namespace": namespace,
        "tolerance": TOLERANCE,
        "model": {"id": model.model_id, "vocab": cfg.vocab, "dim": cfg.dim, "layers": cfg.layers,
                  "heads": cfg.heads, "head_dim": cfg.head_dim, "block_size": cfg.block_size,
                  "block_bytes": model.block_nbytes, "dtype": "float32",
                  "weights_digest": res_a["weights_digest"],
                  "layout_fingerprint": model.layout().fingerprint()},
        "producer": {"pid": res_a["pid"], "exited_before_consumer": res_a["exited_before_consumer"],
                     "startup_ms": res_a["startup_ms"], "rows": res_a["rows"]},
        "consumer": {"pid": res_b["pid"], "startup_ms": res_b["startup_ms"], "torch_threads": res_b["torch_threads"],
                     "timing_reps": 3 if quick else 2},
        "requests": rows,
        "totals": totals,
        "all_match": all_match,
        "errors": [e for r in [*res_a["rows"], *rows] for e in r.get("errors", [])],
    }
    if hybrid_part is not None:
        report["hybrid"] = hybrid_part
        report["errors"] += [e for r in [*hybrid_part["producer"]["rows"], *hybrid_part["requests"]]
                             for e in r.get("errors", [])]
    report["wall_s"] = round(time.perf_counter() - t_start, 3)
    return report


def _size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _request_table(title: str, rows: list[dict], tol: float):
    """One row per request, 79 columns wide at most for the usual values (fits an 80-column
    terminal); the questions are listed under the table (see render_demo). A row whose
    logits differ by more than ``tol`` shows a red NO under "ok"."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1),
              pad_edge=False, show_edge=False, collapse_padding=True)
    for col in ("req", "kind", "prompt\ntokens", "hit\ntokens", "loaded", "TTFT ms\nstore", "TTFT ms\nfull",
                "speed-\nup", "max\n|Δlogit|", "ok"):
        t.add_column(col, justify="left" if col in ("req", "kind") else "right", no_wrap=True)
    for r in rows:
        sp = r.get("speedup")
        t.add_row(r["request_id"], r.get("kind", ""), str(r["prompt_tokens"]), str(r["hit_tokens"]),
                  _size(r["bytes_loaded"]), f"{r['ttft_store_ms']:.1f}", f"{r['ttft_no_store_ms']:.1f}",
                  f"{sp:.1f}x" if sp else "-", f"{r['max_abs_diff']:.1e}",
                  "[green]yes[/]" if r["match"] else "[bold red]NO[/]")
    return t


def _questions(rows: list[dict], console) -> None:
    from rich.markup import escape

    for r in rows:
        if r.get("question"):
            console.print(f"  [dim]{r['request_id']}:[/] {escape(r['question'])}", overflow="ellipsis", no_wrap=True)


def render_demo(report: dict, console=None) -> None:
    """Print the report as rich tables (the JSON form is the dict itself)."""
    from rich.console import Console

    if console is None:
        console = Console()  # a terminal's width, or $COLUMNS when set
        if not console.is_terminal and not os.environ.get("COLUMNS"):  # piped or redirected
            console = Console(width=110)
    m, tot, p = report["model"], report["totals"], report["producer"]
    console.print(f"[bold]kvpool demo[/] ({'quick' if report['quick'] else 'full'}) against {report['master']}, "
                  f"namespace [cyan]{report['namespace']}[/]")
    # short lines: the report stays readable in an 80-column terminal
    console.print(f"model {m['id']}: byte tokens, dim {m['dim']}, {m['layers']} layers x {m['heads']} heads x "
                  f"{m['head_dim']}")
    console.print(f"{m['dtype']} KV blocks of {m['block_size']} tokens = {_size(m['block_bytes'])}")
    console.print(f"weights {m['weights_digest']}, layout {m['layout_fingerprint']}")
    put_blocks = sum(r["blocks_put"] for r in p["rows"])
    skipped = sum(r["already_stored_blocks"] for r in p["rows"])
    console.print(f"engine A (pid {p['pid']}): prefilled {len(p['rows'])} prompts, "
                  f"{'exited before engine B read' if p['exited_before_consumer'] else 'still running'}")
    console.print(f"  stored {put_blocks} blocks ({_size(tot['bytes_put'])}); {skipped} more were already stored "
                  "(by an earlier prompt with the same prefix)")
    console.print(_request_table(f"engine B (pid {report['consumer']['pid']}): store-backed prefill vs full recompute",
                                 report["requests"], report["tolerance"]))
    _questions(report["requests"], console)
    console.print(f"hit rate {tot['hit_rate']:.0%} of prompt tokens, {_size(tot['bytes_loaded'])} loaded")
    console.print(f"TTFT total {tot['ttft_store_ms']:.0f} ms with the store vs {tot['ttft_no_store_ms']:.0f} ms "
                  "recomputing")
    console.print(f"max |Δlogit| {tot['max_abs_diff']:.2e} (tolerance {report['tolerance']:g})")
    h = report.get("hybrid")
    if h is not None:
        from kvpool.connector.demo_engine.hybrid import render_hybrid_section

        render_hybrid_section(h, console, _request_table, _size)
    ok = report["all_match"]
    console.print(("[bold green]all outputs matched[/]" if ok else "[bold red]MISMATCH: some outputs differ[/]")
                  + f"  ({report['wall_s']:.1f} s)")
    for e in report.get("errors", []):
        console.print(f"[yellow]error:[/] {e}")
