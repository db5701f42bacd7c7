"""Client side of the data plane: moves extent bytes between caller buffers and store nodes.

Paths, chosen per replica (``transport="auto"``):

* **same host, shared memory** (``shm``): the node's segment memfd is received once over
  its Unix socket (SCM_RIGHTS) and mapped. A get is **one copy** (segment → caller
  buffer); with ``ReadOp(digest=True)`` it goes in 256 KiB chunks, each hashed (xxh3_64,
  streaming) right after it lands, while still in cache, so the checksum costs no second
  pass over memory. The hash is of the bytes delivered, read back from ``out``, never of
  the segment: a force-removed extent can be reused under a reader, and a hash of what
  landed catches that torn read. A put is **one copy** (caller buffer → segment), hashed
  as it goes, unless the client hashed the buffer while waiting for ``put_start``
  (objects up to 4 MiB) or a helper thread hashes it beside one GIL-free ``memcpy``
  (bigger ones, :meth:`ShmCopies.hash_aside <connector.shmcopy.ShmCopies.hash_aside>`); the checksum reaches the master with
  ``put_end``. Plus a small ``written`` notice; a batch's notices go out in one send
  before the copies, so the node's round trip overlaps them. Big copies without a hash release the GIL (numpy), so the second
  replica of a put and the per-node threads of a batch copy in parallel; copies hit by 4K
  aliasing are bounced (see :meth:`ShmCopies.copy_out <connector.shmcopy.ShmCopies.copy_out>`).
* **same host, Unix socket** (``transport="unix"``, or when the segment cannot be mapped)
  and **network** (``tcp``): one pipelined stream per node per thread. Reads: every
  request frame of the batch in one send, replies parsed through a 256 KiB buffer, and
  each payload ``recv_into`` the caller's buffer directly: **one copy** (kernel → buffer;
  payload bytes that arrived with a reply header, at most 256 KiB, take one extra copy from
  the reply buffer). A buffer that does not start on a cache line (numpy arrays and
  bytearrays start 16 bytes into a page) receives through a 256 KiB L2-resident bounce
  buffer instead: two copies, measured faster than the kernel's slow misaligned one
  (benchmarks/RESULTS.md, "Copies per byte"). Writes: headers and payloads go out with
  ``sendmsg`` scatter/gather straight from the caller's buffer: **one copy** (buffer →
  kernel); a put's first replica is sent in 256 KiB pieces, each hashed right after the
  kernel copied it, so the checksum (sent with ``put_end``) needs no pass of its own.
* **CUDA tensors** (:class:`connector.device_buffer.DeviceBuffer`): on the shared-memory
  path the segment's mapping is registered with CUDA (``cudaHostRegister``, in 64 MiB
  windows on first use) and the bytes move in **one DMA copy** between the extent and the
  tensor, the checksum hashed from the segment's host bytes after the DMA ended (the
  tensor's bytes are not on the host; a byte the DMA read from a reused extent is the new
  one or a later one by then, so a torn read fails the check unless the extent was
  rewritten with the very bytes it held). Other paths stage through a pinned host buffer
  (one DMA + the host path's copy). ``cuda_direct=False`` stages always.
* **disk tier** (an ExtentRef of ``tier`` DISK): read like a network replica, with the
  ``dread`` op, from the node's disk-read socket the ref names (its Unix socket on the same
  host, else TCP); never through the mapping.
* **UCX** (``transport="ucx"``, nodes started with ``--ucx``): the same frames over a
  ``ucx://`` stream (:mod:`protocol.ucx_transport`); UCX moves the payload (shared memory
  or TCP) straight into the caller's buffer when it fits.

No per-byte Python work on any path. Every byte range is bounds-checked against the
master's grant (the ExtentRef). Errors: :class:`~protocol.errors.NodeUnavailable` (node
dead/unreachable), :class:`~protocol.errors.StaleExtent` (extent freed or node restarted).

This module holds :class:`DataPlane` with its write and read paths (the ops are in
:mod:`connector.ops`); the parts it owns live beside it: connections
(:class:`~connector.datastream.Connections`), the same-host segment mappings
(:class:`~connector.segmap.SegmentMaps`), shared-memory copies
(:class:`~connector.shmcopy.ShmCopies`), CUDA tensors (:class:`~connector.dma.CudaDirect`)
and claims held across calls (:class:`~connector.claims.SharedClaims`).
"""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence

