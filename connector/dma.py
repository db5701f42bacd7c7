"""CUDA tensors on the data plane (:class:`connector.dataclient.DataPlane`), moved by
:class:`CudaDirect`: one DMA copy
between a tensor and a same-host extent whose mapping is registered with CUDA, the checksum
hashed from the segment's host bytes after the DMA; staging through pinned host memory when
a mapping cannot be registered, when CUDA refuses a direct copy, or off the shared-memory
path."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from kvpool.connector.shmcopy import _gone
from kvpool.protocol.errors import InvalidRequest, KVPoolError
from kvpool.protocol.messages import ExtentRef

if TYPE_CHECKING:
    from kvpool.connector.segmap import SegmentMaps
    from kvpool.connector.shmcopy import ShmCopies

log = logging.getLogger("kvpool.data")


class CudaDirect:
    """The DMA path of a :class:`~connector.dataclient.DataPlane`: moves bytes between CUDA
    tensors and extents of the segments ``segmaps`` (a :class:`~connector.segmap.SegmentMaps`)
    maps, under its ``lock``. Owns ``pins`` (:class:`~connector.device_buffer.PinnedWindows`:
    which 64 MiB windows of each mapping are registered with CUDA, made on the first CUDA
    tensor; :meth:`unmapping` drops a mapping's windows before it goes). ``enabled``: direct
    transfers are on (else every CUDA tensor stages through pinned host memory). ``shm``
    (:class:`~connector.shmcopy.ShmCopies`) redoes a failed DMA staged."""

    def __init__(self, segmaps: SegmentMaps, shm: ShmCopies, enabled: bool = True) -> None:
        self.segmaps = segmaps
        self.shm = shm
        self.enabled = enabled
        self.pins = None  # connector.device_buffer.PinnedWindows, made on the first CUDA tensor

    def unmapping(self, incarnation: str, base: int | None) -> None:
        """``incarnation``'s mapping (first byte at ``base``) is about to go: its CUDA
        registration goes first. Caller holds ``segmaps.lock``."""
        if self.pins is not None:
            self.pins.drop(incarnation, base)

    def direct(self, ref: ExtentRef, buf) -> bool:
        """True when ``ref`` (a mapped extent) and the CUDA buffer ``buf`` can exchange bytes
        by DMA: direct transfers are on, the extent fits the mapping, and the mapping's
        windows that the extent spans are registered with CUDA (registered here on first
        use; a refusal makes this mapping stage from then on). True also takes a hold on the
        registration, which :meth:`dma` gives back."""
        if not self.enabled or not buf.flat.is_cuda:
            return False
        maps = self.segmaps
        seg = maps.segment(ref)
        if seg is None or ref.offset < 0 or ref.offset + ref.size > len(seg):
            return False  # the staged path reports the bad extent
        with maps.lock:
            if maps.maps.get(ref.incarnation) is not seg:
                return False  # unmapped meanwhile
            if self.pins is None:
                from kvpool.connector.device_buffer import PinnedWindows

                self.pins = PinnedWindows()
            if not self.pins.ready(ref.incarnation, ref.offset, ref.size):
                base = maps.extent_address(ref) - ref.offset
                if not self.pins.ensure(ref.incarnation, base, len(seg), ref.offset, ref.size):
                    return False
            self.pins.acquire(ref.incarnation)
            return True

    def dma(self, ops: Sequence, into_segment: bool) -> None:
        """Direct transfers between registered extents and CUDA tensors (ops :meth:`direct`
        accepted; their holds are given back here). Every copy is queued on its tensor's
        stream (the caller's, see :class:`~connector.device_buffer.DeviceBuffer`), split at
        registration windows; then the streams are synchronised and each extent is hashed
        on the host (on puts those that need a checksum; on gets every one, after the DMA
        so that a torn read of a reused extent is caught, see the comment there). Bytes
        are in place when this returns, or the op has its error."""
        if not ops:
            return
        import torch

        from kvpool.connector.device_buffer import window_pieces

        maps = self.segmaps
        held, streams, hashed = [], {}, []
        try:
            try:
                for op in ops:
                    if op.error is not None:
                        continue
                    r = op.ref
                    buf = op.data if into_segment else op.out
                    if not into_segment and len(buf) < r.size:
                        op.error = InvalidRequest(f"output tensor of {len(buf)} bytes is smaller than the "
                                                  f"{r.size}-byte extent")
                        continue
                    try:
                        src = maps.maps[r.incarnation][r.offset:r.offset + r.size]
                    except (KeyError, TypeError, ValueError):  # unmapped by another thread meanwhile
                        op.error = _gone(r)
                        continue
                    hashed.append((op, src))
                    if r.size:
                        host = torch.frombuffer(src, dtype=torch.uint8)
                        held.append(host)
                        streams[buf.stream] = buf
                        with buf.on_stream():
                            for lo, hi in window_pieces(r.offset, r.size):  # one copy per registration
                                if into_segment:
                                    host[lo:hi].copy_(buf.flat[lo:hi], non_blocking=True)
                                else:
                                    buf.flat[lo:hi].copy_(host[lo:hi], non_blocking=True)
                    if not into_segment:
                        buf.landed_direct()
                for buf in streams.values():
                    buf.sync()
            except RuntimeError as e:  # torch.AcceleratorError: CUDA refused a copy
                self._dma_failed(ops, into_segment, e, streams.values())
                return
            for op, src in hashed:
                if into_segment:
                    if op.checksum is None:
                        op.checksum = xxhash.xxh3_64_intdigest(src)
                elif op.digest:
                    # after the DMA ended: a byte it read from a reused (force-removed) extent
                    # is the new bytes or later ones here, so the torn read fails the check
                    # (hashing during the DMA could read the old bytes before the copy did)
                    op.digest = xxhash.xxh3_64_intdigest(src)
        finally:
            with maps.lock:  # after every copy ended, before the slices in ``held`` go
                for op in ops:
                    self.pins.release(op.ref.incarnation)

    def _dma_failed(self, ops: Sequence, into_segment: bool, e: Exception, used) -> None:
        """A direct copy failed: stage these mappings from now on and redo ``ops`` through
        pinned host memory, so the caller sees the bytes moved, only slower (or, when CUDA
        fails on that path too, a typed error per op)."""
        log.warning("kvpool: a CUDA copy to or from a registered store segment failed (%s); "
                    "staging CUDA tensors through pinned memory for that segment from now on", e)
        for buf in used:  # copies queued before the failure end before the redo
            with contextlib.suppress(RuntimeError):
                buf.sync()
        with self.segmaps.lock:
            for op in ops:
                self.pins.refuse(op.ref.incarnation)
        for op in ops:
            if op.error is not None or not _stage(op, into_segment):
                continue
            if into_segment:
                self.shm.write(op)
            else:
                self.shm.copy_out(op)



def _stage(op, into_segment: bool) -> bool:
    """Give ``op`` its CUDA tensor's pinned staging view in place of the DeviceBuffer (filled
    with the tensor's bytes for a write). False, with ``op.error`` set, when CUDA fails."""
    try:
        if into_segment:
            op.data = op.data.host(fill=True)
        else:
            op.out = op.out.host(fill=False, size=op.ref.size)
        return True
    except RuntimeError as e:
        op.error = KVPoolError(f"CUDA failed while staging the tensor through pinned host memory ({e}); "
                               "check the device (nvidia-smi) and the process's pinned memory")
        return False
