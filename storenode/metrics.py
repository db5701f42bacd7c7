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
* ``kvpool_storenode_registered``: 1 while the node's descriptor is published in etcd;
* with a disk tier (:mod:`storenode.disk_tier`): ``kvpool_storenode_disk_bytes{kind}``
  (``capacity``, ``used``), ``kvpool_storenode_disk_objects`` (files),
  ``kvpool_storenode_disk_ops_total{op}`` and ``kvpool_storenode_disk_op_bytes_total{op}``
  (``write``: demotions published, ``read``: client disk reads and promotions,
  ``dropped``: files that failed a check), ``kvpool_storenode_disk_seconds{op}`` (latency
  histograms: ``demote`` write to publish, ``promote`` file to segment, ``read`` a client's
  disk read) and ``kvpool_storenode_disk_in_flight{op}`` (demotions, promotions queued).
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class NodeStats:
    """Counters the node's threads bump (plain ints and dicts: a lost increment under a
    thread switch is tolerated, a lock per request is not worth it)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # (plane, kind)
        self.errors: Counter[tuple[str, str]] = Counter()  # (plane, error code)


class Hist:
    """A latency histogram kept as plain counts (a lost increment under a thread switch is
    tolerated, as for :class:`NodeStats`): seconds, :data:`BUCKETS` upper bounds."""

    BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last (Prometheus histogram form)."""
        cum, out = 0, []
        for le, n in zip((*map(str, self.BUCKETS), "+Inf"), list(self.counts)):
            cum += n
            out.append((le, cum))
        return out


def _disk_families(n, nid: str):
    """The disk tier's families of node ``n`` (see the module docstring)."""
    disk, mover, reads = n.disk, n.mover, n.disk_reads
    files, used = disk.usage()
    size = GaugeMetricFamily("kvpool_storenode_disk_bytes", "Disk tier bytes: capacity, used (object files)",
                             labels=["node", "kind"])
    size.add_metric([nid, "capacity"], disk.capacity)
    size.add_metric([nid, "used"], used)
    objs = GaugeMetricFamily("kvpool_storenode_disk_objects", "Object files in the disk tier", labels=["node"])
    objs.add_metric([nid], files)
    ops = CounterMetricFamily("kvpool_storenode_disk_ops", "Disk tier operations", labels=["node", "op"])
    nbytes = CounterMetricFamily("kvpool_storenode_disk_op_bytes", "Disk tier bytes moved", labels=["node", "op"])
    for op, count, b in (("write", disk.writes, disk.written_bytes), ("read", disk.reads, disk.read_bytes),
                         ("dropped", disk.dropped, 0)):
        ops.add_metric([nid, op], count)
        nbytes.add_metric([nid, op], b)
    lat = HistogramMetricFamily("kvpool_storenode_disk_seconds", "Disk tier latency (seconds)",
                                labels=["node", "op"])
    for op, h in (("demote", mover.write_hist), ("promote", mover.promote_hist), ("read", reads.read_hist)):
        lat.add_metric([nid, op], h.buckets(), h.total)
    fl = GaugeMetricFamily("kvpool_storenode_disk_in_flight", "Tier moves queued or running", labels=["node", "op"])
    dem, pro = mover.in_flight()
    fl.add_metric([nid, "demote"], dem)
    fl.add_metric([nid, "promote"], pro)
    return size, objs, ops, nbytes, lat, fl


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
        if getattr(n, "disk", None) is not None:
            yield from _disk_families(n, nid)


def node_registry(node) -> CollectorRegistry:
    """A registry holding ``node``'s metrics (a :class:`~storenode.server.StoreNode`: its
    ``node_id``, ``data``, ``table``, ``segment``, ``stats``, ``registered`` and ``registration``)."""
    r = CollectorRegistry()
    r.register(_Collector(node))
    return r
