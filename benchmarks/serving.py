"""Time to first token through ``kvpool proxy`` against one plain vLLM server, in one run.

Starts a local cluster (etcd, master with its metrics port, one store node) and three
vLLM OpenAI servers on the tiny random Llama of ``tests/engines/tiny_model.py``, started as
``tests/engines/servers.py`` starts them for the proxy tests: ``single`` (plain vLLM, no
connector), ``prefill`` (``kv_producer``) and ``decode`` (``kv_consumer``, policy
recompute), then ``kvpool proxy`` in front of prefill and decode. For each prompt length
of ``--lengths``, each of ``--rounds`` rounds sends ``--prompts`` prompts (random words,
one token each; no two share a block) to every path, one request at a time, the order of
the paths turning from prompt to prompt, after ``--warmup`` unmeasured prompts per path
and length. Paths:

* ``single``: straight to the plain server;
* ``proxy``: through ``kvpool proxy`` (prefill with ``max_tokens: 1``, then decode with its
  ``kv_transfer_params``);
* ``split`` (with ``--split``): the proxy's two requests sent by this client, with
  ``--gap`` seconds between them that are not counted: the same work with the decode
  server not sharing the CPU with the prefill server's leftover polling (below).

Before each request the client waits ``--gap`` seconds: a vLLM worker keeps busy-polling
its message queue for a while after its last step (``SpinCondition.busy_loop_s`` in
vLLM's ``shm_broadcast``), and on a small machine that spinning, left over from the
previous request on other servers, slows the request measured; ``--gap 0`` sends them
back to back. Every request is a streaming ``/v1/completions`` (temperature 0,
``--max-tokens`` tokens, ``ignore_eos``, usage in the last event) on a new connection.
Measured on the client, per path and length (min / median / p90 (nearest rank) / mean, ms):

* ``ttft``: from sending the request to the first SSE data event with non-empty text;
* ``total``: from sending the request to ``data: [DONE]``;
* ``ratio``: each path / single, of the medians and of the p90s;
* ``cached_tokens``: ``usage.prompt_tokens_details.cached_tokens`` of the answers (through
  the proxy, the decode server's: the prompt tokens it loaded from the hand-off);
  ``handoff_tokens`` is what a hand-off can carry (whole blocks, all but the last token);
* ``text_mismatches``: prompts whose generated text differs between proxy and single
  (they get the same prompts; split gets others, as it shares the proxy's servers and
  their local prefix caches);
* ``parts``: per path, means over its measured requests from the servers' own
  ``/metrics`` (scraped after each request's gap, so each request's samples are its
  own): the proxy's prefill round trip and decode time to first byte / to the end; each
  vLLM server's time to first token, end-to-end, queue and prefill times, and the
  connector's save (prefill server) and load (decode server) job latencies;
  ``master_rpc``: the master's handling time per RPC kind (a hand-off publish includes
  its etcd write) and calls per request. The client's mean ``ttft`` less the proxy's
  prefill and decode-first-byte means is what the proxy's own hops cost;
* ``rounds_detail``: each round's medians and ratios (how much the machine moved during the run).

    python benchmarks/serving.py [--prompts 6] [--rounds 3] [--gap 1.2] [--lengths 256,960,2048] [--split] [--json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections import defaultdict
from http.client import HTTPConnection
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "engines"))

NS = "bench-serving"
LONGEST = 8192  # tokens: the longest --lengths prompt (the tiny model is built to take it)
# (report name, histogram) per server whose /metrics is scraped
_VLLM = [("ttft_ms", "vllm:time_to_first_token_seconds"), ("e2e_ms", "vllm:e2e_request_latency_seconds"),
         ("queue_ms", "vllm:request_queue_time_seconds"), ("prefill_ms", "vllm:request_prefill_time_seconds")]
PARTS = {
    "proxy": [("prefill_ms", "kvpool_proxy_prefill_seconds"), ("decode_ttfb_ms", "kvpool_proxy_decode_ttfb_seconds"),
              ("decode_ms", "kvpool_proxy_decode_seconds")],
    "single": _VLLM,
    "prefill": _VLLM + [("kv_save_ms", "vllm:kvpool_save_seconds")],
    "decode": _VLLM + [("kv_load_ms", "vllm:kvpool_load_seconds")],
}
RPC = "kvpool_rpc_seconds"  # the master's histogram, label op


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def stream_completion(url: str, body: dict, timeout_s: float) -> dict:
    """One streaming completion: ``ttft_s``, ``total_s``, ``text``, ``usage``. Raises
    RuntimeError for a non-200 answer, an error event, a stream without ``[DONE]`` or
    without text, TimeoutError past ``timeout_s`` (also the limit of each socket read)."""
    u = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode()
    conn = HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    t0 = time.perf_counter()
    first, text, usage, done = None, "", {}, False
    try:
        conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {r.read()[:300]!r}")
        while line := r.readline():
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"{url}: stream not done within {timeout_s:g}s")
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            doc = json.loads(payload)
            if "error" in doc:
                raise RuntimeError(f"{url}: error event {doc['error']}")
            for c in doc.get("choices") or ():
                if c.get("text"):
                    if first is None:
                        first = time.perf_counter()
                    text += c["text"]
            usage = doc.get("usage") or usage
        end = time.perf_counter()
    finally:
        conn.close()
    if not done or first is None:
        raise RuntimeError(f"{url}: stream ended {'without text' if done else 'before data: [DONE]'}")
    return {"ttft_s": first - t0, "total_s": end - t0, "text": text, "usage": usage}


def split_completion(prefill_url: str, decode_url: str, body: dict, gap_s: float, timeout_s: float) -> dict:
    """What the proxy does, from here: prefill (``max_tokens: 1``, not streamed), wait
    ``gap_s``, then the streamed decode with the prefill's ``kv_transfer_params``. Times as
    :func:`stream_completion`'s plus the prefill's round trip (``prefill_s``), not the gap."""
    from servers import http

    pbody = {k: v for k, v in body.items() if k != "stream_options"}
    pbody.update(max_tokens=1, stream=False)
    t0 = time.perf_counter()
    st, _, raw = http("POST", prefill_url + "/v1/completions", pbody, timeout=timeout_s)
    prefill_s = time.perf_counter() - t0
    if st != 200:
        raise RuntimeError(f"{prefill_url}: HTTP {st}: {raw[:300]!r}")
    params = json.loads(raw).get("kv_transfer_params")
    if not isinstance(params, dict):
        raise RuntimeError(f"{prefill_url}: no kv_transfer_params in {raw[:300]!r}")
    time.sleep(gap_s)
    res = stream_completion(decode_url, {**body, "kv_transfer_params": params}, timeout_s)
    res["ttft_s"] += prefill_s
    res["total_s"] += prefill_s
    res["prefill_s"] = prefill_s
    return res


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` of ``url``: each sample's value summed over its labels but ``op`` (the
    master's RPC histogram), keyed ``name`` or ``name|op``."""
    from prometheus_client.parser import text_string_to_metric_families

    from servers import http

    st, _, body = http("GET", url + "/metrics", timeout=10)
    if st != 200:
        raise RuntimeError(f"{url}/metrics: HTTP {st}")
    out: dict[str, float] = defaultdict(float)
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[s.name + (f"|{s.labels['op']}" if "op" in s.labels else "")] += s.value
    return out


