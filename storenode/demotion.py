"""Moves objects between a store node's memory segment and its disk tier, off the control
loop (DESIGN.md §12): demotions (memory → disk) and promotions (disk → memory), each asked
for by the master (:class:`~protocol.messages.NodeDemote`, ``NodePromote``) and answered
with a :class:`~protocol.messages.TierDone` once done.

**Demotion.** One writer thread takes queued demotions in groups (up to
:data:`GROUP_MAX` of them, or :data:`GROUP_BYTES`): each object is written from the
segment straight into its file (no staging copy; :meth:`DiskTier.write` hashes it as it
goes and refuses bytes that changed), then the group's files are ``fsync``'ed and renamed
into place with one directory ``fsync`` (:meth:`DiskTier.publish`), and only then answered:
an answer means the file is durable. The memory extent is never touched: the master frees
it after the answer, so a demotion that fails or is cut short (a crash) leaves the object
in memory as it was. A demotion whose extent was freed or reused meanwhile fails
(StaleExtent, or ChecksumMismatch for bytes that changed under the write).

**Bounds.** At most :data:`QUEUE_MAX` demotions and :data:`PROMOTE_MAX` promotions are
queued or running at once; more are refused at once with Overloaded (the master holds
fewer in flight per node, :mod:`master.tiers`). Memory: nothing but the queued requests
(the bytes move between the segment and the file). Rate: with ``write_rate`` (bytes per
second, 0: none) a token bucket holding one second's worth paces the writes.

**Terms.** A request is refused when its leader term is older than the node's
(``ExtentTable.term``). A demotion or promotion is published (its file indexed, its
memory row committed) under :attr:`TierMover.publish_lock` and only while its term is
still the newest: the master's ``NodeList`` takes the same lock, so a new leader's table
either holds the result or the result is dropped (a deposed leader's move leaves nothing
behind that no master knows about).
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

from kvpool.protocol.errors import InvalidRequest, KVPoolError, Overloaded, StaleExtent, StaleTerm
from kvpool.protocol.messages import ExtentEntry, NodeDemote, NodePromote, TierDone
from kvpool.storenode.disk_tier import DiskTier, Written
from kvpool.storenode.extents import ExtentTable
from kvpool.storenode.metrics import Hist

QUEUE_MAX = 256  # demotions queued or running at once
PROMOTE_MAX = 64  # promotions queued or running at once
GROUP_MAX = 32  # demotions published with one directory fsync, at most
GROUP_BYTES = 64 << 20  # ... and at most this many bytes of them


class _Pace:
    """A token bucket of ``rate`` bytes per second holding at most one second's worth."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.tokens = float(rate)
        self.t = time.monotonic()

    def __call__(self, n: int) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(float(self.rate), self.tokens + (now - self.t) * self.rate)
            self.t = now
            if self.tokens >= min(n, self.rate):
                self.tokens -= n
                return
            time.sleep(min(1.0, (min(n, self.rate) - self.tokens) / self.rate))


class _Owner:
    """The claim owner of a promotion's segment write (:meth:`ExtentTable.claim`)."""


