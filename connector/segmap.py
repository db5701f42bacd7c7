"""Same-host segment mapping of the data plane (:class:`connector.dataclient.DataPlane`),
held by :class:`SegmentMaps`: the ``map`` handshake over a node's Unix socket, which hands over the node's segment memfd
(SCM_RIGHTS) and proves the node shares this host; the mappings per node incarnation, their
retry after a node that did not answer, and unmapping a dead or restarted node's segment.

The handshake also names the node's process (``SO_PEERCRED``), held as a pidfd, which
refers to that one process (no pid-reuse race): a same-host write copies into the mapping
without the node, and the mapping outlives the node, so a copy that returned proves
nothing about the node. :meth:`SegmentMaps.node_alive` asks the pidfd whether the
process still runs, after the copy and before the commit: an acknowledgement never counts
a replica on a node that died before it (DESIGN.md §5)."""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable

from kvpool.connector.shmcopy import _address, _prefault_aside
from kvpool.protocol import transport
from kvpool.protocol.auth import Security
from kvpool.protocol.dataplane import DataRequest, frame, recv_reply
from kvpool.protocol.errors import KVPoolError, NodeUnavailable
from kvpool.protocol.messages import ExtentRef

_MAP_S = 2.0  # seconds asking a node for its segment's mapping may take
_MAP_RETRY_S = 5.0  # a node that did not answer that is asked again after this many seconds
_POPULATE_MAX = 8 << 30  # segments up to this size get their page tables prefaulted (~2 MiB of PTEs per GiB)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
log = logging.getLogger("kvpool.data")


