"""One demo engine process: ``python -m kvpool.connector.demo_engine.worker --role producer|consumer``.

The parent (``cli.demo.run_demo``) starts the process, which builds the reference model
and connects to the cluster, prints ``KVPOOL_WORKER_READY`` and then reads ONE JSON
document from stdin: ``{"requests": [{"request_id": str, "prompt": str}, ...]}``. It
answers with one line ``KVPOOL_RESULT <json>`` on stdout (logs go to stderr) and exits.
Nothing is pickled: the only channel back is that JSON line.

- producer (engine A): full prefill of each prompt, then stores the prompt's full KV
  blocks through ``connector.blocks.BlockStore`` (blocks already stored are skipped:
  content-addressed keys make them identical).
- consumer (engine B): for each prompt, times a full recompute (TTFT without the store),
  then hashes the prompt, looks up the stored prefix, loads the hit blocks into its own
  page tensors and computes only the suffix (TTFT with the store), and reports the max
  abs difference of the two next-token logits.

Times are wall-clock milliseconds from ``time.perf_counter``; bytes are the bytes the
client copied into the engine's tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from kvpool.connector.demo_engine.model import ModelConfig, ReferenceModel
from kvpool.connector.demo_engine.tokenizer import encode
from kvpool.protocol.keys import block_hashes, extra_bytes

RESULT_PREFIX = "KVPOOL_RESULT "
READY_LINE = "KVPOOL_WORKER_READY"
TOLERANCE = 1e-5


def log(msg: str) -> None:
    print(f"[worker {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def token_label(i: int) -> str:
    """A printable label of a byte token: the character if printable ASCII, else ``<0xNN>``."""
    return repr(chr(i)) if 32 <= i < 127 else f"<0x{i:02x}>"


def _errors(res: Any) -> list[str]:
    """Error strings from a per-key result list (``None`` = ok)."""
    if not isinstance(res, (list, tuple)):
        return []
    return [f"{type(r).__name__}: {r}" for r in res if isinstance(r, BaseException)]


class Engine:
    """A reference model plus its view of the store (one full-attention cache group)."""

    def __init__(self, master: str | None, namespace: str, config: ModelConfig | None = None,
                 rpc_timeout_s: float = 10.0) -> None:
        self.model = ReferenceModel(config)
        self.extra = extra_bytes(self.model.model_id)
        self.client = self.store = None
        if master:
            from kvpool.connector.blocks import BlockStore
            from kvpool.connector.client import KVPoolClient

            self.client = KVPoolClient(master=master, rpc_timeout_s=rpc_timeout_s)
            self.store = BlockStore(self.client, model=self.model.model_id, group_id=0,
                                    layout=self.model.layout(), namespace=namespace)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def hashes(self, ids: list[int]) -> list[bytes]:
        return block_hashes(ids, self.model.block_size, self.extra)

    def warm_up(self) -> None:
        """First-call costs (allocator, kernels) out of the measured requests."""
        ids = encode("warm up " * 80)
        _, kv = self.model.prefill(ids)
        self.model.prefill(ids, self.model.blocks_to_kv(self.model.kv_to_blocks(kv)[:10]))

    # ------------------------------------------------------------------ engine A
    def produce(self, rid: str, prompt: str) -> dict:
        ids = encode(prompt)
        t0 = time.perf_counter()
        logits, kv = self.model.prefill(ids)
        prefill_ms = ms(t0)
        blocks = self.model.kv_to_blocks(kv)
        hashes = self.hashes(ids)
        t0 = time.perf_counter()
        have = self.store.lookup_prefix(hashes)
        res = self.store.put_blocks(hashes[have:], blocks[have:]) if have < len(blocks) else []
        put_ms = ms(t0)
        errs = _errors(res)
        return {"request_id": rid, "prompt_tokens": len(ids), "full_blocks": len(blocks),
                "already_stored_blocks": have, "blocks_put": len(blocks) - have - len(errs),
                "bytes_put": (len(blocks) - have - len(errs)) * self.model.block_nbytes,
                "prefill_ms": prefill_ms, "put_ms": put_ms, "errors": errs,
                "next_token": token_label(int(logits.argmax()))}

    # ------------------------------------------------------------------ engine B
    def consume(self, rid: str, prompt: str, reps: int = 1) -> dict:
        """Both paths ``reps`` times, alternating; the report keeps each path's fastest run
        (wall-clock noise on a shared machine only ever adds time)."""
        ids = encode(prompt)
        ttft_no_store, best, ref = float("inf"), None, None
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            ref, _ = self.model.prefill(ids)
            ttft_no_store = min(ttft_no_store, ms(t0))
            run = self._store_path(ids)
            if best is None or run["ttft_store_ms"] < best["ttft_store_ms"]:
                best = run
        logits = best.pop("logits")
        diff = float((logits - ref).abs().max())
        return {"request_id": rid, "prompt_tokens": len(ids), **best, "ttft_no_store_ms": ttft_no_store,
                "reps": max(1, reps), "max_abs_diff": diff, "match": diff <= TOLERANCE,
                "same_next_token": int(logits.argmax()) == int(ref.argmax()),
                "next_token": token_label(int(logits.argmax()))}

    def _store_path(self, ids: list[int]) -> dict:
        """Hash, look up, load the hit blocks into fresh page tensors, compute the suffix."""
        t0 = time.perf_counter()
        hashes = self.hashes(ids)
        n_hit = self.store.lookup_prefix(hashes)
        lookup_ms = ms(t0)
        t1 = time.perf_counter()
        outs = self.model.empty_blocks(n_hit)
        res = self.store.get_blocks(hashes[:n_hit], outs) if n_hit else []
        # keep the leading run of blocks that really arrived (one may be evicted between
        # lookup and get); the rest is recomputed
        loaded, nbytes = 0, 0
        for r in res:
            if not isinstance(r, int) or isinstance(r, bool) or r != self.model.block_nbytes:
                break
            loaded += 1
            nbytes += r
        load_ms = ms(t1)
        t2 = time.perf_counter()
        kv = self.model.blocks_to_kv(outs[:loaded]) if loaded else None
        logits, _ = self.model.prefill(ids, kv)
        compute_ms = ms(t2)
        hit_tokens = min(loaded * self.model.block_size, len(ids))
        return {"hit_blocks_found": n_hit, "hit_blocks": loaded, "hit_tokens": hit_tokens,
                "computed_tokens": len(ids) - min(hit_tokens, len(ids) - 1), "bytes_loaded": nbytes,
                "ttft_store_ms": ms(t0), "lookup_ms": lookup_ms, "load_ms": load_ms,
                "compute_ms": compute_ms, "errors": _errors(res), "logits": logits}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("producer", "consumer"), required=True)
    ap.add_argument("--master", required=True, help="master RPC address, tcp://host:port")
    ap.add_argument("--namespace", default="demo")
    ap.add_argument("--engine", choices=("dense", "hybrid"), default="dense")
    ap.add_argument("--rpc-timeout", type=float, default=10.0, help="client RPC timeout, seconds")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    if args.engine == "hybrid":
        from kvpool.connector.demo_engine.hybrid import HybridEngine

        eng: Any = HybridEngine(args.master, args.namespace, rpc_timeout_s=args.rpc_timeout)
    else:
        eng = Engine(args.master, args.namespace, rpc_timeout_s=args.rpc_timeout)
    try:
        eng.warm_up()
        startup_ms = ms(t_start)
        print(READY_LINE, flush=True)
        doc = json.loads(sys.stdin.readline() or "{}")
        rows = []
        t0 = time.perf_counter()
        reps = int(doc.get("reps", 1))
        for req in doc.get("requests", []):
            if args.role == "producer":
                rows.append(eng.produce(req["request_id"], req["prompt"]))
            else:
                rows.append(eng.consume(req["request_id"], req["prompt"], reps))
            log(f"{args.role} {req['request_id']} done")
        out = {"role": args.role, "engine": args.engine, "pid": os.getpid(), "model_id": eng.model.model_id,
               "weights_digest": eng.model.weights_digest(), "torch_threads": torch.get_num_threads(),
               "startup_ms": startup_ms, "work_ms": ms(t0), "rows": rows}
        if hasattr(eng, "describe"):
            out["engine_info"] = eng.describe()
        print(RESULT_PREFIX + json.dumps(out), flush=True)
        return 0
    finally:
        eng.close()


if __name__ == "__main__":
    sys.exit(main())
