"""The store node's extent table (pure logic, thread-safe, no I/O).

Rows are keyed by segment offset and carry the allocation generation ``gen`` the master
assigned. A read must name the current ``(offset, gen)``; a freed or reused extent
refuses it (:class:`~protocol.errors.StaleExtent`). Committed rows are what the master
rebuilds its index from after a failover (DESIGN.md §8).

**Write claims: a revoked writer never lands bytes in another object.** Every byte that
enters the segment does so under a *claim* of ``[offset, offset + size)`` for one grant
``gen``, taken here before the first byte moves: a same-host writer asks for it over the
node's Unix socket (``claim``) and copies into the shared mapping only after the node said
yes; a network ``write`` is claimed by the node's own data thread for the time its
``recv_into`` the segment runs. A claim ends when its writer says it is done (``written``,
sent after the copy returned), when the node's receive ends, or when the writer's
process is gone (:mod:`storenode.writers`). The rules, all decided under one lock:

1. a claim of ``gen`` is refused with PutRevoked when the master freed that grant
   (``free`` raised the offset's floor above ``gen``) or when any row or claim overlapping
   the range carries a newer generation (a newer grant exists: generations grow per node,
   so this holds even when the master's free notice has not arrived yet);
2. a claim overlapping another live claim is refused with ExtentBusy, even when the
   master freed that other claim's grant and placed the memory again: a revoked writer
   may still be copying, so its range stays quarantined here until its claim ends.

Why no interleaving breaks it: a writer copies only after its claim was accepted, and
keeps copying only inside its own range. Take a revoked writer A and the next owner B of
overlapping memory (gen_B > gen_A). If B's claim came first, A's claim meets B's claim
or row (newer gen) and is refused (rule 1); B's row stays until the master frees B, and
that free is sent after A's (notices to a node go in order), so by then A's floor is
raised. If A's claim came first, B's claim is refused (rule 2) for as long as A's is
live, however long A stalls and at whatever instruction (before, during or after its
copy); A's claim ends only when A said it finished copying or A's process no longer
exists, so no byte of A can arrive after B's claim is granted. A writer that stalls
*before* asking stays harmless: rule 1 refuses it when it resumes.
"""
from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable

import msgspec

from kvpool.protocol.errors import ExtentBusy, InvalidRequest, KVPoolError, PutRevoked, StaleExtent, StaleTerm
from kvpool.protocol.messages import ExtentEntry
from kvpool.protocol.terms import gen_term


