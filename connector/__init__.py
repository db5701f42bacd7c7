"""kvpool connector: the client library engines link (KVPoolClient, group blocks,
P/D hand-off) and the vLLM adapter (imported only when selected).

Installed as ``kvpool.connector`` (this folder; see docs/development.md).
"""
