"""One CPU memory segment backed by an anonymous memfd.

The memfd is mapped here and handed to same-host clients over the node's Unix socket
(SCM_RIGHTS), so a client maps exactly this memory without any named file: nothing is
left in /dev/shm even if the node is SIGKILLed. ``incarnation`` is a fresh random id per
segment (its generation): a restarted node's extents never match an old descriptor.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import uuid

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14, <linux/mman.h>


def _populate_write(view: memoryview, nbytes: int) -> None:
    """Make every page table entry of the mapping writable now (``MADV_POPULATE_WRITE``):
    ``MAP_POPULATE`` of a shared mapping faults pages in for reading, so each page's first
    write (a network put ``recv_into`` the segment) would fault again. Best effort: older
    kernels answer EINVAL and pages fault on first write."""
    if not nbytes:
        return
    buf = ctypes.c_char.from_buffer(view)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise(ctypes.addressof(buf), nbytes, _MADV_POPULATE_WRITE)
    finally:
        del buf


class Segment:
    """``capacity`` bytes of shared memory; :attr:`view` is a writable memoryview."""

    def __init__(self, capacity: int, name: str = "kvpool") -> None:
        self.capacity = capacity
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)
        # MAP_POPULATE faults every page in now, so the first put into an extent does not
        # pay page faults (benchmarks/RESULTS.md, "Measurements behind choices in the code")
        self.mm = mmap.mmap(self.fd, capacity, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.mm)
        _populate_write(self.view, capacity)
        self.renew()

    def renew(self) -> None:
        """A new generation: fresh incarnation id and grant key (old grants stop working)."""
        self.incarnation = uuid.uuid4().hex[:16]
        self.grant_key = os.urandom(32)

    def send(self, sock, offset: int, size: int) -> None:
        """Send bytes ``[offset, offset + size)`` to ``sock`` (no copy in user space)."""
        sock.sendall(self.view[offset:offset + size])

    def recv(self, reader, offset: int, size: int) -> None:
        """Fill ``[offset, offset + size)`` from ``reader`` (a :class:`protocol.dataplane.FrameReader`),
        ``recv_into`` the segment itself."""
        reader.read_into(self.view[offset:offset + size])

    def read(self, offset: int, size: int) -> bytes:
        """A copy of ``[offset, offset + size)`` as bytes (for tools and tests)."""
        return bytes(self.view[offset:offset + size])

    def close(self) -> None:
        try:
            self.view.release()
            self.mm.close()
        except (BufferError, ValueError):
            pass  # a data thread still holds a slice; the OS frees it at exit
        os.close(self.fd)
