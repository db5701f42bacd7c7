"""Group-block API: layout-tagged blocks of one cache group, keyed by chained block hash.

Keys follow DESIGN.md §4: ``<namespace>/<model>/<group_id>:<fingerprint>[/tp<rank>]/<hash>``
(the rank is omitted for REPLICATE layouts, so every rank reads one copy). Every put
carries the full :class:`~protocol.layout.LayoutSpec`; every get checks it and raises
:class:`~protocol.errors.LayoutMismatch` instead of reinterpreting bytes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.protocol.errors import KVPoolError
from kvpool.protocol.keys import group_key
from kvpool.protocol.layout import LayoutSpec


class BlockStore:
    """Blocks of one cache group of one model through a :class:`~connector.client.KVPoolClient`."""

    def __init__(self, client, *, model: str, group_id: int | str, layout: LayoutSpec,
                 namespace: str = "kv") -> None:
        self.client = client
        self.model = model
        self.group_id = group_id
        self.layout = layout
        self.namespace = namespace
        self._fp = layout.fingerprint()
        self._rank = None if layout.replicated else layout.tp_rank

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        return [group_key(self.namespace, self.model, self.group_id, self._fp, h, self._rank) for h in hashes]

    def lookup_prefix(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks stored (no lease, no side effects)."""
        if not hashes:
            return 0
        found = self.client.exists_batch(self.keys(hashes))
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def put_blocks(self, hashes: Sequence[bytes], blocks: Sequence[Any]) -> list[KVPoolError | None]:
        """Store one block (tensor/buffer of ``layout.nbytes``) per hash; existing blocks are
        no-ops. Per-block results."""
        return self.client.put_batch(self.keys(hashes), list(blocks), self.layout)

    def get_blocks(self, hashes: Sequence[bytes], outs: Sequence[Any]) -> list[int | None | KVPoolError]:
        """Load blocks into ``outs``; per block: bytes copied, None (miss) or the error
        (LayoutMismatch, ChecksumMismatch, LeaseExpired, NodeUnavailable)."""
        return self.client.get_into_batch(self.keys(hashes), list(outs), self.layout)
