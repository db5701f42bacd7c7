"""Thin asyncio wrapper over the ``aetcd`` client (etcd v3 API).

Adds what aetcd leaves to callers: endpoint parsing, the ``/kvpool/<cluster>/`` key
layout (DESIGN.md §3), keeping a lease alive (refresh every TTL/3, as etcd's own Go
client does), create-if-absent transactions for leader election, compaction of old
revisions, and clear errors when etcd is unreachable (:class:`~protocol.errors.EtcdUnavailable`)
or full (:class:`~protocol.errors.EtcdFull`).

Several endpoints of one etcd cluster may be given (``http://a:2379,http://b:2379``); aetcd
talks to one host, so :class:`Etcd` uses one endpoint at a time and, when a call cannot
reach it (refused, reset, or no answer within ``timeout_s``), moves to the next endpoint
and repeats the call there, each endpoint at most once per call: a call takes at most
``len(endpoints) × timeout_s``. Repeating is safe for what kvpool does: puts write the
same value again, deletes are idempotent, and create-if-absent recognises its own write.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aetcd
import aetcd.exceptions
import aetcd.watcher
from aetcd import rpc

from kvpool.protocol.errors import AuthFailed, ConfigError, EtcdFull, EtcdUnavailable

# etcd's answers to missing or wrong credentials (etcdserver/api/v3rpc/rpctypes)
_AUTH_REFUSED = ("authentication failed", "user name is empty", "permission denied", "invalid auth token")
# the call could not reach the member: try the next endpoint
_UNREACHABLE = (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError)
NOSPACE = "database space exceeded"  # etcd's "mvcc: database space exceeded" (alarm NOSPACE)
ETCD_FULL_FIX = ("To fix: compact etcd's history, defragment it and disarm the alarm (ETCDCTL_API=3 etcdctl "
                 "compact <current revision>; etcdctl defrag; etcdctl alarm disarm), or restart etcd with a "
                 "larger --quota-backend-bytes (kvpool config etcd.quota_backend)")


def parse_endpoint(endpoint: str, key: str = "etcd") -> tuple[str, int]:
    """One endpoint, ``http://127.0.0.1:2379`` or ``127.0.0.1:2379`` → (host, port). Raises
    ConfigError naming the endpoint (and ``key``) unless it is a plain http URL with a host and a
    port in 1..65535 (no path, query or user; https is refused: the aetcd client has no TLS)."""
    ep = endpoint.strip()
    why = ""
    try:
        u = urllib.parse.urlsplit(ep if "://" in ep else "http://" + ep)
        port = u.port
    except ValueError:
        u, port, why = None, None, "the port must be a number in 1..65535"
    if u is not None:
        if u.scheme != "http":
            why = ("https is not supported (the aetcd client speaks plain http); use http://" if u.scheme == "https"
                   else f"scheme {u.scheme!r} is not supported; use http://")
        elif not u.hostname:
            why = "it needs a host"
        elif port is None:
            why = "it needs a port"
        elif not 1 <= port <= 65535:
            why = "the port must be a number in 1..65535"
        elif u.path not in ("", "/") or u.query or u.fragment or u.username is not None:
            why = "give only scheme, host and port (no path, query or user)"
    if why:
        raise ConfigError(f"{key}: etcd endpoint {endpoint!r}: {why}, e.g. http://127.0.0.1:2379 (several: "
                          "comma-separated)", key=key)
    host = u.hostname
    return (f"[{host}]" if ":" in host else host), port


def parse_endpoints(spec: str | Sequence[str], key: str = "etcd") -> list[str]:
    """Comma-separated endpoints (or a list of them) → the normalised ``http://host:port`` list,
    in order, without repeats. Raises ConfigError naming the first bad one (see
    :func:`parse_endpoint`), or when none is given."""
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{key}: etcd endpoint {item!r}: must be a string like http://127.0.0.1:2379", key=key)
        for ep in item.split(","):
            if not ep.strip():
                raise ConfigError(f"{key}: etcd endpoints {spec!r}: an empty entry; give http://host:port, several "
                                  "separated by commas", key=key)
            host, port = parse_endpoint(ep, key)
            url = f"http://{host}:{port}"
            if url not in out:
                out.append(url)
    if not out:
        raise ConfigError(f"{key}: no etcd endpoint given; pass http://host:port (several: comma-separated)", key=key)
    return out


@dataclass(frozen=True)
class EtcdAuth:
    """Credentials for etcd: ``username``/``password`` (etcd's own users; the client
    authenticates once per connection and sends the token with every call) and TLS from PEM
    files: ``ca`` verifies etcd's server certificate, ``cert``/``key`` are this client's
    certificate for etcd's ``--client-cert-auth``. TLS is on when ``ca`` is set."""

    username: str | None = None
    password: str | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_config(cls, e) -> "EtcdAuth":
        """From an :class:`~protocol.config.EtcdConfig` (its ``password_file``: the password
        is the file's first line). Raises ConfigError naming the key of an unreadable file."""
        password = e.password
        if e.password_file is not None:
            lines = _read(e.password_file, "etcd.password_file").decode(errors="replace").splitlines()
            password = lines[0] if lines else ""
        for key in ("ca", "cert", "key"):
            if getattr(e, key) is not None:
                _read(getattr(e, key), f"etcd.{key}")
        return cls(e.username, password, e.ca, e.cert, e.key)

    def client(self, host: str, port: int, timeout_s: float) -> aetcd.Client:
        """An (unconnected) aetcd client for ``host:port`` with these credentials."""
        kind = _TlsClient if self.ca is not None else aetcd.Client
        c = kind(host=host, port=port, timeout=timeout_s, username=self.username, password=self.password)
        c._kvpool_auth = self
        return c


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path} ({e.strerror}); give a readable file", key=key) from None


