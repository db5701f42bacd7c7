"""A store node's watch over its own etcd registration, and what readiness makes of it.

Keeping the lease alive is not enough: the node's key can vanish under a live lease (an
operator's ``etcdctl del``, a restore of etcd from a backup taken before the node joined),
and a node nobody can see is dead to the masters, while it would go on serving and
reporting itself ready. :meth:`Registration.watch` reads the key every ``every_s``
seconds (``min(1 s, node_ttl/3)``, as the term is followed): when it is gone, the node
publishes it again under its lease (a master that dropped the node meanwhile re-indexes
its committed extents, as after an etcd outage); when another process holds the name
(the key vanished and a second node took it), the node says so, counts as unregistered,
and takes the name back if that process's lease lapses.

Each answer from etcd marks it reachable (:attr:`Registration.seen_at`): readiness
(``/readyz``) requires the key published by this node *and* an answer from etcd within
:meth:`Registration.stale_after` seconds, so a node stops being ready during an etcd
outage (it goes on serving what it holds: DESIGN.md §8) and is ready again once etcd
answers.
"""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from kvpool.protocol import messages as M
from kvpool.protocol.etcd import Etcd

log = logging.getLogger("kvpool.storenode")


class Registration:
    """The state of one node's registration: ``published`` (its key holds its descriptor),
    ``seen_at`` (monotonic time of etcd's last answer), ``again`` (how often the key was
    published again after vanishing)."""

    def __init__(self, node_id: str, every_s: float) -> None:
        self.node_id = node_id
        self.every_s = every_s
        self.published = False
        self.seen_at = 0.0
        self.again = 0

    def stale_after(self) -> float:
        """Seconds without an answer from etcd after which the node is not ready."""
        return max(3 * self.every_s, 2.0)

    def etcd_ok(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) - self.seen_at <= self.stale_after()

    async def watch(self, etcd: Etcd, key: str, desc: M.NodeDesc, lease) -> None:
        """Until cancelled: every ``every_s`` seconds read ``key``; publish ``desc`` there
        again under ``lease`` when it is gone. Never raises (etcd errors are waited out)."""
        val = msgspec.msgpack.encode(desc)
        self.published, self.seen_at = True, time.monotonic()
        told_other = False
        while True:
            await asyncio.sleep(self.every_s)
            try:
                kv = await asyncio.wait_for(etcd.get_meta(key), max(2 * self.every_s, 1.0))
                self.seen_at = time.monotonic()
                if kv is not None and kv.value == val:
                    self.published, told_other = True, False
                    continue
                if kv is None:
                    self.published = False
                    if await asyncio.wait_for(etcd.create_if_absent(key, val, lease), max(2 * self.every_s, 1.0)):
                        self.seen_at = time.monotonic()
                        self.published, told_other = True, False
                        self.again += 1
                        log.warning("storenode %s: its etcd registration %s had vanished (deleted, or etcd lost "
                                    "it); registered again with the same segment", self.node_id, key)
                    continue
                self.published = False
                if not told_other:
                    told_other = True
                    log.error("storenode %s: another process registered under this node's name after its key "
                              "vanished; this node is not in the cluster until that registration lapses",
                              self.node_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - etcd unreachable, slow or refusing: readiness tells
                log.debug("storenode %s: reading its registration failed: %s: %s", self.node_id, type(e).__name__, e)
