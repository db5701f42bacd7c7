"""asyncio forms of the client calls a proxy or an async scheduler needs.

:class:`KVPoolClient` is blocking and thread-safe; :class:`AsyncKVPoolClient` runs each
call on a worker thread (``asyncio.to_thread``) so an event loop never waits on the
network itself. Constructing either inside a running loop is safe (the etcd bootstrap
read runs on its own loop in a helper thread). Every call keeps the client's own
deadlines (``rpc_timeout_s``, ``io_timeout_s``) and raises the same typed errors.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvpool.connector.client import KVPoolClient


class AsyncKVPoolClient:
    """Awaitable facade over one :class:`KVPoolClient` (same arguments); ``client`` is the
    blocking client underneath, for calls not wrapped here."""

    def __init__(self, master: str | None = None, **kwargs: Any) -> None:
        self.client = KVPoolClient(master, **kwargs)

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def put(self, key: str, data: Any, layout=None, replicas: int | None = None) -> bool:
        return await self._call(self.client.put, key, data, layout, replicas)

    async def get(self, key: str, layout=None) -> bytes | None:
        return await self._call(self.client.get, key, layout)

    async def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        return await self._call(self.client.exists_batch, keys)

    async def stats(self):
        return await self._call(self.client.stats)

    async def handoff_claim(self, request_id: str):
        return await self._call(self.client.handoff_claim, request_id)

    async def handoff_ack(self, request_id: str) -> None:
        await self._call(self.client.handoff_ack, request_id)

    async def handoff_release(self, request_id: str) -> None:
        await self._call(self.client.handoff_release, request_id)

    async def close(self) -> None:
        await self._call(self.client.close)

    async def __aenter__(self) -> "AsyncKVPoolClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