class _TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel. aetcd 1.0 opens only ``grpc.aio.insecure_channel``
    in :meth:`aetcd.Client.connect`; this is that method with ``secure_channel`` and
    ``grpc.ssl_channel_credentials`` from the :class:`EtcdAuth` files."""

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        import grpc

        a: EtcdAuth = self._kvpool_auth
        creds = grpc.ssl_channel_credentials(_read(a.ca, "etcd.ca"), a.key and _read(a.key, "etcd.key"),
                                             a.cert and _read(a.cert, "etcd.cert"))
        try:
            self._is_connecting = True
            self.channel = rpc.secure_channel(f"{self._host}:{self._port}", creds, options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                try:
                    resp = await self.auth_stub.Authenticate(
                        rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                except rpc.AioRpcError as e:
                    raise aetcd.exceptions.ClientError(e) from None
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                                  metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


NO_AUTH = EtcdAuth()


class Keys:
    """The cluster's etcd keys under ``/kvpool/<cluster>/``."""

    def __init__(self, cluster: str) -> None:
        self.root = f"/kvpool/{cluster}/"
        self.nodes = self.root + "nodes/"
        self.leader = self.root + "leader"
        self.handoffs = self.root + "handoffs/"
        self.pins = self.root + "pins/"
        self.config = self.root + "config"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def handoff(self, request_id: str) -> str:
        return self.handoffs + request_id

    def pin(self, key: str) -> str:
        return self.pins + key


@dataclass(frozen=True)
class EtcdStatus:
    """One member's answer to a status call: ``revision`` of the store, ``db_size`` (bytes of
    the backend file, what the quota counts) and ``db_size_in_use`` (bytes holding live data;
    the difference is what a defragmentation gives back)."""

    endpoint: str
    revision: int
    db_size: int
    db_size_in_use: int