import xxhash

from kvpool.connector.claims import _RELEASE_S, SharedClaims
from kvpool.connector.ops import ReadOp, WriteOp
from kvpool.connector.datastream import Connections, ReplicaDeadline, _wait_bytes, readable
from kvpool.connector.dma import CudaDirect, _stage
from kvpool.connector.scatter_out import ScatterOut
from kvpool.connector.segmap import SegmentMaps
from kvpool.connector.shmcopy import _CHUNK, _gone, ShmCopies
from kvpool.protocol import copyhash
from kvpool.protocol.auth import Security, resolve
from kvpool.protocol.dataplane import DataReply, DataRequest, frame, sendv
from kvpool.protocol.errors import ConfigError, InvalidRequest, KVPoolError, LoadCancelled, NodeUnavailable, from_wire
from kvpool.protocol.messages import ExtentRef
from kvpool.protocol.spin import Spinner
from kvpool.protocol.units import check_wait

__all__ = ["DataPlane", "ReadOp", "ReplicaDeadline", "WriteOp", "readable"]

_BIG = 64 << 10         # payloads at least this big are read without greedy buffering
_NET_ASIDE_MIN = 1 << 20  # network writes at least this big, not hashed yet, are hashed beside the send
_COMMIT_CONNECT_S = 1.0  # seconds a commit copy may wait to connect
_READ_OP = ("read", "dread")  # by ExtentRef.tier: a memory extent, a disk-tier file (storenode/disk_reads.py)


