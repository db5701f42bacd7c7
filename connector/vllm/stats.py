"""Stats of the kvpool vLLM connector: the counters and distributions both halves
collect (:class:`KVPoolConnectorStats`, shipped to vLLM's scheduler with each step's
output and aggregated there) and the Prometheus metrics vLLM exposes for them
(:class:`KVPoolPromMetrics`). Imports vLLM.

Keys of ``KVPoolConnectorStats.data``: a counter name of COUNTERS (a number), a
distribution of DISTRIBUTIONS (a list of observations, at most MAX_OBSERVED per
collection interval), or ``group/<group id>/<name>`` for the per-cache-group counters
(GROUP_COUNTERS) and latencies (GROUP_LATENCIES).
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = {
    "lookups": "Prefix lookups (one per request that asked kvpool)",
    "hit_tokens": "Prompt tokens loaded from kvpool beyond the local prefix cache (counted when the load "
                  "landed; tokens whose load failed are recomputed_tokens)",
    "miss_tokens": "Prompt tokens looked up but not held by kvpool",
    "loads": "Finished load jobs (one per request and worker)",
    "blocks_loaded": "Blocks loaded from kvpool into the KV cache",
    "blocks_load_failed": "Blocks that could not be loaded (missing, corrupt, layout, node down, deadline)",
    "blocks_corrupt": "Of those, blocks whose bytes failed their checksum (the replica is reported corrupt)",
    "blocks_read_on_lookup_leases": "Blocks whose read went under the read lease of the scheduler's lookup "
                                    "(no lookup of their own; one that failed was looked up again)",
    "bytes_loaded": "Bytes loaded from kvpool",
    "blocks_saved": "Blocks put into kvpool (existing keys count as saved)",
    "blocks_save_failed": "Blocks whose put failed",
    "bytes_saved": "Bytes put into kvpool",
    "handoffs_published": "P/D hand-offs published by this producer",
    "handoffs_acked": "P/D hand-offs loaded and acknowledged by this consumer",
    "handoffs_released": "P/D hand-offs released unused (whole prompt held locally, aborted) or after a failed load",
    "handoff_errors": "Hand-offs that could not be published or claimed",
    "handoff_close_errors": "Hand-off acks or releases the master did not take (it frees them at their deadline)",
    "lookups_timed_out": "Lookups not answered within lookup_timeout_s (the request ran as a miss)",
    "recomputed_tokens": "Tokens kvpool held whose load failed, recomputed by the engine",
    "states_saved": "Recurrent-state checkpoints (Mamba / gated delta net / KDA) put into kvpool",
    "state_lookups": "Lookups of a model with state groups",
    "state_hits": "Loads that restored the recurrent state (counted when the load landed)",
}
GROUP_COUNTERS = {
    "bytes_loaded": "Bytes loaded from kvpool, per cache group",
    "bytes_saved": "Bytes put into kvpool, per cache group",
    "hit_tokens": "Tokens a landed load restored, per cache group (sliding-window groups count only the window, "
                  "state groups one block per checkpoint)",
    "state_lookups": "Lookups that probed this state group's checkpoints",
    "state_hits": "Of those, lookups that found a checkpoint of this group the hit could use",
}
GROUP_PREFIX = "group/"  # stats keys "group/<gid>/<name>"
MAX_OBSERVED = 1024  # observations of each distribution kept per collection interval
_SECONDS = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0)
# name -> (Prometheus metric, documentation, bucket upper bounds); the "_s" ones are latencies
DISTRIBUTIONS = {
    "load_s": ("vllm:kvpool_load_seconds", "Latency of one request's load from kvpool (seconds)", _SECONDS),
    "layer_wait_s": ("vllm:kvpool_layer_wait_seconds",
                     "Time one step's forward pass waited for its layer-wise loads (seconds)", _SECONDS),
    "save_s": ("vllm:kvpool_save_seconds",
               "Latency of one save job's puts into kvpool, from staging to commit (seconds)", _SECONDS),
    "partial_tail_tokens": ("vllm:kvpool_partial_tail_tokens",
                            "Tokens past a computed prompt's last full block, which kvpool does not store",
                            (0, 1, 4, 16, 32, 64, 128, 256, 512, 1024)),
}
GROUP_LATENCIES = {
    "load_s": ("vllm:kvpool_group_load_seconds",
               "Latency of one step's fetch of a cache group's blocks from kvpool (seconds)"),
    "save_s": ("vllm:kvpool_group_save_seconds",
               "Latency of one save job's puts of a cache group's blocks (seconds)"),
}
LATENCIES = {k: v[1] for k, v in DISTRIBUTIONS.items() if k.endswith("_s")}  # (older name)


class KVPoolConnectorStats(KVConnectorStats):
    """Counters since the last collection, and the observations of each distribution
    (latencies in seconds, tail lengths in tokens), at most MAX_OBSERVED each per
    interval."""

    def __post_init__(self) -> None:
        for k in COUNTERS:
            self.data.setdefault(k, 0)
        for k in DISTRIBUTIONS:
            self.data.setdefault(k, [])

    def add(self, key: str, v: float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + v

    def add_group(self, group_id: int, key: str, v: float) -> None:
        if v:
            self.add(f"{GROUP_PREFIX}{group_id}/{key}", v)

    def observe(self, kind: str, value: float) -> None:
        """Record one observation of distribution ``kind`` (in DISTRIBUTIONS, or
        ``group/<gid>/<latency>``)."""
        obs = self.data.setdefault(kind, [])
        if len(obs) < MAX_OBSERVED:
            obs.append(float(value))

    def observe_group(self, group_id: int, kind: str, seconds: float) -> None:
        """One latency of ``kind`` (in GROUP_LATENCIES) of cache group ``group_id``."""
        self.observe(f"{GROUP_PREFIX}{group_id}/{kind}", seconds)

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}
        for k in DISTRIBUTIONS:
            self.data[k] = []

    def aggregate(self, other: KVConnectorStats) -> "KVPoolConnectorStats":
        for k, v in (other.data or {}).items():
            if isinstance(v, list):
                self.data[k] = (list(self.data.get(k) or []) + v)[:MAX_OBSERVED]
            elif isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """Counters as they are; per latency (also per group) its mean and p99 in ms, per
        other distribution its mean."""
        d: dict[str, int | float] = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        for kind, obs in self.data.items():
            if not isinstance(obs, list) or (kind not in DISTRIBUTIONS and not kind.startswith(GROUP_PREFIX)):
                continue
            obs = sorted(obs)
            head, _, name = kind.rpartition("/")
            prefix = f"{head}/" if head else ""
            if name.endswith("_s"):
                op = name[:-2]
                d[f"{prefix}avg_{op}_ms"] = round(1000.0 * sum(obs) / len(obs), 3) if obs else 0.0
                d[f"{prefix}p99_{op}_ms"] = round(1000.0 * obs[min(len(obs) - 1, int(0.99 * len(obs)))], 3) \
                    if obs else 0.0
            else:
                d[f"{prefix}avg_{name}"] = round(sum(obs) / len(obs), 3) if obs else 0.0
        return d

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvpool_<counter>_total`` counters, per-group counters and latency histograms
    with a ``group`` label, and the distributions' histograms, per engine, fed from
    :class:`KVPoolConnectorStats`."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for key, doc in COUNTERS.items():
            c = self._counter_cls(name=f"vllm:kvpool_{key}_total", documentation=doc, labelnames=labelnames)
            self.counters[key] = {i: c.labels(*v) for i, v in per_engine_labelvalues.items()}
        self.hists = {}
        for kind, (name, doc, buckets) in DISTRIBUTIONS.items():
            h = self._histogram_cls(name=name, documentation=doc, labelnames=labelnames, buckets=buckets)
            self.hists[kind] = {i: h.labels(*v) for i, v in per_engine_labelvalues.items()}
        self.group_counters = {
            key: self._counter_cls(name=f"vllm:kvpool_group_{key}_total", documentation=doc,
                                   labelnames=[*labelnames, "group"])
            for key, doc in GROUP_COUNTERS.items()}
        self.group_hists = {
            key: self._histogram_cls(name=name, documentation=doc, labelnames=[*labelnames, "group"],
                                     buckets=_SECONDS)
            for key, (name, doc) in GROUP_LATENCIES.items()}
        self.labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            v = transfer_stats_data.get(key)
            if v and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
        for key, v in transfer_stats_data.items():
            if not key.startswith(GROUP_PREFIX) or not v or engine_idx not in self.labelvalues:
                continue
            _, gid, name = key.split("/", 2)
            if isinstance(v, list):
                h = self.group_hists.get(name)
                if h is not None:
                    child = h.labels(*self.labelvalues[engine_idx], gid)
                    for s in v:
                        child.observe(s)
                continue
            c = self.group_counters.get(name)
            if c is not None:
                c.labels(*self.labelvalues[engine_idx], gid).inc(v)
        for kind, per_engine in self.hists.items():
            hist = per_engine.get(engine_idx)
            if hist is not None:
                for s in transfer_stats_data.get(kind) or ():
                    hist.observe(s)