class Etcd:
    """An open etcd connection. Use ``async with Etcd(endpoints) as e``.

    ``endpoint``: one URL, several comma-separated, or a list (ConfigError for a bad one).
    ``timeout_s``: deadline of one call on one endpoint, seconds. Calls raise aetcd's errors
    (``aetcd.exceptions.ClientError``) when every endpoint failed, and
    :class:`~protocol.errors.EtcdFull` when etcd refuses a write for want of space.
    """

    def __init__(self, endpoint: str | Sequence[str], timeout_s: float = 5.0, auth: EtcdAuth = NO_AUTH) -> None:
        self.endpoints = parse_endpoints(endpoint)
        self.timeout_s = timeout_s
        self.auth = auth  # user/password and TLS (EtcdAuth)
        self._at = 0  # index of the endpoint in use
        self.client: aetcd.Client | None = None
        self._retiring: set[asyncio.Task] = set()  # closes of replaced clients, after their calls ended
        self._told = 0.0  # when a failover was last logged

    @property
    def endpoint(self) -> str:
        """The endpoint in use."""
        return self.endpoints[self._at]

    def _new_client(self) -> aetcd.Client:
        host, port = parse_endpoint(self.endpoint)
        return self.auth.client(host.strip("[]") if self.auth.ca else host, port, self.timeout_s)

    async def __aenter__(self) -> "Etcd":
        failed = []
        for i in range(len(self.endpoints)):
            self._at = i
            client = self._new_client()
            try:
                await client.connect()
                await client.get(b"/kvpool/")
            except Exception as e:  # aetcd raises several connection error types
                if any(w in str(e) for w in _AUTH_REFUSED):
                    with contextlib.suppress(Exception):
                        await client.close()
                    raise AuthFailed(f"etcd at {self.endpoint} refused this process's credentials ({e}); check "
                                     "etcd.username and etcd.password (or etcd.password_file), and that the user "
                                     "has a role granting /kvpool/", endpoint=self.endpoint) from None
                failed.append(f"{self.endpoint} ({type(e).__name__})")
                with contextlib.suppress(Exception):
                    await client.close()
                continue
            self.client = client
            return self
        self._at = 0
        raise EtcdUnavailable(f"cannot reach etcd at {', '.join(failed)}; start one (`kvpool up` starts a local "
                              "etcd) or pass --etcd", endpoint=",".join(self.endpoints))

    async def __aexit__(self, *exc) -> None:
        for task in list(self._retiring):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._retiring, return_exceptions=True)
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()

    async def reconnect(self, failed: aetcd.Client | None = None) -> None:
        """Replace the gRPC channel with a fresh one to the next endpoint (the same endpoint when
        there is only one): after an etcd restart a fresh channel connects at once, where the old
        one may sit in exponential reconnect backoff longer than a lease TTL. With ``failed``
        given, nothing is done when another caller already replaced that client. The old
        client is closed once calls still running on it had their ``timeout_s``."""
        if failed is not None and failed is not self.client:
            return
        old, before = self.client, self.endpoint
        self._at = (self._at + 1) % len(self.endpoints)
        self.client = self._new_client()
        with contextlib.suppress(Exception):
            await self.client.connect()
        if len(self.endpoints) > 1 and time.monotonic() - self._told > 10:  # at most every 10 s in an outage
            logging.getLogger("kvpool.etcd").warning("kvpool: etcd endpoint %s did not answer; using %s", before,
                                                     self.endpoint)
            self._told = time.monotonic()
        if old is not None:
            async def close_later(c: aetcd.Client = old) -> None:
                try:
                    await asyncio.sleep(self.timeout_s + 1.0)
                finally:
                    with contextlib.suppress(Exception):
                        await c.close()

            task = asyncio.get_running_loop().create_task(close_later())
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _call(self, op):
        """``await op(client)`` on the endpoint in use; when it cannot reach that member, on the
        next endpoint (each endpoint at most once). A NOSPACE refusal raises EtcdFull."""
        for attempt in range(len(self.endpoints)):
            client = self.client
            try:
                return await op(client)
            except _UNREACHABLE:
                if attempt + 1 == len(self.endpoints):
                    raise
                await self.reconnect(client)
            except aetcd.exceptions.ClientError as e:
                if NOSPACE in str(e):
                    raise EtcdFull(f"etcd at {self.endpoint} is full: its database reached its space quota "
                                   f"(alarm NOSPACE: {e}), so it refuses new records until space is freed. "
                                   f"{ETCD_FULL_FIX}", endpoint=self.endpoint) from None
                raise

    async def get(self, key: str) -> bytes | None:
        r = await self._call(lambda c: c.get(key.encode()))
        return None if r is None else r.value

    async def get_meta(self, key: str) -> aetcd.rtypes.KeyValue | None:
        """``key``'s value with its revisions and lease (``value``, ``create_revision``,
        ``mod_revision``, ``version``, ``lease``), or None when absent. The leader key's
        ``create_revision`` is the leader term (:mod:`protocol.terms`)."""
        return await self._call(lambda c: c.get(key.encode()))

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        r = await self._call(lambda c: c.get_prefix(prefix.encode()))
        return {kv.key.decode(): kv.value for kv in r}

    async def put(self, key: str, value: bytes, lease: aetcd.Lease | None = None) -> None:
        await self._call(lambda c: c.put(key.encode(), value, lease=lease))

    async def delete(self, key: str) -> None:
        await self._call(lambda c: c.delete(key.encode()))

    async def lease(self, ttl_s: float) -> aetcd.Lease:
        return await self._call(lambda c: c.lease(max(1, int(round(ttl_s)))))

    async def create_if_absent(self, key: str, value: bytes, lease: aetcd.Lease) -> bool:
        """Atomically put ``key`` only if it does not exist (election). True on success, and
        when the key already holds ``value`` under ``lease`` (a repeated call whose first
        answer was lost)."""
        k = key.encode()

        async def txn(c: aetcd.Client) -> bool:
            ok, responses = await c.transaction(compare=[c.transactions.version(k) == 0],
                                                success=[c.transactions.put(k, value, lease=lease)],
                                                failure=[c.transactions.get(k)])
            if ok:
                return True
            kvs = responses[0] if responses else []
            return bool(kvs) and kvs[0][0] == value and kvs[0][1].lease == lease.id

        return await self._call(txn)

    async def delete_if_created(self, key: str, create_revision: int) -> bool:
        """Delete ``key`` only if it is still the one created at ``create_revision`` (a
        leader giving up its own ``leader`` key, never a successor's). True when deleted."""
        k = key.encode()

        async def txn(c: aetcd.Client) -> bool:
            ok, _ = await c.transaction(compare=[c.transactions.create(k) == create_revision],
                                        success=[c.transactions.delete(k)], failure=[])
            return ok

        return await self._call(txn)

    async def status(self) -> EtcdStatus:
        """The status of the member in use (revision and database sizes, see EtcdStatus)."""
        async def go(c: aetcd.Client) -> EtcdStatus:
            await c.connect()
            try:
                r = await c.maintenancestub.Status(rpc.StatusRequest(), timeout=self.timeout_s, metadata=c.metadata)
            except rpc.AioRpcError as e:
                aetcd.exceptions._handle_exception(e)  # raises the matching aetcd error
            return EtcdStatus(self.endpoint, r.header.revision, r.dbSize, r.dbSizeInUse)

        return await self._call(go)

    async def compact(self, revision: int) -> bool:
        """Drop the history of every key below ``revision`` (what a watch or a read at an older
        revision could see); the space is reused by later writes, the file shrinks only with a
        defragmentation. False when etcd was already compacted at or past ``revision``."""
        try:
            await self._call(lambda c: c.compact(revision))
        except aetcd.exceptions.ClientError as e:
            if "has been compacted" in str(e):  # mvcc: required revision has been compacted
                return False
            raise
        return True


