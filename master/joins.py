"""Taking store nodes in, off the master's request path (DESIGN.md §8, "No stall behind one node").

A node that appears in etcd is indexed from its committed extent table before anything is
placed on it. Asking for the table is I/O against a node that may be dead (killed right
after registering: its etcd key outlives it by up to one lease TTL), frozen, or published
under an address nobody answers at; so the RPC thread never waits for it:

* :func:`fetch_table` asks one node on a worker thread, within a deadline;
* :class:`JoinQueue` (no I/O) decides which published nodes to ask now and with what
  deadline, and after a failed attempt when to ask again: exponential backoff, the delay
  and the deadline doubling per failed attempt up to a cap (the retry discipline of
  "Exponential Backoff And Jitter", AWS Architecture Blog, 2015, without the jitter: one
  master retries each node, there is no herd to spread). A node is forgotten when it is
  no longer published, so a dead node stops costing anything when its lease lapses.

The master applies a fetched table on its RPC thread (:meth:`~master.nodes.StoreNodes._joined`); until
then the node is not in the state's node table and takes no placements.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass

import msgspec
import zmq

from kvpool.protocol import messages as M
from kvpool.protocol.config import MasterConfig
from kvpool.protocol.errors import DECODE_ERRORS, AuthFailed, InvalidRequest, NodeUnavailable

_JOIN = MasterConfig().join_settings()  # (timeout, backoff, backoff max) in seconds
_SLICE_S = 0.1  # a fetch looks at the stop flag this often while it waits


@dataclass(frozen=True)
class Table:
    """A node's answer to :class:`~protocol.messages.NodeList`: the incarnation that
    answered, its committed extent rows and the highest generation it has seen."""

    incarnation: str
    rows: list[M.ExtentEntry]
    max_gen: int


def fetch_table(ctx: zmq.Context, desc: M.NodeDesc, timeout_s: float,
                stop: threading.Event | None = None, term: int = 0) -> Table:
    """Ask ``desc``'s control socket for its extent table, waiting at most ``timeout_s``
    seconds (less once ``stop`` is set), as leader of ``term`` (the node refuses notices
    of older terms from then on, and a request of an older term than it knows: an
    InvalidRequest naming StaleTerm's message). Blocking: run it on a worker thread, never on the
    master's RPC thread. Raises NodeUnavailable when no answer came in time (or the
    address is unusable), InvalidRequest for a malformed answer."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # handshake failures (a node of another secret refuses the master's CURVE key) are named
    mon = sock.get_monitor_socket(_HANDSHAKE_FAILED) if sock.get(zmq.MECHANISM) == zmq.CURVE else None
    try:
        try:
            sock.connect(desc.ctrl_addr)
            sock.send(M.encode(M.NodeList(term)))
        except zmq.ZMQError as e:
            raise NodeUnavailable(f"store node {desc.node_id}: cannot use its control address "
                                  f"{desc.ctrl_addr!r} ({e})", node=desc.node_id) from None
        deadline = time.monotonic() + timeout_s
        while not sock.poll(int(1000 * min(_SLICE_S, max(deadline - time.monotonic(), 0)))):
            if mon is not None and mon.poll(0):
                _check_handshake(mon, desc)
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                raise NodeUnavailable(f"store node {desc.node_id} did not send its extent table from "
                                      f"{desc.ctrl_addr} within {timeout_s:g}s", node=desc.node_id)
        try:
            rep = msgspec.msgpack.decode(sock.recv(), type=M.Reply)
            if rep.error is not None:
                raise InvalidRequest(f"store node {desc.node_id} refused its extent table: {rep.error.message}")
            inc, rows, max_gen = msgspec.msgpack.decode(rep.result, type=tuple[str, list[M.ExtentEntry], int])
        except (*DECODE_ERRORS, TypeError) as e:
            raise InvalidRequest(f"store node {desc.node_id} sent a malformed extent table: {e}") from None
        return Table(inc, rows, max_gen)
    finally:
        if mon is not None:
            sock.disable_monitor()
            mon.close(0)
        sock.close(0)


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _check_handshake(mon: zmq.Socket, desc: M.NodeDesc) -> None:
    """Raise AuthFailed when ``mon`` (the control socket's monitor) saw the CURVE handshake
    with ``desc`` fail: the node holds another cluster secret, or runs without one."""
    from zmq.utils.monitor import recv_monitor_message

    while mon.poll(0):
        ev = recv_monitor_message(mon)
        if ev["event"] & _HANDSHAKE_FAILED:
            raise AuthFailed(f"store node {desc.node_id} refused the master's control-channel key at "
                             f"{desc.ctrl_addr}: it holds another cluster secret or none; give every master and "
                             "store node the same --secret-file", cause="wrong_secret", node=desc.node_id)


