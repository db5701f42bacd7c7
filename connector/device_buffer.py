"""CUDA tensors as kvpool buffers, and CUDA registration of mapped store-node segments.

A :class:`DeviceBuffer` is handed to the data plane in place of a host memoryview. For
an extent in a same-host node's segment that the client has mapped *and* registered with
CUDA (:class:`PinnedWindows`, ``cudaHostRegister``), the bytes move in **one DMA copy**
between the segment and the tensor, and the checksum is computed on the host from the
segment bytes (a read pass, overlapped with the DMA on gets). Every other path (network,
Unix socket, a mapping CUDA refused to register) stages through one pinned host buffer
from torch's caching host allocator: device → pinned buffer (DMA), then the host path;
the reverse on gets, copied back by :meth:`DeviceBuffer.finish`.

Pinned and registered host↔device copies run several times faster than pageable ones and
than a host ``memcpy`` (``benchmarks/gpu_paths.py``; figures in benchmarks/RESULTS.md,
"GPU paths"), so a host-memory copy is the cost worth removing. Registering pins the
pages and costs time in proportion to the window, hence windows registered once on first
use. Each window is its own registration, and one copy must stay inside one: a copy
across a window edge fails with ``cudaErrorInvalidValue``, so copies are split at window
edges (:func:`window_pieces`). Any CUDA error in a direct transfer sends that mapping back
to staging for good and redoes the transfer staged (see ``CudaDirect._dma_failed`` in
connector/dma.py).
"""
from __future__ import annotations

import threading

import torch

PIN_WINDOW = 64 << 20  # bytes: the unit of a segment mapping registered with CUDA on first use
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context (CUDA runtime API)


class DeviceBuffer:
    """The bytes of a contiguous CUDA tensor: ``flat`` is its ``torch.uint8`` view of shape
    ``(nbytes,)``; ``len()`` is ``nbytes``. Thread-safe (replicas of one put are written
    from several threads).

    ``stream`` is the caller's current CUDA stream when the buffer was made: every copy of
    this tensor, whichever client thread issues it, runs on that stream (:meth:`on_stream`),
    so it is ordered after the caller's kernels that produce the tensor (puts) or still read
    it (gets), as a plain ``copy_`` in the caller's thread would be. ``sync`` waits for it."""

    __slots__ = ("flat", "stream", "_host", "_filled", "_dirty", "_lock")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.flat = tensor.reshape(-1).view(torch.uint8)
        self.stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
        self._host: torch.Tensor | None = None
        self._filled = False  # the staging buffer holds the tensor's bytes (puts)
        self._dirty = 0  # bytes of a staged read waiting in the staging buffer (gets): copied back by finish
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.flat.numel()

    def on_stream(self):
        """A context in which torch copies run on :attr:`stream` (no-op for host tensors)."""
        return torch.cuda.stream(self.stream)

    def sync(self) -> None:
        """Wait until every copy queued on :attr:`stream` is done (raises RuntimeError for a
        CUDA error)."""
        if self.stream is not None:
            self.stream.synchronize()

    def host(self, fill: bool, size: int | None = None) -> memoryview:
        """The pinned staging buffer as a writable byte memoryview of ``len(self)`` bytes.
        ``fill=True`` (a put): it holds the tensor's bytes (copied once). ``fill=False`` (a
        get of ``size`` bytes): the first ``size`` bytes read into it reach the tensor at
        :meth:`finish`; the tensor's bytes past them are left alone. Raises RuntimeError
        when CUDA fails (pinned allocation, the copy)."""
        with self._lock:
            if self._host is None:
                self._host = torch.empty(len(self), dtype=torch.uint8, pin_memory=self.flat.is_cuda)
            if fill and not self._filled:
                with self.on_stream():
                    self._host.copy_(self.flat)  # synchronous: the bytes are on the host after it
                self._filled = True
            if not fill:
                self._dirty = len(self) if size is None else size
            return memoryview(self._host.numpy())

    def landed_direct(self) -> None:
        """A read DMA'd the bytes straight into the tensor: nothing to copy back."""
        self._dirty = 0

    def finish(self) -> None:
        """After a successful get: copy a staged read into the tensor (synchronous)."""
        n = self._dirty
        if n:
            with self.on_stream():
                self.flat[:n].copy_(self._host[:n])
            self._dirty = 0


