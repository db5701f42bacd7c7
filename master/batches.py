"""Batch requests answered a slice per loop turn.

A batch of up to :data:`~protocol.messages.MAX_BATCH_KEYS` keys costs the master's request
thread tens of microseconds per key. Answered in one go, one client's big batch would hold
every other client for its whole duration; answered as a :class:`SlicedBatch`,
:data:`SLICE` keys go per loop turn and the other clients' requests go between slices
(:class:`~master.clients.ClientConns` steps it like any client with work left).

Only requests whose items are independent are sliced (:data:`SLICED`): each item's result
is the one it would get alone, and the reply is one message with every item's result in
order. Between two slices the state may change as it may between two requests (a key of a
later slice put, removed or evicted meanwhile).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.protocol import messages as M

SLICE = 1024  # keys of one batch handled per loop turn (a few ms of the request thread)
SLICED = frozenset((M.PutStart, M.PutEnd, M.PutRevoke, M.Lookup, M.Exists, M.Remove))


class SlicedBatch:
    """Batch request ``req`` answered :data:`SLICE` keys per :meth:`step`. ``run(part)``
    handles one slice (a request of the same type) and returns its results, or raises to
    end the batch with that error; ``finish(results or exception)`` encodes the reply."""

    __slots__ = ("req", "run", "finish", "n", "at", "results")

    def __init__(self, req: Any, run: Callable[[Any], list], finish: Callable[[Any], bytes]) -> None:
        self.req, self.run, self.finish = req, run, finish
        self.n, self.at, self.results = M.batch_len(req), 0, []

    def step(self) -> bytes | None:
        """Handle the next slice; the encoded reply once the last one is done (or one failed),
        else None (call again on a later turn)."""
        stop = min(self.at + SLICE, self.n)
        try:
            self.results += self.run(M.slice_request(self.req, self.at, stop))
        except Exception as e:  # noqa: BLE001 - the batch's answer: typed errors, or a bug reported
            return self.finish(e)
        self.at = stop
        return self.finish(self.results) if stop >= self.n else None