def ms_summary(seconds: list[float]) -> dict[str, float]:
    xs = sorted(seconds)
    return {"min": round(1000 * xs[0], 2), "median": round(1000 * statistics.median(xs), 2),
            "p90": round(1000 * xs[max(0, math.ceil(0.9 * len(xs)) - 1)], 2),
            "mean": round(1000 * statistics.fmean(xs), 2)}


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def mean_ms(d: dict[str, float], hist: str, op: str | None = None) -> float | None:
    """Mean of histogram ``hist`` (label ``op``) in the deltas ``d``, in ms; None without samples."""
    tag = f"|{op}" if op else ""
    c = d.get(f"{hist}_count{tag}", 0.0)
    return round(1000 * d.get(f"{hist}_sum{tag}", 0.0) / c, 2) if c else None


def path_parts(sums: dict[str, dict[str, float]], requests: int) -> dict:
    """The ``parts`` of one path from its summed metric deltas per server: the servers it
    touched only."""
    parts = {}
    for server, hists in PARTS.items():
        d = sums.get(server, {})
        vals = {name: mean_ms(d, hist) for name, hist in hists}
        if any(v is not None for v in vals.values()):
            parts[server] = vals
    rpc = sums.get("master", {})
    ops = sorted(k.split("|", 1)[1] for k, v in rpc.items() if k.startswith(f"{RPC}_count|") and v > 0)
    parts["master_rpc"] = {op: {"mean_ms": mean_ms(rpc, RPC, op),
                                "calls_per_request": round(rpc[f"{RPC}_count|{op}"] / requests, 2)} for op in ops}
    return parts


