"""The disk tier's read server: clients read disk-resident replicas here, never through
the memory data server (DESIGN.md §12).

A :class:`DiskReadServer` is a :class:`~storenode.dataserver.DataServer` of its own (own
TCP and Unix sockets, published as the node's ``disk_addr`` / ``disk_path``, and its own
few worker threads, ``storenodes[].disk_readers``) that serves ``dread`` (plus ``map`` and
``ping``, so a same-host client can prove the host through it). A disk read therefore
never holds a memory-read worker or sits ahead of a memory read on a client's stream:
memory-tier gets run exactly as without a disk tier.

``dread`` names the file by the ExtentRef's ``gen`` (its disk id) and ``size``, under the
node's incarnation. Objects up to :data:`WHOLE_MAX` bytes are read whole into the worker's
buffer and checked against their checksum before a byte is sent; bigger ones are sent in
pieces as they are read and checked at the end (the reader checks every object's xxh3
anyway). A file that is missing answers StaleExtent; one that fails a check is deleted
and answers StaleExtent too, which a reader under a live lease reports to the master
(:class:`~protocol.messages.ReportCorrupt`), so the replica is dropped from the index.
"""
from __future__ import annotations

import os
import threading
import time

import xxhash

from kvpool.protocol.dataplane import DataReply, FrameReader, frame, sendv
from kvpool.protocol.errors import InvalidRequest, KVPoolError, StaleExtent
from kvpool.storenode.dataserver import DataServer
from kvpool.storenode.disk_tier import CHUNK, DiskTier, _drop_cache, _read_exact
from kvpool.storenode.metrics import Hist

WHOLE_MAX = 16 << 20  # objects up to this size are checked before they are sent


class DiskReadServer(DataServer):
    """Serves ``dread`` of ``disk``'s files (see the module docstring); the other arguments
    are :class:`DataServer`'s (``workers``: ``disk_readers``)."""

    def __init__(self, disk: DiskTier, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.disk = disk
        self.read_hist = Hist()
        self._bufs = threading.local()

    def _buffer(self, size: int) -> memoryview:
        """This worker's read buffer, at least ``size`` bytes (grown to the largest object
        read whole, at most WHOLE_MAX)."""
        buf = getattr(self._bufs, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._bufs.buf = bytearray(max(size, 1 << 20))
        return memoryview(buf)[:size]

    def _handle(self, conn, rd: FrameReader, req, unix: bool, out: list, w) -> int:
        if req.op in ("map", "ping"):
            return super()._handle(conn, rd, req, unix, out, w)
        self.stats.requests["data", req.op] += 1
        try:
            if req.op != "dread":
                raise InvalidRequest(f"data op {req.op!r} is not served on a disk-tier socket; accepted: dread, "
                                     "map, ping")
            if req.incarnation != self.segment.incarnation:
                raise StaleExtent(f"store node restarted (generation {self.segment.incarnation}, request named "
                                  f"{req.incarnation}); look the key up again")
            t0 = time.perf_counter()
            if req.size <= WHOLE_MAX:
                view = self._buffer(req.size)
                self.disk.read_into(req.gen, view)
                out.append(frame(DataReply(True, size=req.size)))
                out.append(view)
                sendv(conn, out)  # now: the buffer is this worker's and is reused by its next read
                out.clear()
            else:
                self._stream(conn, req, out)
            self.read_hist.observe(time.perf_counter() - t0)
            self.bytes_out += req.size
            return 0
        except KVPoolError as e:
            self.stats.errors["data", e.code] += 1
            out.append(frame(DataReply(False, e.to_wire())))
            return 64

    def _stream(self, conn, req, out: list) -> None:
        """Send a big file in pieces as it is read; checked at the end (see the module docstring)."""
        fd, row, off = self.disk.open(req.gen, req.size)
        try:
            out.append(frame(DataReply(True, size=req.size)))
            sendv(conn, out)
            out.clear()
            view = self._buffer(min(CHUNK, req.size))
            h = xxhash.xxh3_64()
            for a in range(0, req.size, CHUNK):
                piece = view[:min(CHUNK, req.size - a)]
                try:
                    _read_exact(fd, piece, off + a)
                except OSError as e:  # the reply is half sent: the stream goes (the reader sees EOF)
                    self.disk.corrupt(req.gen, f"read failed: {e}")
                    raise
                h.update(piece)
                sendv(conn, [piece])
            _drop_cache(fd)
        finally:
            os.close(fd)
        if h.intdigest() != row.checksum:  # the reader's own check refuses the bytes
            self.disk.corrupt(req.gen, "payload checksum mismatch")
        else:
            self.disk.reads += 1
            self.disk.read_bytes += req.size
