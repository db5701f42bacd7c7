"""Durable etcd writes behind RPC answers (pin records, hand-off records, their deletes).

Writes to one etcd key run one at a time, in the order the calls arrived, so etcd ends
in the state of the last operation; each write's in-memory change (``then``) runs in the
same order and only once its write landed, so the master's memory and etcd agree. The RPC
loop keeps serving other clients meanwhile and calls :meth:`DurableWrites.advance` each
turn. ``undo`` runs when ``then`` refuses (e.g. the object went away while its pin record
was written). A write etcd refuses for want of space is answered EtcdFull (which says how to
free space). A write that neither lands nor fails within :data:`WAIT_S` is answered
EtcdUnavailable ("outcome unknown") and still applied if it lands later; a write queued
behind it is answered EtcdUnavailable ("nothing was changed") and dropped.

No sockets here: ``submit(coro_fn, what, check)`` starts a coroutine on the etcd thread
and returns its concurrent Future (raising EtcdUnavailable when etcd is known to be down);
``answer(pending, result, error)`` sends a request's reply; ``retry_later(key)`` takes a
background delete that could not start.
"""
from __future__ import annotations

import sys
import time
import traceback
from collections import deque

from kvpool.protocol.errors import EtcdFull, EtcdUnavailable, InvalidRequest, KVPoolError

WAIT_S = 3.0  # seconds a durable write may take before its request is answered


class Pending:
    """One durable write and, for a request, the answer waiting for it (``client`` set by
    the RPC loop; None for a background delete)."""

    __slots__ = ("key", "coro_fn", "then", "undo", "what", "fut", "deadline", "client", "rid", "op", "t0",
                 "answered")

    def __init__(self, key: str, coro_fn, what: str, then=None, undo=None) -> None:
        self.key, self.coro_fn, self.what, self.then, self.undo = key, coro_fn, what, then, undo
        self.fut = None
        self.deadline = time.monotonic() + WAIT_S
        self.client = None
        self.rid = 0
        self.op, self.t0 = "etcd", time.perf_counter()
        self.answered = False


class DurableWrites:
    def __init__(self, submit, answer, retry_later) -> None:
        self.submit, self.answer, self.retry_later = submit, answer, retry_later
        self.chains: dict[str, deque[Pending]] = {}  # etcd key -> its writes, in call order

    def __bool__(self) -> bool:
        return bool(self.chains)

    def write(self, key: str, coro_fn, what: str, then, undo=None) -> Pending:
        """Queue a request's write behind earlier ones to ``key`` (started at once when
        none). Raises EtcdUnavailable at once when etcd is known to be down."""
        p = Pending(key, coro_fn, what, then, undo)
        chain = self.chains.get(key)
        if chain:
            chain.append(p)
        else:
            p.fut = self.submit(coro_fn, what, True)
            self.chains[key] = deque([p])
        return p

    def after(self, key: str, coro_fn, what: str) -> bool:
        """Queue a background write behind the writes to ``key`` in flight; False when there
        are none (the caller may start it right away)."""
        chain = self.chains.get(key)
        if chain is None:
            return False
        chain.append(Pending(key, coro_fn, what))
        return True

    def advance(self) -> None:
        """Answer what finished or ran out of time; start what is next in each chain."""
        now = time.monotonic()
        for key in list(self.chains):
            chain = self.chains[key]
            for p in [p for p in list(chain)[1:] if p.client is not None and not p.answered and now >= p.deadline]:
                chain.remove(p)  # a request never started: nothing was applied (background deletes wait)
                self.answer(p, None, EtcdUnavailable(
                    f"etcd did not take earlier writes to this record within {WAIT_S:g}s; {p.what} need etcd "
                    "and nothing was changed. Check `kvpool status` and the etcd endpoint, then retry"))
            while chain:
                p = chain[0]
                if p.fut is None:
                    try:
                        p.fut = self.submit(p.coro_fn, p.what, p.client is not None)
                    except EtcdUnavailable as e:
                        chain.popleft()
                        if p.client is None:
                            self.retry_later(key)
                        self.answer(p, None, e)
                        continue
                if not p.fut.done():
                    if now >= p.deadline and not p.answered:
                        self.answer(p, None, EtcdUnavailable(
                            f"etcd did not confirm the write within {WAIT_S:g}s; {p.what} need etcd. The outcome "
                            "is unknown: the change applies if the write still lands. Check `kvpool ls` / `kvpool "
                            "status` and retry"))
                    break
                chain.popleft()
                self._finish(p)
            if not chain:
                del self.chains[key]

    def _finish(self, p: Pending) -> None:
        exc = p.fut.exception()
        if isinstance(exc, EtcdFull):  # etcd answered: nothing was written, and a retry cannot help yet
            if p.client is None:
                self.retry_later(p.key)
            self.answer(p, None, EtcdFull(f"{p.what} need etcd and nothing was changed: {exc}", **exc.fields))
            return
        if exc is not None:
            if "too large" in str(exc):  # etcd's request size limit (--max-request-bytes, 1.5 MiB by default)
                self.answer(p, None, InvalidRequest(
                    f"etcd refused the record as too large ({exc}); nothing was changed. {p.what.capitalize()} "
                    "are kept in etcd: make the record smaller (fewer keys per hand-off)"))
                return
            if p.client is None:
                self.retry_later(p.key)
            self.answer(p, None, EtcdUnavailable(
                f"etcd refused the write ({type(exc).__name__}); {p.what} need etcd and nothing was changed. "
                "Check `kvpool status` and the etcd endpoint, then retry"))
            return
        try:
            result = p.then() if p.then is not None else None
        except KVPoolError as e:
            if p.undo is not None:
                p.undo()
            self.answer(p, None, e)
            return
        except Exception as e:  # noqa: BLE001 - a bug must cost one request, not the master
            traceback.print_exc(file=sys.stderr)
            self.answer(p, None, KVPoolError(f"master failed on {p.op}: {type(e).__name__}: {e}"))
            return
        self.answer(p, result, None)
