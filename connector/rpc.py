"""Blocking RPC to the leading master: one plain TCP connection per thread, frames of
:mod:`protocol.rpcwire` (``u32 length || u64 request id || msgpack``).

The master is found directly (``tcp://host:port``) or through etcd's ``leader`` key. A
refused or broken connection, or a ``NotLeader`` reply, makes the client re-resolve the
leader and retry until the call's deadline, then raise :class:`~protocol.errors.Timeout`.
One-way messages (:meth:`MasterRPC.send_nowait`) cost one ``send`` and get no reply.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from protocol import messages as M
from protocol import rpcwire, transport
from protocol.errors import ConfigError, KVPoolError, NodeUnavailable, NotLeader, Timeout, from_wire
from protocol.etcd import Keys, read_key_sync


class _Conn:
    __slots__ = ("addr", "sock", "frames")

    def __init__(self, addr: str, timeout_s: float) -> None:
        self.addr = addr
        self.sock = transport.connect(addr, timeout_s)
        self.frames = rpcwire.BlockingFrames(self.sock)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class MasterRPC:
    def __init__(self, master: str | None = None, etcd: str | None = None, cluster: str = "default",
                 timeout_s: float = 10.0) -> None:
        if not master and not etcd:
            raise ConfigError("KVPoolClient needs master='tcp://host:port' or etcd='http://host:port'",
                              key="master")
        self.fixed_master = master
        self.etcd = etcd
        self.cluster = cluster
        self.timeout_s = timeout_s
        self._addr = master
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()

    def leader(self) -> str:
        if self._addr is None:
            self._resolve()
        return self._addr or ""

    def _resolve(self) -> None:
        if self.fixed_master:
            self._addr = self.fixed_master
            return
        val = read_key_sync(self.etcd, Keys(self.cluster).leader, timeout_s=min(self.timeout_s, 5.0))
        self._addr = val.decode() if val else None

    def _conn(self, timeout_s: float) -> _Conn:
        c = getattr(self._local, "conn", None)
        if c is not None and c.addr == self._addr:
            return c
        if c is not None:
            self._reset()
        c = _Conn(self._addr, timeout_s)
        self._local.conn = c
        with self._lock:
            self._conns.append(c)
        return c

    def _reset(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None
            with self._lock:
                if c in self._conns:
                    self._conns.remove(c)

    def call(self, req: Any, timeout_s: float | None = None) -> Any:
        """Send ``req`` and return its decoded result; raise the typed error on failure
        (:class:`~protocol.errors.Timeout` when no master answered before the deadline)."""
        waited = timeout_s or self.timeout_s
        deadline = time.monotonic() + waited
        body = M.encode(req)
        typ = M.RESULT_TYPES[type(req)]
        while True:
            if self._addr is None:
                self._resolve()
            if self._addr is not None:
                rep = self._round_trip(body, deadline)
                if rep is not None:
                    if rep.error is None:
                        return M.decode_result(rep.result, typ)
                    err = from_wire(rep.error)
                    if not isinstance(err, NotLeader):
                        raise err
                    self._reset()
                if not self.fixed_master:
                    self._addr = None
            if time.monotonic() >= deadline:
                raise Timeout(self._timeout_message(waited), op=type(req).__name__)
            time.sleep(0.05)

    def _round_trip(self, body: bytes, deadline: float) -> M.Reply | None:
        """One send + the matching reply; None when the connection failed (retry)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            c = self._conn(left)
            c.sock.settimeout(left)
            rid = next(self._ids)
            c.sock.sendall(rpcwire.pack(rid, body))
            while True:
                got, payload = c.frames.read()
                if got == rid:
                    return M.decode_result(payload, M.Reply)
                # a late reply to an earlier call that timed out: skip it
        except (OSError, NodeUnavailable, KVPoolError):
            self._reset()
            return None

    def _timeout_message(self, waited: float) -> str:
        if self.fixed_master:
            return (f"no reply from the kvpool master at {self.fixed_master} within {waited:g}s; is it "
                    "running? `kvpool up` starts a local cluster")
        if self._addr is None:
            return (f"no master is elected for cluster {self.cluster!r} in etcd at {self.etcd} (waited "
                    f"{waited:g}s); start one with `kvpool master --etcd {self.etcd}` or `kvpool up`")
        return f"no reply from the elected master {self._addr} within {waited:g}s; is it running?"

    def send_nowait(self, req: Any) -> None:
        """Fire-and-forget (lease release, corruption report): one ``send``, no reply. Best
        effort: dropped when no master connection can be made right now."""
        if self._addr is None:
            return
        try:
            c = self._conn(min(self.timeout_s, 1.0))
            c.sock.settimeout(self.timeout_s)
            c.sock.sendall(rpcwire.pack(rpcwire.ONE_WAY, M.encode(req)))
        except OSError:
            self._reset()

    def close(self) -> None:
        with self._lock:
            for c in self._conns:
                c.close()
            self._conns.clear()
