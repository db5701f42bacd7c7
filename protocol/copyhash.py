"""Copies that hash what they copy: the native ``_copyhash`` extension, or the same functions
in pure Python.

Every byte kvpool stores or delivers is copied once between a caller's buffer and a
segment and hashed (xxh3_64). The native module (protocol/native/copyhash.c, built by
``.ci/setup``) copies in 64 KiB pieces, hashing each piece as it landed while it is still in
cache, with the GIL released for the whole call, and takes a whole batch in one call; the
fallback below does the same in 256 KiB pieces with one interpreter call per piece, holding
the GIL for pieces under 1 MiB. Both give the digests of the xxhash package
(``xxh3_64_intdigest``) and copy the same bytes. ``KVPOOL_NATIVE=0`` in the environment
selects the fallback (tests run both).

Functions (buffers are anything exporting the buffer protocol; destinations writable;
ValueError when a destination is too small):

* ``copy_hash(dst, src, hash) -> int | None``: ``src`` into the start of ``dst``; with
  ``hash``, the xxh3_64 of the bytes as they landed in ``dst``.
* ``copy_hash_many(dsts, srcs, hash) -> list[int] | None``: ``copy_hash`` over pairs.
* ``hash_many(bufs) -> list[int]``: the xxh3_64 of each buffer.
* ``scatter_hash(src, dsts, hash) -> int | None``: ``src`` into ``dsts`` in order.
* ``gather_hash(dst, srcs, hash) -> int | None``: ``srcs`` back to back into ``dst``.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import xxhash

_PIECE = 256 << 10  # pure-Python copy+hash granularity: fits L2, so the hash reads hot bytes
_GIL_FREE = 1 << 20  # pure-Python copies at least this big go through numpy, which releases the GIL


def _mv(b) -> memoryview:
    m = b if type(b) is memoryview else memoryview(b)
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")


def _copy(dst: memoryview, src: memoryview) -> None:
    if len(src) >= _GIL_FREE:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


def py_copy_hash(dst, src, hash: bool) -> int | None:
    d, s = _mv(dst), _mv(src)
    n = len(s)
    if len(d) < n:
        raise ValueError(f"destination of {len(d)} bytes is smaller than the {n}-byte source")
    if not hash:
        _copy(d[:n], s)
        return None
    if n <= _PIECE:
        d[:n] = s
        return xxhash.xxh3_64_intdigest(d[:n])
    h = xxhash.xxh3_64()
    for a in range(0, n, _PIECE):
        b = min(a + _PIECE, n)
        d[a:b] = s[a:b]
        h.update(d[a:b])
    return h.intdigest()


def py_copy_hash_many(dsts: Sequence, srcs: Sequence, hash: bool) -> list[int] | None:
    if len(dsts) != len(srcs):
        raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources")
    out = [py_copy_hash(d, s, hash) for d, s in zip(dsts, srcs)]
    return out if hash else None


def py_hash_many(bufs: Sequence) -> list[int]:
    return [xxhash.xxh3_64_intdigest(b) for b in bufs]


def py_scatter_hash(src, dsts: Sequence, hash: bool) -> int | None:
    s = _mv(src)
    ds = [_mv(d) for d in dsts]
    if sum(len(d) for d in ds) < len(s):
        raise ValueError(f"pieces hold {sum(len(d) for d in ds)} bytes, fewer than the {len(s)}-byte source")
    h = xxhash.xxh3_64() if hash else None
    pos = 0
    for d in ds:
        if pos >= len(s):
            break
        k = min(len(d), len(s) - pos)
        for a in range(0, k, _PIECE):
            b = min(a + _PIECE, k)
            d[a:b] = s[pos + a:pos + b]
            if h is not None:
                h.update(d[a:b])
        pos += k
    return h.intdigest() if h is not None else None


def py_gather_hash(dst, srcs: Sequence, hash: bool) -> int | None:
    d = _mv(dst)
    ss = [_mv(s) for s in srcs]
    if len(d) < sum(len(s) for s in ss):
        raise ValueError(f"destination of {len(d)} bytes is smaller than the {sum(len(s) for s in ss)} bytes gathered")
    h = xxhash.xxh3_64() if hash else None
    pos = 0
    for s in ss:
        for a in range(0, len(s), _PIECE):
            b = min(a + _PIECE, len(s))
            d[pos + a:pos + b] = s[a:b]
            if h is not None:
                h.update(d[pos + a:pos + b])
        pos += len(s)
    return h.intdigest() if h is not None else None


def _load():
    if os.environ.get("KVPOOL_NATIVE", "1") == "0":
        return None
    try:
        from kvpool.protocol import _copyhash
    except ImportError:
        return None
    return _copyhash


_native = _load()
NATIVE = _native is not None  # the native module is in use
copy_hash = _native.copy_hash if NATIVE else py_copy_hash
copy_hash_many = _native.copy_hash_many if NATIVE else py_copy_hash_many
# into a store segment (puts): natively, copies of 256 KiB and up stream past the caches and
# hash the source as read; the pure-Python form is copy_hash's
store_hash = _native.store_hash if NATIVE else py_copy_hash
store_hash_many = _native.store_hash_many if NATIVE else py_copy_hash_many
hash_many = _native.hash_many if NATIVE else py_hash_many
scatter_hash = _native.scatter_hash if NATIVE else py_scatter_hash
gather_hash = _native.gather_hash if NATIVE else py_gather_hash
