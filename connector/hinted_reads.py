"""One-key network gets whose read overlaps their lookup.

A get over the network is two round trips in a row: the master's lookup (replicas and a
read lease), then the node's read. When this client already knows where a key lives (it put
the key, or read it before), a one-key get sends the node its read request first and then
asks the master, so that both answer at once; the get then costs about one round trip.

Such a read ran before its lease was granted, so it is only kept when it provably read the
object: the lookup must name that very extent (node, incarnation, offset, size and
allocation generation: a freed and reused extent has a new generation) and the bytes must
hash to the object's xxh3 checksum (a torn read does not), the same check every read passes.
Anything else (a moved, removed or re-put key, a node error, a different layout asked for)
falls back to reading the lookup's answer as usual, under its lease, with no extra round
trip; the stale location is forgotten. On a miss the caller's buffer may hold what such a
read brought (a get into a buffer leaves it unspecified unless it returns a size). Same-host
keys are not hinted: their read is a copy, not a round trip.
"""
from __future__ import annotations

import msgspec

from kvpool.connector.dataclient import ReadOp, ReplicaDeadline
from kvpool.protocol import messages as M

HINTS_MAX = 16384  # keys whose network location one client remembers (oldest forgotten first)


class HintedReads:
    """Mixed into :class:`~connector.client.KVPoolClient` (uses its ``data``,
    ``replica_reads``, ``read_hook`` and ``_release_live``)."""

    def _init_hints(self) -> None:
        self._where: dict[str, M.ExtentRef] = {}  # key -> a network replica, token stripped
        self.hinted_kept = 0  # one-key gets served by the read sent with their lookup
        self.hinted_dropped = 0  # ... whose early read did not match the lookup (read again as usual)
        timeout = self.replica_reads.timeout_s
        self._hint_deadline = None if timeout is None else ReplicaDeadline(timeout)

    def _remember(self, key: str, ref: M.ExtentRef) -> None:
        """``key`` lives at ``ref`` (a network replica; same-host ones are skipped)."""
        if self.data.uses_shm(ref):
            return
        where = self._where
        where[key] = msgspec.structs.replace(ref, token=b"") if ref.token else ref
        if len(where) > HINTS_MAX:
            try:
                del where[next(iter(where))]
            except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                pass

    def _start_hinted(self, keys, todo: list[int], views: list) -> tuple | None:
        """For a get of one key with a remembered location, send its read now (see the module
        docstring); what :meth:`_end_hinted` needs, or None."""
        if len(todo) != 1 or self.read_hook is not None:  # a read hook times reads under their lease
            return None
        i = todo[0]
        ref = self._where.get(keys[i])
        out = views[i]
        if ref is None or type(out) is not memoryview or len(out) < ref.size:
            return None
        op = ReadOp(ref, out, digest=True)
        return i, op, self.data.start_reads([op], self._hint_deadline)

    def _end_hinted(self, early: tuple, keys, lays, results, todo: list[int], infos: list,
                    t_sent: float) -> tuple[list[int], list]:
        """Receive the read :meth:`_start_hinted` sent and keep it when it read the object the
        lookup answered (``infos``, sent at ``t_sent``): the key's result is set and its lease
        released, and ``todo`` and ``infos`` come back without it. Otherwise they come back
        as they were, for the usual read."""
        i, op, pending = early
        self.data.finish_reads(pending)
        info = infos[0]
        if (op.error is None and type(info) is M.ObjectInfo and op.digest == info.checksum
                and op.ref in info.replicas and (lays[i] is None or lays[i] == info.layout)):
            results[i] = info.size
            self._release_live([info], t_sent)
            self.hinted_kept += 1
            return [], []
        self._where.pop(keys[i], None)
        self.hinted_dropped += 1
        return todo, infos
