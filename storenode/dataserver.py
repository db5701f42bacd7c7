"""Threaded data server: reads and writes extents straight between sockets and the
segment (``recv_into``/``sendall`` on memoryview slices, no per-byte Python work).

One thread per connection; socket calls release the GIL, so several streams run in
parallel. Frames are described in :mod:`protocol.dataplane`. A malformed frame gets an
error reply and the connection is closed (its stream position can no longer be trusted).
"""
from __future__ import annotations

import contextlib
import socket
import threading

from protocol import transport
from protocol.grants import check_token
from protocol.dataplane import DataReply, DataRequest, frame, recv_exact, recv_request
from protocol.errors import InvalidRequest, KVPoolError, NodeUnavailable, StaleExtent
from storenode.extents import ExtentTable
from storenode.segment import Segment

_SCRATCH = 1 << 20


class DataServer:
    """Serves one segment on the given listen addresses (``tcp://``, ``unix://``)."""

    def __init__(self, segment: Segment, table: ExtentTable, addrs: list[str]) -> None:
        self.segment = segment
        self.table = table
        self.listeners = [(a, transport.listen(a)) for a in addrs]
        self.addrs = [self._bound(a, s) for a, s in self.listeners]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.bytes_in = 0
        self.bytes_out = 0

    @staticmethod
    def _bound(addr: str, s) -> str:
        scheme, _ = transport.split_addr(addr)
        if scheme == "tcp":
            host, port = s.getsockname()[:2]
            return f"tcp://{host}:{port}"
        return addr

    def start(self) -> None:
        for addr, s in self.listeners:
            threading.Thread(target=self._accept, args=(addr, s), daemon=True, name=f"accept-{addr}").start()

    def stop(self) -> None:
        self._stop.set()
        for _, s in self.listeners:
            with contextlib.suppress(OSError):
                s.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()

    def _accept(self, addr: str, s) -> None:
        unix = addr.startswith("unix://")
        while not self._stop.is_set():
            try:
                conn, _ = s.accept()
            except OSError:
                return
            if not unix:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, unix), daemon=True).start()

    def _serve(self, conn: socket.socket, unix: bool) -> None:
        try:
            while not self._stop.is_set():
                try:
                    req = recv_request(conn)
                except InvalidRequest as e:
                    conn.sendall(frame(DataReply(False, e.to_wire())))
                    return
                if not self._handle(conn, req, unix):
                    return
        except (NodeUnavailable, OSError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _handle(self, conn: socket.socket, req: DataRequest, unix: bool) -> bool:
        """Serve one request; False closes the connection."""
        seg = self.segment
        try:
            if req.incarnation != seg.incarnation and req.op != "ping":
                raise StaleExtent(f"store node segment restarted (generation {seg.incarnation}, request "
                                  f"named {req.incarnation}); look the key up again")
            if req.op in ("write", "written"):
                self.table.check_bounds(req.offset, req.size)
                if not check_token(seg.grant_key, seg.incarnation, req.offset, req.size, req.gen, req.token):
                    raise InvalidRequest(f"write to [{req.offset}, +{req.size}) gen {req.gen} carries no valid "
                                         "grant from the master; writes need a put_start grant")
            if req.op == "write":
                recv_exact(conn, seg.view[req.offset:req.offset + req.size])
                self.bytes_in += req.size
                self.table.record_write(req.key, req.offset, req.size, req.gen, req.checksum, req.layout)
                conn.sendall(frame(DataReply(True)))
            elif req.op == "written":
                self.table.record_write(req.key, req.offset, req.size, req.gen, req.checksum, req.layout)
                conn.sendall(frame(DataReply(True)))
            elif req.op == "read":
                self.table.check_read(req.offset, req.size, req.gen)
                conn.sendall(frame(DataReply(True, size=req.size)))
                conn.sendall(seg.view[req.offset:req.offset + req.size])
                self.bytes_out += req.size
            elif req.op == "map":
                if not unix:
                    raise InvalidRequest("map is only served on the node's Unix socket")
                socket.send_fds(conn, [frame(DataReply(True, capacity=seg.capacity))], [seg.fd])
            elif req.op == "ping":
                conn.sendall(frame(DataReply(True, capacity=seg.capacity)))
            else:
                raise InvalidRequest(f"unknown data op {req.op!r}; accepted: write, written, read, map, ping")
            return True
        except KVPoolError as e:
            if req.op == "write":
                # keep the stream in step: swallow the payload the client is sending
                if not 0 <= req.size <= seg.capacity:
                    conn.sendall(frame(DataReply(False, e.to_wire())))
                    return False
                scratch = memoryview(bytearray(min(_SCRATCH, max(req.size, 1))))
                left = req.size
                while left:
                    n = min(left, len(scratch))
                    recv_exact(conn, scratch[:n])
                    left -= n
            conn.sendall(frame(DataReply(False, e.to_wire())))
            return True
