"""Reads that do not stall behind one store node (DESIGN.md §8, "No stall behind one node").

A frozen or overloaded node still accepts TCP connections (the kernel completes the
handshake) but sends nothing, so a read that waits on it waits the whole ``io_timeout_s``
although another replica could answer. :class:`ReplicaReads` is the client's policy for
replica reads that have another replica to turn to:

* **per-replica deadline**: the connect and every wait for bytes of a network read from
  one node is bounded by ``replica_timeout_s``; past it the node is given up and the key
  read from its next replica (the last replica left waits ``io_timeout_s`` as before);
* **hedged read**: when a node has sent no byte ``hedge_after_s`` after the requests went
  out, the same keys are also read from their next replica, into scratch buffers, and the
  first source to deliver wins ("hedged requests", Dean & Barroso, *The Tail at Scale*,
  CACM 56(2), 2013). The losing primary is abandoned (its connection dropped) before its
  caller's buffers are touched by the hedge's bytes, so no buffer is written by two reads
  at once; a losing hedge only ever wrote its own scratch buffer;
* **memory**: a node given up or failing is remembered for :data:`SLOW_MEMORY_S` seconds;
  meanwhile replicas on it are read last and not hedged to, so the next reads start
  elsewhere.

Shared-memory reads copy from the mapped segment without the node's help and never wait
on it. Every byte still goes through the caller's checksum check (the hedge's digest is
of the bytes it received, which are copied unchanged); a key no replica delivered gets
the typed error of its last attempt.
"""
from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvpool.connector.dataclient import DataPlane, ReadOp, ReplicaDeadline, readable
from kvpool.protocol import messages as M
from kvpool.protocol.errors import NodeUnavailable
from kvpool.protocol.units import check_wait

SLOW_MEMORY_S = 5.0  # how long a node that missed a deadline or failed is read last
_POLL_S = 0.005  # while a hedge is out: how often the primary's socket and the hedge are looked at


class ReplicaRead(ReadOp):
    """A read of one replica of a key with further replicas (``rest``, in read order) to
    turn to; ``hedge`` is its hedged read while one is out: (op, scratch buffer)."""

    __slots__ = ("rest", "hedge")

    def __init__(self, ref: M.ExtentRef, out, rest: Sequence[M.ExtentRef]) -> None:
        super().__init__(ref, out, digest=True)
        self.rest = rest
        self.hedge: tuple[ReadOp, bytearray] | None = None


