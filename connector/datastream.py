"""Connections of the data plane (:class:`connector.dataclient.DataPlane`):
:class:`Connections` keeps one pipelined stream per store node per thread, dialled on first
use and redialled when it was opened to an earlier incarnation of the node; a stream's
buffered reply reader (:class:`_Stream`), which receives
payloads straight into the caller's buffer (through a bounce buffer when that buffer is
misaligned); and how long a network read may wait on a node (:class:`ReplicaDeadline`,
:func:`readable`)."""
from __future__ import annotations

import select
import socket
import threading
import weakref
from collections.abc import Callable, Sequence

import msgspec

from kvpool.connector.parking import Parking, held
from kvpool.connector.shmcopy import _CHUNK, _PAGE, _address, _misaligned
from kvpool.protocol import transport
from kvpool.protocol.auth import Security
from kvpool.protocol.dataplane import DataReply, FrameReader
from kvpool.protocol.errors import DECODE_ERRORS, InvalidRequest, NodeUnavailable

_BOUNCE_RECV = 64 << 10  # socket payloads at least this big into a misaligned buffer are bounced
_REDIAL_S = 2.0  # seconds a redial of a stale connection (to a restarted node's old instance) may take
_rep_dec = msgspec.msgpack.Decoder(DataReply)


class ReplicaDeadline:
    """How long a network read may wait on the one node it reads from, for a caller that
    has another replica to turn to (see ``KVPoolClient(replica_timeout_s=...)``).

    ``timeout_s`` (seconds) bounds the connect and every wait for bytes of the read: a node
    that sends nothing for that long is given up, and the read's ops fail with
    NodeUnavailable. ``first_byte``, when set, replaces the wait for the first reply: called
    with the socket once the requests are sent, it returns True when the socket is readable
    and False to give the node up (a caller hedging to another replica decides there)."""

    __slots__ = ("timeout_s", "first_byte")

    def __init__(self, timeout_s: float, first_byte: Callable[[socket.socket], bool] | None = None) -> None:
        self.timeout_s, self.first_byte = timeout_s, first_byte



def readable(sock: socket.socket, timeout_s: float) -> bool:
    """True when ``sock`` has bytes (or an error or end of stream) within ``timeout_s`` seconds."""
    if getattr(sock, "pending", lambda: 0)():  # TLS: bytes already decrypted, invisible to poll
        return True
    p = select.poll()
    p.register(sock, select.POLLIN | select.POLLPRI)
    return bool(p.poll(max(int(timeout_s * 1000), 0)))



def _wait_bytes(timeout_s: float) -> Callable[[socket.socket], bool]:
    return lambda sock: readable(sock, timeout_s)



