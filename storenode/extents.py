"""The store node's extent table (pure logic, thread-safe, no I/O).

Rows are keyed by segment offset and carry the allocation generation ``gen`` the master
assigned. A read must name the current ``(offset, gen)``; a freed or reused extent
refuses it (:class:`~protocol.errors.StaleExtent`). Committed rows are what the master
rebuilds its index from after a failover (DESIGN.md §8).
"""
from __future__ import annotations

import threading

import msgspec

from kvpool.protocol.errors import InvalidRequest, StaleExtent
from kvpool.protocol.messages import ExtentEntry


class ExtentTable:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: dict[int, ExtentEntry] = {}
        self._floor: dict[int, int] = {}  # offset -> lowest generation a write there may carry
        self.max_gen = 0  # highest generation seen (a new master grants above it)
        self._lock = threading.Lock()

    def check_bounds(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.capacity:
            raise InvalidRequest(f"extent [{offset}, +{size}) lies outside the {self.capacity}-byte segment",
                                 offset=offset, size=size)

    def check_write(self, offset: int, gen: int) -> None:
        """Refuse a write whose grant is older than what this offset has since held: a
        writer that stalled past its put timeout must not overwrite the extent's next
        owner. Raises StaleExtent."""
        with self._lock:
            cur = self._rows.get(offset)
            if gen < self._floor.get(offset, 0) or (cur is not None and cur.gen > gen):
                raise StaleExtent(f"write to offset {offset} carries generation {gen}, older than the extent's "
                                  "current one (the put was revoked); put the object again", offset=offset, gen=gen)

    def record_write(self, key: str, offset: int, size: int, gen: int, checksum: int,
                     layout: bytes | None) -> None:
        self.check_bounds(offset, size)
        with self._lock:
            cur = self._rows.get(offset)
            if cur is not None and cur.gen > gen:
                return  # a late write of an older generation never replaces the current row
            self._rows[offset] = ExtentEntry(key, offset, size, gen, checksum, layout, False)
            self.max_gen = max(self.max_gen, gen)

    def check_read(self, offset: int, size: int, gen: int) -> ExtentEntry:
        self.check_bounds(offset, size)
        with self._lock:
            row = self._rows.get(offset)
        if row is None or row.gen != gen or row.size != size:
            raise StaleExtent(f"extent at offset {offset} gen {gen} was freed or reused on this node; "
                              "look the key up again", offset=offset, gen=gen)
        return row

    def commit(self, row: ExtentEntry, writer: bool = False) -> None:
        """Record the master's committed row (replacing what a network ``write`` recorded;
        same-host writers record nothing). A row of an older generation than the one held
        at that offset is stale and ignored. ``writer``: the writer's copy of the commit,
        which never replaces a row the master committed already. Raises InvalidRequest
        outside the segment."""
        self.check_bounds(row.offset, row.size)
        with self._lock:
            cur = self._rows.get(row.offset)
            if row.gen < self._floor.get(row.offset, 0):
                return  # committed and already freed again (notices arrive in order)
            if writer and cur is not None and cur.gen == row.gen and cur.committed:
                return
            if cur is None or cur.gen <= row.gen:
                self._rows[row.offset] = row if row.committed else msgspec.structs.replace(row, committed=True)
                self.max_gen = max(self.max_gen, row.gen)

    def free(self, offset: int, gen: int) -> None:
        """Drop the row of ``(offset, gen)``; from now on a write of that generation or an
        older one at this offset is stale."""
        with self._lock:
            row = self._rows.get(offset)
            if row is not None and row.gen == gen:
                del self._rows[offset]
            self._floor[offset] = max(self._floor.get(offset, 0), gen + 1)
            self.max_gen = max(self.max_gen, gen)

    def committed(self) -> list[ExtentEntry]:
        with self._lock:
            return [r for r in self._rows.values() if r.committed]

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._floor.clear()
            self.max_gen = 0

    def __len__(self) -> int:
        return len(self._rows)
