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

import os
import threading
import uuid

from protocol.errors import ConfigError

STAGE_BYTES = 4 << 20  # per-thread staging buffer (bytes): one 4 MiB piece per device copy


class DeviceSegment:
    """``capacity`` bytes of ``device`` memory (a ``torch.uint8`` tensor of shape
    ``(capacity,)``). Raises ConfigError when the device does not exist or has less than
    ``capacity`` bytes free (see :func:`check_device`)."""

    fd = None  # not shareable: clients read and write through the streams
    view = None

    def __init__(self, capacity: int, device: str) -> None:
        import torch

        check_device(device, capacity)
        self.capacity = capacity
        self.device = torch.device(device)
        self.tensor = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._local = threading.local()
        self.renew()

    def renew(self) -> None:
        """A new generation: fresh incarnation id and grant key (old grants stop working)."""
        self.incarnation = uuid.uuid4().hex[:16]
        self.grant_key = os.urandom(32)

    def _stage(self):
        """This thread's staging buffer: (uint8 tensor of STAGE_BYTES, its memoryview)."""
        st = getattr(self._local, "stage", None)
        if st is None:
            import torch

            t = torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            st = self._local.stage = (t, memoryview(t.numpy()))
        return st

    def send(self, sock, offset: int, size: int) -> None:
        """Send bytes ``[offset, offset + size)`` to ``sock``: device → staging → socket."""
        t, view = self._stage()
        for a in range(offset, offset + size, STAGE_BYTES):
            n = min(STAGE_BYTES, offset + size - a)
            t[:n].copy_(self.tensor[a:a + n])  # synchronous: the bytes are in host memory after it
            sock.sendall(view[:n])

    def recv(self, reader, offset: int, size: int) -> None:
        """Fill ``[offset, offset + size)`` from ``reader`` (a :class:`protocol.dataplane.FrameReader`):
        socket → staging → device."""
        t, view = self._stage()
        for a in range(offset, offset + size, STAGE_BYTES):
            n = min(STAGE_BYTES, offset + size - a)
            reader.read_into(view[:n])
            self.tensor[a:a + n].copy_(t[:n])

    def read(self, offset: int, size: int) -> bytes:
        """A copy of ``[offset, offset + size)`` as bytes (for tools and tests)."""
        return self.tensor[offset:offset + size].cpu().numpy().tobytes()

    def close(self) -> None:
        self.tensor = None
        self._local = threading.local()


def check_device(device: str, capacity: int) -> None:
    """Raise ConfigError unless ``device`` ("cpu", "cuda" or "cuda:N") exists here with at
    least ``capacity`` bytes free (``torch.cuda.mem_get_info``)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r}; accepted: cpu, cuda:N", key="device") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ConfigError(f"--device {device!r}: only cpu and cuda:N segments are supported", key="device")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch sees no CUDA device on this machine "
                          "(torch.cuda.is_available() is False); use --device cpu", key="device")
    index = dev.index if dev.index is not None else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                          f"(cuda:0 … cuda:{torch.cuda.device_count() - 1})", key="device")
    free, _ = torch.cuda.mem_get_info(index)
    if capacity > free:
        raise ConfigError(f"--device {device}: a {capacity}-byte segment does not fit the {free} bytes free "
                          "on it; lower --memory", key="device")
