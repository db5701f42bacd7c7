"""Waiting for a reply, or a request, by polling before sleeping.

A client that sleeps in ``recv`` until its reply arrives pays one wake-up of its thread per
round trip: the kernel must notice the bytes, pick the thread and (usually) move it to
another CPU. On virtual machines, where each cross-CPU wake-up is an inter-processor
interrupt through the hypervisor, that costs about as much as the master takes to answer
a small request (benchmarks/RESULTS.md, "Polling for replies"); and a server asleep in
``poll`` pays the same on the way in. :func:`spin_readable` polls a socket instead, without
blocking, for a short bound, and yields the CPU between polls (``sched_yield``) so that a
peer sharing this CPU runs at once; only an answer that takes longer than the bound is
waited for in the kernel. The client's bound is ``client.spin_wait`` (0 turns it off), so
one wait costs at most that much CPU beyond a plain blocking one. The master polls the same
way for its next request (:meth:`Spinner.spin`), for ``master.spin_wait`` after serving
one, so a client that sends one request per reply finds it awake. Busy polling for
completions is what RDMA-based stores (Mooncake's transfer engine) and vLLM's shared-memory
broadcast do for the same reason.

On a host whose CPUs are taken, polling loses: a poll takes the CPU a peer needs, and a
polling thread gives up the preference the scheduler gives a thread it wakes, so an answer
landing while another task holds the CPU waits out that task's time slice. A yield tells
at once: one that kept the CPU away for longer than :data:`HOG_S` ran a task that uses
whole time slices (a shorter absence is a task that ran briefly, often the very peer whose
answer is awaited, sharing this CPU: the poll goes on). The poll then ends, and once
:data:`STOLEN_IN_A_ROW` polls in a row ended so, nothing is polled for :data:`HOLD_S`. The
load average would be the wrong gate: it notices a busy host only tens of seconds late and,
on a small host, counts the client and the servers it waits for as load.
"""
from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any

_IN = select.POLLIN | select.POLLPRI
SPIN_WAIT_MAX_S = 0.01  # the largest spin_wait accepted (seconds): past it a sleep costs less than polling
HOG_S = 500e-6  # seconds: a yield that kept the CPU away longer ran a task that uses whole time slices
STOLEN_IN_A_ROW = 2  # polls in a row ended by such a yield that stop a Spinner polling ...
HOLD_S = 1.0  # ... for this many seconds


class Stolen(float):
    """The seconds a yield kept the CPU away (another task wanted this CPU); falsy, like
    any other poll that found nothing."""

    def __bool__(self) -> bool:
        return False


def spin_until(ready: Callable[[], Any], seconds: float) -> Any:
    """Call ``ready()`` until it returns something truthy, for at most ``seconds``, yielding
    the CPU (``sched_yield``) between calls; never blocks in the kernel. Returns that first
    truthy result; False when the bound passed first; a :class:`Stolen` (falsy) when a
    yield kept the CPU away for longer than :data:`HOG_S` (another task wants this CPU for
    whole time slices: block instead, see the module docstring)."""
    pause, clock = os.sched_yield, time.perf_counter
    end = clock() + seconds
    while True:
        got = ready()
        if got:
            return got
        t = clock()
        if t >= end:
            return False
        pause()
        away = clock() - t
        if away > HOG_S:
            return Stolen(away)


def spin_readable(sock, seconds: float) -> bool | Stolen:
    """Poll ``sock`` (a socket, or a TLS socket) for readability for at most ``seconds``
    (:func:`spin_until`): True as soon as it is readable (bytes, an error or end of stream),
    False when the bound passed first or ``sock`` is no socket (a ``ucx://`` stream, whose
    bytes do not arrive through a descriptor), a :class:`Stolen` (falsy) when another task
    wanted the CPU for whole time slices. Never blocks in the kernel; the caller's blocking
    read follows."""
    if seconds <= 0 or not isinstance(sock, socket.socket):  # ssl.SSLSocket is one
        return False
    if getattr(sock, "pending", _nothing)():  # TLS: bytes already decrypted, invisible to poll
        return True
    fd = sock.fileno()
    if fd < 0:  # closed: the read that follows reports it
        return False
    p = select.poll()
    p.register(fd, _IN)
    got = spin_until(lambda: p.poll(0), seconds)
    return got if type(got) is Stolen else bool(got)


class Spinner:
    """:func:`spin_readable` (or :func:`spin_until`) with a bound of ``seconds``, backing off
    while polls go unanswered: after a poll that found nothing within the bound, the next
    waits sleep at once (1, then 2, 4 … up to :data:`BACKOFF_MAX` of them while polls keep
    failing; one that succeeds resets it). Answers that are slow (a loaded server, other
    clients on the same CPUs) then cost no polling CPU, and a quiet server is polled for
    again soon. Polls that keep losing their yields to tasks running whole time slices stop
    polling for :data:`HOLD_S` (:meth:`busy`, module docstring). Shared by a client's
    threads; the counters are hints, so races on them are harmless."""

    __slots__ = ("seconds", "skip", "backoff", "stolen", "held_until")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.skip = 0
        self.backoff = 1
        self.stolen = 0  # polls in a row that a yield to a CPU-bound task ended
        self.held_until = 0.0  # monotonic seconds: nothing is polled before then

    def busy(self) -> bool:
        """Whether this host's CPUs are taken: polls kept losing their yields to tasks that
        run whole time slices, within the last :data:`HOLD_S`. A poll would then only take
        a CPU from the peer that is to answer, so waits sleep at once."""
        return self.held_until > 0 and time.monotonic() < self.held_until

    def wait(self, reader) -> None:
        """Poll the socket of ``reader`` (a :class:`~protocol.dataplane.FrameReader`) before
        the caller's blocking read of it, unless bytes are buffered already, polling is off
        (``seconds`` 0), the host is busy (:meth:`busy`) or polls are backing off (see the
        class docstring)."""
        if not self.seconds or reader.buffered() or not isinstance(reader.sock, socket.socket):
            return  # (a ucx:// stream cannot be polled: no verdict on the server's speed)
        if self._may_poll():
            self._verdict(spin_readable(reader.sock, self.seconds))

    def spin(self, ready: Callable[[], Any], seconds: float) -> Any:
        """:func:`spin_until` over ``ready`` for at most ``seconds``, gated and backing off
        as :meth:`wait` is (polling off, a busy host, polls backing off: nothing is
        called). Returns ready's truthy result, or None: the caller then blocks."""
        if not self.seconds or seconds <= 0 or not self._may_poll():
            return None
        got = spin_until(ready, seconds)
        self._verdict(got)
        return got or None

    def _may_poll(self) -> bool:
        """Whether this wait polls: not on a busy host (:meth:`busy`), nor while polls back
        off (a skipped wait counts down the back-off)."""
        if self.busy():
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def _verdict(self, got) -> None:
        """A poll answered (the back-off resets), or not: unanswered within its bound, or
        ended by a yield to a CPU-bound task (a :class:`Stolen`)."""
        if type(got) is not Stolen:
            self.stolen = 0
        elif self.stolen < STOLEN_IN_A_ROW - 1:  # one may be a task that ran long once (a peer's GC)
            self.stolen += 1
        else:
            self.stolen = 0
            self.held_until = time.monotonic() + HOLD_S
        if got:
            self.backoff = 1
        else:
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, BACKOFF_MAX)


BACKOFF_MAX = 64  # waits that sleep at once after polls kept going unanswered


def _nothing() -> int:
    return 0
