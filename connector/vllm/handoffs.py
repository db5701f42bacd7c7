"""Closing a consumer's P/D hand-offs off the vLLM scheduler's thread.

A consumer acks a hand-off once its load landed, and releases it when it ends without
using it (its load failed, it was aborted, or the engine already held the whole prompt
in its local prefix cache). Either call is a master round trip, so it runs on the
scheduler's lookup pool, never in a scheduler step. The outcomes are folded into the
connector's stats on the scheduler's thread (``drain_into``): the stats object is not
shared with the pool's threads.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvpool.protocol.errors import KVPoolError

log = logging.getLogger("kvpool.vllm")


class HandoffCloser:
    """Acks and releases hand-offs on ``pool`` through ``client``
    (:class:`~connector.client.KVPoolClient`)."""

    def __init__(self, client, pool: ThreadPoolExecutor) -> None:
        self.client = client
        self.pool = pool
        self.outcomes: deque[str] = deque()  # stats keys of closes done, appended by the pool's threads
        self.pending: set[Future] = set()

    def close(self, handoff_id: str, ok: bool, check: Callable[[], None] | None = None, why: str = "") -> None:
        """Ack (``ok``) or release ``handoff_id`` in the background. ``check``: run first
        on the pool; a KVPoolError from it (the record is not this request's, or is gone)
        leaves the hand-off alone, to its own consumer or its deadline. ``why``: logged
        with a release."""
        try:
            fut = self.pool.submit(self._run, handoff_id, ok, check, why)
        except RuntimeError:  # the pool is shut down: the master frees it at its deadline
            return
        self.pending.add(fut)
        fut.add_done_callback(self.pending.discard)

    def _run(self, handoff_id: str, ok: bool, check: Callable[[], None] | None, why: str) -> None:
        try:
            if check is not None:
                check()
        except KVPoolError as e:
            log.warning("kvpool: hand-off %s left open: %s: %s", handoff_id, type(e).__name__, e)
            return
        try:
            if ok:
                self.client.handoff_ack(handoff_id)
            else:
                self.client.handoff_release(handoff_id)
        except KVPoolError as e:
            self.outcomes.append("handoff_close_errors")
            log.warning("kvpool: closing hand-off %s failed (%s: %s); the master frees it at its "
                        "deadline", handoff_id, type(e).__name__, e)
            return
        self.outcomes.append("handoffs_acked" if ok else "handoffs_released")
        if why:
            log.info("kvpool: hand-off %s released: %s", handoff_id, why)

    def drain_into(self, stats) -> None:
        """Add the outcomes of the closes done so far to ``stats`` (scheduler thread)."""
        while self.outcomes:
            stats.add(self.outcomes.popleft())

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the closes under way (at shutdown)."""
        if self.pending:
            wait(list(self.pending), timeout=timeout_s)
