"""A get's destination in pieces: one object read straight into several buffers, in order.

A KV block stored as one object holds every layer's page of that block back to back,
while the engine keeps one cache tensor per layer: the block's bytes belong in as many
separate pages. A :class:`ScatterOut` names those pages, so a same-host get copies the
object from the mapped segment into them directly (one copy, as a get into one buffer
is) instead of into a staging buffer that is then scattered (two copies). Like every
get, it hashes the bytes as they landed, read back from each page right after its copy
(still in cache), never the segment: a torn read fails the check.

Other paths (network, Unix socket, UCX) read into a private staging buffer
(:meth:`ScatterOut.host`) and the client copies it into the pieces once the object
passed its checks (:meth:`ScatterOut.finish`), as it does for a CUDA tensor
(:class:`connector.device_buffer.DeviceBuffer`). The staging buffer is the newest
attempt's: a direct copy voids it, and each staged attempt (another replica, a retry
under a fresh lease) replaces it, so what ``finish`` copies is always the bytes the
checks passed. A failed attempt may leave its bytes in the pieces; the get's result for
the object then says it is not there, and a later attempt that passes rewrites them.

``gate``: an optional object with ``lock`` (a ``threading.Lock``) and ``cancelled`` (a
bool), such as :class:`connector.vllm.layer_loads.LayerLoads`. Every write into the pieces
runs under ``gate.lock`` and only while ``gate.cancelled`` is false: whoever owns the
pages sets ``cancelled`` and takes the lock once, and from then on no byte is written
into them (a write already running, one object's copy, is waited out).
"""
from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvpool.protocol import copyhash
from kvpool.protocol.errors import LoadCancelled


class ScatterOut:
    """``pieces``: writable, contiguous byte memoryviews, filled in order with the object's
    bytes (``len()`` is their total, in bytes); ``gate``: see the module docstring."""

    __slots__ = ("pieces", "size", "gate", "_staged")

    def __init__(self, pieces: Sequence[memoryview], gate=None) -> None:
        self.pieces = list(pieces)
        self.size = sum(len(p) for p in self.pieces)
        self.gate = gate
        self._staged: memoryview | None = None

    def __len__(self) -> int:
        return self.size

    def copy_from(self, src: memoryview, digest: bool) -> int | None:
        """Copy ``src`` (``len(src)`` bytes, at most ``len(self)``) into the pieces, each
        hashed (xxh3_64, streaming) right after its copy landed; returns the digest of the
        bytes as they landed (None without ``digest``). Raises :class:`LoadCancelled`, with
        nothing written, once the gate is cancelled."""
        gate = self.gate
        if gate is None:
            return self._copy(src, digest)
        with gate.lock:
            if gate.cancelled:
                raise _cancelled()
            return self._copy(src, digest)

    def _copy(self, src: memoryview, digest: bool) -> int | None:
        self._staged = None  # the pages now hold this copy: an earlier, failed staged attempt is void
        if copyhash.NATIVE:  # one GIL-free call over every page
            return copyhash.scatter_hash(src, self.pieces, digest)
        h = xxhash.xxh3_64() if digest else None
        a, size = 0, len(src)
        for p in self.pieces:
            if a >= size:
                break
            n = len(p)
            if n > size - a:  # the object ends inside this page
                n = size - a
                p = p[:n]
            p[:] = src[a:a + n]
            if h is not None:
                h.update(p)
            a += n
        return h.intdigest() if h is not None else None

    def host(self, size: int) -> memoryview:
        """A private staging buffer of ``size`` bytes for a path that cannot write the
        pieces directly, replacing any earlier attempt's; :meth:`finish` copies it into
        them. Raises :class:`LoadCancelled` once the gate is cancelled (no read is worth
        making then)."""
        if self.gate is not None and self.gate.cancelled:
            raise _cancelled()
        self._staged = memoryview(bytearray(size))
        return self._staged

    def finish(self) -> None:
        """After a staged read passed its checks: copy the staged bytes into the pieces
        (through the gate: raises :class:`LoadCancelled`, with nothing written, once it is
        cancelled). No-op after a direct copy."""
        staged, self._staged = self._staged, None
        if staged is not None:
            self.copy_from(staged, False)


def _cancelled() -> LoadCancelled:
    return LoadCancelled("the load was cancelled (its step's deadline lapsed) before this block was written "
                         "into the cache; the block is reported failed and recomputed")
