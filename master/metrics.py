"""Prometheus metrics for the master (``/metrics``), read from the state on each scrape."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _StateCollector:
    def __init__(self, owner: "Metrics") -> None:
        self.owner = owner

    def collect(self):
        st = self.owner.state.stats()
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
        held = GaugeMetricFamily("kvpool_held_bytes", "Bytes held for P/D hand-offs (all replicas)")
        held.add_metric([], st.held_bytes)
        yield held
        ops = CounterMetricFamily("kvpool_ops", "Operations by kind", labels=["op"])
        ev = CounterMetricFamily("kvpool_evictions", "Objects evicted by reason", labels=["reason"])
        for name, v in st.counters.items():
            if name.startswith("evictions_"):
                ev.add_metric([name[len("evictions_"):]], v)
            else:
                ops.add_metric([name], v)
        yield ops
        yield ev


class Metrics:
    """Owns a private registry: RPC latency histogram plus gauges/counters from the state."""

    def __init__(self, state) -> None:
        self.state = state
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(self))
        self.rpc = Histogram("kvpool_rpc_seconds", "Master RPC handling latency (seconds)", ["op"],
                             registry=self.registry,
                             buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0))

    def observe(self, op: str, seconds: float) -> None:
        self.rpc.labels(op).observe(seconds)

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)