class ExtentTable:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: dict[int, ExtentEntry] = {}
        self._floor: dict[int, int] = {}  # offset -> lowest generation a write there may carry
        self._offs: list[int] = []  # sorted offsets of _rows (overlap queries)
        self._max_size = 0  # largest row or claim size seen: bounds the overlap scan
        # (offset, gen) -> (size, owner): ranges a writer may be copying into right now
        self._claims: dict[tuple[int, int], tuple[int, object]] = {}
        self._coffs: list[int] = []  # sorted offsets of _claims (claims never overlap: one per offset)
        self._max_claim = 0  # largest claim size seen: bounds the overlap scan
        self._claim_gen: dict[int, int] = {}  # offset -> generation of the claim there
        self.max_gen = 0  # highest generation seen (a new master grants above it)
        self.term = 0  # the newest leader term this node knows (protocol.terms); see check_term
        self._lock = threading.Lock()

    def check_bounds(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.capacity:
            raise InvalidRequest(f"extent [{offset}, +{size}) lies outside the {self.capacity}-byte segment",
                                 offset=offset, size=size)

    def check_write(self, offset: int, gen: int) -> None:
        """Refuse a write whose grant is older than what this offset has since held: a
        writer that stalled past its put timeout must not overwrite the extent's next
        owner. Raises PutRevoked, or StaleTerm for a grant of a deposed leader."""
        self.check_term(gen)
        with self._lock:
            self._check_write(offset, gen)

    def _check_write(self, offset: int, gen: int) -> None:
        """:meth:`check_write` but the term; caller holds the lock."""
        cur = self._rows.get(offset)
        if gen < self._floor.get(offset, 0) or (cur is not None and cur.gen > gen):
            raise PutRevoked(f"write to offset {offset} carries generation {gen}, older than the extent's "
                             "current one (the put was revoked); put the object again", offset=offset, gen=gen)

    def claim(self, offset: int, size: int, gen: int, owner: object) -> None:
        """Take the write claim of ``[offset, offset + size)`` for grant ``gen`` on behalf of
        ``owner`` (a writer handle, compared by identity), before any byte of it lands.
        Raises PutRevoked when the grant was freed or a newer grant overlaps the range, and
        ExtentBusy when another live claim overlaps it (rules in the module docstring). A
        repeated claim of the same grant by the same owner is accepted. Raises StaleTerm for
        a grant of a deposed leader."""
        self.check_bounds(offset, size)
        self.check_term(gen)
        with self._lock:
            self._claim(offset, size, gen, owner)

    def claim_many(self, items: Iterable[tuple[int, int, int]], owner: object) -> list[KVPoolError | None]:
        """:meth:`claim` of each ``(offset, size, gen)`` of ``items`` (bytes, bytes, grant
        generation) for ``owner``, in order, under one acquisition of the lock: the same
        verdicts as that many calls of :meth:`claim` in a row. Per item None (claimed) or the
        error :meth:`claim` raises for it (InvalidRequest outside the segment, StaleTerm,
        PutRevoked, ExtentBusy); an item refused takes no claim, and the others go on.
        Raises nothing itself."""
        out: list[KVPoolError | None] = []
        append = out.append
        with self._lock:
            for offset, size, gen in items:
                try:
                    self.check_bounds(offset, size)
                    self.check_term(gen)
                    self._claim(offset, size, gen, owner)
                except KVPoolError as e:
                    append(e)
                else:
                    append(None)
        return out

    def _claim(self, offset: int, size: int, gen: int, owner: object) -> None:
        """:meth:`claim`'s rules, bounds and term checked already; caller holds the lock."""
        end = offset + size
        if gen < self._floor.get(offset, 0):
            raise PutRevoked(f"write to offset {offset} carries generation {gen}, which the master freed "
                             "(the put was revoked: its writer was silent past put_timeout); put the "
                             "object again", offset=offset, gen=gen)
        offs, rows, reach = self._offs, self._rows, self._max_size
        i = bisect.bisect_left(offs, end) - 1
        while i >= 0 and offs[i] + reach > offset:  # the rows overlapping the range (_overlapping_rows)
            row = rows[offs[i]]
            if row.offset + row.size > offset and row.gen > gen:
                raise PutRevoked(f"write to offset {offset} carries generation {gen}, older than the "
                                 f"extent's current one ({row.gen}): the put was revoked; put the object "
                                 "again", offset=offset, gen=gen)
            i -= 1
        coffs = self._coffs
        i = bisect.bisect_left(coffs, offset + max(size, 1)) - 1
        if i >= 0 and coffs[i] + self._max_claim > offset:  # a claim may overlap: the full scan
            self._claim_overlaps(offset, size, gen)
        held = self._claims.get((offset, gen))
        if held is not None and held[1] is not owner:
            raise ExtentBusy(f"[{offset}, +{size}) generation {gen} is being written by another writer",
                             offset=offset, gen=gen)
        if held is None:
            bisect.insort(self._coffs, offset)
        self._claims[(offset, gen)] = (size, owner)
        self._claim_gen[offset] = gen
        if size > self._max_claim or not self._max_claim:
            self._max_claim = max(size, 1)
        if gen > self.max_gen:
            self.max_gen = gen

    def _claim_overlaps(self, offset: int, size: int, gen: int) -> None:
        """Rule 1 (a newer grant's claim) and rule 2 (another live claim) against the claims
        overlapping ``[offset, offset + size)``; caller holds the lock."""
        for c_off, c_gen, _ in self._overlapping_claims(offset, offset + max(size, 1)):
            if (c_off, c_gen) != (offset, gen):
                if c_gen > gen:
                    raise PutRevoked(f"write to offset {offset} carries generation {gen}, older than a "
                                     f"write in progress there ({c_gen}): the put was revoked; put the "
                                     "object again", offset=offset, gen=gen)
                raise ExtentBusy(f"[{offset}, +{size}) overlaps memory a revoked writer may still be "
                                 f"copying into (generation {c_gen}); the put is placed again elsewhere",
                                 offset=offset, gen=gen)

    def release(self, offset: int, gen: int, owner: object) -> bool:
        """End ``owner``'s claim of ``(offset, gen)`` (its writer finished copying). False
        when it held none."""
        with self._lock:
            held = self._claims.get((offset, gen))
            if held is None or held[1] is not owner:
                return False
            self._unclaim(offset, gen)
            return True

    def _unclaim(self, offset: int, gen: int) -> None:
        """Caller holds the lock."""
        del self._claims[(offset, gen)]
        del self._claim_gen[offset]
        del self._coffs[bisect.bisect_left(self._coffs, offset)]

    def _overlapping_claims(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(offset, gen, size)`` of the claims overlapping ``[start, end)``; caller holds the lock."""
        out = []
        i = bisect.bisect_left(self._coffs, end) - 1
        while i >= 0 and self._coffs[i] + self._max_claim > start:
            off = self._coffs[i]
            gen = self._claim_gen[off]
            size = self._claims[(off, gen)][0]
            if off + max(size, 1) > start:  # an empty extent still owns its offset
                out.append((off, gen, size))
            i -= 1
        return out

    def reown(self, old: object, new: object) -> int:
        """Every claim of ``old`` passes to ``new`` (another connection of the same writer
        process); returns how many."""
        with self._lock:
            mine = [k for k, (_, o) in self._claims.items() if o is old]
            for k in mine:
                self._claims[k] = (self._claims[k][0], new)
            return len(mine)

    def release_owner(self, owner: object) -> int:
        """End every claim of ``owner`` (its process is gone); returns how many ended."""
        with self._lock:
            mine = [k for k, (_, o) in self._claims.items() if o is owner]
            for off, gen in mine:
                self._unclaim(off, gen)
            return len(mine)

    def claims(self, owner: object | None = None) -> int:
        """Live claims (of ``owner``, or all)."""
        with self._lock:
            return sum(1 for _, o in self._claims.values() if owner is None or o is owner)

    def _overlapping_rows(self, start: int, end: int) -> list[ExtentEntry]:
        """Rows overlapping ``[start, end)``; caller holds the lock."""
        out = []
        i = bisect.bisect_left(self._offs, end) - 1
        while i >= 0 and self._offs[i] + self._max_size > start:
            row = self._rows[self._offs[i]]
            if row.offset + row.size > start:
                out.append(row)
            i -= 1
        return out

    def _put_row(self, row: ExtentEntry) -> None:
        """Caller holds the lock."""
        if row.offset not in self._rows:
            bisect.insort(self._offs, row.offset)
        self._rows[row.offset] = row
        self._max_size = max(self._max_size, row.size)

    def _del_row(self, offset: int) -> None:
        """Caller holds the lock."""
        del self._rows[offset]
        i = bisect.bisect_left(self._offs, offset)
        del self._offs[i]

    def check_term(self, gen: int) -> None:
        """Refuse a grant made by a leadership older than the newest term this node knows
        (``term``, raised by the master's notices and by the ``leader`` key in etcd): a
        deposed master's grants land no byte (:mod:`protocol.terms`). Raises StaleTerm."""
        t = gen_term(gen)
        if t < self.term:
            raise StaleTerm(f"write grant generation {gen} comes from leader term {t}, but term {self.term} "
                            "has been elected since; the grant's master was deposed. Put the object again "
                            "(through the current leader)", gen=gen, term=self.term)

    def record_write(self, key: str, offset: int, size: int, gen: int, checksum: int,
                     layout: bytes | None) -> None:
        self.check_bounds(offset, size)
        with self._lock:
            cur = self._rows.get(offset)
            if cur is not None and (cur.gen > gen or cur.gen == gen and cur.committed):
                return  # a late write of an older generation (or of a committed one) keeps the row
            if gen < self._floor.get(offset, 0):
                return  # freed meanwhile (a revoked writer's late notice)
            self._put_row(ExtentEntry(key, offset, size, gen, checksum, layout, False))
            self.max_gen = max(self.max_gen, gen)

    def check_read(self, offset: int, size: int, gen: int) -> ExtentEntry | None:
        """The row a read of ``[offset, +size)`` at generation ``gen`` may be served from.
        None when the node holds no row there yet but the extent is still that grant's: a
        same-host writer copies without the node, and the master's commit notice (or the
        writer's copy of it) may reach the node after a reader that looked the key up at the
        master (a reader only learns an extent the master committed, after its writer's copy
        ended; the reader checks the bytes' checksum), as may the notice freeing the older
        objects the master placed it over. Raises StaleExtent when the extent was freed
        since (the floor passed ``gen``), memory over it carries a newer grant, or the node
        never saw a grant as new as ``gen`` (claims, rows and frees raise ``max_gen``)."""
        self.check_bounds(offset, size)
        with self._lock:
            row = self._rows.get(offset)
            if row is not None and row.gen == gen and row.size == size:
                return row
            if (row is None or row.gen < gen) and self._floor.get(offset, 0) <= gen <= self.max_gen and not any(
                    r.gen >= gen for r in self._overlapping_rows(offset, offset + size)) and not any(
                    c_gen > gen for _, c_gen, _ in self._overlapping_claims(offset, offset + max(size, 1))):
                return None  # older rows overlapping it were freed by the master (their notice is on its way)
        raise StaleExtent(f"extent at offset {offset} gen {gen} was freed or reused on this node; "
                          "look the key up again", offset=offset, gen=gen)

    def commit(self, row: ExtentEntry, writer: object | None = None) -> None:
        """Record the master's committed row (replacing what a network ``write`` recorded;
        same-host writers record nothing). A row of an older generation than the one held
        at that offset is stale and ignored. ``writer``: the connection sending the writer's
        own copy of the commit, which never replaces a row the master committed already.
        A commit ends the write claim of its ``(offset, gen)``: the master's, whoever holds
        it (a writer commits only after its copy returned, so no byte of that grant can
        still be on its way); the writer's copy, the claim it holds itself. Raises
        InvalidRequest outside the segment."""
        self.check_bounds(row.offset, row.size)
        with self._lock:
            self._commit(row, writer)

    def commit_many(self, rows: Iterable[ExtentEntry], writer: object | None = None,
                    until_error: bool = False) -> list[KVPoolError | None]:
        """:meth:`commit` of each of ``rows``, in order, under one acquisition of the lock.
        For a writer's copies (``writer`` set) each row is first checked as
        :meth:`check_write` checks a write, and a row it refuses is neither committed nor
        ends a claim: the same as :meth:`check_write` then :meth:`commit` per row. Per row
        None (done) or the error refusing it (InvalidRequest outside the segment; for a
        writer's copy also StaleTerm, PutRevoked); with ``until_error`` the first refusal
        ends the call (the rows after it are left alone and the list ends with it). Raises
        nothing itself."""
        out: list[KVPoolError | None] = []
        append = out.append
        with self._lock:
            for row in rows:
                try:
                    self.check_bounds(row.offset, row.size)
                    if writer is not None:
                        self.check_term(row.gen)
                        self._check_write(row.offset, row.gen)
                    self._commit(row, writer)
                except KVPoolError as e:
                    append(e)
                    if until_error:
                        break
                else:
                    append(None)
        return out

    def _commit(self, row: ExtentEntry, writer: object | None) -> None:
        """:meth:`commit`, bounds checked already; caller holds the lock."""
        off, gen = row.offset, row.gen
        held = self._claims.get((off, gen))
        if held is not None and (writer is None or held[1] is writer):
            self._unclaim(off, gen)
        cur = self._rows.get(off)
        if gen < self._floor.get(off, 0):
            return  # committed and already freed again (notices arrive in order)
        if cur is not None and cur.gen == gen and cur.committed and (writer is not None or cur == row):
            return  # committed already (a writer's copy never replaces it; the same row changes nothing)
        if cur is None or cur.gen <= gen:
            self._put_row(row if row.committed else msgspec.structs.replace(row, committed=True))
            if gen > self.max_gen:
                self.max_gen = gen

    def settled(self, offset: int, gen: int, owner: object) -> bool:
        """Whether ``(offset, gen)`` is committed already (the master's notice came first): a
        writer's copy of that commit then only ends ``owner``'s claim of it, which this does."""
        with self._lock:
            return self._settled(offset, gen, owner)

    def settled_many(self, extents: Iterable[tuple[int, int]], owner: object) -> list[bool]:
        """:meth:`settled` of each ``(offset, gen)`` of ``extents`` (byte offset, grant
        generation), in order, under one acquisition of the lock: per extent whether it was
        committed already (``owner``'s claim of it then ended). Raises nothing."""
        with self._lock:
            return [self._settled(offset, gen, owner) for offset, gen in extents]

    def _settled(self, offset: int, gen: int, owner: object) -> bool:
        """Caller holds the lock."""
        cur = self._rows.get(offset)
        if cur is None or cur.gen != gen or not cur.committed:
            return False
        held = self._claims.get((offset, gen))
        if held is not None and held[1] is owner:
            self._unclaim(offset, gen)
        return True

    def free(self, offset: int, gen: int) -> None:
        """Drop the row of ``(offset, gen)``; from now on a write of that generation or an
        older one at this offset is stale."""
        with self._lock:
            row = self._rows.get(offset)
            if row is not None and row.gen == gen:
                self._del_row(offset)
            self._floor[offset] = max(self._floor.get(offset, 0), gen + 1)
            self.max_gen = max(self.max_gen, gen)

    def committed(self) -> list[ExtentEntry]:
        with self._lock:
            return [r for r in self._rows.values() if r.committed]

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._offs.clear()
            self._floor.clear()
            self._claims.clear()
            self._coffs.clear()
            self._claim_gen.clear()
            self.max_gen = 0

    def usage(self) -> tuple[int, int, int]:
        """``(committed rows, written rows not committed yet, bytes under all rows)``."""
        with self._lock:
            rows = list(self._rows.values())
        committed = sum(1 for r in rows if r.committed)
        return committed, len(rows) - committed, sum(r.size for r in rows)

    def __len__(self) -> int:
        return len(self._rows)
