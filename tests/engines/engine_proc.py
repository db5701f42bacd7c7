"""A vLLM engine in its own process, driven over stdin/stdout with JSON lines.

Run as ``python tests/engines/engine_proc.py '<json config>'`` with the repo on PYTHONPATH. The
config: ``model`` (path), ``kv_transfer_config`` (dict or null), ``multiprocess``
(bool: vLLM's default engine-core process, else in-process), ``seed``, ``log_stats``,
``engine_kwargs`` (``LLM(...)`` arguments over the defaults below).

Commands, one JSON object per line on stdin; each answer is one stdout line starting
with ``KVPOOL_ENGINE `` followed by JSON (vLLM's own logs go to stderr):

* ``{"op": "generate", "prompts": [[ids...]...], "max_tokens": n, "params": [dict|null...]}``
  → ``{"elapsed_s": seconds in llm.generate, "outputs": [{"token_ids", "num_cached_tokens",
  "kv_transfer_params", "finish_reason"}]}``
* ``{"op": "reset_prefix_cache"}`` → ``{"ok": true}``
* ``{"op": "metrics"}`` → ``{"metrics": {name: value}}`` for vLLM's ``*kvpool*``,
  ``*preemption*`` and ``prompt_tokens_by_source`` metrics (needs ``"log_stats": true``
  in the config); a metric with labels of its own (beyond model and engine) is named
  ``name{label=value,...}``; a histogram's value is its count
* ``{"op": "quit"}`` → exits.

Errors are answered as ``{"error": "..."}``. Nothing here is pickled.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

PREFIX = "KVPOOL_ENGINE "


def _answer(out, obj) -> None:
    out.write(PREFIX + json.dumps(obj) + "\n")
    out.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    # keep stdout for answers: everything else (vLLM logs, prints) goes to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.get("multiprocess") else "0"
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=cfg["model"], dtype="float32", block_size=32, enforce_eager=True,
                  max_model_len=1024, seed=cfg.get("seed", 0), kv_cache_memory_bytes=64 << 20,
                  max_num_seqs=16, disable_log_stats=not cfg.get("log_stats"))
    kwargs.update(cfg.get("engine_kwargs") or {})  # per-architecture overrides (dtype, block size, ...)
    if cfg.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = cfg["kv_transfer_config"]
    llm = LLM(**kwargs)
    _answer(answers, {"ready": True, "startup_s": round(time.monotonic() - t0, 2)})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "quit":
                break
            if op == "reset_prefix_cache":
                _answer(answers, {"ok": bool(llm.reset_prefix_cache())})
            elif op == "metrics":  # vLLM's Prometheus metrics of kvpool, preemptions and prompt token sources
                found = {}
                for mt in llm.get_metrics():
                    if "kvpool" in mt.name or "preemption" in mt.name or "prompt_tokens_by_source" in mt.name:
                        own = {k: v for k, v in (mt.labels or {}).items() if k not in ("model_name", "engine")}
                        name = mt.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(own.items())) + "}"
                                          if own else "")
                        found[name] = getattr(mt, "value", None) if hasattr(mt, "value") else mt.count
                _answer(answers, {"metrics": found})
            elif op == "generate":
                prompts = cmd["prompts"]
                params = cmd.get("params") or [None] * len(prompts)
                sps = [SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8), ignore_eos=True,
                                      extra_args={"kv_transfer_params": p} if p is not None else None)
                       for p in params]
                t_gen = time.perf_counter()
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
                elapsed = time.perf_counter() - t_gen
                _answer(answers, {"elapsed_s": elapsed, "outputs": [{
                    "token_ids": list(o.outputs[0].token_ids),
                    "num_cached_tokens": o.num_cached_tokens,
                    "kv_transfer_params": o.kv_transfer_params,
                    "finish_reason": o.outputs[0].finish_reason} for o in outs]})
            else:
                _answer(answers, {"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - report to the driving test
            traceback.print_exc()
            _answer(answers, {"error": f"{type(e).__name__}: {e}"})
    del llm
    answers.close()


if __name__ == "__main__":
    main()
