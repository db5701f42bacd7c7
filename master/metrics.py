"""Prometheus metrics for the master (``/metrics``, beside ``/healthz`` and ``/readyz``:
:mod:`protocol.opshttp`): one snapshot of the state per scrape, taken on the RPC thread
(a copy of the index, :class:`~master.stats.StatsSnapshot`) and walked on the scrape's
thread, so a scrape costs the RPC thread no walk of the index.

The RPC latency histogram is kept in plain lists by the RPC thread and turned into a
histogram family only when scraped: ``prometheus_client.Histogram.labels().observe``
(label lookup, a lock per bucket) cost ~1/3 of the master's Python time per one-key
request (cProfile of a lookup loop).
"""
from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvpool.master.handoffs import HOLD_BUCKETS

BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0)  # seconds (upper bounds; +Inf added)


def _disk_families(st):
    """Per store node with a disk tier: its capacity, bytes and objects on disk, tier moves
    in flight, and the demotions and promotions done with the node's seconds spent in them."""
    lab = ["node"]
    fams = {name: GaugeMetricFamily(f"kvpool_node_disk_{name}", doc, labels=lab) for name, doc in (
        ("capacity_bytes", "Disk tier bytes per store node"),
        ("used_bytes", "Bytes of object files in a store node's disk tier"),
        ("objects", "Replicas on a store node's disk tier"),
        ("moves_in_flight", "Demotions and promotions under way on a store node"))}
    done = {name: CounterMetricFamily(f"kvpool_node_{name}", doc, labels=lab) for name, doc in (
        ("demotions", "Replicas demoted from memory to a store node's disk tier"),
        ("demotion_seconds", "Sum of demotions' latencies on store nodes (write to publish, fsync included)"),
        ("promotions", "Replicas promoted from a store node's disk tier to memory"),
        ("promotion_seconds", "Sum of promotions' latencies on store nodes (read, check, copy)"))}
    for n in st.nodes:
        if not n.disk_capacity:
            continue
        for name, v in (("capacity_bytes", n.disk_capacity), ("used_bytes", n.disk_used),
                        ("objects", n.disk_objects), ("moves_in_flight", n.tier_moves)):
            fams[name].add_metric([n.node_id], v)
        for name, v in (("demotions", n.demotions), ("demotion_seconds", n.demotion_s),
                        ("promotions", n.promotions), ("promotion_seconds", n.promotion_s)):
            done[name].add_metric([n.node_id], v)
    return [*fams.values(), *done.values()]


