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
so an entry costs a tuple and an append on the request path.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

STORY_MAX = 100_000  # entries kept, all keys together (about 21 MB at most, metadata_bench.py)


class Story:
    """The bounded log; ``clock`` gives wall-clock seconds (``time.time``)."""

    __slots__ = ("log", "clock")

    def __init__(self, maxlen: int = STORY_MAX, clock: Callable[[], float] = time.time) -> None:
        self.log: deque[tuple[float, str, str, Any]] = deque(maxlen=maxlen)
        self.clock = clock

    def add(self, key: str, event: str, detail: Any = "") -> None:
        self.log.append((self.clock(), key, event, detail))

    def of(self, key: str, limit: int = 100) -> list[tuple[float, str, str]]:
        """The newest ``limit`` entries of ``key``, oldest first: ``(wall time, event,
        detail text)``. Scans the whole log (at most STORY_MAX entries; a few ms)."""
        out = [(t, e, _text(d)) for t, k, e, d in self.log if k == key]
        return out[-limit:] if limit > 0 else out


def _text(detail: Any) -> str:
    if isinstance(detail, (tuple, list)):
        return ", ".join(str(d) for d in detail)
    return str(detail)
