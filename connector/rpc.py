"""Blocking RPC to the leading master: one plain socket per thread, frames of
:mod:`protocol.rpcwire` (``u32 length || u64 request id || msgpack``). The socket is TCP,
or the master's same-host Unix socket when its Hello offers one (see :class:`_Conn`).

The master is found directly (``tcp://host:port``) or through etcd's ``leader`` key. A
refused or broken connection, or a ``NotLeader`` or ``LeaderFenced`` reply, makes the client
re-resolve the leader and retry until the call's deadline, then raise
:class:`~protocol.errors.Timeout` (or the last ``LeaderFenced``: the leader's etcd is away).
A client given one master address raises ``NotLeader`` at once only when that master
names another leader; one that names none (or itself: it lost its lease and campaigns
again) is waited for until the deadline.
Every answer carries its leader term (:mod:`protocol.terms`); an answer of an older term
than one already seen comes from a deposed leader and is refused the same way.
One-way messages (:meth:`MasterRPC.send_nowait`) cost one ``send`` and get no reply.
"""
from __future__ import annotations

import itertools
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from kvpool.connector.parking import Parking, held, release
from kvpool.protocol import messages as M
from kvpool.protocol import rpcwire, transport
from kvpool.protocol.auth import RPC, Security, resolve
from kvpool.protocol.errors import (AuthFailed, ConfigError, InvalidRequest, KVPoolError, LeaderFenced, NotLeader,
                                    Overloaded, Timeout, from_wire)
from kvpool.protocol.etcd import NO_AUTH, EtcdAuth, Keys, parse_endpoints, read_meta_sync
from kvpool.protocol.spin import Spinner
from kvpool.protocol.transport import default_host_id
from kvpool.protocol.units import check_wait