class LeaseClock:
    """When a kept-alive lease was last known to be renewed, on this process's monotonic
    clock: ``renewed_at`` is the time the last successful grant or refresh request was
    *sent* (etcd resets the lease's expiry to its TTL when it receives the request, so
    etcd cannot expire the lease before ``renewed_at + ttl_s``), and ``ttl_s`` the TTL etcd
    granted (seconds; etcd may round a short TTL up, never down)."""

    def __init__(self) -> None:
        self.renewed_at = time.monotonic()
        self.ttl_s = 0.0

    def age(self, now: float | None = None) -> float:
        """Seconds since ``renewed_at``."""
        return (time.monotonic() if now is None else now) - self.renewed_at


@contextlib.asynccontextmanager
async def kept_alive(etcd: Etcd, ttl_s: float, lost: asyncio.Event,
                     clock: LeaseClock | None = None) -> AsyncIterator[aetcd.Lease]:
    """Grant a lease and refresh it every TTL/4 until the block exits.

    ``lost`` is set only when etcd *answers* that the lease is gone (TTL <= 0: it expired
    or etcd lost its data). While etcd is unreachable we keep retrying: the holder keeps
    serving what it knows (DESIGN.md §8), and etcd extends live leases when it comes back.
    One refresh waits at most max(TTL/3, 0.5 s) for its answer (an endpoint that does not
    answer is left for the next one, which is tried 0.1 s later), so a holder that must
    know how fresh its lease is (``clock``, see :class:`LeaseClock`; the master's
    self-fencing) learns it in time.
    """
    sent = time.monotonic()
    lease = await etcd.lease(ttl_s)
    if clock is not None:
        clock.renewed_at, clock.ttl_s = sent, float(lease.ttl or ttl_s)
    every, patience = max(ttl_s / 4, 0.1), max(ttl_s / 3, 0.5)

    stopping = False  # checked by the loop too: 3.11's wait_for can swallow a cancel that
    # lands as the refresh fails (the inner call finishing with an error at that moment)

    async def refresher() -> None:
        wait = every
        while not stopping:
            await asyncio.sleep(wait)
            client = etcd.client
            sent = time.monotonic()
            try:
                r = await asyncio.wait_for(client.refresh_lease(lease.id), patience)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - unreachable or too slow: a fresh channel (the next endpoint)
                await etcd.reconnect(client)
                wait = min(every, 0.1)  # retry soon: the lease runs out meanwhile
                continue
            wait = every
            if r.TTL <= 0:  # protobuf default 0: etcd no longer knows the lease
                lost.set()
                return
            if clock is not None:
                clock.renewed_at = max(clock.renewed_at, sent)

    task = asyncio.create_task(refresher())
    try:
        yield lease
    finally:
        stopping = True
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(etcd.client.revoke_lease(lease.id), 2.0)


