"""One-key network gets whose read overlaps their lookup.

A get over the network is two round trips in a row: the master's lookup (replicas and a
read lease), then the node's read. When this client already knows where a key lives (it put
the key, or read it before), a one-key get sends the node its read request first and then
asks the master, so that both answer at once; the get then costs about one round trip.

Such a read ran before its lease was granted, so it is only kept when it provably read the
object: the lookup must name that very extent (node, incarnation, offset, size and
allocation generation: a freed and reused extent has a new generation) and the bytes must
hash to the object's xxh3 checksum (a torn read does not), the same check every read passes.
When the lookup names another extent, a same-host replica, or a layout the caller's does
not accept, the early read is not waited for (its stream is dropped) and the lookup's
answer is read as usual, under its lease, with no extra round trip; a stale location is
forgotten, and so are all of a node's when it fails. On a miss the caller's buffer may hold
what such a read brought (a get into a buffer leaves it unspecified unless it returns a
size). Keys with a same-host replica, objects above :data:`HINT_MAX_BYTES` and nodes that
recently missed a deadline are not hinted.
"""
from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvpool.connector.dataclient import ReadOp, ReplicaDeadline
from kvpool.protocol import messages as M
from kvpool.protocol.errors import KVPoolError, NodeUnavailable, StaleExtent
from kvpool.protocol.layout import check_layout

HINTS_MAX = 16384  # keys whose network location one client remembers (oldest forgotten first)
HINT_MAX_BYTES = 4 << 20  # bigger objects are not read ahead: a wasted read would cost more than a round trip


class HintedReads:
    """The locations one client remembers and the early reads it sends from them; owned by
    :class:`~connector.client.KVPoolClient` (its ``hints``). ``data``: the client's
    :class:`~connector.dataclient.DataPlane`; ``replica_reads``: its
    :class:`~connector.hedge.ReplicaReads` (slow nodes, their deadline); ``release(infos,
    t_sent)``: gives back the read leases of looked-up ``infos``. ``kept`` / ``dropped``
    count the one-key gets an early read served, and those it did not."""

    def __init__(self, data, replica_reads, release: Callable[[list, float], None]) -> None:
        self.data = data
        self._uses_shm = data.segmaps.uses_shm  # ref -> copied through a same-host mapping
        self.replica_reads = replica_reads
        self._release = release
        self.where: dict[str, M.ExtentRef] = {}  # key -> a network replica, token stripped
        self.kept = 0
        self.dropped = 0
        timeout = replica_reads.timeout_s
        self._deadline = None if timeout is None else ReplicaDeadline(timeout)

    def remember(self, key: str, ref: M.ExtentRef) -> None:
        """``key`` lives at ``ref``, a network replica (same-host ones and big objects are
        skipped; the caller skips keys that also have a same-host replica)."""
        if ref.size > HINT_MAX_BYTES or ref.tier or self._uses_shm(ref):
            return  # (a disk replica is not read ahead: a wasted read would cost disk I/O)
        where = self.where
        where.pop(key, None)  # re-inserted last: the oldest-first eviction forgets cold keys
        where[key] = msgspec.structs.replace(ref, token=b"") if ref.token else ref
        if len(where) > HINTS_MAX:
            try:
                del where[next(iter(where))]
            except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                pass

    def forget(self, keys) -> None:
        """Forget the locations of ``keys`` (removed, or seen elsewhere)."""
        for k in keys:
            self.where.pop(k, None)

    def forget_node(self, node_id: str) -> None:
        """Forget every location on ``node_id`` (it failed a read: died, froze or restarted)."""
        self.where = {k: r for k, r in list(self.where.items()) if r.node_id != node_id}

    def start(self, keys, todo: list[int], views: list) -> tuple | None:
        """For a get of one key with a remembered location, send its read now (see the module
        docstring); what :meth:`end` needs, or None."""
        if len(todo) != 1:
            return None
        i = todo[0]
        ref = self.where.get(keys[i])
        out = views[i]
        if ref is None or type(out) is not memoryview or len(out) < ref.size or self.replica_reads.is_slow(ref.node_id):
            return None
        op = ReadOp(ref, out, digest=True)
        pending = self.data.start_reads([op], self._deadline)
        if pending is None:  # the node could not be reached
            self._failed(keys[i], op)
            return None
        return i, op, pending

    def end(self, early: tuple, keys, lays, results, todo: list[int], infos: list,
            t_sent: float) -> tuple[list[int], list]:
        """Keep the read :meth:`start` sent when it read the object the lookup answered
        (``infos``, sent at ``t_sent``): the key's result is set and its lease released, and
        ``todo`` and ``infos`` come back empty. Otherwise they come back as they were, for
        the usual read, and the early read is either received and dropped (it named the right
        extent but failed) or not waited for at all."""
        i, op, pending = early
        info = infos[0]
        if not self._may_keep(keys[i], op.ref, info, lays[i]):
            self.data.abandon_reads(pending)
            self.dropped += 1
            return todo, infos
        try:
            self.data.finish_reads(pending)
        except BaseException:  # interrupted mid-reply: the stream cannot be trusted, the lease goes back
            self.data.abandon_reads(pending)
            self._release([info], t_sent)
            raise
        if op.error is None and op.digest == info.checksum:
            results[i] = info.size
            self._release([info], t_sent)
            self.kept += 1
            return [], []
        self._failed(keys[i], op)
        self.dropped += 1
        return todo, infos

    def _may_keep(self, key: str, ref: M.ExtentRef, info, want_layout) -> bool:
        """Whether the lookup's ``info`` lets a read of ``ref`` stand (before its bytes are
        checked); a key whose location went stale is forgotten."""
        if (type(info) is not M.ObjectInfo or ref not in info.replicas
                or any(self._uses_shm(r) for r in info.replicas)):  # a copy here beats any network read
            self.where.pop(key, None)
            return False
        if want_layout is not None and want_layout != info.layout:
            try:
                check_layout(want_layout, info.layout, info.key)
            except KVPoolError:  # the usual read raises it
                return False
        return True

    def _failed(self, key: str, op: ReadOp) -> None:
        """The early read of ``key`` failed or delivered other bytes: forget its location; a
        node that did not answer is read last for a while, and a node that failed or no
        longer holds the extent (it may have restarted) loses every location on it."""
        if isinstance(op.error, NodeUnavailable):
            self.replica_reads.failed(op.ref.node_id)
        if isinstance(op.error, (NodeUnavailable, StaleExtent)):
            self.forget_node(op.ref.node_id)
        else:
            self.where.pop(key, None)
