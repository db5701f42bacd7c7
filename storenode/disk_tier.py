"""A store node's disk tier: one directory of object files and their table (DESIGN.md §12).

Each object on disk is one file ``<disk id, 16 hex digits>.kvd``: a versioned header and
the object's bytes. Little-endian header (:data:`_HEAD`, then the key and the layout):

====================  ==========================================================
magic                 ``b"KVPD"``
format                :data:`FORMAT` (files of another format are dropped at start)
header length         bytes before the payload
disk id               the file's id on this node (its name)
size                  payload bytes
checksum              xxh3_64 of the payload (the object's checksum)
replicas              the object's wanted replica count (0: the cluster default)
key / layout lengths  bytes of the UTF-8 key and of the msgpack layout descriptor
fingerprint           the layout's fingerprint as it was computed when written
                      (:meth:`~protocol.layout.LayoutSpec.fingerprint`), 0 without layout
created               wall-clock time of the write (Unix seconds; operators only)
header checksum       xxh3_64 of every header byte before it, then key and layout
====================  ==========================================================

A file is written under a temporary name (``.tmp``), hashed as its payload is written
(a payload whose hash is not the object's checksum is never renamed into place),
``fsync``'ed, renamed and the directory ``fsync``'ed: so after any crash a ``.kvd`` name
holds a whole file or none. Writes come in groups (:meth:`DiskTier.write` each, then one
:meth:`DiskTier.publish`): the group's files are ``fsync``'ed one after the other once all
are written, so the filesystem's journal commits them together (on ext4 in its default
``data=ordered`` mode the first ``fsync`` flushes them all), then renamed, with one
directory ``fsync``. The page cache is told to drop the file's pages
(``POSIX_FADV_DONTNEED``) after the sync and after a read: the memory tier is the cache of
hot objects, the disk tier must not double it in page cache.

At start (:meth:`DiskTier.scan`) every file is verified: header (magic, format, header
checksum, lengths), file length, payload checksum, and the layout (it must decode under
this release's layout format, and its fingerprint must be what the file recorded): a
file failing any check is deleted with one log line, never served. ``.tmp`` files (a
write cut short) are deleted. The directory is locked (``flock`` on ``.lock``) for the
life of the node: two nodes never share one.

Thread-safe: the table is guarded by one lock; file I/O runs outside it (a file deleted
while being read stays readable through its open descriptor).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass

import xxhash

from kvpool.protocol.errors import ChecksumMismatch, ConfigError, InvalidRequest, NoSpace, StaleExtent
from kvpool.protocol.layout import FORMAT_VERSION, LayoutSpec
from kvpool.protocol.messages import DISK, ExtentEntry

log = logging.getLogger("kvpool.storenode")

MAGIC = b"KVPD"
FORMAT = 1
"""Format version of the files this release writes and reads."""
# magic, format, flags, header length, disk id, size, checksum, replicas, key length,
# layout length, layout fingerprint, created (Unix seconds); then the header checksum
_HEAD = struct.Struct("<4sHHIQQQHHIQd")
_SUM = struct.Struct("<Q")
SUFFIX = ".kvd"
CHUNK = 4 << 20  # bytes per write/read/hash step (hashed right after it moved, still in cache)
_LOCK = ".lock"


@dataclass(frozen=True, slots=True)
class FileHeader:
    """A parsed file header (see the module docstring)."""

    disk_id: int
    size: int
    checksum: int
    replicas: int
    key: str
    layout: bytes | None
    fingerprint: int
    header_len: int


def _fingerprint(layout: bytes | None) -> int:
    """The fingerprint of an encoded layout as an int (0: none); raises InvalidRequest
    when it does not decode under this release's layout format."""
    if not layout:
        return 0
    spec = LayoutSpec.decode(layout)
    if spec.version != FORMAT_VERSION:
        raise InvalidRequest(f"layout format version {spec.version}, this release reads {FORMAT_VERSION}")
    return int(spec.fingerprint(), 16)


def encode_header(disk_id: int, size: int, checksum: int, replicas: int, key: str, layout: bytes | None,
                  created: float | None = None) -> bytes:
    """The header bytes of a file (raises InvalidRequest for a layout that does not decode)."""
    kb, lb = key.encode(), layout or b""
    n = _HEAD.size + _SUM.size + len(kb) + len(lb)
    head = _HEAD.pack(MAGIC, FORMAT, 0, n, disk_id, size, checksum, replicas, len(kb), len(lb),
                      _fingerprint(layout), time.time() if created is None else created)
    return head + _SUM.pack(xxhash.xxh3_64_intdigest(head + kb + lb)) + kb + lb


