"""Batch requests answered a slice per loop turn.

A batch of up to :data:`~protocol.messages.MAX_BATCH_KEYS` keys costs the master's request
thread tens of microseconds per key. Answered in one go, one client's big batch would hold
every other client for its whole duration; answered as a :class:`SlicedBatch`,
:data:`SLICE` keys go per loop turn and the other clients' requests go between slices
(:class:`~master.clients.ClientConns` steps it like any client with work left).

Only requests whose items are independent are sliced (:data:`SLICED`): each item's result
is the one it would get alone, and the reply is one message with every item's result in
order. Between two slices the state may change as it may between two requests (a key of a
later slice put, removed or evicted meanwhile). A slice that fails (the leader fenced or
deposed meanwhile) ends the batch: for a request whose results are per key
(:data:`PER_KEY_ERRORS`) the keys of the slices already applied keep their results and
every later key gets that error, so the reply says exactly what was applied; any other
batch is answered with the error alone (a read: nothing was changed).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.protocol import messages as M

SLICE = 1024  # keys of one batch handled per loop turn (a few ms of the request thread)
SLICED = frozenset((M.PutStart, M.PutEnd, M.PutRevoke, M.Lookup, M.Exists, M.Remove))
PER_KEY_ERRORS = frozenset((M.PutStart, M.PutEnd, M.PutRevoke, M.Lookup, M.Remove))  # results hold an ErrorInfo


class SlicedBatch:
    """Batch request ``req`` answered :data:`SLICE` keys per :meth:`step`. ``run(part)``
    handles one slice (a request of the same type) and returns its results, or raises to
    end the batch; ``finish(results or exception)`` encodes the reply; ``key_error(e)``
    (for :data:`PER_KEY_ERRORS` requests) is the per-key result of a key the batch did
    not reach because of ``e``."""

    __slots__ = ("req", "run", "finish", "key_error", "n", "at", "results")

    def __init__(self, req: Any, run: Callable[[Any], list], finish: Callable[[Any], bytes],
                 key_error: Callable[[Exception], Any] | None = None) -> None:
        self.req, self.run, self.finish, self.key_error = req, run, finish, key_error
        self.n, self.at, self.results = M.batch_len(req), 0, []

    def step(self) -> bytes | None:
        """Handle the next slice; the encoded reply once the last one is done (or one failed),
        else None (call again on a later turn)."""
        stop = min(self.at + SLICE, self.n)
        try:
            self.results += self.run(M.slice_request(self.req, self.at, stop))
        except Exception as e:  # noqa: BLE001 - the batch's answer: typed errors, or a bug reported
            if self.at and self.key_error is not None:  # slices applied: say which keys were not
                return self.finish(self.results + [self.key_error(e)] * (self.n - self.at))
            return self.finish(e)
        self.at = stop
        return self.finish(self.results) if stop >= self.n else None
