"""What one data-plane call moves: :class:`WriteOp` (bytes into a granted extent) and
:class:`ReadOp` (an extent into a buffer), each carrying its own error. The data plane
(connector/dataclient.py) and its parts (shmcopy.py, dma.py, ...) take lists of them."""
from __future__ import annotations

from kvpool.protocol.errors import KVPoolError
from kvpool.protocol.messages import ExtentRef


class WriteOp:
    """Write ``data`` (a byte memoryview, or a :class:`~connector.device_buffer.DeviceBuffer`)
    into the granted extent ``ref``. ``checksum=None`` asks the data plane
    to hash the bytes as it copies or sends them and set :attr:`checksum` (xxh3_64); the
    node learns it from the master's commit."""

    __slots__ = ("ref", "data", "key", "checksum", "layout", "error", "replicas")

    def __init__(self, ref: ExtentRef, data, key: str, checksum: int | None, layout: bytes | None,
                 replicas: int = 0):
        self.ref, self.data, self.key, self.checksum, self.layout = ref, data, key, checksum, layout
        self.replicas = replicas  # the object's wanted replica count (for the writer's commit copy)
        self.error: KVPoolError | None = None


class ReadOp:
    """Read ``ref`` into ``out`` (a writable byte memoryview, a
    :class:`~connector.device_buffer.DeviceBuffer` or a
    :class:`~connector.scatter_out.ScatterOut`). With ``digest=True`` the data plane also sets
    :attr:`digest` to the xxh3_64 of the bytes as they landed in ``out`` (computed chunk by
    chunk during the copy), so the caller need not hash them again."""

    __slots__ = ("ref", "out", "error", "digest")

    def __init__(self, ref: ExtentRef, out, digest: bool = False):
        self.ref, self.out = ref, out
        self.error: KVPoolError | None = None
        self.digest: int | bool | None = True if digest else None
