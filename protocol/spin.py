"""Waiting for a reply by polling before sleeping.

A client that sleeps in ``recv`` until its reply arrives pays one wake-up of its thread per
round trip: the kernel must notice the bytes, pick the thread and (usually) move it to
another CPU. On virtual machines, where each cross-CPU wake-up is an inter-processor
interrupt through the hypervisor, that costs about as much as the master takes to answer
a small request (benchmarks/RESULTS.md, "Polling for replies").
:func:`spin_readable` polls the socket instead, without blocking, for a short bound, and
yields the CPU between polls (``sched_yield``) so that a server sharing this CPU runs at
once; only a reply that takes longer than the bound is waited for in the kernel. The
bound is the client's ``spin_wait`` (``client.spin_wait``; 0 turns it off), so one wait
costs at most that much CPU beyond a plain blocking one. On a host whose CPUs are all taken
(load average at least the CPU count minus a half) nothing is polled: a poll there takes
the CPU the answering server needs, so the client that polls loses to one that sleeps,
while on an idle host it wins; gating on the load keeps the default right on both. Busy polling for completions is
what RDMA-based stores (Mooncake's transfer engine) and vLLM's shared-memory broadcast do
for the same reason.
"""
from __future__ import annotations

import os
import select
import socket
import time

_IN = select.POLLIN | select.POLLPRI
SPIN_WAIT_MAX_S = 0.01  # the largest spin_wait accepted (seconds): past it a sleep costs less than polling


def spin_readable(sock, seconds: float) -> bool:
    """Poll ``sock`` (a socket, or a TLS socket) for readability for at most ``seconds``,
    yielding the CPU between polls; True as soon as it is readable (bytes, an error or end
    of stream), False when the bound passed first or ``sock`` is no socket (a ``ucx://``
    stream, whose bytes do not arrive through a descriptor). Never blocks in the kernel;
    the caller's blocking read follows."""
    if seconds <= 0 or not isinstance(sock, socket.socket):  # ssl.SSLSocket is one
        return False
    if getattr(sock, "pending", _nothing)():  # TLS: bytes already decrypted, invisible to poll
        return True
    fd = sock.fileno()
    if fd < 0:  # closed: the read that follows reports it
        return False
    p = select.poll()
    p.register(fd, _IN)
    poll, pause, clock = p.poll, os.sched_yield, time.perf_counter
    end = clock() + seconds
    while not poll(0):
        if clock() >= end:
            return False
        pause()
    return True


class Spinner:
    """:func:`spin_readable` with a bound of ``seconds``, backing off while polls go
    unanswered: after a poll that found no reply within the bound, the next waits sleep at
    once (1, then 2, 4 … up to :data:`BACKOFF_MAX` of them while polls keep failing; one that
    succeeds resets it). Replies that are slow (a loaded server, other clients on the
    same CPUs) then cost no polling CPU, and a quiet server is polled for again soon.
    Shared by a client's threads; the counters are hints, so races on them are harmless."""

    __slots__ = ("seconds", "skip", "backoff", "_busy", "_checked")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.skip = 0
        self.backoff = 1
        self._busy = False
        self._checked = 0.0

    def busy(self) -> bool:
        """Whether this host's CPUs are all taken: its load average over the last minute is
        at least its CPU count minus a half (read at most every :data:`LOAD_CHECK_S`). Then a
        poll would only take a CPU from the server that is to answer, so waits sleep at once."""
        now = time.monotonic()
        if now - self._checked >= LOAD_CHECK_S:
            self._checked = now
            try:
                self._busy = os.getloadavg()[0] >= (os.cpu_count() or 1) - 0.5
            except OSError:
                self._busy = False
        return self._busy

    def wait(self, reader) -> None:
        """Poll the socket of ``reader`` (a :class:`~protocol.dataplane.FrameReader`) before
        the caller's blocking read of it, unless bytes are buffered already, polling is off
        (``seconds`` 0), the host is busy (:meth:`busy`) or polls are backing off (see the
        class docstring)."""
        if not self.seconds or reader.buffered() or not isinstance(reader.sock, socket.socket):
            return  # (a ucx:// stream cannot be polled: no verdict on the server's speed)
        if self.busy():
            return
        if self.skip > 0:
            self.skip -= 1
        elif spin_readable(reader.sock, self.seconds):
            self.backoff = 1
        else:
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, BACKOFF_MAX)


BACKOFF_MAX = 64  # waits that sleep at once after polls kept going unanswered
LOAD_CHECK_S = 1.0  # seconds between two looks at the host's load average


def _nothing() -> int:
    return 0