def decode_header(buf: bytes) -> FileHeader:
    """Parse a header from the first bytes of a file (at least its whole header). Raises
    InvalidRequest naming what is wrong: magic, format, lengths, header checksum."""
    if len(buf) < _HEAD.size + _SUM.size:
        raise InvalidRequest(f"header cut short ({len(buf)} bytes)")
    (magic, fmt, _flags, hlen, disk_id, size, checksum, replicas, klen, llen, fp,
     _created) = _HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise InvalidRequest("not a kvpool disk object (bad magic)")
    if fmt != FORMAT:
        raise InvalidRequest(f"file format {fmt}, this release reads format {FORMAT}")
    if hlen != _HEAD.size + _SUM.size + klen + llen or hlen > len(buf):
        raise InvalidRequest(f"header length {hlen} does not match its key and layout lengths")
    (want,) = _SUM.unpack_from(buf, _HEAD.size)
    body = buf[_HEAD.size + _SUM.size:hlen]
    if xxhash.xxh3_64_intdigest(bytes(buf[:_HEAD.size]) + bytes(body)) != want:
        raise InvalidRequest("header checksum mismatch")
    try:
        key = bytes(body[:klen]).decode()
    except UnicodeDecodeError:
        raise InvalidRequest("key is not UTF-8") from None
    layout = bytes(body[klen:]) or None
    return FileHeader(disk_id, size, checksum, replicas, key, layout, fp, hlen)


@dataclass(slots=True)
class Written:
    """A file :meth:`DiskTier.write` wrote and :meth:`DiskTier.publish` has not made
    durable yet: its temporary path and open descriptor."""

    tmp: str
    fd: int | None


_MAX_HEADER = _HEAD.size + _SUM.size + 512 + (1 << 20)  # a key is <= 512 bytes; a layout far below 1 MiB


