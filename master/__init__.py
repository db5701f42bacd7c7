"""kvpool master: control plane (membership, placement, object index, leases, eviction,
hand-off records, leader election). ``state.py`` holds all decisions and does no I/O;
``server.py`` is the thin asyncio shell around it.

Installed as ``kvpool.master`` (this folder; see docs/development.md).
"""
