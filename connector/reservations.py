"""The writer's side of reserved extents: which reservations it holds, per object size.

Slots are claimed at the node a little ahead of use, not when they are granted: a put
claims, in one round trip per node (all nodes at once), the slots it takes that are not
claimed yet plus the next :data:`CLAIM_AHEAD` of that size, so a writer that stalls holds
claims on at most its batch and that many extents per size (a claim outlives the writer's
silence, and the master places in memory it has freed again), while the claim costs one
node round trip per that many puts, or per batch.

Pure bookkeeping, thread-safe, no I/O (the client moves the bytes and talks to the master
and the nodes; the protocol is in :mod:`master.reservations`). Reservations are kept per
``(size, replicas)``, each with the leader term that granted it and the monotonic time it
must be used by (half its lifetime at the master, counted from when it was asked for, so
clock and scheduling slack never let a writer copy into an extent the master has freed
before the writer's commit is answered).

How many to hold per size: none until a size has been put twice (a one-off size reserves
only what its put needs), then three times the largest batch of that size seen, at least
:data:`MIN_DEPTH`, at most :data:`MAX_DEPTH` and the client's byte budget. A batch that
finds too few asks for the rest on the spot (one round trip, as a put without reservations
would), and a commit asks for more (riding on its reply) when what is left would not cover
the next batch of the same size. Reservations held ahead are placed only in free memory
under the high watermark (:mod:`master.reservations`): they never push data out. At most :data:`MAX_SIZES` sizes are kept; the least
recently used size's reservations are given back first.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.protocol.messages import Reservation

MIN_DEPTH = 64  # reservations held per size at least (once the size was put twice)
MAX_DEPTH = 1024  # reservations held per size at most (the master's cap per call)
MAX_SIZES = 16  # distinct (size, replicas) pools kept
CLAIM_AHEAD = 32  # slots claimed ahead of use per size, beyond the put's own


@dataclass(slots=True)
class Slot:
    """One reservation as the writer holds it: ``res`` (res_id, replicas), the object size
    (bytes), the replica count asked for (0: the cluster default) and wanted, the granting
    term, the monotonic use-by time (seconds) and the replicas claimed on this host."""

    res: Reservation
    size: int
    replicas: int
    wanted: int
    term: int
    use_by: float
    local: list = field(default_factory=list)  # replicas claimed on the shared claim stream (same host)
    claimed: bool = False  # its same-host extents are claimed (or it has none): bytes may be copied in
    pending: bool = False  # a claim of it is on its way (another thread's): not handed out meanwhile


@dataclass(slots=True)
class _Size:
    slots: deque
    batch: int = 1
    uses: int = 0  # puts of this size seen (reservations are held ahead from the second on)


class ReservationPool:
    """Reservations per ``(size, replicas)``. ``budget_bytes``: bytes of reservations held
    at most across sizes (a batch may exceed it for the time of one call)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._sizes: OrderedDict[tuple[int, int], _Size] = OrderedDict()
        self._dead: list[Slot] = []  # taken out unused (expired, stale term, size dropped): to give back
        self._lock = threading.Lock()

    def take(self, size: int, replicas: int, n: int, now: float, term: int) -> list[Slot]:
        """Up to ``n`` usable reservations of ``size`` bytes; records the batch size. Expired
        ones and ones of a term older than ``term`` go to :meth:`take_dead`."""
        with self._lock:
            key = (size, replicas)
            st = self._sizes.get(key)
            if st is None:
                st = self._sizes[key] = _Size(deque())
                while len(self._sizes) > MAX_SIZES:
                    _, old = self._sizes.popitem(last=False)
                    self._dead.extend(old.slots)
            self._sizes.move_to_end(key)
            st.batch = max(st.batch, n)
            st.uses += 1
            out: list[Slot] = []
            skipped: list[Slot] = []
            while st.slots and len(out) < n:
                s = st.slots.popleft()
                if s.use_by <= now or s.term < term:
                    self._dead.append(s)
                elif s.pending:
                    skipped.append(s)
                else:
                    out.append(s)
            st.slots.extendleft(reversed(skipped))
            return out

    def claim_ahead(self, size: int, replicas: int, k: int) -> list[Slot]:
        """Up to ``k`` held, unclaimed slots of this size from the front (the next to be
        used), marked pending: the caller claims them and then calls :meth:`claimed`."""
        with self._lock:
            st = self._sizes.get((size, replicas))
            out: list[Slot] = []
            for s in st.slots if st is not None else ():
                if len(out) >= k:
                    break
                if not s.claimed and not s.pending:
                    s.pending = True
                    out.append(s)
            return out

    def claimed(self, good: list[Slot], bad: list[Slot]) -> None:
        """The claims of pending slots were answered: ``good`` may be written into now,
        ``bad`` (refused) leave the pool for :meth:`take_dead`."""
        with self._lock:
            for s in good:
                s.claimed, s.pending = True, False
            gone = {id(s) for s in bad}
            for s in bad:
                s.pending = False
            if gone:
                for st in self._sizes.values():
                    if any(id(s) in gone for s in st.slots):
                        st.slots = deque(s for s in st.slots if id(s) not in gone)

    def give_back(self, slots: list[Slot]) -> None:
        """Return slots that were taken but not consumed (their key was stored already):
        they are used first next time (they were the oldest, so the use-by order holds)."""
        self._put(slots, front=True)

    def add(self, slots: list[Slot]) -> None:
        """Hold newly granted slots (a size no longer kept sends them to :meth:`take_dead`)."""
        self._put(slots, front=False)

    def _put(self, slots: list[Slot], front: bool) -> None:
        with self._lock:
            for s in sorted(slots, key=lambda s: s.use_by, reverse=front):  # keep the use-by order
                st = self._sizes.get((s.size, s.replicas))
                if st is None:
                    self._dead.append(s)
                elif front:
                    st.slots.appendleft(s)
                else:
                    st.slots.append(s)

    def drop_nodes(self, nodes: set[tuple[str, str]]) -> None:
        """Set aside (for :meth:`take_dead`) every held slot with a replica on one of
        ``nodes`` (node id, incarnation): a write there failed."""
        self._set_aside(lambda s: any((r.node_id, r.incarnation) in nodes for r in s.res.replicas))

    def target(self, size: int, replicas: int) -> int:
        """How many reservations of this size to hold (see the module docstring); none for
        a size put only once so far."""
        with self._lock:
            st = self._sizes.get((size, replicas))
            if st is None or st.uses < 2:
                return 0
            batch = st.batch
        return max(0, min(max(3 * batch, MIN_DEPTH), MAX_DEPTH, self.budget_bytes // max(size, 1)))

    def refill(self, size: int, replicas: int) -> int:
        """How many to ask for now: 0 while what is held covers the next batch of this size,
        else the target minus what is held."""
        want = self.target(size, replicas)
        with self._lock:
            st = self._sizes.get((size, replicas))
            have = len(st.slots) if st is not None else 0
            batch = st.batch if st is not None else 1
        return want - have if have < min(batch, want) else 0

    def take_dead(self, now: float | None = None) -> list[Slot]:
        """Slots to give back: those taken out unused, plus (given ``now``) every held slot
        past its use-by time."""
        with self._lock:
            if now is not None:  # a size's slots are in use-by order: new ones join at the back
                for st in self._sizes.values():
                    while st.slots and st.slots[0].use_by <= now:
                        self._dead.append(st.slots.popleft())
            out, self._dead = self._dead, []
            return out

    def drop_older(self, term: int) -> int:
        """Set aside (for :meth:`take_dead`) every held slot granted before leader ``term``:
        a new leader does not know them and places other writers over their extents.
        Returns how many."""
        return self._set_aside(lambda s: s.term < term)

    def _set_aside(self, drop: Callable[[Slot], bool]) -> int:
        """Move every held slot for which ``drop(slot)`` is true to the slots to give back
        (:meth:`take_dead`), keeping the others in order; how many moved."""
        n = 0
        with self._lock:
            for st in self._sizes.values():
                gone = [s for s in st.slots if drop(s)]
                if gone:
                    st.slots = deque(s for s in st.slots if not drop(s))
                    self._dead.extend(gone)
                    n += len(gone)
        return n

    def drain(self) -> list[Slot]:
        """Every slot held (the client is closing)."""
        with self._lock:
            out = self._dead
            for st in self._sizes.values():
                out.extend(st.slots)
            self._sizes.clear()
            self._dead = []
            return out

    def next_use_by(self) -> float | None:
        """The earliest use-by time of a held slot (None: none held)."""
        with self._lock:
            times = [st.slots[0].use_by for st in self._sizes.values() if st.slots]
        return min(times) if times else None

    def held(self) -> int:
        with self._lock:
            return sum(len(st.slots) for st in self._sizes.values())
