"""A segment in torch device memory (``--device cuda:N``), served through host staging.

Device memory cannot be handed to other processes as a memfd, so a device segment has no
``fd`` and no host ``view``: same-host clients are refused the ``map`` op and use the
node's Unix socket, remote clients its TCP address. Every byte therefore crosses the
node's staging buffer (pinned host memory when the device is CUDA, so the device copy
is a DMA): a read copies device → staging → kernel socket buffer, a write kernel socket
buffer → staging → device, in :data:`STAGE_BYTES` pieces. That is one more copy than a
CPU segment's path; GPUDirect-style paths (device memory registered with the NIC, CUDA
IPC for same-host readers) are what Mooncake's RDMA transport adds and are not built.

The class works on any torch device; the tests run it on ``cpu`` (same code, pageable
staging) and on ``cuda:0`` where a GPU is present.
"""
from __future__ import annotations

import queue
import re
import threading

from kvpool.protocol.config import DEVICE_RE
from kvpool.protocol.errors import ConfigError
from kvpool.storenode.segment import Segment

STAGE_BYTES = 4 << 20  # one staging buffer (bytes): the largest piece of one device copy
STAGE_BUFFERS = 4  # staging buffers per segment, shared by all connections (pinned memory is scarce)


class DeviceSegment:
    """``capacity`` bytes of ``device`` memory (a ``torch.uint8`` tensor of shape
    ``(capacity,)``). Raises ConfigError when the device does not exist, has less than
    ``capacity`` bytes free or refuses the allocation (see :func:`check_device`).

    Transfers stage through at most :data:`STAGE_BUFFERS` buffers of :data:`STAGE_BYTES`
    (pinned host memory for CUDA), made on first use and shared by every connection: a
    transfer holds one buffer per piece, so more concurrent transfers than buffers wait
    their turn instead of pinning 4 MiB per connection."""

    fd = None  # not shareable: clients read and write through the streams
    view = None

    def __init__(self, capacity: int, device: str) -> None:
        import torch

        self.device = torch.device(check_device(device, capacity))
        self.capacity = capacity
        try:
            self.tensor = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        except RuntimeError as e:  # torch.OutOfMemoryError is one: memory taken since the check
            raise ConfigError(f"--device {device}: cannot allocate a {capacity}-byte segment there ({e}); "
                              "lower --memory or free the device", key="device") from None
        self._free: queue.LifoQueue = queue.LifoQueue()
        self._made = 0
        self._lock = threading.Lock()
        self.renew()

    renew = Segment.renew  # the same generation identity as a host segment

    def _take(self):
        """A staging buffer (uint8 tensor of STAGE_BYTES, its memoryview); give it back with
        ``self._free.put``. Waits when all :data:`STAGE_BUFFERS` are in use."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            make = self._made < STAGE_BUFFERS
            self._made += make
        if not make:
            return self._free.get()
        import torch

        t = torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return t, memoryview(t.numpy())

    def send(self, sock, offset: int, size: int) -> None:
        """Send bytes ``[offset, offset + size)`` to ``sock``: device → staging → socket."""
        for a in range(offset, offset + size, STAGE_BYTES):
            n = min(STAGE_BYTES, offset + size - a)
            st = self._take()
            try:
                st[0][:n].copy_(self.tensor[a:a + n])  # synchronous: the bytes are in host memory after it
                sock.sendall(st[1][:n])
            finally:
                self._free.put(st)

    def recv(self, reader, offset: int, size: int) -> None:
        """Fill ``[offset, offset + size)`` from ``reader`` (a :class:`protocol.dataplane.FrameReader`):
        socket → staging → device."""
        for a in range(offset, offset + size, STAGE_BYTES):
            n = min(STAGE_BYTES, offset + size - a)
            st = self._take()
            try:
                reader.read_into(st[1][:n])
                self.tensor[a:a + n].copy_(st[0][:n])
            finally:
                self._free.put(st)

    def read(self, offset: int, size: int) -> bytes:
        """A copy of ``[offset, offset + size)`` as bytes (for tools and tests)."""
        return self.tensor[offset:offset + size].cpu().numpy().tobytes()

    def close(self) -> None:
        self.tensor = None


_DEVICE = re.compile(DEVICE_RE)


def check_device(device: str, capacity: int) -> str:
    """The canonical form of ``device`` ("cpu" or "cuda:N") after checking that it exists
    here with at least ``capacity`` bytes free (``torch.cuda.mem_get_info``). Raises
    ConfigError otherwise. The same spelling rule as config validation
    (:data:`protocol.config.DEVICE_RE`)."""
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ConfigError(f"--device {device!r}; accepted: cpu, cuda:N", key="device")
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch sees no CUDA device on this machine "
                          "(torch.cuda.is_available() is False); use --device cpu", key="device")
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"--device {device}: this machine has {count} CUDA device(s) "
                          f"(cuda:0 … cuda:{count - 1})", key="device")
    try:
        free, _ = torch.cuda.mem_get_info(index)
    except RuntimeError as e:  # a busy or exclusive-process device
        raise ConfigError(f"--device {device}: cannot query its memory ({e}); is another process holding "
                          "it in exclusive mode?", key="device") from None
    if capacity > free:
        raise ConfigError(f"--device {device}: a {capacity}-byte segment does not fit the {free} bytes free "
                          "on it; lower --memory", key="device")
    return f"cuda:{index}"