class SegmentMaps:
    """The same-host segment mappings of a :class:`~connector.dataclient.DataPlane`, by node
    incarnation: ``maps`` (incarnation -> the mapped segment as a memoryview, or None when
    it cannot be mapped), the ``lock`` that guards them (and what :class:`~connector.dma.
    CudaDirect` registers with CUDA on them), each node's process as a pidfd
    (:meth:`node_alive`) and whether each node proved it shares this host
    (:meth:`same_host`).

    Given ``host_id`` (this client's host id), ``mode`` (the DataPlane's transport mode:
    ``tcp`` never maps, ``unix``/``ucx`` ask the question but do not map), ``io_timeout_s``
    (seconds; bounds the ``map`` handshake with 2 s) and ``security`` (TLS and the cluster
    secret of the handshake). ``before_unmap(incarnation, base address or None)``, when
    set, is called under ``lock`` before a mapping goes (the CUDA part drops its
    registration of it there)."""

    def __init__(self, host_id: str, mode: str, io_timeout_s: float, security: Security) -> None:
        self.host_id = host_id
        self.mode = mode
        self.io_timeout_s = io_timeout_s
        self.security = security
        self.before_unmap: Callable[[str, int | None], None] | None = None
        self.maps: dict[str, memoryview | None] = {}
        self.lock = threading.Lock()
        self._bases: dict[str, int] = {}  # incarnation -> address of the mapping's first byte
        self._mmaps: dict[str, mmap.mmap] = {}
        self._node_inc: dict[str, str] = {}  # node id -> incarnation currently mapped
        self._map_retry: dict[str, float] = {}  # incarnation -> when to ask again for a mapping not answered
        self._proven: dict[str, bool] = {}  # incarnation -> its node proved to share this host (same_host)
        self._pidfds: dict[str, int | None] = {}  # incarnation -> pidfd of its node's process (node_alive)
        self._told_remote: set[str] = set()  # node ids warned about: same host id, not provably this host

    def uses_shm(self, ref: ExtentRef) -> bool:
        """Whether ``ref`` is copied through the mapped segment (a same-host memory replica;
        a disk replica never is: it is read over its node's disk-read socket)."""
        return self._may_map(ref) and self.segment(ref) is not None

    def _may_map(self, ref: ExtentRef) -> bool:
        """Whether this client copies ``ref`` through a mapping, should its node's be there:
        shared memory allowed, the same host, a memory extent (not the disk tier)."""
        return self.mode in ("auto", "shm") and ref.host_id == self.host_id and not ref.tier

    def shm_segments(self, refs: Iterable[ExtentRef]) -> list[memoryview | None]:
        """Per ref of ``refs``: the mapped segment it is copied through when :meth:`uses_shm`
        holds for it, else None; asked once per node incarnation (host id and tier) of the
        batch, as :meth:`segment` asks."""
        out: list[memoryview | None] = []
        memo: dict[tuple[str, str, int], memoryview | None] = {}
        for r in refs:
            k = (r.incarnation, r.host_id, r.tier)
            seg = memo.get(k, False)
            if seg is False:
                seg = memo[k] = self.segment(r) if self._may_map(r) else None
            out.append(seg)
        return out

    def same_host(self, ref: ExtentRef) -> bool:
        """Whether ``ref``'s node proved to share this host: it publishes this client's host
        id and its Unix socket answered the ``map`` handshake for ``ref``'s incarnation (a
        host id alone proves nothing: two machines may carry the same one). Asked once per
        incarnation, as :meth:`segment` asks; a node that does not prove it is reached over
        TCP, with one warning per node."""
        if self.mode == "tcp" or ref.host_id != self.host_id or not ref.shm_path:
            return False
        if self.maps.get(ref.incarnation) is None:
            self.segment(ref, self.mode in ("auto", "shm"))
        return bool(self.maps.get(ref.incarnation) is not None or self._proven.get(ref.incarnation))

    def _not_local(self, ref: ExtentRef, why: str) -> None:
        """Record that ``ref``'s node did not prove it shares this host; warn once per node."""
        self._proven[ref.incarnation] = False
        if ref.node_id not in self._told_remote:
            self._told_remote.add(ref.node_id)
            log.warning("store node %s carries this client's host id %r but its Unix socket %s did not prove it "
                        "is on this host (%s); using TCP %s. Give hosts distinct host ids (--host-id) if they "
                        "differ", ref.node_id, self.host_id, ref.shm_path, why, ref.data_addr)

    def segment(self, ref: ExtentRef, map_it: bool = True) -> memoryview | None:
        """The mapped segment of ``ref``'s node incarnation (None when it cannot be mapped).
        Asking for the mapping waits at most ``min(io_timeout_s, 2 s)``; a node that did not
        answer (frozen, overloaded, or another machine with the same host id) is asked again
        after 5 s, meanwhile served by TCP. The answer also settles :meth:`same_host`: a
        reply naming ``ref``'s incarnation (a mapping, or a device segment's refusal) proves
        the node is on this host. ``map_it=False`` (transport ``unix``/``ucx``) asks the same
        question but closes the memfd unmapped."""
        seg = self.maps.get(ref.incarnation, False)
        if seg is not False and (seg is not None or ref.incarnation not in self._map_retry):
            return seg
        with self.lock:
            if ref.incarnation in self.maps:
                if self._map_retry.get(ref.incarnation, float("inf")) > time.monotonic():
                    return self.maps[ref.incarnation]
                del self.maps[ref.incarnation], self._map_retry[ref.incarnation]
            seg = None
            old = self._node_inc.get(ref.node_id)
            if old is not None and old != ref.incarnation:
                self._unmap(old)  # the node restarted: drop the dead incarnation's mapping
            self._node_inc[ref.node_id] = ref.incarnation
            try:
                s = transport.connect(ref.shm_path, min(self.io_timeout_s, _MAP_S), self.security)
                try:
                    s.settimeout(min(self.io_timeout_s, _MAP_S))
                    s.sendall(frame(DataRequest("map", ref.incarnation)))
                    msg, fds, _, _ = socket.recv_fds(s, 1 << 16, 1)
                    try:
                        rep = recv_reply(_Buffered(msg))
                        if rep.ok and fds and map_it:
                            mm = mmap.mmap(fds[0], rep.capacity, mmap.MAP_SHARED,
                                           mmap.PROT_READ | mmap.PROT_WRITE)
                            self._mmaps[ref.incarnation] = mm
                            seg = memoryview(mm)
                            if rep.capacity <= _POPULATE_MAX:
                                _prefault_aside(seg, rep.capacity)
                        # our incarnation was answered (a memfd, or a device segment's refusal)
                        if (rep.ok and fds) or (not rep.ok and rep.error is not None
                                                and rep.error.code != "stale_extent"):
                            self._proven[ref.incarnation] = True
                            if seg is not None:
                                self._pidfds[ref.incarnation] = _peer_pidfd(s)
                        else:
                            self._not_local(ref, "another node answers there" if not rep.ok else "no memfd came")
                    finally:
                        for fd in fds:
                            os.close(fd)
                finally:
                    s.close()
            except (KVPoolError, OSError) as e:
                seg = None
                self._not_local(ref, f"{type(e).__name__}: {e}")
                if isinstance(e, (TimeoutError, NodeUnavailable)):  # no answer: ask again later
                    self._map_retry[ref.incarnation] = time.monotonic() + _MAP_RETRY_S
            self.maps[ref.incarnation] = seg
            return seg

    def node_alive(self, ref: ExtentRef) -> bool | None:
        """Whether the process of ``ref``'s node incarnation (mapped here) still runs: False
        once it has exited, None when this client could not name it (another pid namespace,
        a kernel without pidfds): then only a round trip to the node can tell. One
        ``poll`` of the node's pidfd, no round trip."""
        fd = self._pidfds.get(ref.incarnation)
        if fd is None:
            return None
        p = select.poll()
        p.register(fd, select.POLLIN)
        try:
            return not p.poll(0)
        except OSError:  # closed by an unmap meanwhile: the node is being forgotten
            return None

    def extent_address(self, ref: ExtentRef) -> int:
        base = self._bases.get(ref.incarnation)
        if base is None:
            base = self._bases[ref.incarnation] = _address(self.segment(ref)[:1])
        return base + ref.offset

    def forget(self, node_id: str) -> None:
        """Unmap ``node_id``'s segment (it died): a long-lived client must not keep a dead
        node's whole segment resident."""
        with self.lock:
            inc = self._node_inc.pop(node_id, None)
            if inc is not None:
                self._unmap(inc)

    def close(self) -> None:
        """Unmap every segment."""
        with self.lock:
            for inc in list(self.maps):
                self._unmap(inc)
            self._node_inc.clear()

    def _unmap(self, incarnation: str) -> None:
        """Caller holds ``lock``."""
        self._proven.pop(incarnation, None)
        fd = self._pidfds.pop(incarnation, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        view = self.maps.pop(incarnation, None)
        base = self._bases.pop(incarnation, None)
        if self.before_unmap is not None:
            self.before_unmap(incarnation, base)  # CUDA registration goes before the mapping
        mm = self._mmaps.pop(incarnation, None)
        try:
            if view is not None:
                view.release()
            if mm is not None:
                mm.close()
        except BufferError:
            pass  # a slice is still in use by another thread; the OS unmaps it with the object


def _peer_pidfd(sock) -> int | None:
    """A pidfd of the process at the other end of Unix socket ``sock`` (None when it cannot
    be named: another pid namespace answers pid 0, or the kernel has no pidfds)."""
    try:
        pid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[0]
        return os.pidfd_open(pid) if pid > 0 else None
    except (OSError, AttributeError, struct.error):
        return None


class _Buffered:
    """Present already-received bytes as a socket for :func:`recv_reply`."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def recv_into(self, view: memoryview, n: int) -> int:
        chunk = self.data[self.pos:self.pos + n]
        view[:len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)