class ReplicaReads:
    """Replica order, deadlines and hedges for one client's reads (thread-safe).

    ``replica_timeout_s``: seconds a network read of a replica with another to turn to may
    wait for bytes (connect included) before the node is given up, at most the data plane's
    ``io_timeout_s``; None: no deadline (wait ``io_timeout_s``), and no hedging.
    ``hedge_after_s``: seconds without a first byte after which the next replica is read as
    well; None: no hedging. Both finite, > 0 and at most a day (else ConfigError,
    protocol/units.py check_wait); a hedge delay at or past the deadline never hedges."""

    def __init__(self, data: DataPlane, host_id: str, replica_timeout_s: float | None = 1.0,
                 hedge_after_s: float | None = 0.1) -> None:
        for key, v in (("replica_timeout_s", replica_timeout_s), ("hedge_after_s", hedge_after_s)):
            check_wait(v, key=key, none=True)
        self.data, self.host_id = data, host_id
        self.timeout_s = None if replica_timeout_s is None else min(replica_timeout_s, data.io_timeout_s)
        self.hedge_after_s = hedge_after_s if replica_timeout_s is not None else None
        self._slow: dict[str, float] = {}  # node id -> monotonic time until which it is read last
        self._pool: ThreadPoolExecutor | None = None  # hedged reads, made on the first
        self._pool_lock = threading.Lock()
        self.hedges = 0  # hedged reads started
        self.hedges_won = 0  # keys a hedge delivered first

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- order and memory -----------------------------------------------------------------

    def order(self, replicas: Sequence[M.ExtentRef]) -> list[M.ExtentRef]:
        """``replicas`` in read order: nodes not remembered as slow first, then memory replicas
        before disk ones, then same host first."""
        slow = self._slow
        if slow:
            now = time.monotonic()
            for nid in [n for n, until in slow.items() if until <= now]:
                slow.pop(nid, None)
        return sorted(replicas, key=lambda r: (r.node_id in slow, r.tier, r.host_id != self.host_id))

    def is_slow(self, node_id: str) -> bool:
        """``node_id`` missed a deadline lately (see :meth:`failed`)."""
        until = self._slow.get(node_id)
        return until is not None and until > time.monotonic()

    def failed(self, node_id: str) -> None:
        """``node_id`` missed a deadline or failed a read: read it last for a while."""
        self._slow[node_id] = time.monotonic() + SLOW_MEMORY_S

    def op(self, order: Sequence[M.ExtentRef], out) -> ReadOp:
        """The read of ``order[0]`` into ``out`` (digest on), knowing the replicas after it."""
        return ReplicaRead(order[0], out, order[1:]) if len(order) > 1 else ReadOp(order[0], out, digest=True)

    # ---- reads ----------------------------------------------------------------------------

    def read(self, ops: Sequence[ReadOp]) -> None:
        """Read ``ops`` (all from one node, see :meth:`DataPlane.read`): those with another
        replica under the deadline, with a hedge, the others as plain reads. Each op ends with
        its bytes in ``out`` (``ref`` and ``digest`` then name the replica that delivered
        them) or its error."""
        alt = [op for op in ops if type(op) is ReplicaRead]
        if len(alt) < len(ops):
            plain = [op for op in ops if type(op) is not ReplicaRead]
            if alt:
                self._read_hedged(alt)
            self.data.read(plain)
            return
        self._read_hedged(alt)

    def _read_hedged(self, ops: list[ReplicaRead]) -> None:
        if self.timeout_s is None or self.data.segmaps.uses_shm(ops[0].ref):
            self.data.read(ops)
            return
        hedges: list[Future] = []
        self.data.read(ops, ReplicaDeadline(self.timeout_s, self._first_byte(ops, hedges)))
        if not hedges:
            return
        if any(op.error is not None for op in ops):
            for f in hedges:  # the primary gave up or failed: the hedge is the best source left
                f.exception()  # bounded: a hedge runs under the replica deadline
        for op in ops:
            h, op.hedge = op.hedge, None
            if h is None or op.error is None:
                continue  # the primary delivered (a hedge still out writes only its scratch buffer)
            hop, scratch = h
            if hop.error is None and isinstance(op.out, memoryview):
                size = hop.ref.size
                op.out[:size] = memoryview(scratch)[:size]
                op.ref, op.digest, op.error = hop.ref, hop.digest, None
                self.hedges_won += 1

    def _first_byte(self, ops: list[ReplicaRead], hedges: list[Future]) -> Callable[[socket.socket], bool]:
        """The wait for the first reply of ``ops``' node (see :class:`ReplicaDeadline`): after
        ``hedge_after_s`` without a byte, hedge (the futures go into ``hedges``); give the
        node up (False) once every key's hedge delivered, or when ``replica_timeout_s`` passed."""
        def wait(sock: socket.socket) -> bool:
            deadline = time.monotonic() + self.timeout_s
            hedge = self.hedge_after_s is not None and self.hedge_after_s < self.timeout_s
            if readable(sock, self.hedge_after_s if hedge else self.timeout_s):
                return True
            if hedge:
                hedges.extend(self._hedge(ops))
                while hedges and (left := deadline - time.monotonic()) > 0 and not all(f.done() for f in hedges):
                    if readable(sock, min(left, _POLL_S)):
                        return True
                delivered = bool(hedges) and all(f.done() for f in hedges) and all(
                    op.hedge is not None and op.hedge[0].error is None for op in ops)
                left = deadline - time.monotonic()
                if not delivered and left > 0 and readable(sock, left):  # the primary may still make it
                    return True
            self.failed(ops[0].ref.node_id)
            return False
        return wait

    def _hedge(self, ops: list[ReplicaRead]) -> list[Future]:
        """Start the hedged reads of ``ops``: each key from its next replica into a scratch
        buffer, grouped per node, on the hedge pool, under the replica deadline (no hedge of
        a hedge). Keys whose next replica is on a node remembered as slow are not hedged."""
        by_node: dict[str, list[ReadOp]] = defaultdict(list)
        for op in ops:
            ref = op.rest[0]
            if ref.node_id in self._slow:
                continue
            scratch = bytearray(ref.size)
            hop = ReadOp(ref, memoryview(scratch), digest=True)
            op.hedge = (hop, scratch)
            by_node[ref.data_addr].append(hop)  # per stream (a node's disk tier has sockets of its own)
        if not by_node:
            return []
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvpool-hedge")
        deadline = ReplicaDeadline(self.timeout_s)
        futs = []
        for group in by_node.values():
            try:
                futs.append(self._pool.submit(self._hedge_read, group, deadline))
                self.hedges += len(group)
            except RuntimeError:  # shut down (the client is closing): no hedge
                for hop in group:
                    hop.error = NodeUnavailable("the client is closing; no hedged read")
        return futs

    def _hedge_read(self, group: list[ReadOp], deadline: ReplicaDeadline) -> None:
        try:
            self.data.read(group, deadline)
        except BaseException as e:  # which bytes landed is unknown: none of them count
            for hop in group:
                hop.error = NodeUnavailable(f"hedged read from {hop.ref.node_id} failed: {type(e).__name__}: {e}",
                                            node=hop.ref.node_id)
            raise
        for hop in group:
            if type(hop.error) is NodeUnavailable:
                self.failed(hop.ref.node_id)