@dataclass
class _Try:
    incarnation: str
    failures: int = 0
    next_at: float = 0.0  # monotonic time of the next attempt
    in_flight: bool = False
    why: str = ""  # the last failure


class JoinQueue:
    """Which published store nodes to ask for their extent table, and when (no I/O; every
    method takes ``now``, seconds on the master's monotonic clock).

    ``timeout_s``: deadline of a first attempt; ``backoff_s``: wait after a first failure;
    each further failure doubles both, up to ``backoff_max_s`` (seconds; the defaults are
    ``MasterConfig``'s ``join_timeout``, ``join_backoff``, ``join_backoff_max``). A new
    incarnation of a node starts over."""

    def __init__(self, timeout_s: float = _JOIN[0], backoff_s: float = _JOIN[1],
                 backoff_max_s: float = _JOIN[2]) -> None:
        self.timeout_s, self.backoff_s, self.backoff_max_s = timeout_s, backoff_s, backoff_max_s
        self.tries: dict[str, _Try] = {}

    def due(self, descs: Iterable[M.NodeDesc], known: Container[str], now: float) -> list[tuple[M.NodeDesc, float]]:
        """The nodes of ``descs`` (the published ones) not in ``known`` (already indexed) to
        ask now, each with its deadline in seconds; marks them in flight. Nodes no longer
        published are forgotten."""
        published = {}
        out = []
        for d in descs:
            published[d.node_id] = d
            if d.node_id in known:
                self.tries.pop(d.node_id, None)
                continue
            t = self.tries.get(d.node_id)
            if t is None or t.incarnation != d.incarnation:
                t = self.tries[d.node_id] = _Try(d.incarnation)
            if t.in_flight or t.next_at > now:
                continue
            t.in_flight = True
            out.append((d, min(self.timeout_s * 2 ** min(t.failures, 30), self.backoff_max_s)))
        for nid in [n for n in self.tries if n not in published]:
            del self.tries[nid]
        return out

    def done(self, node_id: str) -> None:
        """The node was indexed (or its attempt no longer matters): forget its failures."""
        self.tries.pop(node_id, None)

    def failed(self, node_id: str, incarnation: str, why: str, now: float) -> tuple[int, float]:
        """An attempt failed; returns (failed attempts in a row, seconds until the next)."""
        t = self.tries.get(node_id)
        if t is None or t.incarnation != incarnation:
            t = self.tries[node_id] = _Try(incarnation)
        t.in_flight = False
        t.failures += 1
        t.why = why
        wait = min(self.backoff_s * 2 ** min(t.failures - 1, 30), self.backoff_max_s)
        t.next_at = now + wait
        return t.failures, wait

    def waiting(self, now: float) -> dict[str, str]:
        """Node id -> why it is not indexed yet, for ``kvpool status``."""
        out = {}
        for nid, t in self.tries.items():
            if t.failures:
                left = max(t.next_at - now, 0.0)
                out[nid] = f"{t.why} ({t.failures} failed attempt(s); " + (
                    "asking again now)" if t.in_flight or not left else f"next in {left:.1f}s)")
            else:
                out[nid] = "asking for its extent table"
        return out