class _Conn:
    """One thread's connection; closed when that thread's storage goes (thread exit).

    It opens over TCP and asks the master ``Hello``; a master on this host answers with
    its abstract Unix socket, and the connection moves there (a loopback round trip costs
    about half as much over a Unix socket; benchmarks/RESULTS.md, "Master RPC carrier")
    if the peer's SO_PEERCRED pid is the master's. Otherwise it stays on TCP."""

    __slots__ = ("addr", "sock", "frames", "__weakref__")

    def __init__(self, addr: str, timeout_s: float, security: Security) -> None:
        self.addr = addr
        self.sock = transport.connect(addr, timeout_s, security, RPC)
        self.frames = rpcwire.BlockingFrames(self.sock)
        try:
            self._hello(timeout_s, addr.startswith("tcp://"), security)
        except BaseException:
            self.sock.close()
            raise

    def _hello(self, timeout_s: float, switch: bool, security: Security) -> None:
        """Check the master's wire version, then (``switch``: a TCP connection) ask for its
        same-host alias and switch to it when it is really the master. Raises ConfigError
        for a master of another kvpool version (one that does not know Hello predates
        versions); other errors on the exchange propagate (the connection is unusable); an
        alias that fails the checks leaves the TCP connection."""
        self.sock.settimeout(timeout_s)
        self.sock.sendall(rpcwire.pack(_HELLO_RID, M.encode(M.Hello(default_host_id(), M.WIRE_VERSION))))
        got, payload = self.frames.read()
        if got != _HELLO_RID:
            raise InvalidRequest(f"master answered request {got} to a Hello")
        rep = M.decode_result(payload, M.Reply)
        if rep.error is not None and rep.error.code in (AuthFailed.code, Overloaded.code):
            raise from_wire(rep.error)  # no or another secret on this side; a full master
        hello = None if rep.error is not None else M.decode_result(rep.result, M.HelloReply)
        wire = 0 if hello is None else hello.wire  # a master that does not know Hello predates versions
        if wire != M.WIRE_VERSION:
            raise ConfigError(f"the master at {self.addr} speaks kvpool wire version {wire}, this client "
                              f"{M.WIRE_VERSION}; run one kvpool version across the cluster (install the "
                              "same kvpool release on clients, masters and store nodes)", key="master")
        if not switch or not hello.alias or hello.host_id != default_host_id():
            return
        try:
            alias = transport.connect(hello.alias, timeout_s, security, RPC)
        except KVPoolError:
            return
        try:
            pid = _PEERCRED.unpack(alias.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
        except OSError:
            pid = -1
        if pid != hello.pid:  # not the master's socket (or another pid namespace): stay on TCP
            alias.close()
            return
        self.sock.close()
        self.sock, self.frames = alias, rpcwire.BlockingFrames(alias)

    def close(self) -> None:
        sock = getattr(self, "sock", None)  # None when the connect itself failed
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    __del__ = close


_HELLO_RID = (1 << 64) - 1  # request id of the Hello (ids of calls count up from 1)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class MasterRPC:
    def __init__(self, master: str | None = None, etcd: str | None = None, cluster: str = "default",
                 timeout_s: float = 10.0, security: Security | None = None, etcd_auth: EtcdAuth = NO_AUTH,
                 spin_s: float = 0.0) -> None:
        if not master and not etcd:
            raise ConfigError("KVPoolClient needs master='tcp://host:port' or etcd='http://host:port'",
                              key="master")
        check_wait(timeout_s, key="rpc_timeout_s")
        if master:
            _check_master_addr(master)
        else:  # ConfigError naming a bad URL; several (comma-separated, or a list) fail over
            etcd = ",".join(parse_endpoints(etcd))
        self.fixed_master = master
        self.etcd = etcd
        self.etcd_auth = etcd_auth  # etcd user/password and TLS for the leader lookups
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.spin = Spinner(spin_s)  # a reply is polled for before the wait sleeps (protocol/spin.py)
        self.security = resolve(security)  # TLS and the cluster-secret handshake (protocol/auth.py)
        self._addr = master
        self._term = 0  # the newest leader term seen (protocol/terms.py): older answers are refused
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._conns: weakref.WeakSet[_Conn] = weakref.WeakSet()  # every live thread's, for close()
        # a finished thread's connection waits for the next thread (no TIME_WAIT per thread)
        self._parking = Parking(lambda c: [(c.addr, c)], _Conn.close)
        self._lock = threading.Lock()

    def leader(self) -> str:
        if self._addr is None:
            self._resolve()
        return self._addr or ""

    def _resolve(self) -> None:
        if self.fixed_master:
            self._addr = self.fixed_master
            return
        got = read_meta_sync(self.etcd, Keys(self.cluster).leader, timeout_s=min(self.timeout_s, 5.0),
                             auth=self.etcd_auth)
        if got is None:
            self._addr = None
            return
        # etcd's word on the term (the key's create revision) is authoritative: it may even be
        # lower than one seen, when etcd's history restarted
        self._addr, self._term = got[0].decode(), got[1]

    @property
    def term(self) -> int:
        """The newest leader term seen (0: none yet; :mod:`protocol.terms`)."""
        return self._term

    def forget_leader(self) -> None:
        """Look the leader up again at the next call (a store node refused a grant of a
        deposed leader: :class:`~protocol.errors.StaleTerm`)."""
        self._reset()
        if not self.fixed_master:
            self._addr = None

    def _conn(self, addr: str, timeout_s: float) -> _Conn:
        """This thread's connection to ``addr``: the one it holds, one a finished thread left
        (connector/parking.py), or a new one dialled within ``timeout_s``."""
        c = held(self._local, "conn")
        if c is not None and c.addr == addr:
            return c
        if c is not None:
            self._reset()
        c = self._parking.take(addr)
        if c is None:
            c = _Conn(addr, timeout_s, self.security)
            with self._lock:
                self._conns.add(c)
        return self._parking.hold(self._local, "conn", c)

    def _reset(self) -> None:
        c = held(self._local, "conn")
        if c is not None:
            c.close()
            release(self._local, "conn")
            with self._lock:
                self._conns.discard(c)

    def call(self, req: Any, timeout_s: float | None = None,
             meanwhile: Callable[[Callable[[], bool]], None] | None = None) -> Any:
        """Send ``req`` and return its decoded result; raise the typed error on failure
        (:class:`~protocol.errors.Timeout` when no master answered before the deadline).

        ``meanwhile(answered)``: work to do while the master handles the request, run once,
        after the first send that went out (a resend after a broken connection does not
        run it again; no reply is returned without a send, so it has always run by then);
        ``answered()`` is True when the reply can be read without waiting, so the work can
        stop there. A put hashes its buffers here. It may use :meth:`send_nowait` but not
        ``call`` (RuntimeError). An exception from it propagates (the reply left unread is
        skipped by the next call). The time it runs does not count against the deadline:
        the master has had all of it to answer."""
        if getattr(self._local, "busy", False):
            raise RuntimeError("MasterRPC.call from inside another call's meanwhile; only send_nowait may be used there")
        waited = self.timeout_s if timeout_s is None else timeout_s
        if not waited > 0:
            raise ConfigError(f"call timeout must be > 0 seconds, got {timeout_s!r}", key="timeout_s")
        deadline = time.monotonic() + waited
        body = M.encode(req)
        if len(body) + 8 > rpcwire.MAX_FRAME:  # the master would refuse it unread and hang up
            raise InvalidRequest(f"{type(req).__name__} encodes to {len(body)} bytes, over the {rpcwire.MAX_FRAME}-byte "
                                 "frame limit; send fewer keys per request (KVPoolClient's batch calls split by "
                                 "bytes)", limit=rpcwire.MAX_FRAME, request_bytes=len(body))
        typ = M.RESULT_TYPES[type(req)]
        if meanwhile is not None:
            meanwhile = _once(meanwhile)
        fenced: KVPoolError | None = None  # the last "no leader for now" answer (LeaderFenced, NotLeader)
        while True:
            addr = self._addr  # one read: another thread may clear it during a failover
            if addr is None:
                self._resolve()
                addr = self._addr
            if addr is not None:
                rep, spent = self._round_trip(addr, body, deadline, meanwhile)
                deadline += spent  # time spent in meanwhile is not the master's
                if rep is not None and rep.term and rep.term < self._term:
                    # a deposed leader's answer (a newer term was seen): not trusted; find the leader
                    self._reset()
                    rep = None
                elif rep is not None and rep.term > self._term:
                    self._term = rep.term
                if rep is not None:
                    if rep.error is None:
                        return M.decode_result(rep.result, typ)
                    err = from_wire(rep.error)
                    if not isinstance(err, (NotLeader, LeaderFenced)):
                        raise err
                    self._reset()
                    if isinstance(err, LeaderFenced):
                        fenced = err  # the leader has no lease for now: retry; a new one may be elected
                    elif self.fixed_master and err.fields.get("leader") in ("", None, self.fixed_master):
                        # the master we were given lost its lease and campaigns again (or no leader
                        # is elected yet): wait for it within the deadline, like a fenced leader
                        fenced = err
                    elif self.fixed_master:  # pointed at a standby: say so, and where the leader is
                        raise NotLeader(f"{self.fixed_master} is a standby master, not the leader; connect to "
                                        f"{err.fields.get('leader') or 'the leader'}, or follow the elected one "
                                        "through etcd (CLI --etcd, client etcd=...)", **err.fields)
                if not self.fixed_master:
                    self._addr = None
            if time.monotonic() >= deadline:
                if isinstance(fenced, NotLeader):
                    raise NotLeader(f"the kvpool master at {self.fixed_master} is not leading (it lost its etcd "
                                    f"lease, or no leader is elected) and did not lead again within {waited:g}s; "
                                    "check etcd and the master's log", **fenced.fields)
                if fenced is not None:
                    raise fenced
                raise Timeout(self._timeout_message(waited), op=type(req).__name__)
            time.sleep(0.05)

    def _round_trip(self, addr: str, body: bytes, deadline: float,
                    meanwhile=None) -> tuple[M.Reply | None, float]:
        """One send (then ``meanwhile``, see :meth:`call`) + the matching reply (polled for
        before the wait sleeps, protocol/spin.py), and the seconds ``meanwhile`` ran (the wait
        for the reply starts after it); the reply is None when the connection failed (retry)."""
        spent = 0.0
        left = deadline - time.monotonic()
        if left <= 0:
            return None, spent
        try:
            c = self._conn(addr, left)
            c.sock.settimeout(left)
            rid = next(self._ids)
            c.sock.sendall(rpcwire.pack(rid, body))
        except (ConfigError, AuthFailed, Overloaded):
            raise  # a master of another kvpool version, or one refusing us: retrying cannot help
        except (OSError, KVPoolError):  # NodeUnavailable (EOF) is one
            self._reset()
            return None, spent
        if meanwhile is not None:  # outside the try: its errors are its own, not the connection's
            self._local.busy = True  # a call from inside would take this call's reply for a late one
            t0 = time.monotonic()
            try:
                meanwhile(c.frames.ready)
            finally:
                self._local.busy = False
                spent = time.monotonic() - t0
                deadline += spent
        try:
            if meanwhile is not None:
                c.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            self.spin.wait(c.frames)
            while True:
                got, payload = c.frames.read()
                if got == rid:
                    return M.decode_result(payload, M.Reply), spent
                # a late reply to an earlier call that timed out: skip it
        except (ConfigError, AuthFailed, Overloaded):
            raise  # a master of another kvpool version, or one refusing us: retrying cannot help
        except InvalidRequest:  # a reply frame out of bounds: asking again would get the same
            self._reset()
            raise
        except (OSError, KVPoolError):  # NodeUnavailable (EOF) is one
            self._reset()
            return None, spent

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
        addr = self._addr
        if addr is None:
            return
        try:
            c = self._conn(addr, min(self.timeout_s, 1.0))
            c.sock.settimeout(self.timeout_s)
            c.sock.sendall(rpcwire.pack(rpcwire.ONE_WAY, M.encode(req)))
        except OSError:
            self._reset()

    def close(self) -> None:
        self._parking.close()
        with self._lock:
            for c in list(self._conns):
                c.close()
            self._conns.clear()


def _once(fn: Callable[[Callable[[], bool]], None]) -> Callable[[Callable[[], bool]], None]:
    """``fn`` to be run at most once: beside the first send of a call that may resend."""
    ran = False

    def run(answered: Callable[[], bool]) -> None:
        nonlocal ran
        if not ran:
            ran = True
            fn(answered)
    return run


def _check_master_addr(addr: str) -> None:
    """A master address the user gave: ``tcp://host:port`` with a port in 1..65535 and a
    host that resolves, or ``unix://...``. Raises ConfigError at once, instead of a
    connect retried until the RPC timeout."""
    scheme, rest = transport.split_addr(addr)
    if scheme == "unix":
        return
    host, sep, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"master address {addr!r}: use tcp://host:port (port 1-65535)", key="master")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except OSError as e:  # socket.gaierror
        raise ConfigError(f"master address {addr!r}: cannot resolve host {host!r} ({e})", key="master") from None
