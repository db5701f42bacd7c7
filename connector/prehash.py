"""Hashing a put's buffers while the put waits on an answer (the master's ``put_start``,
or the same-host node's claims): a buffer hashed then is afterwards copied or sent
without hashing (a shared-memory copy is one GIL-free ``memcpy``), so most of the hash
leaves the put's critical path (``benchmarks/RESULTS.md``, "the put's hash off its
critical path"). Buffers over :data:`PREHASH_MAX` are hashed beside their copy instead
(:meth:`ShmCopies.hash_aside <connector.shmcopy.ShmCopies.hash_aside>`): hashing them
here would outlast the wait."""
from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence

import xxhash

PREHASH_MAX = 4 << 20  # buffers up to this size (bytes) are hashed during the wait
PREHASH_POLL = 256 << 10  # ... looking for the answer after about this many bytes hashed


def prehash(bufs: Sequence, sums: MutableMapping[int, int] | list, indices: Iterable[int],
            answered: Callable[[], bool] | None = None) -> None:
    """``sums[j]`` = the xxh3_64 of ``bufs[j]`` for each ``j`` of ``indices`` (in order)
    whose buffer is a host ``memoryview`` of at most :data:`PREHASH_MAX` bytes. With
    ``answered``, stops once it returns True (asked after about :data:`PREHASH_POLL`
    bytes each time); buffers left unhashed are hashed by their copy."""
    since = 0  # bytes hashed since the last look at the answer
    for j in indices:
        b = bufs[j]
        if type(b) is memoryview and len(b) <= PREHASH_MAX:
            if answered is not None and since >= PREHASH_POLL:
                if answered():
                    return
                since = 0
            sums[j] = xxhash.xxh3_64_intdigest(b)
            since += len(b)