def read_key_sync(endpoint: str | Sequence[str], key: str, timeout_s: float = 5.0,
                  auth: EtcdAuth = NO_AUTH) -> bytes | None:
    """Blocking read of one key (for CLI and client bootstrap) from the first of the etcd
    ``endpoint`` (one, or several comma-separated) that answers. Safe to call from inside a
    running asyncio loop (a proxy, a notebook): the read then runs on its own loop in a
    helper thread, since ``asyncio.run`` refuses to nest. Raises what the read raises;
    ``TimeoutError`` if the helper thread is not back within ``2 * n * timeout_s + 1`` s
    for ``n`` endpoints."""

    got = read_meta_sync(endpoint, key, timeout_s, auth)
    return None if got is None else got[0]


def read_meta_sync(endpoint: str | Sequence[str], key: str, timeout_s: float = 5.0,
                   auth: EtcdAuth = NO_AUTH) -> tuple[bytes, int] | None:
    """Like :func:`read_key_sync`, with the key's create revision: ``(value,
    create_revision)`` or None when absent (for the leader key: its address and term)."""

    async def go() -> tuple[bytes, int] | None:
        async with Etcd(endpoint, timeout_s, auth) as e:
            kv = await e.get_meta(key)
            return None if kv is None else (kv.value, kv.create_revision)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(go())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-etcd") as ex:
        return ex.submit(asyncio.run, go()).result(timeout=2 * len(parse_endpoints(endpoint)) * timeout_s + 1)
