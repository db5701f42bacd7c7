"""Client side of the data plane: moves extent bytes between caller buffers and store nodes.

Paths, chosen per replica (``transport="auto"``):

* **same host, shared memory** (``shm``): the node's segment memfd is received once over
  its Unix socket (SCM_RIGHTS) and mapped; a get is one copy (segment → caller buffer),
  a put is one copy (caller buffer → segment) plus a small ``written`` notice.
* **network** (``tcp``): one pipelined stream per node per thread; reads ``recv_into`` the
  caller's buffer directly (one copy kernel → buffer), writes ``sendall`` from it.

Every byte range is bounds-checked against the master's grant (the ExtentRef). Errors:
:class:`~protocol.errors.NodeUnavailable` (node dead/unreachable),
:class:`~protocol.errors.StaleExtent` (extent freed or node restarted).
"""
from __future__ import annotations

import mmap
import os
import socket
import threading
from collections.abc import Sequence

from protocol import transport
from protocol.dataplane import DataReply, DataRequest, frame, recv_exact, recv_reply
from protocol.errors import KVPoolError, NodeUnavailable, from_wire
from protocol.messages import ExtentRef


class WriteOp:
    __slots__ = ("ref", "data", "key", "checksum", "layout", "error")

    def __init__(self, ref: ExtentRef, data: memoryview, key: str, checksum: int, layout: bytes | None):
        self.ref, self.data, self.key, self.checksum, self.layout = ref, data, key, checksum, layout
        self.error: KVPoolError | None = None


class ReadOp:
    __slots__ = ("ref", "out", "error")

    def __init__(self, ref: ExtentRef, out: memoryview):
        self.ref, self.out = ref, out
        self.error: KVPoolError | None = None