class DataPlane:
    """Thread-safe: connections are per thread; shared-memory maps are shared.

    ``transport_mode``: ``auto``/``shm`` (shared memory on the same host, else TCP),
    ``unix`` (the node's Unix socket on the same host, else TCP), ``tcp`` (always TCP),
    ``ucx`` (the node's ``ucx://`` address when it serves one — store nodes started with
    ``--ucx`` — else as ``unix``). Raises ConfigError for any other mode.
    ``io_timeout_s``: seconds any wait on a node may take unless a call's deadline says
    otherwise. ``cuda_direct``: move CUDA tensors by DMA to and from registered shared
    mappings (else they stage through pinned host memory on every path). ``security``: TLS
    and the cluster-secret handshake on every stream. ``spin_s``: seconds a node's reply
    is polled for before the wait sleeps (:mod:`protocol.spin`).

    Its parts, each given what it uses: ``conns`` (:class:`~connector.datastream.
    Connections`: the per-thread streams), ``segmaps`` (:class:`~connector.segmap.
    SegmentMaps`: same-host segment mappings), ``shm`` (:class:`~connector.shmcopy.
    ShmCopies`: copies through those mappings, and the put hasher thread), ``cuda``
    (:class:`~connector.dma.CudaDirect`: DMA between CUDA tensors and the mappings) and
    ``claims`` (:class:`~connector.claims.SharedClaims`: claims held across calls). This
    class holds the write and read paths that route each op to them.
    """

    MODES = ("auto", "shm", "unix", "tcp", "ucx")

    def __init__(self, host_id: str, transport_mode: str = "auto", io_timeout_s: float = 30.0,
                 cuda_direct: bool = True, security: Security | None = None, spin_s: float = 0.0) -> None:
        if transport_mode not in self.MODES:
            raise ConfigError(f"transport {transport_mode!r}; accepted: {', '.join(self.MODES)}", key="transport")
        check_wait(io_timeout_s, key="io_timeout_s")
        self.host_id = host_id
        self.mode = transport_mode
        self.io_timeout_s = io_timeout_s
        self.spin = Spinner(spin_s)
        security = resolve(security)
        self.conns = Connections(io_timeout_s, security)
        self.segmaps = SegmentMaps(host_id, transport_mode, io_timeout_s, security)
        self.shm = ShmCopies(self.segmaps.segment, self.segmaps.extent_address)
        self.cuda = CudaDirect(self.segmaps, self.shm, cuda_direct)
        self.segmaps.before_unmap = self.cuda.unmapping  # a mapping's CUDA registration goes before it
        self.claims = SharedClaims(self.conns, io_timeout_s, self.spin)

    # ---- writes -------------------------------------------------------------------------

    def write(self, ops: Sequence[WriteOp], deadline: ReplicaDeadline | None = None, held: bool = False) -> None:
        """Write every op (all to one node); sets ``op.error`` per failed op. ``deadline``:
        how long the writes may wait on the node (connect, each wait for bytes or a reply;
        default ``io_timeout_s``): past it the ops fail with NodeUnavailable.

        Same host: the ops' ``claim`` frames go out in one send and the node's verdicts are
        read *before* any byte is copied; only claimed extents are copied into, and a
        one-way ``written`` per claimed op (sent after its copy returned, also when it
        failed) ends the claim. A claim refused with PutRevoked (the master revoked the put:
        the writer stalled past put_timeout) or ExtentBusy (a revoked writer may still be
        copying there) fails its op and nothing is copied: a revoked writer never lands a
        byte in another object's extent, however long it stalls at whatever point (the
        argument is in :mod:`storenode.extents`). Ops with
        ``checksum=None`` are hashed chunk by chunk as they are copied (the bytes are still
        in cache), so the checksum costs no separate pass over memory; network writes of
        such ops hash each 256 KiB piece right after sending it (see :func:`_send_hashing`).

        ``held``: the same-host ops' extents are claimed already, on the shared claim stream
        (reserved extents, :mod:`connector.claims`): they are copied without a claim, and
        their claims outlive this call (``claims.end`` ends them)."""
        copies = self.shm
        shm, net, dma = [], [], []
        seg_of: dict[int, memoryview] = {}  # id(op) -> the mapped segment a same-host op is copied into
        for op, seg in zip(ops, self.segmaps.shm_segments([op.ref for op in ops])):
            local = seg is not None
            if not isinstance(op.data, memoryview):  # a CUDA tensor
                if local and self.cuda.direct(op.ref, op.data):
                    dma.append(op)
                elif not _stage(op, True):
                    continue
            if local:
                shm.append(op)
                seg_of[id(op)] = seg
            else:
                net.append(op)
        for op in shm:
            r = op.ref
            try:
                cap = len(seg_of[id(op)])
            except ValueError:  # released: the node's mapping went meanwhile
                op.error = _gone(r)
                continue
            if r.offset < 0 or r.offset + r.size > cap or len(op.data) != r.size:
                op.error = KVPoolError(f"grant for {op.key!r} does not fit the mapped segment")
        if held:
            claim, claimed = None, [op for op in shm if op.error is None]
            dma = [op for op in dma if op.error is None]
        else:
            claim = self._send_writes(shm, True, deadline)
            self._finish_writes(claim, deadline, claims=True)  # the node's verdicts, before any byte is copied
            claimed = [op for op in claim[2] if op.error is None] if claim else []
        try:
            host = [op for op in claimed if isinstance(op.data, memoryview)]
            if copyhash.NATIVE and len(host) > 1:  # one GIL-free call for the whole batch
                copies.write_many(host, [seg_of[id(op)] for op in host])
            else:
                for op in host:
                    copies.write(op)
            self.cuda.dma(dma, into_segment=True)
        finally:
            if not held:
                self._end_claims(claim[0] if claim else "", claimed)
        self._confirm([*claimed, *dma], deadline)
        self._finish_writes(self._send_writes(net, False, deadline), deadline)

    def _confirm(self, ops: Sequence[WriteOp], deadline: ReplicaDeadline | None = None) -> None:
        """Fail the same-host ``ops`` (copied into a mapping, without their node) whose node
        is gone by now: the mapping outlives the node, so only this check, made after the
        copy, lets a commit count the replica (DESIGN.md §5). One pidfd ``poll`` per node
        (:meth:`SegmentMaps.node_alive <connector.segmap.SegmentMaps.node_alive>`); a ``ping``
        round trip where the node's process is unknown."""
        by_inc: dict[str, list[WriteOp]] = {}
        for op in ops:
            if op.error is None:
                by_inc.setdefault(op.ref.incarnation, []).append(op)
        for group in by_inc.values():
            r = group[0].ref
            alive = self.segmaps.node_alive(r)
            if alive is None:
                alive = self._ping(r, deadline)
            if not alive:
                err = NodeUnavailable(f"store node {r.node_id} exited before the write of {len(group)} object(s) "
                                      "into its segment was confirmed; the put is placed again without it",
                                      node=r.node_id)
                for op in group:
                    op.error = err

    def _ping(self, r: ExtentRef, deadline: ReplicaDeadline | None = None) -> bool:
        """One ``ping`` round trip to ``r``'s node incarnation over its Unix socket: True when
        it answered within ``deadline`` (default ``io_timeout_s``)."""
        addr = r.shm_path
        try:
            s = self.conns.stream(addr, deadline.timeout_s if deadline is not None else None, incarnation=r.incarnation)
            s.sock.settimeout(deadline.timeout_s if deadline is not None else self.io_timeout_s)
            sendv(s.sock, [frame(DataRequest("ping", r.incarnation))])
            ok = s.reply().ok
            s.sock.settimeout(self.io_timeout_s)
            return ok
        except (OSError, KVPoolError):
            self.conns.drop(addr)
            return False

    def _end_claims(self, addr: str, ops: Sequence[WriteOp]) -> None:
        """One-way ``written`` frames for the claimed ``ops``, copied (or failed) by now."""
        if not ops:
            return
        try:
            s = self.conns.stream(addr, incarnation=ops[0].ref.incarnation)
            sendv(s.sock, [_written(ops)])
        except (OSError, KVPoolError):
            # the node keeps the claims until this process exits (storenode/writers.py)
            self.conns.drop(addr)

    def _send_writes(self, ops: Sequence[WriteOp], notice: bool, deadline: ReplicaDeadline | None = None):
        """Send the ``write`` (header + payload) or ``claim`` frames (``notice``) of ``ops``
        in one scatter/gather stream, waiting at most ``deadline`` on the node; returns what
        :meth:`_finish_writes` needs."""
        ops = [op for op in ops if op.error is None]
        if not ops:
            return None
        addr = ops[0].ref.shm_path if notice else self._stream_addr(ops[0].ref)
        try:
            s = self.conns.stream(addr, deadline.timeout_s if deadline is not None else None,
                           incarnation=ops[0].ref.incarnation)
            if deadline is not None:
                s.sock.settimeout(deadline.timeout_s)
            bufs: list = []
            hashing: list = []  # (op, future of its xxh3_64 on the helper thread)
            after: list = []  # small ops hashed after the send
            for op in ops:
                r = op.ref
                if not notice and len(op.data) != r.size:
                    raise InvalidRequest(f"buffer for {op.key!r} has {len(op.data)} bytes; the grant is {r.size}")
                if not notice and op.checksum is None and r.size <= _CHUNK:
                    after.append(op)  # one piece: hashed once sent, while the node takes it in
                stream_hash = not notice and op.checksum is None and r.size > _CHUNK
                aside = self.shm.hash_aside(op.data) if stream_hash and r.size >= _NET_ASIDE_MIN else None
                bufs.append(frame(DataRequest("claim" if notice else "write", r.incarnation, r.offset, r.size,
                                              r.gen, op.key, op.checksum or 0, op.layout, r.token)))
                if aside is not None:  # hashed on the helper while the kernel copies it
                    hashing.append((op, aside))
                    bufs.append(op.data)
                elif stream_hash:  # the node learns the checksum from the master's commit
                    sendv(s.sock, bufs)
                    bufs = []
                    op.checksum = _send_hashing(s.sock, op.data)
                elif not notice and r.size:
                    bufs.append(op.data)
            sendv(s.sock, bufs)
            for op in after:  # (the node learns the checksum from the commit)
                op.checksum = xxhash.xxh3_64_intdigest(op.data)
            for op, fut in hashing:
                op.checksum = fut.result()
            return addr, s, ops
        except (OSError, KVPoolError) as e:
            self.conns.failed(addr, ops, e, "write")
            return None

    def commit(self, ops: Sequence[WriteOp]) -> None:
        """After ``put_end`` committed ``ops`` (all to one node, ``op.checksum`` set): send
        the node one-way ``commit`` frames, so the commit reaches the node's table even if
        the master dies before its own notice leaves (a failover rebuilds from those tables).
        Best effort, no reply: the master's notice is the primary path."""
        r0 = ops[0].ref
        addr = r0.shm_path if self.segmaps.uses_shm(r0) else self._stream_addr(r0)
        try:
            # no connection from this thread yet (the writes ran in pool threads): do not let an
            # unreachable node hold up a put that is already acknowledged
            s = self.conns.stream(addr, connect_timeout_s=min(self.io_timeout_s, _COMMIT_CONNECT_S),
                           incarnation=r0.incarnation)
            sendv(s.sock, [b"".join(frame(DataRequest("commit", op.ref.incarnation, op.ref.offset, op.ref.size,
                                                      op.ref.gen, op.key, op.checksum or 0, op.layout, op.ref.token,
                                                      replicas=op.replicas)) for op in ops)])
        except (OSError, KVPoolError):
            self.conns.drop(addr)

    def _finish_writes(self, pending, deadline: ReplicaDeadline | None = None, claims: bool = False) -> None:
        """Read the replies of :meth:`_send_writes`' frames into the ops' errors. ``claims``:
        they were claims; when their verdicts do not come (the deadline passed, the stream
        broke), nothing is copied, and ``written`` frames follow them so that a node that
        answers late does not keep the claims of a stream this side closed."""
        if pending is None:
            return
        addr, s, ops = pending
        try:
            self.spin.wait(s)
            for op in ops:
                rep = s.reply()
                if not rep.ok and op.error is None:
                    op.error = from_wire(rep.error)
            if deadline is not None:
                s.sock.settimeout(self.io_timeout_s)
        except (OSError, KVPoolError) as e:
            if isinstance(e, TimeoutError):
                e = NodeUnavailable(f"store node {ops[0].ref.node_id} did not answer a write within "
                                    f"{deadline.timeout_s if deadline else self.io_timeout_s:g}s",
                                    node=ops[0].ref.node_id)
            if claims:
                with contextlib.suppress(OSError):
                    s.sock.settimeout(_RELEASE_S)
                    sendv(s.sock, [_written(ops)])
            self.conns.failed(addr, ops, e, "write")

    # ---- reads --------------------------------------------------------------------------

    def read(self, ops: Sequence[ReadOp], deadline: ReplicaDeadline | None = None) -> None:
        """Read every op (all from one node) into its ``out``; sets ``op.error`` on failure
        (and ``op.digest`` when it was asked for). ``deadline``: how long a network read may
        wait on the node (:class:`ReplicaDeadline`; default: ``io_timeout_s``); shared-memory
        copies do not wait on the node and ignore it."""
        uses_shm, copies = self.segmaps.uses_shm, self.shm
        net, dma = [], []
        for op in ops:
            local = uses_shm(op.ref)
            if type(op.out) is ScatterOut:  # pages: copied straight in from a mapped segment, else staged
                if local:
                    copies.copy_scatter(op)
                    continue
                try:
                    op.out = op.out.host(op.ref.size)
                except LoadCancelled as e:
                    op.error = e
                    continue
            elif not isinstance(op.out, memoryview):  # a CUDA tensor
                if local and self.cuda.direct(op.ref, op.out):
                    dma.append(op)
                    continue
                if not _stage(op, False):
                    continue
            if local:
                copies.copy_out(op)
            else:
                net.append(op)
        self.cuda.dma(dma, into_segment=False)
        if net:
            self.finish_reads(self.start_reads(net, deadline))

    def start_reads(self, net: Sequence[ReadOp], deadline: ReplicaDeadline | None = None) -> tuple | None:
        """Send the read requests of ``net`` (network reads into memoryviews, all from one
        node) on this thread's stream to it, and return at once; :meth:`finish_reads` with
        what this returns receives the bytes. The caller sends nothing else on this
        thread's stream to that node in between (a master round trip is fine). None, with
        every op failed, when the requests could not go out."""
        addr = self._stream_addr(net[0].ref)
        try:
            s = self.conns.stream(addr, deadline.timeout_s if deadline is not None else None,
                           incarnation=net[0].ref.incarnation)
            for op in net:
                if len(op.out) < op.ref.size:
                    raise InvalidRequest(f"output buffer of {len(op.out)} bytes is smaller than the "
                                         f"{op.ref.size}-byte extent")
            sendv(s.sock, [b"".join([frame(DataRequest(_READ_OP[op.ref.tier], op.ref.incarnation, op.ref.offset,
                                                        op.ref.size, op.ref.gen)) for op in net])])
        except (OSError, KVPoolError) as e:  # the stream is dropped
            self.conns.failed(addr, net, e, "read")
            return None
        return addr, s, net, deadline

    def abandon_reads(self, pending: tuple | None) -> None:
        """Drop the stream of :meth:`start_reads` whose replies will not be read."""
        if pending is not None:
            self.conns.drop(pending[0])

    def finish_reads(self, pending: tuple | None) -> None:
        """Receive the replies of :meth:`start_reads` into the ops' ``out`` (and ``digest``),
        or their errors; a stream that breaks or passes the deadline is dropped."""
        if pending is None:
            return
        addr, s, net, deadline = pending
        try:
            self.spin.wait(s)
            if deadline is not None and isinstance(s.sock, socket.socket):  # (a UCX stream waits io_timeout_s)
                if not s.buffered() and not (deadline.first_byte or _wait_bytes(deadline.timeout_s))(s.sock):
                    raise NodeUnavailable(f"store node {net[0].ref.node_id} did not answer within the "
                                          f"{deadline.timeout_s:g}s replica deadline", node=net[0].ref.node_id)
                s.sock.settimeout(deadline.timeout_s)  # then no wait for bytes may pass it either
            for op in net:
                size = op.ref.size
                rep: DataReply = s.reply(greedy=size < _BIG)
                if rep.ok and rep.size != size:  # the stream is out of step (a reply to another request)
                    raise InvalidRequest(f"store node {op.ref.node_id} answered a read of {size} bytes with {rep.size}")
                if rep.ok:
                    h = xxhash.xxh3_64() if op.digest else None
                    s.read_into(op.out[:size], h)
                    if h is not None:
                        op.digest = h.intdigest()
                else:
                    op.error = from_wire(rep.error)
            if deadline is not None:
                s.sock.settimeout(self.io_timeout_s)
        except (OSError, KVPoolError) as e:  # the stream is dropped: a reply may still be on its way
            self.conns.failed(addr, net, e, "read")

    def _stream_addr(self, ref: ExtentRef) -> str:
        """The address a stream to ``ref``'s node dials: its ``ucx://`` address in ``ucx``
        mode (when it serves one), its Unix socket when it proved to share this host, else
        its data address."""
        if self.mode == "ucx" and ref.ucx_addr:
            return ref.ucx_addr
        if self.segmaps.same_host(ref):
            return ref.shm_path  # same host without shm: the node's Unix socket
        return ref.data_addr

    def close(self) -> None:
        self.shm.close()
        self.conns.close()
        self.segmaps.close()


def _written(ops: Sequence[WriteOp]) -> bytes:
    """One-way ``written`` frames of ``ops``: their copies are over, their claims end."""
    return b"".join(frame(DataRequest("written", op.ref.incarnation, op.ref.offset, op.ref.size, op.ref.gen,
                                      op.key, op.checksum or 0, op.layout, op.ref.token)) for op in ops)


def _send_hashing(sock, data: memoryview) -> int:
    """Send ``data`` in 256 KiB pieces, hashing each right after the kernel copied it (the
    piece is still in cache): the xxh3_64 of ``data`` without a separate pass over memory."""
    h = xxhash.xxh3_64()
    for a in range(0, len(data), _CHUNK):
        piece = data[a:a + _CHUNK]
        sendv(sock, [piece])
        h.update(piece)
    return h.intdigest()


