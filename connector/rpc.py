"""Blocking RPC to the leading master over zmq DEALER sockets (one per thread).

The master is found directly (``tcp://host:port``) or through etcd's ``leader`` key; a
``NotLeader`` reply or a timeout makes the client re-resolve the leader and retry until
the call's deadline, then raise :class:`~protocol.errors.Timeout`.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import zmq

from protocol import messages as M
from protocol.errors import ConfigError, NotLeader, Timeout, from_wire
from protocol.etcd import Keys, read_key_sync


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
        self._ctx = zmq.Context.instance()
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._socks: list[zmq.Socket] = []
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

    def _sock(self) -> zmq.Socket:
        s = getattr(self._local, "sock", None)
        if s is not None and getattr(self._local, "addr", None) == self._addr:
            return s
        if s is not None:
            s.close(0)
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self._addr)
        self._local.sock, self._local.addr = s, self._addr
        with self._lock:
            self._socks.append(s)
        return s

    def _reset(self) -> None:
        s = getattr(self._local, "sock", None)
        if s is not None:
            s.close(0)
            self._local.sock = None

    def call(self, req: Any, timeout_s: float | None = None) -> Any:
        """Send ``req`` and return its decoded result; raise the typed error on failure."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        body = M.encode(req)
        typ = M.RESULT_TYPES[type(req)]
        while True:
            if self._addr is None:
                self._resolve()
            if self._addr is not None:
                sock = self._sock()
                rid = next(self._ids).to_bytes(8, "little")
                sock.send_multipart([rid, body])
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not sock.poll(int(min(left, 1.0) * 1000) + 1):
                        if left <= 0:
                            break
                        continue
                    got_rid, reply = sock.recv_multipart()
                    if got_rid != rid:
                        continue  # a late reply to an earlier timed-out call
                    rep = M.decode_result(reply, M.Reply)
                    if rep.error is None:
                        return M.decode_result(rep.result, typ)
                    err = from_wire(rep.error)
                    if isinstance(err, NotLeader):
                        break
                    raise err
                self._reset()
                if not self.fixed_master:
                    self._addr = None
            if time.monotonic() >= deadline:
                waited = timeout_s or self.timeout_s
                if self.fixed_master:
                    msg = (f"no reply from the kvpool master at {self.fixed_master} within {waited:g}s; is it "
                           "running? `kvpool up` starts a local cluster")
                elif self._addr is None:
                    msg = (f"no master is elected for cluster {self.cluster!r} in etcd at {self.etcd} (waited "
                           f"{waited:g}s); start one with `kvpool master --etcd {self.etcd}` or `kvpool up`")
                else:
                    msg = f"no reply from the elected master {self._addr} within {waited:g}s; is it running?"
                raise Timeout(msg, op=type(req).__name__)
            time.sleep(0.05)

    def send_nowait(self, req: Any) -> None:
        """Fire-and-forget (e.g. lease release); its reply is discarded by request id."""
        if self._addr is None:
            return
        self._sock().send_multipart([next(self._ids).to_bytes(8, "little"), M.encode(req)])

    def close(self) -> None:
        with self._lock:
            for s in self._socks:
                s.close(0)
            self._socks.clear()