class PinnedWindows:
    """Which :data:`PIN_WINDOW`-byte windows of each mapped segment (by incarnation) are
    registered with CUDA. ``ensure`` registers the windows an extent spans; a refusal
    (``cudaHostRegister`` error) disables the direct path for that mapping, which then
    stages. A direct transfer holds the mapping (``acquire`` … ``release``) while its
    copies may run; ``drop`` unregisters before the mapping is closed, or, while transfers
    hold it, when the last one is released (unregistering memory an async copy still uses
    is undefined in CUDA). Every method but ``ready`` runs under the caller's lock."""

    def __init__(self) -> None:
        self._done: dict[str, set[int]] = {}
        self._refused: set[str] = set()
        self._busy: dict[str, int] = {}  # direct transfers in flight per mapping
        self._late: dict[str, list[tuple[int, set[int]]]] = {}  # unregistrations waiting for them

    def ready(self, incarnation: str, offset: int, size: int) -> bool:
        done = self._done.get(incarnation)
        if done is None or incarnation in self._refused:
            return False
        return all(w in done for w in _windows(offset, size))

    def refuse(self, incarnation: str) -> None:
        """Stage this mapping's transfers from now on (a direct copy failed)."""
        self._refused.add(incarnation)

    def ensure(self, incarnation: str, base: int, capacity: int, offset: int, size: int) -> bool:
        """Register the windows of ``[offset, offset + size)`` in the mapping at address
        ``base`` (``capacity`` bytes). Returns False when CUDA refused (never retried)."""
        if incarnation in self._refused:
            return False
        done = self._done.setdefault(incarnation, set())
        cudart = torch.cuda.cudart()
        for w in _windows(offset, size):
            if w in done:
                continue
            start = w * PIN_WINDOW
            if _code(cudart.cudaHostRegister(base + start, min(PIN_WINDOW, capacity - start),
                                             _REGISTER_PORTABLE)) != 0:
                self._refused.add(incarnation)
                return False
            done.add(w)
        return True

    def acquire(self, incarnation: str) -> None:
        self._busy[incarnation] = self._busy.get(incarnation, 0) + 1

    def release(self, incarnation: str) -> None:
        left = self._busy[incarnation] - 1
        if left:
            self._busy[incarnation] = left
            return
        del self._busy[incarnation]
        for base, done in self._late.pop(incarnation, []):
            _unregister(base, done)

    def drop(self, incarnation: str, base: int | None) -> None:
        done = self._done.pop(incarnation, set())
        self._refused.discard(incarnation)
        if base is None or not done:
            return
        if self._busy.get(incarnation):
            self._late.setdefault(incarnation, []).append((base, done))
        else:
            _unregister(base, done)


def _unregister(base: int, windows: set[int]) -> None:
    cudart = torch.cuda.cudart()
    for w in windows:
        cudart.cudaHostUnregister(base + w * PIN_WINDOW)


def window_pieces(offset: int, size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` byte ranges, relative to the extent ``[offset, offset + size)``, that
    split it where it crosses a :data:`PIN_WINDOW` boundary. Each window is a separate
    CUDA registration, and one copy must stay inside one registration."""
    cuts = list(range((offset // PIN_WINDOW + 1) * PIN_WINDOW, offset + size, PIN_WINDOW))
    edges = [offset, *cuts, offset + size]
    return [(a - offset, b - offset) for a, b in zip(edges, edges[1:])]


def _windows(offset: int, size: int) -> range:
    return range(offset // PIN_WINDOW, (offset + max(size, 1) - 1) // PIN_WINDOW + 1)


def _code(rc) -> int:
    """A cudaError from torch's cudart binding as an int (0: cudaSuccess)."""
    return int(getattr(rc, "value", rc))