class _StateCollector:
    def __init__(self, owner: "Metrics") -> None:
        self.owner = owner

    def collect(self):
        st, rpc_hist, holds = self.owner.snapshot()
        objs = GaugeMetricFamily("kvpool_objects", "Committed objects in the index")
        objs.add_metric([], st.objects)
        yield objs
        used = GaugeMetricFamily("kvpool_node_used_bytes", "Bytes allocated per store node", labels=["node"])
        cap = GaugeMetricFamily("kvpool_node_capacity_bytes", "Segment bytes per store node", labels=["node"])
        for n in st.nodes:
            used.add_metric([n.node_id], n.used)
            cap.add_metric([n.node_id], n.capacity)
        yield used
        yield cap
        if st.disk_capacity:  # disk tiers (master/tiers.py); moves are counted in kvpool_ops
            yield from _disk_families(st)
        held = GaugeMetricFamily("kvpool_held_bytes", "Bytes held for P/D hand-offs (all replicas)")
        held.add_metric([], st.held_bytes)
        yield held
        under = GaugeMetricFamily("kvpool_under_replicated", "Objects with fewer replicas than they want")
        under.add_metric([], st.under_replicated)
        yield under
        copies = GaugeMetricFamily("kvpool_repairs_in_flight", "Re-replication copies under way")
        copies.add_metric([], st.repairs_in_flight)
        yield copies
        ops = CounterMetricFamily("kvpool_ops", "Operations by kind", labels=["op"])
        ev = CounterMetricFamily("kvpool_evictions", "Objects evicted by reason", labels=["reason"])
        for name, v in st.counters.items():
            if name.startswith("evictions_"):
                ev.add_metric([name[len("evictions_"):]], v)
            else:
                ops.add_metric([name], v)
        yield ops
        yield ev
        refused = CounterMetricFamily("kvpool_connections_refused", "Client connections closed by the master's "
                                      "bounds, by reason (max_conns, auth, tls, handshake_timeout, frame_timeout)",
                                      labels=["reason"])
        for reason, n in dict(self.owner.refusals).items():
            refused.add_metric([reason], n)
        yield refused
        rpc = HistogramMetricFamily("kvpool_rpc_seconds", "Master RPC handling latency (seconds)", labels=["op"])
        for op, (counts, total) in rpc_hist.items():
            rpc.add_metric([op], _cumulative(BUCKETS, counts), total)
        yield rpc
        hold = HistogramMetricFamily("kvpool_handoff_hold_seconds", "How long P/D hand-offs held their blocks, "
                                     "from publish to ack, release or expiry, by outcome (seconds)",
                                     labels=["outcome"])
        for outcome, (counts, total) in holds.items():
            hold.add_metric([outcome], _cumulative(HOLD_BUCKETS, counts), total)
        yield hold


def _cumulative(bounds, counts: list[int]) -> list[tuple[str, int]]:
    """Prometheus buckets (``le``, cumulative count) of per-bucket ``counts`` (``bounds``, then +Inf)."""
    cum, out = 0, []
    for le, n in zip((*map(str, bounds), "+Inf"), counts):
        cum += n
        out.append((le, cum))
    return out


class Metrics:
    """Owns a private registry: RPC latency histogram plus gauges/counters from the state.

    A scrape never iterates the state from the HTTP thread while the RPC thread changes it:
    ``ask(fn)`` runs ``fn`` on the RPC thread and returns its result (the server posts it
    between two polls): that takes the snapshot, which the scrape's thread then walks
    (:mod:`master.stats`). Without ``ask`` (a state with no RPC thread, as in unit tests)
    the snapshot is taken in place.
    """

    def __init__(self, state, ask=None) -> None:
        self.state = state
        self.ask = ask
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(self))
        self.refusals: dict[str, int] = {}  # connections closed by the server's bounds, by reason
        self.rpc: dict[str, tuple[list[int], list[float]]] = {}  # op -> (per-bucket counts, [sum of seconds])

    def _take(self):
        return (self.state.stats_snapshot(), {op: (list(c), t[0]) for op, (c, t) in self.rpc.items()},
                self.state.hold_histogram())

    def snapshot(self):
        """``(ClusterStats, {op: (bucket counts, seconds)}, hand-off hold histogram by
        outcome)`` from a snapshot taken on the RPC thread, walked on the caller's."""
        snap, hist, holds = self.ask(self._take) if self.ask is not None else self._take()
        return snap.finish(), hist, holds

    def observe(self, op: str, seconds: float) -> None:
        """Count one request of ``op`` that took ``seconds`` (RPC thread only)."""
        h = self.rpc.get(op)
        if h is None:
            h = self.rpc[op] = ([0] * (len(BUCKETS) + 1), [0.0])
        h[0][bisect_left(BUCKETS, seconds)] += 1
        h[1][0] += seconds

    def serve(self, host: str, port: int, healthz, readyz) -> str:
        """Serve ``/metrics`` with ``/healthz`` and ``/readyz`` (checks: ``() -> (ok, detail)``)
        on ``host:port`` (0: any free port); the bound URL. Raises OSError when it cannot bind."""
        from kvpool.protocol.opshttp import OpsServer

        self.http = OpsServer(host, port, self.registry, healthz, readyz)
        return self.http.url
