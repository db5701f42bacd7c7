"""Prometheus metrics of one store node, read from its data server and extent table at
each scrape (every family carries a ``node`` label):

* ``kvpool_storenode_received_bytes_total`` / ``kvpool_storenode_sent_bytes_total``:
  object bytes written into / read from the segment over the node's sockets (same-host
  clients' shared-memory copies do not pass through the node and are not counted);
* ``kvpool_storenode_requests_total{plane, kind}``: data-plane requests by op
  (``plane="data"``: write, written, commit, read, map, ping, ...) and the master's control
  messages by type (``plane="control"``: commit, free, list, copy, ...);
* ``kvpool_storenode_errors_total{plane, kind}``: requests refused, by the error's code;
* ``kvpool_storenode_extents{state}``: extent rows held, ``committed`` or ``written`` (not
  committed yet);
* ``kvpool_storenode_segment_bytes{kind}``: ``capacity``, ``used`` (bytes under extent rows),
  ``free`` (the rest);
* ``kvpool_storenode_registered``: 1 while the node's descriptor is published in etcd.
"""
from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class NodeStats:
    """Counters the node's threads bump (plain ints and dicts: a lost increment under a
    thread switch is tolerated, a lock per request is not worth it)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # (plane, kind)
        self.errors: Counter[tuple[str, str]] = Counter()  # (plane, error code)


class _Collector:
    def __init__(self, node) -> None:
        self.node = node

    def collect(self):
        n = self.node
        lab = ["node"]
        nid = n.node_id
        rx = CounterMetricFamily("kvpool_storenode_received_bytes", "Object bytes written into the segment over "
                                 "the node's sockets", labels=lab)
        rx.add_metric([nid], n.data.bytes_in)
        tx = CounterMetricFamily("kvpool_storenode_sent_bytes", "Object bytes read from the segment over the "
                                 "node's sockets", labels=lab)
        tx.add_metric([nid], n.data.bytes_out)
        req = CounterMetricFamily("kvpool_storenode_requests", "Requests served, by plane and kind",
                                  labels=[*lab, "plane", "kind"])
        for (plane, kind), v in sorted(dict(n.stats.requests).items()):
            req.add_metric([nid, plane, kind], v)
        err = CounterMetricFamily("kvpool_storenode_errors", "Requests refused, by plane and error code",
                                  labels=[*lab, "plane", "kind"])
        for (plane, kind), v in sorted(dict(n.stats.errors).items()):
            err.add_metric([nid, plane, kind], v)
        committed, written, used = n.table.usage()
        ext = GaugeMetricFamily("kvpool_storenode_extents", "Extent rows held, by state", labels=[*lab, "state"])
        ext.add_metric([nid, "committed"], committed)
        ext.add_metric([nid, "written"], written)
        seg = GaugeMetricFamily("kvpool_storenode_segment_bytes", "Segment bytes: capacity, used (under extent "
                                "rows), free", labels=[*lab, "kind"])
        cap = n.segment.capacity
        for kind, v in (("capacity", cap), ("used", used), ("free", max(0, cap - used))):
            seg.add_metric([nid, kind], v)
        reg = GaugeMetricFamily("kvpool_storenode_registered", "1 while the node is published in etcd", labels=lab)
        reg.add_metric([nid], 1 if n.registered and n.registration.published else 0)
        yield from (rx, tx, req, err, ext, seg, reg)


def node_registry(node) -> CollectorRegistry:
    """A registry holding ``node``'s metrics (a :class:`~storenode.server.StoreNode`: its
    ``node_id``, ``data``, ``table``, ``segment``, ``stats``, ``registered`` and ``registration``)."""
    r = CollectorRegistry()
    r.register(_Collector(node))
    return r