def build_report(a, lengths: list[int], block_size: int, boot_s: float, wall_s: float, samples: dict,
                 sums: dict, mismatches: dict, rounds: list[dict]) -> dict:
    cases = []
    for n in lengths:
        case: dict = {"prompt_tokens": n, "handoff_tokens": (n - 1) // block_size * block_size}
        for p, xs in samples[n].items():
            cached = [int((x["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for x in xs]
            case[p] = {"ttft_ms": ms_summary([x["ttft_s"] for x in xs]),
                       "total_ms": ms_summary([x["total_s"] for x in xs]),
                       "cached_tokens": {"min": min(cached), "max": max(cached)}, "requests": len(xs)}
            if "prefill_s" in xs[0]:
                case[p]["prefill_rtt_ms"] = ms_summary([x["prefill_s"] for x in xs])
        case["ratio"] = {p: {f"{q}_{s}": ratio(case[p][f"{q}_ms"][s], case["single"][f"{q}_ms"][s])
                             for q in ("ttft", "total") for s in ("median", "p90")}
                         for p in samples[n] if p != "single"}
        case["text_mismatches"] = mismatches[n]
        case["parts"] = {p: path_parts(sums[n][p], len(samples[n][p])) for p in samples[n]}
        cases.append(case)
    return {"prompts": a.prompts, "rounds": a.rounds, "warmup": a.warmup, "gap_s": a.gap,
            "max_tokens": a.max_tokens, "lengths": lengths, "boot_s": round(boot_s, 1), "wall_s": round(wall_s, 1),
            "cases": cases, "rounds_detail": rounds}


def print_report(rep: dict) -> None:
    print(f"{'tokens':>6} {'path':>6} {'ttft min / median / p90 ms':>28} {'total min / median / p90 ms':>28} "
          f"{'cached':>9}")
    for c in rep["cases"]:
        paths = [p for p in ("single", "proxy", "split") if p in c]
        for p in paths:
            t, e, k = c[p]["ttft_ms"], c[p]["total_ms"], c[p]["cached_tokens"]
            print(f"{c['prompt_tokens']:>6} {p:>6} {t['min']:>8} {t['median']:>9} {t['p90']:>9} "
                  f"{e['min']:>9} {e['median']:>9} {e['p90']:>9} {k['min']:>5}-{k['max']}")
        for p, r in c["ratio"].items():
            print(f"{'':>6} {p + '/single':>13}: ttft median x{r['ttft_median']}, p90 x{r['ttft_p90']}; "
                  f"total median x{r['total_median']}, p90 x{r['total_p90']}")
        print(f"{'':>6} text mismatches: {c['text_mismatches']}")
        for p in paths:
            for server, v in c["parts"][p].items():
                if server == "master_rpc":
                    text = ", ".join(f"{op} {x['mean_ms']} ms x{x['calls_per_request']}" for op, x in v.items())
                else:
                    text = ", ".join(f"{name} {val}" for name, val in v.items())
                print(f"{'':>6} {p + ' ' + server:>18}: {text}")
    print(f"boot {rep['boot_s']} s, wall {rep['wall_s']} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6, help="measured prompts per length and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default="256,960,2048", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured prompts per path and length")
    ap.add_argument("--gap", type=float, default=1.2, help="seconds idle before each request")
    ap.add_argument("--split", action="store_true", help="also measure the split path")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the servers may take to boot")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    # a SIGTERM runs the finally blocks below (children stopped) instead of orphaning them
    signal.signal(signal.SIGTERM, lambda sig, _frame: sys.exit(128 + sig))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from kvpool.cli.cluster import LocalCluster, free_port
    from harness import kv_config
    from kvpool.protocol.config import load_config
    from servers import MODEL, every_backend_healthy, prompt_text, start_proxy, start_vllm_server, stop_all, \
        write_chat_template
    from tiny_model import BLOCK_SIZE, MAX_MODEL_LEN, build_tiny_llama

    if a.prompts < 1 or a.rounds < 1 or a.gap < 0 or any(not 0 < n <= LONGEST for n in lengths):
        ap.error(f"--prompts and --rounds must be >= 1, --gap >= 0, each length in 1..{LONGEST}")
    # the tiny model and the servers take the longest prompt and its answer
    max_len = max(MAX_MODEL_LEN, -(-(max(lengths) + a.max_tokens) // BLOCK_SIZE) * BLOCK_SIZE)

    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-serving-"))
    logs = tmp / "logs"
    logs.mkdir()
    model = build_tiny_llama(tmp / "model", max_len=max_len)
    master_metrics = free_port()
    cfg = load_config(None, {"storenodes": [{"name": "node-0", "memory": "512MiB"}],
                             "master": {"metrics_port": master_metrics}}, environ={})
    seeds = itertools.count(1_000_000)
    procs = []
    ok = False
    try:
        with LocalCluster(cfg) as lc:
            try:
                template = write_chat_template(tmp)
                m = lc.master_addr
                single = start_vllm_server("single", model, logs, template, max_model_len=max_len)
                procs.append(single)
                prefill = start_vllm_server("prefill", model, logs, template,
                                            kv_config("kv_producer", m, NS, handoff_ttl_s=120),
                                            max_model_len=max_len)
                procs.append(prefill)
                decode = start_vllm_server("decode", model, logs, template,
                                           kv_config("kv_consumer", m, NS, "recompute"),
                                           max_model_len=max_len)
                procs.append(decode)
                deadline = time.monotonic() + a.startup_timeout
                for p in procs:
                    p.wait_healthy(deadline)
                proxy = start_proxy("proxy", ["--prefill", prefill.url, "--decode", decode.url, "--master", m], logs)
                procs.append(proxy)
                proxy.wait_healthy(time.monotonic() + 60, every_backend_healthy)
                boot_s = time.monotonic() - t_start
                log(f"servers up in {boot_s:.1f}s; logs in {logs}")

                def body(seed: int, n: int) -> dict:
                    return {"model": MODEL, "prompt": prompt_text(seed, n), "max_tokens": a.max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}

                paths = {"single": lambda b: stream_completion(single.url, b, a.timeout),
                         "proxy": lambda b: stream_completion(proxy.url, b, a.timeout)}
                if a.split:
                    paths["split"] = lambda b: split_completion(prefill.url, decode.url, b, a.gap, a.timeout)
                metric_urls = {"proxy": proxy.url, "single": single.url, "prefill": prefill.url,
                               "decode": decode.url, "master": f"http://127.0.0.1:{master_metrics}"}
                samples = {n: {p: [] for p in paths} for n in lengths}
                # sums[length][path][server][sample]: metric deltas over that path's requests
                sums = {n: {p: defaultdict(lambda: defaultdict(float)) for p in paths} for n in lengths}
                mismatches = {n: 0 for n in lengths}
                rounds = []
                for n in lengths:  # warm-up: first requests pay lazy set-up costs
                    for _ in range(a.warmup):
                        for run in paths.values():
                            time.sleep(a.gap)
                            run(body(next(seeds), n))
                time.sleep(a.gap)
                last = {k: scrape(u) for k, u in metric_urls.items()}
                for r in range(a.rounds):
                    for n in lengths:
                        got = {p: [] for p in paths}
                        for i in range(a.prompts):
                            # single and proxy get the same prompt (they share no server), split
                            # another: it shares the proxy's servers and their prefix caches
                            seed = next(seeds)
                            prompt_seeds = {p: seed for p in paths}
                            if "split" in paths:
                                prompt_seeds["split"] = next(seeds)
                            names = list(paths)
                            texts = {}
                            for p in names[i % len(names):] + names[:i % len(names)]:
                                res = paths[p](body(prompt_seeds[p], n))
                                if res["usage"].get("prompt_tokens") != n:
                                    raise RuntimeError(f"{p}: {res['usage']} for a {n}-token prompt")
                                got[p].append(res)
                                texts[p] = res["text"]
                                time.sleep(a.gap)  # then its metrics are in, and the servers idle again
                                now = {k: scrape(u) for k, u in metric_urls.items()}
                                for k in metric_urls:
                                    for name, v in now[k].items():
                                        sums[n][p][k][name] += v - last[k].get(name, 0.0)
                                last = now
                            mismatches[n] += texts["proxy"] != texts["single"]
                        med = {p: {q: statistics.median(x[f"{q}_s"] for x in got[p]) for q in ("ttft", "total")}
                               for p in paths}
                        rounds.append({"round": r, "prompt_tokens": n,
                                       **{f"{p}_{q}_ms": round(1000 * med[p][q], 2) for p in paths
                                          for q in ("ttft", "total")},
                                       **{f"{p}_{q}_ratio": ratio(med[p][q], med["single"][q]) for p in paths
                                          if p != "single" for q in ("ttft", "total")}})
                        log(f"round {r}, {n} tokens: ttft medians " + ", ".join(
                            f"{p} {rounds[-1][f'{p}_ttft_ms']} ms" for p in paths))
                        for p in paths:
                            samples[n][p] += got[p]
            finally:
                stop_all(reversed(procs))
        ok = True
    finally:
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"failed; server logs kept in {logs}")

    rep = build_report(a, lengths, BLOCK_SIZE, boot_s, time.monotonic() - t_start, samples, sums, mismatches, rounds)
    if a.json:
        print(json.dumps(rep, indent=1))
    else:
        print_report(rep)


if __name__ == "__main__":
    main()
