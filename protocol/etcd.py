"""Thin asyncio wrapper over the ``aetcd`` client (etcd v3 API).

Adds what aetcd leaves to callers: endpoint parsing, the ``/kvpool/<cluster>/`` key
layout (DESIGN.md §3), keeping a lease alive (refresh every TTL/3, as etcd's own Go
client does), create-if-absent transactions for leader election, and clear errors when
etcd is unreachable (:class:`~protocol.errors.EtcdUnavailable`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator

import aetcd

from protocol.errors import ConfigError, EtcdUnavailable


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``http://127.0.0.1:2379`` or ``127.0.0.1:2379`` → (host, port)."""
    rest = endpoint.split("://", 1)[-1].rstrip("/")
    if ":" not in rest:
        raise ConfigError(f"etcd endpoint {endpoint!r} needs host:port, e.g. http://127.0.0.1:2379", key="etcd")
    host, port = rest.rsplit(":", 1)
    return host, int(port)


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


class Etcd:
    """An open etcd connection. Use ``async with Etcd(endpoint) as e``."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint)
        self.timeout_s = timeout_s
        self.client: aetcd.Client | None = None

    async def __aenter__(self) -> "Etcd":
        self.client = aetcd.Client(host=self.host, port=self.port, timeout=self.timeout_s)
        try:
            await self.client.connect()
            await self.client.get(b"/kvpool/")
        except Exception as e:  # aetcd raises several connection error types
            await self.client.close()
            raise EtcdUnavailable(f"cannot reach etcd at {self.endpoint} ({type(e).__name__}); start one "
                                  "(`kvpool up` starts a local etcd) or pass --etcd", endpoint=self.endpoint) from None
        return self

    async def __aexit__(self, *exc) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()

    async def reconnect(self) -> None:
        """Replace the gRPC channel: after an etcd restart a fresh channel connects at once,
        where the old one may sit in exponential reconnect backoff longer than a lease TTL."""
        old = self.client
        self.client = aetcd.Client(host=self.host, port=self.port, timeout=self.timeout_s)
        with contextlib.suppress(Exception):
            await self.client.connect()
        if old is not None:
            with contextlib.suppress(Exception):
                await old.close()

    async def get(self, key: str) -> bytes | None:
        r = await self.client.get(key.encode())
        return None if r is None else r.value

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        r = await self.client.get_prefix(prefix.encode())
        return {kv.key.decode(): kv.value for kv in r}

    async def put(self, key: str, value: bytes, lease: aetcd.Lease | None = None) -> None:
        await self.client.put(key.encode(), value, lease=lease)

    async def delete(self, key: str) -> None:
        await self.client.delete(key.encode())

    async def lease(self, ttl_s: float) -> aetcd.Lease:
        return await self.client.lease(max(1, int(round(ttl_s))))

    async def create_if_absent(self, key: str, value: bytes, lease: aetcd.Lease) -> bool:
        """Atomically put ``key`` only if it does not exist (election). True on success."""
        c = self.client
        ok, _ = await c.transaction(compare=[c.transactions.version(key.encode()) == 0],
                                    success=[c.transactions.put(key.encode(), value, lease=lease)],
                                    failure=[])
        return bool(ok)


@contextlib.asynccontextmanager
async def kept_alive(etcd: Etcd, ttl_s: float, lost: asyncio.Event) -> AsyncIterator[aetcd.Lease]:
    """Grant a lease and refresh it every TTL/3 until the block exits.

    ``lost`` is set only when etcd *answers* that the lease is gone (TTL <= 0: it expired
    or etcd lost its data). While etcd is unreachable we keep retrying: the holder keeps
    serving what it knows (DESIGN.md §8), and etcd extends live leases when it comes back.
    """
    lease = await etcd.lease(ttl_s)

    async def refresher() -> None:
        while True:
            await asyncio.sleep(max(ttl_s / 3, 0.2))
            try:
                r = await etcd.client.refresh_lease(lease.id)
            except asyncio.CancelledError:
                raise
            except Exception:
                await etcd.reconnect()  # unreachable: retry on a fresh channel
                continue
            if r.TTL <= 0:  # protobuf default 0: etcd no longer knows the lease
                lost.set()
                return

    task = asyncio.create_task(refresher())
    try:
        yield lease
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(etcd.client.revoke_lease(lease.id), 2.0)


def read_key_sync(endpoint: str, key: str, timeout_s: float = 5.0) -> bytes | None:
    """Blocking read of one key (for CLI and client bootstrap). Safe to call from inside a
    running asyncio loop (a proxy, a notebook): the read then runs on its own loop in a
    helper thread, since ``asyncio.run`` refuses to nest. Raises what the read raises;
    ``TimeoutError`` if the helper thread is not back within ``2 * timeout_s + 1`` s."""

    async def go() -> bytes | None:
        async with Etcd(endpoint, timeout_s) as e:
            return await e.get(key)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(go())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-etcd") as ex:
        return ex.submit(asyncio.run, go()).result(timeout=2 * timeout_s + 1)
