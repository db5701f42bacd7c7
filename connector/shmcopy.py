"""Shared-memory copies of the data plane (:class:`connector.dataclient.DataPlane`),
made by :class:`ShmCopies`: the copies between caller buffers and a mapped extent (hashed
chunk by chunk as they go, or beside the copy on a helper thread; bounced where 4K
aliasing slows ``memcpy``), and their helpers: a GIL-free ``memcpy`` for big copies, buffer addresses and alignment, and
prefaulting a new mapping's page tables beside the first transfers."""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvpool.protocol import copyhash
from kvpool.protocol.errors import InvalidRequest, KVPoolError, LoadCancelled, NodeUnavailable
from kvpool.protocol.messages import ExtentRef

if TYPE_CHECKING:
    from kvpool.connector.ops import ReadOp, WriteOp

_CHUNK = 256 << 10      # shm copy+hash granularity: fits L2, so the hash reads hot bytes
_PAGE = 4096
_ALIAS = 64             # destinations 1..63 bytes ahead of the source, modulo a page, ...
_BOUNCE_MAX = 512 << 10  # ... and copies smaller than this take glibc's slow rep-movsb path
HASH_ASIDE_MIN = 4 << 20  # shm put copies at least this big are hashed by a helper thread beside them
_GIL_FREE = 1 << 20  # copies at least this big run without the GIL (numpy)


def _memcpy(dst: memoryview, src) -> None:
    """``dst[:] = src``; large copies through numpy, which releases the GIL, so the
    per-node threads of a batch (and both replicas of a put) copy in parallel."""
    if len(dst) >= _GIL_FREE:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


def _misaligned(mv: memoryview) -> bool:
    """True when ``mv`` does not start on a cache line (numpy arrays and bytearrays start
    16 bytes into a page): the kernel's copy into such a buffer is markedly slower
    (benchmarks/RESULTS.md, "Copies per byte")."""
    try:
        return _address(mv) % 64 != 0
    except (TypeError, ValueError):
        return False


