"""Who may still be copying into the segment: same-host writer processes and their claims.

A same-host writer maps the segment and copies into it without the node (see
:mod:`storenode.extents` for the claim rules). The node cannot stop such a copy, so it
keeps the writer's claims until the writer says it finished (``written``) or until no
thread of the writer's process can run any more. The writer's process is learnt from its
Unix socket (``SO_PEERCRED``) and held as a pidfd, which names that one process (no pid
reuse race): the pidfd becomes readable when the process has exited.

When a writer's connection closes with claims outstanding (the process was killed, or a
thread of it closed the stream while another copied), :class:`WriterWatch` keeps those
claims until the pidfd says the process is gone, then ends them, or until the same process
connects again, which then owns them (:meth:`WriterWatch.adopt`); a process killed by a
signal loses its memory mappings before its sockets close, so by then nothing of it can
write. A peer whose process cannot be named (another pid namespace, a kernel without
pidfds) has its claims ended when its connection closes.
"""
from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading

from kvpool.storenode.extents import ExtentTable

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_POLL_S = 0.2  # how often the watch looks for newly orphaned writers while it waits


class Writer:
    """One data connection's writer identity: owner of the claims taken on it.
    ``pid``/``pidfd``: the peer process over a Unix socket (0/None when unknown)."""

    __slots__ = ("pid", "pidfd", "_conn")

    def __init__(self, conn: socket.socket | None = None) -> None:
        self.pid = 0
        self.pidfd: int | None = None
        self._conn = conn  # a Unix socket, identified on the first claim

    def identify(self) -> bool:
        """Learn the peer's process (once); on any failure it stays unknown. True when this
        call is the one that tried."""
        conn, self._conn = self._conn, None
        if conn is None:
            return False
        try:
            self.pid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[0]
            if self.pid > 0:
                self.pidfd = os.pidfd_open(self.pid)
        except (OSError, AttributeError, struct.error):
            self.pidfd = None  # exited already (ESRCH), or no pidfds: the connection's end is the signal
        return True

    def gone(self) -> bool:
        """The process has exited (True also when it cannot be named)."""
        if self.pidfd is None:
            return True
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        return bool(p.poll(0))

    def close(self) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None


class WriterWatch:
    """Ends the claims of writers whose connection closed once their process is gone."""

    def __init__(self, table: ExtentTable) -> None:
        self.table = table
        self._orphans: list[Writer] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.reclaimed = 0  # claims ended because their writer's process went away

    def closed(self, w: Writer) -> None:
        """``w``'s connection closed: end its claims now when its process is gone (or
        unknown), else when it exits."""
        if self.table.claims(w) and not w.gone():
            with self._lock:
                self._orphans.append(w)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="kvpool-writers", daemon=True)
                    self._thread.start()
            return
        self.reclaimed += self.table.release_owner(w)
        w.close()

    def adopt(self, w: Writer) -> int:
        """``w`` (just identified) is a new connection of a process whose earlier connection
        closed with claims outstanding: those claims pass to ``w``, so the process can end
        them there (``written``) instead of keeping them until it exits. The same pid with
        the earlier process still alive is the same process (a pid is not reused while its
        process lives). Returns how many claims passed."""
        if w.pidfd is None or w.pid <= 0:
            return 0
        with self._lock:
            mine = [o for o in self._orphans if o.pid == w.pid]
            for o in mine:
                self._orphans.remove(o)
        moved = 0
        for o in mine:
            if o.gone():  # exited meanwhile: its claims end (w is another process with its pid)
                self.reclaimed += self.table.release_owner(o)
            else:
                moved += self.table.reown(o, w)
            o.close()
        return moved

    def orphans(self) -> int:
        """Writers whose claims wait for their process to exit."""
        with self._lock:
            return len(self._orphans)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                ws = list(self._orphans)
            p = select.poll()
            for w in ws:
                p.register(w.pidfd, select.POLLIN)
            ready = {fd for fd, _ in p.poll(int(_POLL_S * 1000))} if ws else set()
            if not ws:
                self._stop.wait(_POLL_S)
            for w in ws:
                if w.pidfd in ready:
                    with self._lock:
                        self._orphans.remove(w)
                    self.reclaimed += self.table.release_owner(w)
                    w.close()