class TierMover:
    """Demotions and promotions of one store node (see the module docstring).
    ``segment``: the memory segment (host memory with a ``view``, or a device segment
    read and written through its staging); ``write_rate``: bytes per second, 0: no bound."""

    def __init__(self, segment, table: ExtentTable, disk: DiskTier, write_rate: int = 0) -> None:
        self.segment, self.table, self.disk = segment, table, disk
        self._pace = _Pace(write_rate) if write_rate else None
        self.publish_lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # demotions queued or running
        self._promoting = 0
        self._count_lock = threading.Lock()
        self._promoter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-promote")
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="kvpool-demote")
        self._writer.start()
        # latencies (seconds): a demotion from its start of writing to its publish; a promotion's copy
        self.write_hist = Hist()
        self.promote_hist = Hist()
        self.demotions = self.promotions = self.failures = 0

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._promoter.shutdown(wait=False, cancel_futures=True)

    def in_flight(self) -> tuple[int, int]:
        """``(demotions, promotions)`` queued or running."""
        return self._queued, self._promoting

    # ---- requests -------------------------------------------------------------------------

    def demote(self, req: NodeDemote) -> concurrent.futures.Future:
        """Queue a demotion; its future gives a TierDone or raises the typed error. Raises
        Overloaded at once when :data:`QUEUE_MAX` are queued already."""
        with self._count_lock:
            if self._queued >= QUEUE_MAX:
                raise Overloaded(f"{QUEUE_MAX} demotions queued on this store node; retry later")
            self._queued += 1
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((req, fut))
        return fut

    def promote(self, req: NodePromote) -> concurrent.futures.Future:
        """Queue a promotion; its future gives a TierDone or raises the typed error. Raises
        Overloaded when :data:`PROMOTE_MAX` are queued already."""
        with self._count_lock:
            if self._promoting >= PROMOTE_MAX:
                raise Overloaded(f"{PROMOTE_MAX} promotions queued on this store node; retry later")
            self._promoting += 1
        try:
            return self._promoter.submit(self._promote, req)
        except RuntimeError:  # shut down
            with self._count_lock:
                self._promoting -= 1
            raise Overloaded("this store node is stopping") from None

    # ---- demotions (the writer thread) ----------------------------------------------------

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            first = self._queue.get()
            if first is None:
                return
            group, size = [first], first[0].size
            while len(group) < GROUP_MAX and size < GROUP_BYTES:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._stop.set()
                    break
                group.append(nxt)
                size += nxt[0].size
            try:
                self._write_group(group)
            finally:
                with self._count_lock:
                    self._queued -= len(group)

    def _write_group(self, group: list) -> None:
        written: list[tuple[int, ExtentEntry, Written]] = []
        done: list = []  # (request, future, disk id, seconds)
        for req, fut in group:
            if not fut.set_running_or_notify_cancel():
                continue
            t0 = time.perf_counter()
            disk_id, tmp = 0, None
            try:
                row = self._source(req)
                disk_id = self.disk.reserve(req.size)
                tmp = self.disk.write(disk_id, row, self._payload(req.offset, req.size), self._pace)
                written.append((disk_id, row, tmp))
                done.append((req, fut, disk_id, time.perf_counter() - t0))
            except (KVPoolError, OSError) as e:
                if disk_id:
                    self.disk.abandon(disk_id, req.size, tmp)
                self.failures += 1
                fut.set_exception(e if isinstance(e, KVPoolError) else KVPoolError(f"disk write failed: {e}"))
        if not written:
            return
        t0 = time.perf_counter()
        err: KVPoolError | None = None
        with self.publish_lock:  # see the module docstring, "Terms"
            keep = [w for w, d in zip(written, done) if d[0].term >= self.table.term]
            try:
                if keep:
                    self.disk.publish(keep)
            except OSError as e:  # (a file renamed before the failure is verified and indexed at restart)
                keep, err = [], KVPoolError(f"disk publish failed: {e}")
        kept = {w[0] for w in keep}
        sync_s = time.perf_counter() - t0
        for (disk_id, row, tmp), (req, fut, _, secs) in zip(written, done):
            if disk_id in kept:
                self.demotions += 1
                self.write_hist.observe(secs + sync_s)
                fut.set_result(TierDone("demote", req.key, req.gen, disk_id, secs + sync_s))
                continue
            self.disk.abandon(disk_id, row.size, tmp)
            self.failures += 1
            fut.set_exception(err or StaleTerm(f"a newer leader term than {req.term} was elected during the "
                                               "demotion; dropped", term=self.table.term))

    def _source(self, req: NodeDemote) -> ExtentEntry:
        """The committed row a demotion writes (raises StaleTerm, StaleExtent, InvalidRequest)."""
        if req.term < self.table.term:
            raise StaleTerm(f"demotion of leader term {req.term}, but term {self.table.term} has been elected "
                            "since", term=self.table.term)
        row = self.table.check_read(req.offset, req.size, req.gen)
        if not row.committed or row.key != req.key:
            raise InvalidRequest(f"extent at offset {req.offset} gen {req.gen} holds {row.key!r} "
                                 f"({'committed' if row.committed else 'not committed'}), not {req.key!r}")
        return row

    def _payload(self, offset: int, size: int) -> memoryview:
        seg = self.segment
        if seg.view is not None:
            return seg.view[offset:offset + size]
        return memoryview(seg.read(offset, size))  # device memory: one staged copy

    # ---- promotions (the promoter thread) -------------------------------------------------

    def _promote(self, req: NodePromote) -> TierDone:
        try:
            return self._promote_one(req)
        except KVPoolError:
            self.failures += 1
            raise
        except OSError as e:
            self.failures += 1
            raise KVPoolError(f"promotion of {req.key!r} failed: {e}") from None
        finally:
            with self._count_lock:
                self._promoting -= 1

    def _promote_one(self, req: NodePromote) -> TierDone:
        t0 = time.perf_counter()
        dst, seg = req.dst, self.segment
        row = self.disk.row(req.disk_id)
        if row is None or row.key != req.key or row.size != dst.size:
            raise StaleExtent(f"disk object {req.disk_id} of {req.key!r} is not on this node's disk tier",
                              gen=req.disk_id)
        owner = _Owner()
        self.table.claim(dst.offset, dst.size, dst.gen, owner)  # term, bounds and overlap checks
        try:
            if seg.view is not None:
                self.disk.read_into(req.disk_id, seg.view[dst.offset:dst.offset + dst.size])
            else:  # device memory: through a host buffer and the segment's staging
                buf = bytearray(dst.size)
                self.disk.read_into(req.disk_id, memoryview(buf))
                seg.recv(_BufferReader(buf), dst.offset, dst.size)
        finally:
            self.table.release(dst.offset, dst.gen, owner)
        with self.publish_lock:
            if req.term < self.table.term:
                raise StaleTerm(f"a newer leader term than {req.term} was elected during the promotion; dropped",
                                term=self.table.term)
            self.table.commit(ExtentEntry(row.key, dst.offset, dst.size, dst.gen, row.checksum, row.layout, True,
                                          row.replicas))
        secs = time.perf_counter() - t0
        self.promotions += 1
        self.promote_hist.observe(secs)
        return TierDone("promote", req.key, dst.gen, req.disk_id, secs)


class _BufferReader:
    """A ``read_into`` source over a buffer (what a device segment's ``recv`` reads from)."""

    def __init__(self, buf: bytearray) -> None:
        self.view, self.pos = memoryview(buf), 0

    def read_into(self, dst: memoryview) -> None:
        n = len(dst)
        dst[:] = self.view[self.pos:self.pos + n]
        self.pos += n