def _address(mv: memoryview) -> int:
    """Start address of a writable, contiguous buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


_MADV_POPULATE_READ = 22  # Linux >= 5.14, <linux/mman.h>: prefault page tables, reading
_MADV_POPULATE_WRITE = 23  # ... writable, without writing a byte
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _prefault_aside(seg: memoryview, nbytes: int) -> None:
    """Prefault a new mapping's page tables on a daemon thread (``madvise`` with
    ``MADV_POPULATE_WRITE``), so that reads and writes on it meanwhile fault only the pages
    they touch instead of waiting for the whole segment, and later ones fault none. Writable:
    a page mapped by a read fault is mapped read-only, so a put's first write to each of its
    pages takes a second fault (thousands for a 16 MiB object); populating for writing makes
    the page tables writable without touching the bytes. A kernel without the flag answers
    EINVAL: then ``MADV_POPULATE_READ`` (older kernels: pages fault on first touch)."""

    def run() -> None:
        try:
            view = seg[:nbytes]
            buf = ctypes.c_char.from_buffer(view)
        except (BufferError, ValueError, TypeError):
            return  # unmapped meanwhile
        try:  # the GIL is released in these calls
            if _libc.madvise(ctypes.addressof(buf), nbytes, _MADV_POPULATE_WRITE) != 0:
                _libc.madvise(ctypes.addressof(buf), nbytes, _MADV_POPULATE_READ)
        finally:
            del buf
            view.release()

    threading.Thread(target=run, name="kvpool-prefault", daemon=True).start()


def _gone(r: ExtentRef) -> NodeUnavailable:
    return NodeUnavailable(f"store node {r.node_id}'s segment went away during a transfer (the node died or "
                           "restarted); retry", node=r.node_id)



class ShmCopies:
    """The shared-memory copies of a :class:`~connector.dataclient.DataPlane`, between caller
    buffers and extents of mapped segments. Given ``segment(ref)`` (the mapped segment of
    ``ref``'s node as a memoryview, None when it cannot be mapped) and
    ``extent_address(ref)`` (the address of ``ref``'s first byte in that mapping): both of
    :class:`~connector.segmap.SegmentMaps`. Owns a per-thread 256 KiB bounce buffer (4K aliasing, see :meth:`copy_out`) and
    the one helper thread that hashes a put's buffer beside its copy (:meth:`hash_aside`,
    also used by network writes); :meth:`close` shuts that thread down."""

    def __init__(self, segment: Callable[[ExtentRef], memoryview | None],
                 extent_address: Callable[[ExtentRef], int]) -> None:
        self._segment = segment
        self._extent_address = extent_address
        self._local = threading.local()  # .bounce: (buffer, its address), made on first use
        self._hasher: ThreadPoolExecutor | None = None  # see hash_aside
        self._hasher_free = threading.Lock()

    def close(self) -> None:
        """Shut the helper thread down (puts hash inline from then on)."""
        if self._hasher is not None:
            self._hasher.shutdown(wait=False)

    def write(self, op: WriteOp) -> None:
        """Copy ``op.data`` (a memoryview) into its mapped extent, hashing it on the way
        when no checksum is set yet; NodeUnavailable on the op when the mapping is gone."""
        r = op.ref
        seg = self._segment(r)
        if seg is None:
            op.error = _gone(r)
            return
        digest = self.copy_in(r, seg[r.offset:r.offset + r.size], op.data, op.checksum is None)
        if op.checksum is None:
            op.checksum = digest

    def write_many(self, ops: list[WriteOp], segs: list[memoryview | None] | None = None) -> None:
        """:meth:`write` for many ops (host buffers, extents checked to fit), in one
        native call: every object copied and hashed (checksums set where none was).
        ``segs``: each op's mapped segment, when the caller looked them up already."""
        dsts, live = [], []
        segment = self._segment
        for i, op in enumerate(ops):
            r = op.ref
            if segs is not None:
                try:
                    dsts.append(segs[i][r.offset:r.offset + r.size])
                    live.append(op)
                    continue
                except ValueError:  # released: the node's mapping went meanwhile (looked up again)
                    pass
            seg = segment(r)
            if seg is None:
                op.error = _gone(r)
                continue
            dsts.append(seg[r.offset:r.offset + r.size])
            live.append(op)
        if not live:
            return
        sums = copyhash.store_hash_many(dsts, [op.data for op in live], any(op.checksum is None for op in live))
        if sums is not None:
            for op, h in zip(live, sums):
                if op.checksum is None:
                    op.checksum = h

    def copy_in(self, ref: ExtentRef, dst: memoryview, data: memoryview, digest: bool) -> int | None:
        """Shared-memory write: caller buffer → extent, one copy (bounced in the 4K-aliasing
        case described in :meth:`copy_out`). With ``digest``, returns the xxh3_64 of the
        bytes, hashed per 256 KiB chunk right after it is copied (source still in L2)."""
        if copyhash.NATIVE:  # one GIL-free call: large copies streamed past the caches, aliasing bounced in C
            return copyhash.store_hash(dst, data, digest)
        size = len(dst)
        if digest and size >= HASH_ASIDE_MIN:
            fut = self.hash_aside(data)
            if fut is not None:
                _memcpy(dst, data)
                return fut.result()
        bounce = None
        if 2048 < size < _BOUNCE_MAX:
            try:
                bounce = self._bounce_for(_address(data), self._extent_address(ref))
            except (TypeError, ValueError):  # a read-only buffer (bytes): copy directly
                bounce = None
        if bounce is None and (not digest or size <= _CHUNK):
            _memcpy(dst, data)
            return xxhash.xxh3_64_intdigest(data) if digest else None
        h = xxhash.xxh3_64() if digest else None
        step = _CHUNK if bounce is None else len(bounce)
        for a in range(0, size, step):
            b = min(a + step, size)
            if bounce is None:
                dst[a:b] = data[a:b]
            else:
                bounce[:b - a] = data[a:b]
                dst[a:b] = bounce[:b - a]
            if h is not None:
                h.update(data[a:b])
        return h.intdigest() if h is not None else None

    def hash_aside(self, data) -> Future | None:
        """Start the xxh3_64 of a put's buffer ``data`` on the one helper thread,
        so that it runs beside the caller's GIL-free ``memcpy`` of the same bytes into the
        segment; None when the helper is busy with another thread's copy or shut down
        (``close()``, interpreter exit): that copy hashes as it goes instead. Puts only: the
        caller owns the buffer, so its bytes are the stored ones. A get must hash what
        landed in its output, not the segment (see the module docstring).

        Worth it only for large puts: at :data:`HASH_ASIDE_MIN` and below the put hashes
        while ``put_start`` is in flight instead, and the hand-off to a thread costs more
        than it saves (benchmarks/RESULTS.md has the measurements)."""
        if not self._hasher_free.acquire(blocking=False):
            return None
        try:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kvpool-hash")
            fut = self._hasher.submit(_hash_one, data)
        except RuntimeError:  # shut down (close(), or the interpreter is exiting): hash inline
            self._hasher_free.release()
            return None
        except BaseException:
            self._hasher_free.release()
            raise
        fut.add_done_callback(lambda _: self._hasher_free.release())
        return fut

    def _bounce_for(self, src: int, dst: int) -> memoryview | None:
        """A bounce buffer half a page from ``src`` when ``dst`` sits 1–63 bytes past
        ``src`` modulo a page (the slow case), else None."""
        if not 0 < (dst - src) % _PAGE < _ALIAS:
            return None
        b = getattr(self._local, "bounce", None)
        if b is None:
            view = memoryview(bytearray(_CHUNK + 2 * _PAGE))
            b = self._local.bounce = (view, _address(view))
        k = (src + _PAGE // 2 - b[1]) % _PAGE
        return b[0][k:k + _CHUNK]

    def copy_out(self, op: ReadOp) -> None:
        """Shared-memory read: segment → ``op.out``, one copy. With a digest wanted, the copy
        goes in 256 KiB chunks, each hashed right after it lands (still in L2), which is
        faster than copy-then-hash (benchmarks/RESULTS.md, "Measurements behind choices in
        the code").

        One exception, seen with glibc's ``rep movsb`` copies: when the destination lies 1–63
        bytes past the source modulo 4 KiB (a numpy array or bytearray sits at page offset
        16, extents are page-aligned), ``memcpy`` of 4–512 KiB runs many times slower (4K
        aliasing in ``rep movsb``). Such copies go through a small per-thread bounce buffer
        placed half a page from both, which stays in L2: two fast copies instead of one
        slow one. Bigger copies do not suffer it and stay one ``memcpy``."""
        src = self._extent_view(op)
        if src is None:
            return
        r = op.ref
        if len(op.out) < r.size:
            op.error = InvalidRequest(f"output buffer of {len(op.out)} bytes is smaller than the "
                                      f"{r.size}-byte extent")
            return
        out, size = op.out, r.size
        if copyhash.NATIVE:  # one GIL-free call, hashing what landed in ``out`` (see above)
            got = copyhash.copy_hash(out[:size], src, bool(op.digest))
            if op.digest:
                op.digest = got
            return
        bounce = None
        if size > 2048:
            try:
                bounce = self._bounce_for(self._extent_address(r), _address(out))
            except (TypeError, ValueError):
                bounce = None
        if bounce is None and size <= _CHUNK:
            _memcpy(out[:size], src)  # one chunk, no 4K aliasing: copy, then hash the bytes still in L2
            if op.digest:
                op.digest = xxhash.xxh3_64_intdigest(out[:size])
            return
        if size >= _BOUNCE_MAX and bounce is not None:
            bounce = None  # big copies do not suffer the aliasing: one memcpy (+ one hash pass)
            if op.digest:
                _memcpy(out[:size], src)
                op.digest = xxhash.xxh3_64_intdigest(out[:size])
                return
        if not op.digest and bounce is None:
            _memcpy(out[:size], src)
            return
        h = xxhash.xxh3_64() if op.digest else None
        step = _CHUNK if bounce is None else len(bounce)
        for a in range(0, size, step):
            b = min(a + step, size)
            if bounce is not None and b - a > 2048:
                bounce[:b - a] = src[a:b]
                out[a:b] = bounce[:b - a]
            else:
                out[a:b] = src[a:b]
            if h is not None:
                h.update(out[a:b])
        if h is not None:
            op.digest = h.intdigest()

    def copy_scatter(self, op: ReadOp) -> None:
        """Shared-memory read into a :class:`~connector.scatter_out.ScatterOut`: segment →
        its pieces, one copy each, each hashed right after it landed (when a digest is
        wanted)."""
        src = self._extent_view(op)
        if src is None:
            return
        if len(op.out) < op.ref.size:
            op.error = InvalidRequest(f"output pages hold {len(op.out)} bytes, fewer than the "
                                      f"{op.ref.size}-byte extent")
            return
        try:
            op.digest = op.out.copy_from(src, bool(op.digest))
        except LoadCancelled as e:
            op.error = e

    def _extent_view(self, op: ReadOp) -> memoryview | None:
        """The mapped bytes of ``op.ref``'s extent; None, with ``op.error`` set, when the
        node's mapping is gone or the extent does not fit it."""
        seg = self._segment(op.ref)
        r = op.ref
        if seg is None:
            op.error = _gone(r)
            return None
        if r.offset < 0 or r.offset + r.size > len(seg):
            op.error = KVPoolError(f"extent [{r.offset}, +{r.size}) does not fit the mapped segment")
            return None
        return seg[r.offset:r.offset + r.size]


def _hash_one(data) -> int:
    """The xxh3_64 of ``data``, without the GIL when the native module is built."""
    return copyhash.hash_many([data])[0]
