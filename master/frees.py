"""Freeing a replica's storage in the master state (pure, no I/O): a memory extent goes
back to its node's allocator with a free notice, a disk file leaves its tier's count with
a delete notice. Notices are appended to the state's outbox (node id -> messages) for the
server to send."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.protocol.messages import ExtentRef, NodeDiskFree, NodeFree

if TYPE_CHECKING:
    from kvpool.master.members import Node


def free_extent(nodes: dict[str, Node], outbox: dict[str, list], r: ExtentRef) -> None:
    """Free replica ``r``: its memory extent (``size`` bytes at ``offset``), or its disk
    file when ``r.tier`` is set. Nothing for a node that left (its memory went with it) or,
    for a file, a node of another incarnation."""
    node = nodes.get(r.node_id)
    if node is None:
        return
    if r.tier:
        if node.disk is None or node.desc.incarnation != r.incarnation:
            return
        node.disk.used -= r.size
        free_disk_file(outbox, r.node_id, r.gen)
        return
    node.alloc.free(r.offset, r.size)
    outbox[r.node_id].append(NodeFree([(r.offset, r.gen)]))


def free_disk_file(outbox: dict[str, list], node_id: str, disk_id: int) -> None:
    """Queue a delete of file ``disk_id`` on ``node_id`` (consecutive ones in one notice)."""
    box = outbox[node_id]
    if box and type(box[-1]) is NodeDiskFree:
        box[-1].ids.append(disk_id)
    else:
        box.append(NodeDiskFree([disk_id]))
