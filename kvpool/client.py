"""``kvpool.client``: the client library's entry points (see :mod:`kvpool.connector.client`)."""

from kvpool.connector.aclient import AsyncKVPoolClient
from kvpool.connector.client import KVPoolClient, PutResult

__all__ = ["AsyncKVPoolClient", "KVPoolClient", "PutResult"]
