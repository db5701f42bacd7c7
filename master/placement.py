"""Where new extents go: the order in which the master tries store nodes (pure, no I/O)."""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.master.members import Node


def placeable(nodes: dict[str, Node], now: float) -> list[Node]:
    """The nodes of the node table ``nodes`` new extents may go to at ``now`` (monotonic
    seconds): not draining and not suspect (suspects, which a client failed to reach, only
    when nothing else is left)."""
    live = [n for n in nodes.values() if not n.draining and n.suspect_until <= now]
    return live or [n for n in nodes.values() if not n.draining]


def room(node: Node, high_watermark: float) -> float:
    """The bytes ``node`` has below ``high_watermark`` (a fraction of its capacity); at or
    below 0 once it is at or past the mark. The weight new objects are placed by."""
    return high_watermark * node.alloc.capacity - node.alloc.used


def spread(nodes: Sequence[Node], rank: Callable[[Node], object], high_watermark: float,
           rng: random.Random) -> list[Node]:
    """``nodes`` in the order to place on: by ``rank(node)`` first (False before True, e.g.
    "not on the writer's host"), then at random weighted by room, the bytes a node has
    below ``high_watermark`` (a fraction of its capacity).

    Taking the first k nodes is weighted random sampling without replacement (Efraimidis
    and Spirakis, "Weighted random sampling with a reservoir", Information Processing
    Letters 97(5), 2006, in its exponential-clock form: node i draws Exp(room_i) and the
    smallest draws come first), so each node gets new objects in proportion to its room:
    an empty node fills faster than fuller ones without taking every put, and the shares
    even out as it fills. Nodes at or past ``high_watermark`` come last, emptiest first.
    Cost: one draw per node and a sort."""
    draw = rng.expovariate

    def key(n: Node) -> tuple:
        r = room(n, high_watermark)
        return (rank(n), r <= 0, draw(r) if r > 0 else n.alloc.used - n.alloc.capacity)

    return sorted(nodes, key=key)
