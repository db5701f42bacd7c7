"""What happened to each object, for an operator who asks why ("story").

dask/distributed's scheduler keeps a log of its transitions and answers
``Scheduler.story(key)`` from it; the master does the same for objects: each decision
about one (stored, replica lost, repair started or done, demoted, promoted, pinned,
corrupt replica reported, evicted and why, removed, write revoked) appends one entry,
and ``kvpool story KEY`` prints a key's entries. The log is bounded: it keeps the newest
:data:`STORY_MAX` entries of all keys, so a key written long ago under a busy cluster may
have none left. It lives in the leading master's memory: a new leader starts it empty.

Entries are ``(wall time, key, event, detail)``; ``detail`` is kept as the caller gave it
(a node id, a tuple of node ids, a reason) and formatted only when a story is asked for,
so an entry costs a tuple and two appends on the request path.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

STORY_MAX = 50_000  # entries kept, all keys together (about 330 bytes each, metadata_bench.py: 16 MB)
STORY_LIMIT = 1000  # entries one answer holds at most (a key re-put all day keeps more)


class Story:
    """The bounded log, indexed by key; ``clock`` gives wall-clock seconds (``time.time``).
    A story is read from its key's own entries, so asking costs what that key holds, never
    a scan of the whole log (any client may ask)."""

    __slots__ = ("maxlen", "size", "order", "by_key", "clock")

    def __init__(self, maxlen: int = STORY_MAX, clock: Callable[[], float] = time.time) -> None:
        self.maxlen = maxlen
        self.size = 0
        self.order: deque[str] = deque()  # the key of every entry, oldest first
        self.by_key: dict[str, list[tuple[float, str, Any]]] = {}  # lists: a deque per key costs 600 bytes
        self.clock = clock

    def add(self, key: str, event: str, detail: Any = "") -> None:
        entries = self.by_key.get(key)
        if entries is None:
            entries = self.by_key[key] = []
        entries.append((self.clock(), event, detail))
        self.order.append(key)
        if self.size < self.maxlen:
            self.size += 1
            return
        old = self.order.popleft()  # the oldest entry of all is its key's oldest
        gone = self.by_key[old]
        del gone[0]
        if not gone:
            del self.by_key[old]

    def of(self, key: str, limit: int = 100) -> list[tuple[float, str, str]]:
        """The newest ``limit`` entries of ``key`` (at most STORY_LIMIT; 0: that many),
        oldest first: ``(wall time, event, detail text)``."""
        entries = self.by_key.get(key, ())
        limit = min(limit, STORY_LIMIT) if limit > 0 else STORY_LIMIT
        return [(t, e, _text(d)) for t, e, d in entries[-limit:]]


def _text(detail: Any) -> str:
    if isinstance(detail, (tuple, list)):
        return ", ".join(str(d) for d in detail)
    return str(detail)