class DataPlane:
    """Thread-safe: connections are per thread; shared-memory maps are shared."""

    def __init__(self, host_id: str, transport_mode: str = "auto", io_timeout_s: float = 30.0) -> None:
        self.host_id = host_id
        self.mode = transport_mode
        self.io_timeout_s = io_timeout_s
        self._local = threading.local()
        self._maps: dict[str, memoryview | None] = {}
        self._map_lock = threading.Lock()
        self._all_conns: list[socket.socket] = []
        self._mmaps: list[mmap.mmap] = []

    # ---- connections ----------------------------------------------------------------------

    def _conns(self) -> dict[str, socket.socket]:
        c = getattr(self._local, "conns", None)
        if c is None:
            c = self._local.conns = {}
        return c

    def _conn(self, addr: str) -> socket.socket:
        conns = self._conns()
        s = conns.get(addr)
        if s is None:
            s = transport.connect(addr, self.io_timeout_s)
            s.settimeout(self.io_timeout_s)
            conns[addr] = s
            with self._map_lock:
                self._all_conns.append(s)
        return s

    def _drop(self, addr: str) -> None:
        s = self._conns().pop(addr, None)
        if s is not None:
            try:
                s.close()
            except OSError:
                pass

    def uses_shm(self, ref: ExtentRef) -> bool:
        return self.mode in ("auto", "shm") and ref.host_id == self.host_id and self._segment(ref) is not None

    def _stream_addr(self, ref: ExtentRef) -> str:
        if self.mode != "tcp" and ref.host_id == self.host_id and ref.shm_path:
            return ref.shm_path  # same host without shm: the node's Unix socket
        return ref.data_addr

    def _segment(self, ref: ExtentRef) -> memoryview | None:
        """The mapped segment of ``ref``'s node incarnation (None when it cannot be mapped)."""
        seg = self._maps.get(ref.incarnation, False)
        if seg is not False:
            return seg
        with self._map_lock:
            if ref.incarnation in self._maps:
                return self._maps[ref.incarnation]
            seg = None
            try:
                s = transport.connect(ref.shm_path, self.io_timeout_s)
                try:
                    s.sendall(frame(DataRequest("map", ref.incarnation)))
                    msg, fds, _, _ = socket.recv_fds(s, 1 << 16, 1)
                    if fds:
                        try:
                            rep = recv_reply(_Buffered(msg))
                            if rep.ok:
                                mm = mmap.mmap(fds[0], rep.capacity,
                                               mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                               mmap.PROT_READ | mmap.PROT_WRITE)
                                self._mmaps.append(mm)
                                seg = memoryview(mm)
                        finally:
                            for fd in fds:
                                os.close(fd)
                finally:
                    s.close()
            except (KVPoolError, OSError):
                seg = None
            self._maps[ref.incarnation] = seg
            return seg

    # ---- writes -------------------------------------------------------------------------

    def write(self, ops: Sequence[WriteOp]) -> None:
        """Write every op (all to one node); sets ``op.error`` per failed op."""
        shm = [op for op in ops if self.uses_shm(op.ref)]
        net = [op for op in ops if not self.uses_shm(op.ref)]
        for op in shm:
            seg = self._segment(op.ref)
            r = op.ref
            if r.offset + r.size > len(seg) or len(op.data) != r.size:
                op.error = KVPoolError(f"grant for {op.key!r} does not fit the mapped segment")
                continue
            seg[r.offset:r.offset + r.size] = op.data
        self._stream(shm, notice=True)
        self._stream(net, notice=False)

    def _stream(self, ops: Sequence[WriteOp], notice: bool) -> None:
        if not ops:
            return
        addr = ops[0].ref.shm_path if notice else self._stream_addr(ops[0].ref)
        try:
            s = self._conn(addr)
            for op in ops:
                if op.error is not None:
                    continue
                r = op.ref
                s.sendall(frame(DataRequest("written" if notice else "write", r.incarnation, r.offset, r.size,
                                            r.gen, op.key, op.checksum, op.layout, r.token)))
                if not notice and r.size:
                    s.sendall(op.data)
            for op in ops:
                if op.error is not None:
                    continue
                rep = recv_reply(s)
                if not rep.ok:
                    op.error = from_wire(rep.error)
        except (OSError, KVPoolError) as e:
            self._drop(addr)
            err = e if isinstance(e, NodeUnavailable) else NodeUnavailable(
                f"store node {ops[0].ref.node_id} failed during write: {e}", node=ops[0].ref.node_id)
            for op in ops:
                if op.error is None:
                    op.error = err

    # ---- reads --------------------------------------------------------------------------

    def read(self, ops: Sequence[ReadOp]) -> None:
        """Read every op (all from one node) into its ``out``; sets ``op.error`` on failure."""
        net = []
        for op in ops:
            if self.uses_shm(op.ref):
                seg = self._segment(op.ref)
                r = op.ref
                op.out[:r.size] = seg[r.offset:r.offset + r.size]
            else:
                net.append(op)
        if not net:
            return
        addr = self._stream_addr(net[0].ref)
        try:
            s = self._conn(addr)
            for op in net:
                r = op.ref
                s.sendall(frame(DataRequest("read", r.incarnation, r.offset, r.size, r.gen)))
            for op in net:
                rep: DataReply = recv_reply(s)
                if rep.ok:
                    recv_exact(s, op.out[:op.ref.size])
                else:
                    op.error = from_wire(rep.error)
        except (OSError, KVPoolError) as e:
            self._drop(addr)
            err = e if isinstance(e, NodeUnavailable) else NodeUnavailable(
                f"store node {net[0].ref.node_id} failed during read: {e}", node=net[0].ref.node_id)
            for op in net:
                if op.error is None:
                    op.error = err

    def close(self) -> None:
        with self._map_lock:
            for s in self._all_conns:
                try:
                    s.close()
                except OSError:
                    pass
            self._all_conns.clear()
            for v in self._maps.values():
                if v is not None:
                    v.release()
            self._maps.clear()
            for mm in self._mmaps:
                try:
                    mm.close()
                except BufferError:
                    pass
            self._mmaps.clear()


class _Buffered:
    """Present already-received bytes as a socket for :func:`recv_reply`."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def recv_into(self, view: memoryview, n: int) -> int:
        chunk = self.data[self.pos:self.pos + n]
        view[:len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)
