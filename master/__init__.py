"""kvpool master: control plane (membership, placement, object index, leases, eviction,
hand-off records, leader election). ``state.py`` holds all decisions and does no I/O;
``server.py`` is the shell around it: one RPC thread polling the clients' and the store
nodes' sockets, and an etcd thread (``etcd_thread.py``) running the asyncio etcd client.

Installed as ``kvpool.master`` (this folder; see docs/development.md).
"""