class DiskTier:
    """The files of one node's disk tier in ``path`` (created if missing), holding at most
    ``capacity`` payload bytes. ``scan`` (at start) verifies and indexes what is there.
    Raises ConfigError when the directory cannot be made, written or locked."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.capacity = capacity
        try:
            os.makedirs(self.path, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.path, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ConfigError(f"storenodes[].disk_dir: cannot use {self.path} ({e}); give a writable directory",
                              key="storenodes[].disk_dir") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"storenodes[].disk_dir: {self.path} is in use by another store node; give each "
                              "node a directory of its own", key="storenodes[].disk_dir") from None
        self._dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._rows: dict[int, ExtentEntry] = {}
        self._lock = threading.Lock()
        self.used = 0  # payload bytes of indexed files and of writes under way
        self._next_id = 1
        self._writing: set[int] = set()
        # counters (plain ints, bumped by the threads that do the work)
        self.writes = self.reads = self.dropped = 0
        self.written_bytes = self.read_bytes = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._dir_fd)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)  # releases the flock

    def _file(self, disk_id: int) -> str:
        return os.path.join(self.path, f"{disk_id:016x}{SUFFIX}")

    # ---- start: verify and index ----------------------------------------------------------

    def scan(self) -> tuple[int, int]:
        """Verify every file (see the module docstring) and index the good ones; delete the
        rest, one log line each. Returns ``(files kept, files dropped)``."""
        kept = dropped = 0
        for name in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, name)
            if name == _LOCK:
                continue
            if name.endswith(".tmp"):  # a write cut short (crash or kill): never renamed into place
                self._drop_file(full, "an unfinished write")
                dropped += 1
                continue
            if not name.endswith(SUFFIX):
                continue  # not ours: left alone
            try:
                disk_id = int(name[:-len(SUFFIX)], 16)
                h = self._verify(full, disk_id)
            except (ValueError, InvalidRequest, OSError) as e:
                self._drop_file(full, str(e))
                dropped += 1
                continue
            self._rows[disk_id] = ExtentEntry(h.key, 0, h.size, disk_id, h.checksum, h.layout, True, h.replicas,
                                              DISK)
            self.used += h.size
            self._next_id = max(self._next_id, disk_id + 1)
            kept += 1
        return kept, dropped

    def _drop_file(self, full: str, why: str) -> None:
        log.warning("storenode: disk tier: dropping %s: %s", full, why)
        self.dropped += 1
        with contextlib.suppress(OSError):
            os.unlink(full)

    def _verify(self, full: str, disk_id: int) -> FileHeader:
        """The header of a whole, intact file; raises InvalidRequest (or OSError) naming the fault."""
        fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
        try:
            length = os.fstat(fd).st_size
            h = decode_header(os.pread(fd, min(length, _MAX_HEADER), 0))
            if h.disk_id != disk_id:
                raise InvalidRequest(f"file names disk id {h.disk_id}, not {disk_id}")
            if length != h.header_len + h.size:
                raise InvalidRequest(f"file holds {length - h.header_len} payload bytes, its header says {h.size} "
                                     "(torn or cut short)")
            if h.layout is not None and _fingerprint(h.layout) != h.fingerprint:
                raise InvalidRequest("layout fingerprint differs from the one recorded (written under another "
                                     "layout scheme)")
            got = _hash_file(fd, h.header_len, h.size)
            if got != h.checksum:
                raise InvalidRequest("payload checksum mismatch")
            _drop_cache(fd)
            return h
        finally:
            os.close(fd)

    # ---- table ----------------------------------------------------------------------------

    def rows(self) -> list[ExtentEntry]:
        """The table: one committed DISK row per file (``gen`` its disk id)."""
        with self._lock:
            return list(self._rows.values())

    def row(self, disk_id: int) -> ExtentEntry | None:
        with self._lock:
            return self._rows.get(disk_id)

    def usage(self) -> tuple[int, int]:
        """``(files, payload bytes)`` (bytes include writes under way)."""
        with self._lock:
            return len(self._rows), self.used

    def max_id(self) -> int:
        with self._lock:
            return self._next_id - 1

    # ---- writes ---------------------------------------------------------------------------

    def reserve(self, size: int) -> int:
        """A fresh disk id for a write of ``size`` bytes, counted in ``used`` until the write
        ends. Raises NoSpace when the tier cannot take it."""
        with self._lock:
            if self.used + size > self.capacity:
                raise NoSpace(f"disk tier {self.path} holds {self.used} of {self.capacity} bytes; no room for "
                              f"{size} more", size=size)
            disk_id = self._next_id
            self._next_id += 1
            self.used += size
            self._writing.add(disk_id)
            return disk_id

    def write(self, disk_id: int, row: ExtentEntry, payload: memoryview, pace=None) -> Written:
        """Write ``payload`` as file ``disk_id`` of object ``row`` (its key, checksum, layout,
        replicas) under a temporary name, hashing each piece after it is written; on a
        hash other than ``row.checksum`` (the bytes changed under the write) the file is
        deleted and ChecksumMismatch raised. The file is neither synced nor renamed yet:
        :meth:`publish` does both (or :meth:`abandon` drops it). ``pace(nbytes)``: called
        before each piece (a rate bound). Raises OSError on I/O errors (the file removed)."""
        tmp = self._file(disk_id) + ".tmp"
        head = encode_header(disk_id, len(payload), row.checksum, row.replicas, row.key, row.layout)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, memoryview(head))
            h = xxhash.xxh3_64()
            for a in range(0, len(payload), CHUNK):
                piece = payload[a:a + CHUNK]
                if pace is not None:
                    pace(len(piece))
                _write_all(fd, piece)
                h.update(piece)
            if h.intdigest() != row.checksum:
                raise ChecksumMismatch(f"bytes of {row.key!r} changed while they were written to disk; not kept",
                                       key=row.key)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return Written(tmp, fd)

    def publish(self, written: list[tuple[int, ExtentEntry, Written]]) -> None:
        """Make written files durable and serve them: fsync each, rename it into place,
        fsync the directory once, and index them. ``written``: (disk id, row, what
        :meth:`write` returned). Raises OSError (the files not renamed yet stay temporary:
        :meth:`abandon` them)."""
        for _, _, w in written:
            if w.fd is not None:
                os.fsync(w.fd)
                _drop_cache(w.fd)
                os.close(w.fd)
                w.fd = None
        for disk_id, _, w in written:
            os.rename(w.tmp, self._file(disk_id))
        os.fsync(self._dir_fd)
        with self._lock:
            for disk_id, row, _ in written:
                self._writing.discard(disk_id)
                self._rows[disk_id] = ExtentEntry(row.key, 0, row.size, disk_id, row.checksum, row.layout, True,
                                                  row.replicas, DISK)
        self.writes += len(written)
        self.written_bytes += sum(r.size for _, r, _ in written)

    def abandon(self, disk_id: int, size: int, written: Written | None = None) -> None:
        """A write that will not be published: its bytes leave ``used``, its file goes."""
        if written is not None:
            if written.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(written.fd)
                written.fd = None
            with contextlib.suppress(OSError):
                os.unlink(written.tmp)
        with self._lock:
            if disk_id in self._writing:
                self._writing.discard(disk_id)
                self.used -= size

    # ---- reads and deletes ----------------------------------------------------------------

    def open(self, disk_id: int, size: int, first: memoryview | None = None) -> tuple[int, ExtentEntry, int]:
        """An open descriptor on file ``disk_id`` with its row and payload offset, its header
        checked against the table. ``first``: a buffer the payload's first bytes are read
        into together with the header (one read for a small file). Raises StaleExtent when
        the file is not (or no longer) indexed, or its size is not ``size``, or it is
        damaged (then deleted); the caller closes the descriptor."""
        with self._lock:
            row = self._rows.get(disk_id)
        if row is None or row.size != size:
            raise StaleExtent(f"disk object {disk_id} was deleted or evicted from this node's disk tier; look the "
                              "key up again", gen=disk_id)
        try:
            fd = os.open(self._file(disk_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise StaleExtent(f"disk object {disk_id} was deleted from this node's disk tier; look the key up "
                              "again", gen=disk_id) from None
        try:
            head = memoryview(bytearray(_HEAD.size + _SUM.size + len(row.key.encode()) + len(row.layout or b"")))
            _read_exact(fd, head, 0, [] if first is None else [first])
            h = decode_header(head)
            if h.disk_id != disk_id or h.size != size or h.checksum != row.checksum or h.key != row.key:
                raise InvalidRequest("header differs from the table")
        except (InvalidRequest, OSError) as e:
            os.close(fd)
            self.corrupt(disk_id, f"unreadable header: {e}")
            raise StaleExtent(f"disk object {disk_id} is damaged and was dropped; look the key up again",
                              gen=disk_id) from None
        return fd, row, h.header_len

    def read_into(self, disk_id: int, view: memoryview) -> ExtentEntry:
        """Read file ``disk_id``'s payload into ``view`` (exactly its size) and verify its
        checksum. Raises StaleExtent when the file is gone, or damaged (then it is
        deleted, one log line). The header and the first CHUNK of payload come in one read."""
        fd, row, off = self.open(disk_id, len(view), view[:CHUNK])
        try:
            h = xxhash.xxh3_64()
            for a in range(0, len(view), CHUNK):
                piece = view[a:a + CHUNK]
                if a:
                    _read_exact(fd, piece, off + a)
                h.update(piece)
            _drop_cache(fd)
        except OSError as e:
            self.corrupt(disk_id, f"read failed: {e}")
            raise StaleExtent(f"disk object {disk_id} could not be read and was dropped ({e})", gen=disk_id) from None
        finally:
            os.close(fd)
        if h.intdigest() != row.checksum:
            self.corrupt(disk_id, "payload checksum mismatch")
            raise StaleExtent(f"disk object {disk_id} failed its checksum and was dropped; look the key up again",
                              gen=disk_id)
        self.reads += 1
        self.read_bytes += len(view)
        return row

    def corrupt(self, disk_id: int, why: str) -> None:
        """File ``disk_id`` failed a check: drop it (one log line); the master learns it from
        the reader that meets the gap (a StaleExtent under a lease is reported)."""
        with self._lock:
            row = self._rows.pop(disk_id, None)
            if row is not None:
                self.used -= row.size
        self._drop_file(self._file(disk_id), why)

    def delete(self, ids: list[int]) -> int:
        """Delete files (the master freed them); returns how many were indexed."""
        n = 0
        for disk_id in ids:
            with self._lock:
                row = self._rows.pop(disk_id, None)
                if row is None:
                    continue
                self.used -= row.size
            n += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file(disk_id))
        return n


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, view: memoryview, offset: int, more: list[memoryview] = ()) -> None:
    """Fill ``view`` and then the buffers ``more`` from ``fd`` at ``offset`` (one ``preadv``
    when the file gives them at once); OSError when the file ends first."""
    bufs = [v for v in (view, *more) if len(v)]
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n == 0:
            raise OSError(f"file ended {sum(len(b) for b in bufs)} bytes early")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs.pop(0))
        if n:
            bufs[0] = bufs[0][n:]


def _hash_file(fd: int, offset: int, size: int) -> int:
    h = xxhash.xxh3_64()
    buf = bytearray(min(CHUNK, max(size, 1)))
    mv = memoryview(buf)
    pos = 0
    while pos < size:
        piece = mv[:min(CHUNK, size - pos)]
        _read_exact(fd, piece, offset + pos)
        h.update(piece)
        pos += len(piece)
    return h.intdigest()


def _drop_cache(fd: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