class _Stream(FrameReader):
    """One connection plus its buffered reply reader; closed when the thread that owns it
    exits (its thread-local storage goes) or the DataPlane closes. ``incarnation``: of the
    node it was opened to ("" when the caller did not say)."""

    __slots__ = ("bounce", "incarnation", "__weakref__")

    def __del__(self) -> None:
        try:
            self.sock.close()
        except (OSError, AttributeError):
            pass

    def __init__(self, sock, incarnation: str = "") -> None:
        super().__init__(sock)
        self.bounce: memoryview | None = None
        self.incarnation = incarnation

    def reply(self, greedy: bool = True) -> DataReply:
        try:
            return _rep_dec.decode(self.frame(greedy))
        except DECODE_ERRORS as e:
            raise InvalidRequest(f"malformed data reply: {e}") from None

    def read_into(self, dst: memoryview, h) -> None:
        """Fill ``dst`` (buffered bytes first, then ``recv_into`` directly); hash each piece
        into ``h`` as it lands when ``h`` is not None."""
        n = len(dst)
        take = min(n, self.hi - self.lo)
        if take:
            dst[:take] = self.view[self.lo:self.lo + take]
            self.lo += take
            if h is not None:
                h.update(dst[:take])
        pos = take
        recv = self.sock.recv_into
        if n - pos >= _BOUNCE_RECV and _misaligned(dst):
            bounce = self._bounce()
            while pos < n:
                got = recv(bounce, min(len(bounce), n - pos))
                if got == 0:
                    raise NodeUnavailable("data connection closed mid-frame")
                dst[pos:pos + got] = bounce[:got]
                if h is not None:
                    h.update(dst[pos:pos + got])
                pos += got
            return
        while pos < n:
            got = recv(dst[pos:], n - pos)
            if got == 0:
                raise NodeUnavailable("data connection closed mid-frame")
            if h is not None:
                h.update(dst[pos:pos + got])
            pos += got

    def _bounce(self) -> memoryview:
        """This stream's receive bounce buffer: 256 KiB at page offset 2048."""
        if self.bounce is None:
            raw = memoryview(bytearray(_CHUNK + 2 * _PAGE))
            k = (_PAGE // 2 - _address(raw)) % _PAGE
            self.bounce = raw[k:k + _CHUNK]
        return self.bounce



def close_stream(s: _Stream) -> None:
    try:
        s.sock.close()
    except OSError:
        pass


class Connections:
    """The per-thread streams of a :class:`~connector.dataclient.DataPlane`: one stream per
    node address per thread (:meth:`stream`), parked when its thread ends and taken up by
    the next thread that dials that address (:class:`~connector.parking.Parking`), and every
    stream it ever dialled, for :meth:`close` (the shared claim streams of
    :class:`~connector.claims.SharedClaims` are dialled here too, with :meth:`dial`).

    Given ``io_timeout_s`` (seconds: the default connect timeout and every socket's
    timeout) and ``security`` (TLS and the cluster-secret handshake of every stream).
    ``redials`` counts the stale streams (opened to an earlier incarnation of a node)
    replaced, all threads."""

    def __init__(self, io_timeout_s: float, security: Security) -> None:
        self.io_timeout_s = io_timeout_s
        self.security = security
        self.redials = 0
        self._local = threading.local()
        self._parking = Parking(dict.items, close_stream)  # finished threads' streams
        self._all: weakref.WeakSet[_Stream] = weakref.WeakSet()  # live threads' streams
        self._lock = threading.Lock()  # guards ``_all``

    def thread_streams(self) -> dict[str, _Stream]:
        """This thread's streams by address."""
        c = held(self._local, "conns")
        if c is None:  # a thread's streams are parked when it ends (connector/parking.py)
            c = self._parking.hold(self._local, "conns", {})
        return c

    def dial(self, addr: str, connect_timeout_s: float, incarnation: str = "") -> _Stream:
        """A new stream to ``addr`` (connected within ``connect_timeout_s``), closed by
        :meth:`close` at the latest. Raises OSError or KVPoolError when the dial fails."""
        sock = transport.connect(addr, connect_timeout_s, self.security)
        sock.settimeout(self.io_timeout_s)
        s = _Stream(sock, incarnation)
        with self._lock:
            self._all.add(s)
        return s

    def stream(self, addr: str, connect_timeout_s: float | None = None, incarnation: str = "") -> _Stream:
        """This thread's stream to ``addr``, dialled within ``connect_timeout_s`` (default
        ``io_timeout_s``) when it has none. Given the node ``incarnation`` the caller's
        grant names, a stream opened to another one (the node restarted at the same address,
        as a Unix socket path is: its old instance is gone) is stale: it is closed and
        redialled once, within ``min(io_timeout_s, 2 s)``, so that the new instance is never
        taken for dead because of it. Raises OSError or KVPoolError when the dial fails."""
        conns = self.thread_streams()
        s = conns.get(addr)
        if s is not None and incarnation and s.incarnation != incarnation:
            self.drop(addr)
            s = None
            connect_timeout_s = min(connect_timeout_s or self.io_timeout_s, _REDIAL_S)
            self.redials += 1
        if s is None:
            s = self._parking.take(addr)  # one a finished thread left
            if s is not None and incarnation and s.incarnation != incarnation:
                close_stream(s)
                s = None
            if s is None:
                s = self.dial(addr, connect_timeout_s or self.io_timeout_s, incarnation)
            conns[addr] = s
        return s

    def drop(self, addr: str) -> None:
        """Close this thread's stream to ``addr``, if any."""
        s = self.thread_streams().pop(addr, None)
        if s is not None:
            close_stream(s)

    def failed(self, addr: str, ops: Sequence, e: Exception, doing: str) -> None:
        """The stream to ``addr`` broke: drop it and fail every op not failed yet with
        NodeUnavailable (or ``e`` itself when it is one)."""
        self.drop(addr)
        err = e if isinstance(e, NodeUnavailable) else NodeUnavailable(
            f"store node {ops[0].ref.node_id} failed during {doing}: {e}", node=ops[0].ref.node_id)
        for op in ops:
            if op.error is None:
                op.error = err

    def all_streams(self) -> list[_Stream]:
        """Every stream dialled here and not collected yet (all threads, claim streams too)."""
        with self._lock:
            return list(self._all)

    def close(self) -> None:
        """Close every stream, parked or in use."""
        self._parking.close()
        with self._lock:
            for s in list(self._all):
                close_stream(s)
            self._all.clear()
