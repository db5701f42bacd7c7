"""KVPoolClient: put/get/exists/remove of bytes and torch tensors, batch forms, admin calls
and the P/D hand-off API (DESIGN.md §5–7).

Put: into extents reserved ahead of need, one copy and one ``PutReserved`` round trip
(:mod:`connector.reserved_puts`); otherwise, and for anything that path cannot finish,
``put_start`` (master places replicas) → write every replica in parallel (one thread per
node) → ``put_end`` commits; a failed replica write revokes the put and reports the error
for that key. The master places as many replicas as live nodes can take
(up to the count asked for); :meth:`KVPoolClient.put_batch_results` says per key how many
landed (:class:`PutResult`). Get: ``lookup`` grants a read lease → read one replica
(same-host shared memory first) → verify the xxh3_64 checksum and that the lease was
still valid when the read finished; otherwise try the next replica, then look up again
once, then report :class:`~protocol.errors.LeaseExpired` /
:class:`~protocol.errors.ChecksumMismatch`. A miss is ``None``. A network read waits on a
node at most ``replica_timeout_s`` while the key has another replica, and hedges to it
after ``hedge_after_s`` without a first byte (:mod:`connector.hedge`).

Buffers: ``bytes``/``bytearray``/``memoryview``/numpy arrays (C-contiguous) and torch
tensors (contiguous; CPU directly, CUDA through a host staging copy). No intermediate
``bytes`` objects are made for tensor puts or gets.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from kvpool.connector.dataclient import DataPlane, ReadOp, ReplicaDeadline, WriteOp
from kvpool.connector.hedge import ReplicaReads
from kvpool.connector.hinted_reads import HintedReads
from kvpool.connector.prehash import prehash
from kvpool.connector.read_leases import ReadLeases
from kvpool.connector.reserved_puts import ReservedPuts
from kvpool.connector.scatter_out import ScatterOut
from kvpool.connector.rpc import MasterRPC
from kvpool.protocol.auth import Security, resolve
from kvpool.protocol import messages as M
from kvpool.protocol.errors import (ChecksumMismatch, ConfigError, ExtentBusy, InvalidRequest, KVPoolError,
                             LayoutMismatch, LeaseExpired, LoadCancelled, NodeUnavailable, NotFound, PutInFlight,
                             PutRevoked, ReplyTooLarge, StaleExtent, StaleTerm, from_wire)
from kvpool.protocol.keys import validate_key
from kvpool.protocol.layout import LayoutSpec, check_layout, layout_bytes, raw_layout
from kvpool.protocol.config import CLIENT_DEFAULTS
from kvpool.protocol.spin import SPIN_WAIT_MAX_S
from kvpool.protocol.transport import default_host_id
from kvpool.protocol.units import check_wait

LEASE_MARGIN = 0.9  # use 90% of the granted lease, for clock and scheduling slack
_INLINE_BYTES = 1 << 20  # shared-memory copies below this hold the GIL: done in the calling thread
_D = CLIENT_DEFAULTS  # the defaults below: protocol/config.py ClientConfig, parsed once
PIPELINE_KEYS = 64  # a batch get of more keys looks up each slice of this many while reading the one before
_LANE_MIN = 4 << 20  # a node's share of a network batch is split into streams only above this many bytes
PUT_ROUNDS = 3  # placements a put_start/put_end put gets at most (a dead node, a busy extent, a revoked grant)
DISK_STREAMS = 4  # streams one batch's reads of a node's disk tier use at most (storenodes[].disk_readers: 4)


def as_buffer(x: Any, writable: bool) -> tuple[Any, Callable[[], None] | None]:
    """A flat unsigned-byte memoryview over ``x`` plus an optional finaliser; for a CUDA
    tensor a :class:`~connector.device_buffer.DeviceBuffer` (moved by DMA or staged, see
    :mod:`connector.dataclient`) whose finaliser copies a staged read into the tensor; a
    :class:`~connector.scatter_out.ScatterOut` (gets only) as it is, with its finaliser.
    Raises InvalidRequest for anything that is not one contiguous run of plain bytes
    (strided, sparse, nested, conjugate/negative views, object arrays, meta tensors,
    released views, non-buffers) and for read-only outputs."""
    try:
        return _as_buffer(x, writable)
    except (TypeError, ValueError, RuntimeError, BufferError) as e:  # whatever the object's own checks raise
        raise InvalidRequest(f"cannot use a {type(x).__name__} as a byte buffer: {e}") from None


def _as_buffer(x: Any, writable: bool) -> tuple[Any, Callable[[], None] | None]:
    if type(x) is ScatterOut:
        if not writable:
            raise InvalidRequest("a ScatterOut is a get's destination; put its bytes as one buffer")
        return x, x.finish
    torch = sys.modules.get("torch")  # a tensor means torch is imported already
    if torch is not None and isinstance(x, torch.Tensor):
        if x.is_nested:
            raise InvalidRequest("a nested tensor is not one run of bytes; store its components one by one")
        if x.layout != torch.strided:
            raise InvalidRequest(f"a {x.layout} tensor is not one run of bytes; call .to_dense() first")
        if x.is_conj() or x.is_neg():
            raise InvalidRequest("a lazily conjugated or negated tensor view holds other bytes than it shows; "
                                 "call .resolve_conj().resolve_neg() first")
        if not x.is_contiguous():
            raise InvalidRequest("tensor is not contiguous; call .contiguous() first")
        if x.device.type == "meta":
            raise InvalidRequest("a meta tensor has no data to store or fill")
        if x.device.type != "cpu":
            from kvpool.connector.device_buffer import DeviceBuffer

            buf = DeviceBuffer(x)
            return buf, (buf.finish if writable else None)
        flat = x.reshape(-1).view(torch.uint8) if x.numel() else torch.empty(0, dtype=torch.uint8)
        return memoryview(flat.numpy()), None
    if type(x).__module__.startswith("numpy"):
        if type(x).__module__.startswith("numpy.ma"):
            raise InvalidRequest("a masked array's mask would be lost; store .filled(value), or its .data and "
                                 ".mask as two objects")
        if x.dtype.hasobject:
            raise InvalidRequest(f"a numpy array of dtype {x.dtype} holds Python object pointers, not bytes "
                                 "to store; convert it to a numeric dtype")
        try:
            mv = memoryview(x)  # most dtypes export a buffer: cheaper than a reshape/view
        except (TypeError, ValueError):  # e.g. datetime64: view its bytes instead
            mv = None
        if not (x.flags["C_CONTIGUOUS"] if mv is None else mv.c_contiguous):
            raise InvalidRequest("array is not C-contiguous; use numpy.ascontiguousarray")
        if mv is None:
            mv = memoryview(x.reshape(-1).view("u1"))
    else:
        try:
            mv = memoryview(x)
        except TypeError:
            raise InvalidRequest(f"expected bytes, bytearray, memoryview, a numpy array or a torch tensor, "
                                 f"got {type(x).__name__}") from None
        if not mv.c_contiguous:
            raise InvalidRequest("buffer is not C-contiguous (a strided memoryview?); pass a contiguous copy, "
                                 "e.g. bytes(view) or numpy.ascontiguousarray")
    if writable and mv.readonly:
        raise InvalidRequest("output buffer is read-only; pass a bytearray, numpy array or tensor")
    if mv.nbytes == 0:
        return memoryview(bytearray()), None  # an empty view of any shape (cast refuses zero dims)
    return (mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv), None


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put did for one key (:meth:`KVPoolClient.put_batch_results`).

    ``error``: None on success, else the typed error (the key was not stored by this call).
    ``stored``: this call wrote and committed the bytes (False: the key was stored already,
    a content-addressed no-op, or the error). ``replicas``: replicas this call wrote (0 when
    it stored nothing); ``replicas_wanted``: the replica count it asked for, the cluster
    default resolved (0 when it stored nothing)."""

    key: str
    error: KVPoolError | None = None
    stored: bool = False
    replicas: int = 0
    replicas_wanted: int = 0

    @property
    def ok(self) -> bool:
        """No error: stored now or already present."""
        return self.error is None

    @property
    def short(self) -> bool:
        """Stored on fewer replicas than asked for (fewer live store nodes could take it)."""
        return self.stored and self.replicas < self.replicas_wanted


class KVPoolClient:
    """A connection to one kvpool cluster. Thread-safe.

    ``master``: the master's RPC address (``tcp://host:port``), or ``etcd`` + ``cluster``
    to follow the elected leader. ``transport``: ``auto`` | ``shm`` | ``unix`` | ``tcp`` | ``ucx``
    (see :class:`~connector.dataclient.DataPlane`).
    ``streams_per_node``: network connections (TCP/Unix/UCX) one batch uses per store node;
    a node's share of a batch above 4 MiB is split into that many byte-balanced lanes moved
    in parallel (several kernel copies at once, as Mooncake's TCP transport does for big
    transfers). Default 1: on a machine with few cores a second stream brings no gain
    (benchmarks/RESULTS.md); raise it where spare cores can copy in parallel.
    ``read_hook(key)`` runs after bytes land and before validation (fault injection in
    tests: a slow reader). ``cuda_direct``: CUDA tensors move by DMA to and from same-host
    segments (registered with CUDA on first use); False stages them through pinned host
    memory like every other path (see :mod:`connector.device_buffer`).
    ``replica_timeout_s``: seconds a network read of a replica may wait on its node (connect,
    and every wait for bytes) while the key has another replica to read; past it the next
    replica is read (None: wait ``io_timeout_s``). ``hedge_after_s``: seconds without a first
    byte after which the next replica is read as well, the first to deliver winning (None:
    no hedging). A node that missed its deadline is read last for a few seconds. See
    :mod:`connector.hedge`; ConfigError for values that are not seconds > 0.
    ``write_timeout_s``: seconds a put's write of one replica may wait on its node (connect,
    each wait for bytes or a reply; None: ``io_timeout_s``); past it the write fails with
    NodeUnavailable and the put is placed once more without that node (a 2-replica put with
    one node frozen lands one replica, and says so: :attr:`PutResult.short`).
    ``security``: the cluster secret and TLS settings (:class:`~protocol.auth.Security`);
    None reads ``KVPOOL_SECRET_FILE`` / ``KVPOOL_SECRET`` from the environment. A refused
    connection raises :class:`~protocol.errors.AuthFailed` naming the cause.
    ``etcd_auth``: etcd credentials for the leader lookups (:class:`~protocol.etcd.EtcdAuth`:
    user/password, TLS files); None: an open etcd.
    ``reserve_bytes``: bytes of extents this client reserves ahead of need, across object
    sizes, so that a put is one copy and one round trip to the master
    (:mod:`connector.reserved_puts`); 0 turns reservations off (every put asks the master for
    its extents first). ``reserve_max_object_bytes``: objects above this size (bytes) are
    never put through reservations. ConfigError for negative values.
    ``spin_wait_s``: seconds a wait for a reply from the master or a store node first polls
    its socket, yielding the CPU between polls, before it sleeps in the kernel: a reply
    within it costs no wake-up of this thread (:mod:`protocol.spin`); 0 sleeps at once
    (what an engine sharing its CPUs with the forward pass wants). ConfigError outside
    [0, 0.01].
    """

    def __init__(self, master: str | None = None, *, etcd: str | None = None, cluster: str = "default",
                 transport: str = _D["transport"], host_id: str | None = None,
                 rpc_timeout_s: float = _D["rpc_timeout_s"], io_timeout_s: float = _D["io_timeout_s"],
                 lease_retries: int = 1, in_flight_wait_s: float = 5.0,
                 streams_per_node: int = _D["streams_per_node"], read_hook: Callable[[str], None] | None = None,
                 cuda_direct: bool = True, replica_timeout_s: float | None = _D["replica_timeout_s"],
                 hedge_after_s: float | None = _D["hedge_after_s"], security: Security | None = None,
                 write_timeout_s: float | None = _D["write_timeout_s"], etcd_auth=None,
                 reserve_bytes: int = _D["reserve_bytes"],
                 reserve_max_object_bytes: int = _D["reserve_max_object_bytes"],
                 spin_wait_s: float = _D["spin_wait_s"]) -> None:
        if not (isinstance(spin_wait_s, (int, float)) and 0 <= spin_wait_s <= SPIN_WAIT_MAX_S):
            raise ConfigError(f"spin_wait_s must be seconds from 0 to {SPIN_WAIT_MAX_S:g}, got {spin_wait_s!r}",
                              key="spin_wait")
        if not (isinstance(streams_per_node, int) and 1 <= streams_per_node <= 16):
            raise ConfigError(f"streams_per_node must be an integer from 1 to 16, got {streams_per_node!r}",
                              key="streams_per_node")
        self.streams_per_node = streams_per_node
        # (the other waits are checked where they are used: MasterRPC, DataPlane, ReplicaReads)
        check_wait(write_timeout_s, key="write_timeout_s", none=True)
        check_wait(in_flight_wait_s, key="in_flight_wait_s", zero=True)
        # a replica write waits at most this long on its node; then the put is placed again
        # without it (it says so: PutResult.short), instead of waiting io_timeout_s
        self._write_deadline = None if write_timeout_s is None else ReplicaDeadline(write_timeout_s)
        security = resolve(security)
        self.rpc = MasterRPC(master, etcd, cluster, rpc_timeout_s, security,
                             **({"etcd_auth": etcd_auth} if etcd_auth is not None else {}), spin_s=spin_wait_s)
        self.host_id = host_id or default_host_id()
        self.data = DataPlane(self.host_id, transport, io_timeout_s, cuda_direct, security, spin_s=spin_wait_s)
        self.replica_reads = ReplicaReads(self.data, self.host_id, replica_timeout_s, hedge_after_s)
        self.lease_retries = lease_retries
        self.in_flight_wait_s = in_flight_wait_s
        self.read_hook = read_hook
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvpool-io")
        if not (isinstance(reserve_bytes, int) and reserve_bytes >= 0 and isinstance(reserve_max_object_bytes, int)
                and reserve_max_object_bytes >= 0):
            raise ConfigError(f"reserve_bytes and reserve_max_object_bytes must be integers >= 0, got "
                              f"{reserve_bytes!r} and {reserve_max_object_bytes!r}", key="reserve_bytes")
        self.hints = HintedReads(self.data, self.replica_reads, self._release_live)  # connector/hinted_reads.py
        self.reserved = ReservedPuts(self.rpc, self.data, self.host_id, reserve_bytes, reserve_max_object_bytes,
                                     self._parallel, self._write_deadline, self._await_in_flight,
                                     self.hints.remember)  # connector/reserved_puts.py

    @classmethod
    def from_config(cls, cfg, master: str | None = None, **overrides) -> "KVPoolClient":
        """A client with the settings of ``cfg.client`` (and its etcd and security sections);
        ``overrides``: constructor arguments that replace them."""
        from kvpool.protocol.etcd import EtcdAuth

        kw = dict(etcd=cfg.etcd.endpoint, cluster=cfg.cluster, **cfg.client.client_kwargs(),
                  security=Security.from_config(cfg.security), etcd_auth=EtcdAuth.from_config(cfg.etcd))
        return cls(master, **{**kw, **overrides})

    def reservations_held(self) -> int:
        """Reservations this client holds now, all object sizes (connector/reserved_puts.py)."""
        return self.reserved.held()

    def close(self) -> None:
        self.reserved.close()
        self._pool.shutdown(wait=True)
        self.replica_reads.close()
        self.data.close()
        self.rpc.close()

    def __enter__(self) -> "KVPoolClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- puts ---------------------------------------------------------------------------

    def put(self, key: str, data: Any, layout: LayoutSpec | None = None, replicas: int | None = None) -> bool:
        """Store ``data`` under ``key``. Returns True when this call stored the bytes, False
        when the key already existed (content-addressed no-op). Raises the typed error
        (InvalidKey, InvalidRequest, ObjectTooLarge, NoSpace, NodeUnavailable, PutInFlight, ...).
        How many replicas landed: :meth:`put_batch_results`."""
        errs, stored = self._put([key], [data], [layout], replicas)
        if errs[0] is not None:
            raise errs[0]
        return stored[0] is not None

    def put_batch(self, keys: Sequence[str], datas: Sequence[Any],
                  layouts: Sequence[LayoutSpec | None] | LayoutSpec | None = None,
                  replicas: int | None = None) -> list[KVPoolError | None]:
        """Store many objects with one master round trip each way; per-key results (None =
        stored or already present). How many replicas landed: :meth:`put_batch_results`."""
        return self._put(keys, datas, layouts, replicas)[0]

    def put_batch_results(self, keys: Sequence[str], datas: Sequence[Any],
                          layouts: Sequence[LayoutSpec | None] | LayoutSpec | None = None,
                          replicas: int | None = None) -> list[PutResult]:
        """:meth:`put_batch` with one :class:`PutResult` per key: its error, whether this call
        stored the bytes, and on how many replicas of how many asked for (``replicas``, or the
        cluster default). A put stored on fewer replicas than asked (fewer live store nodes
        could take it) succeeds with ``short`` set, as Mooncake Store reports a status per
        key; the master re-replicates it in the background as nodes allow. Raises what
        :meth:`put_batch` raises (InvalidRequest for mismatched arguments, master errors)."""
        errs, stored = self._put(keys, datas, layouts, replicas)
        return [PutResult(k, e, s is not None, *(s or (0, 0))) for k, e, s in zip(keys, errs, stored)]

    def _put(self, keys, datas, layouts, replicas) -> tuple[list[KVPoolError | None], list[tuple[int, int] | None]]:
        """Per key: the error or None, and (replicas written, replicas wanted) when this call
        stored it (None: not stored by it)."""
        n = len(keys)
        if len(datas) != n:
            raise InvalidRequest(f"put_batch: {n} keys but {len(datas)} buffers")
        if replicas is not None and not 1 <= replicas <= 16:
            raise InvalidRequest(f"replicas must be between 1 and 16, got {replicas}")
        lays = _per_key(layouts, n)
        cuts = _request_cuts(keys, lays)
        if len(cuts) > 2:  # the master takes this many keys (and bytes) per request
            errs: list[KVPoolError | None] = []
            stored_all: list[tuple[int, int] | None] = []
            for a, b in zip(cuts, cuts[1:]):
                e, st = self._put(keys[a:b], datas[a:b], lays[a:b], replicas)
                errs += e
                stored_all += st
            return errs, stored_all
        results: list[KVPoolError | None] = [None] * n
        stored: list[tuple[int, int] | None] = [None] * n
        items, bufs, idx = [], [], []
        for i, (k, d, lay) in enumerate(zip(keys, datas, lays)):
            try:
                k = validate_key(k)
                mv, _ = as_buffer(d, writable=False)
                if lay is not None and lay.nbytes != len(mv):
                    raise LayoutMismatch(f"object {k!r} has {len(mv)} bytes but layout {lay.kind} describes "
                                         f"{lay.nbytes}", key=k)
                items.append(M.PutItem(k, len(mv), 0, raw_layout(lay)))  # checksum: computed while writing, sent at put_end
                bufs.append(mv)
                idx.append(i)
            except KVPoolError as e:
                results[i] = e
        if items and self.reserved.reserve_budget:
            todo = self.reserved.put(items, bufs, idx, replicas, results, stored)
            items, bufs, idx = [items[j] for j in todo], [bufs[j] for j in todo], [idx[j] for j in todo]
        if items:
            self.reserved.forget_old_terms()  # a new leader places over an old one's reservations
            if self.reserved.ends_pending:  # claims this client ended lately first: put_start may grant those ranges again
                self.reserved.flush_ends()
            for round_ in range(PUT_ROUNDS):  # writes that hit a dead node or a busy extent are placed again
                retry = self._put_round(items, bufs, idx, replicas, results, stored)
                if not retry or round_ == PUT_ROUNDS - 1:
                    break  # (the last round's errors stand)
                items, bufs, idx = [items[j] for j in retry], [bufs[j] for j in retry], [idx[j] for j in retry]
                for i in idx:
                    results[i] = None
        return results, stored

    def _put_round(self, items, bufs, idx, replicas, results, stored) -> list[int]:
        """put_start → write replicas in parallel → put_end. Returns positions (in ``items``)
        whose write failed on a dead node (worth one more placement)."""
        sums: list[int | None] = [None] * len(items)
        grants = self.rpc.call(M.PutStart(items, self.host_id, replicas or 0), meanwhile=lambda answered: prehash(bufs, sums, range(len(bufs)), answered))
        by_node: dict[str, list[WriteOp]] = defaultdict(list)
        ops_of: dict[int, list[WriteOp]] = {}
        in_flight: list[int] = []
        for j, g in enumerate(grants):
            i = idx[j]
            if isinstance(g, M.ErrorInfo):
                results[i] = from_wire(g)
                continue
            if g.status == "in_flight":
                in_flight.append(j)
            if g.status != "write":
                continue  # "exists": content-addressed no-op
            lay = layout_bytes(items[j].wire_layout)
            # hashed while put_start was in flight, or else by the first replica's write as it
            # copies or sends the bytes (checksum None): the others carry 0 then, and every node
            # gets the real one with the commit
            first = sums[j]
            ops = [WriteOp(r, bufs[j], g.key, first if k == 0 else first or 0, lay,
                           g.replicas_wanted) for k, r in enumerate(g.replicas)]
            ops_of[j] = ops
            for op in ops:
                by_node[op.ref.node_id].append(op)
        try:
            self._parallel(self._write, by_node)
        except BaseException:  # a bug or Ctrl-C mid-write: give the grants back, do not leave them pending
            if ops_of:
                self.rpc.send_nowait(M.PutRevoke([grants[j].key for j in ops_of], [grants[j].put_id for j in ops_of]))
            raise
        commit_keys, commit_ids, commit_sums, revoke_keys, revoke_ids, commit_j, retry = [], [], [], [], [], [], []
        for j, ops in ops_of.items():
            g = grants[j]
            bad = next((op.error for op in ops if op.error is not None), None)
            if bad is None:
                commit_keys.append(g.key)
                commit_ids.append(g.put_id)
                commit_sums.append(ops[0].checksum)
                commit_j.append(j)
            elif isinstance(bad, StaleTerm):  # granted by a deposed leader: nothing to revoke; place it again
                results[idx[j]] = bad
                retry.append(j)
                self.rpc.forget_leader()
            else:
                revoke_keys.append(g.key)
                revoke_ids.append(g.put_id)
                results[idx[j]] = bad
                if isinstance(bad, (NodeUnavailable, ExtentBusy, PutRevoked)):  # busy: quarantined; revoked: stalled
                    retry.append(j)
        if revoke_keys:
            self.rpc.call(M.PutRevoke(revoke_keys, revoke_ids))
            dead = {op.ref.node_id: op.ref.incarnation for ops in ops_of.values() for op in ops
                    if isinstance(op.error, NodeUnavailable)}
            for nid, inc in dead.items():
                self.rpc.call(M.ReportDead(nid, inc))  # the master stops placing there for a while
                self.data.segmaps.forget(nid)
        if commit_keys:
            committed: dict[str, list[WriteOp]] = defaultdict(list)
            for j, e in zip(commit_j, self.rpc.call(M.PutEnd(commit_keys, commit_ids, commit_sums))):
                if e is not None:
                    results[idx[j]] = from_wire(e)
                    if isinstance(results[idx[j]], PutRevoked):  # a replica's node died meanwhile, the
                        retry.append(j)  # writer stalled past put_timeout, or a new leader: place it again
                else:
                    stored[idx[j]] = (len(ops_of[j]), grants[j].replicas_wanted or len(ops_of[j]))
                    for op in ops_of[j]:
                        op.checksum = ops_of[j][0].checksum
                        committed[op.ref.node_id].append(op)
            for ops in committed.values():  # acknowledged: make sure the nodes learn it (master failover)
                self.data.commit(ops)
        if in_flight:
            self._await_in_flight(items, idx, in_flight, results)
        return retry

    def _write(self, ops: list[WriteOp]) -> None:
        self.data.write(ops, self._write_deadline)

    def _await_in_flight(self, items, idx, in_flight: list[int], results) -> None:
        """Another writer is storing the same key: wait (bounded) until it is committed, so
        that a successful put means the key is readable."""
        deadline = time.monotonic() + self.in_flight_wait_s
        waiting = list(in_flight)
        while waiting:
            there = self.rpc.call(M.Exists([items[j].key for j in waiting]))
            waiting = [j for j, ok in zip(waiting, there) if not ok]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        for j in waiting:
            results[idx[j]] = PutInFlight(
                f"another writer is storing {items[j].key!r} and had not committed it within "
                f"{self.in_flight_wait_s:g}s; retry later (its put is revoked after master.put_timeout)",
                key=items[j].key)

    def _parallel(self, fn, by_node: dict[str, list]) -> None:
        """Run ``fn`` on each node's ops: shared-memory groups of objects under
        :data:`_INLINE_BYTES` right here (such copies hold the GIL, so a thread hand-off
        would cost more than it overlaps); everything else — network streams, split into
        up to ``streams_per_node`` lanes per node, and big copies, which release the GIL —
        in parallel: one unit in this thread, the others in pool threads. Each thread has
        its own connection per node, so a node's lanes are distinct streams."""
        units = []
        for ops in by_node.values():
            if self.data.segmaps.uses_shm(ops[0].ref):
                if max(op.ref.size for op in ops) < _INLINE_BYTES:
                    fn(ops)
                else:
                    units.append(ops)
            else:  # (a node's disk reads: several streams, so the node's disk readers work in parallel)
                units.extend(disk_lanes(ops) if ops[0].ref.tier else lanes(ops, self.streams_per_node))
        if not units:
            return
        futs = [self._pool.submit(fn, g) for g in units[1:]]
        try:
            fn(units[0])
        finally:
            errors = [f.exception() for f in futs]  # waits for every unit, even when this one failed
        for e in errors:
            if e is not None:
                raise e

    # ---- gets ---------------------------------------------------------------------------

    def get(self, key: str, layout: LayoutSpec | None = None) -> bytes | None:
        """The object's bytes, or None when not stored."""
        r = self.get_batch([key], layout)[0]
        if isinstance(r, KVPoolError):
            raise r
        return r

    def get_into(self, key: str, out: Any, layout: LayoutSpec | None = None) -> int | None:
        """Copy the object into ``out`` (≥ its size); return bytes copied, None on a miss.
        Raises LayoutMismatch, LeaseExpired, ChecksumMismatch, NodeUnavailable."""
        r = self.get_into_batch([key], [out], layout)[0]
        if isinstance(r, KVPoolError):
            raise r
        return r

    def get_batch(self, keys: Sequence[str], layout=None) -> list[bytes | None | KVPoolError]:
        """Batch get into new buffers sized from the lookup: per key bytes, None or error."""
        n = len(keys)
        results: list[Any] = [None] * n
        outs: list[bytearray] = [bytearray() for _ in range(n)]
        todo = self._valid(keys, results)
        self._get_rounds(keys, _per_key(layout, n), results, todo, [None] * n, alloc=outs)
        return [bytes(o) if isinstance(r, int) else r for r, o in zip(results, outs)]

    def get_into_batch(self, keys: Sequence[str], outs: Sequence[Any],
                       layout: Sequence[LayoutSpec | None] | LayoutSpec | None = None,
                       leases: ReadLeases | None = None) -> list[int | None | KVPoolError]:
        """Batch get into caller buffers: per key bytes copied, None (miss) or the error.
        A buffer may be a :class:`~connector.scatter_out.ScatterOut` (one object into
        several pages, filled in order; same-host reads copy straight into them).

        ``leases``: answers of an earlier leased lookup (:meth:`lookup_leased`, possibly
        made by another process on this host): keys it holds are read without a lookup of
        their own, and their leases released; each answer is taken out of ``leases``
        (used once). Keys it lacks, and all of them when it is not usable here (another
        host, or a lease near its end: :meth:`ReadLeases.usable`), are looked up as usual,
        as is any key whose read under the handed-over lease failed."""
        n = len(keys)
        if len(outs) != n:
            raise InvalidRequest(f"get_into_batch: {n} keys but {len(outs)} buffers")
        results: list[int | None | KVPoolError] = [None] * n
        views: list[memoryview | None] = [None] * n
        fins: list[Callable[[], None] | None] = [None] * n
        todo = []
        for i in self._valid(keys, results):
            try:
                views[i], fins[i] = as_buffer(outs[i], writable=True)
                todo.append(i)
            except KVPoolError as e:
                results[i] = e
        lays = _per_key(layout, n)
        if leases is not None and todo and leases.usable(time.monotonic(), LEASE_MARGIN):
            todo = self._read_with(leases, keys, lays, results, todo, views)
        self._get_rounds(keys, lays, results, todo, views)
        for i in range(n):
            if isinstance(results[i], int) and fins[i] is not None:
                try:
                    fins[i]()
                except LoadCancelled as e:  # a staged read the pages' owner no longer wants
                    results[i] = e
        return results

    def _read_with(self, leases: ReadLeases, keys, lays, results, todo: list[int], views: list) -> list[int]:
        """Read the keys ``leases`` answers for under its leases (released after); returns
        the indices still to look up: those it lacks, and those to retry."""
        held, infos, rest = [], [], []
        for i in todo:
            info = leases.take(keys[i])
            if info is None:
                rest.append(i)
            else:
                held.append(i)
                infos.append(info)
        if held:
            rest += self._read(keys, views, lays, results, held, infos, leases.sent_at, False)
        return rest

    def lookup_leased(self, keys: Sequence[str]) -> ReadLeases:
        """Look ``keys`` up with a read lease each (one round trip): the found ones'
        answers, to read later with ``get_into_batch(..., leases=)`` in this or another
        process on this host before the lease lapses (``lease_ttl`` from now, counted as
        a read: the LRU order is touched). Keys not found are absent. Whoever does not
        read an answer lets it go with :meth:`release_leases` (or its lease lapses)."""
        t_sent, infos = self._leased_lookup(keys, range(len(keys)))
        return ReadLeases.of(infos, t_sent)

    def _release_live(self, leased: list, t_sent: float) -> None:
        """Release the leases of ``leased`` (ObjectInfo answers of a lookup sent at
        ``t_sent``) while they are live (:meth:`release_leases`)."""
        if leased:
            self.release_leases([i.key for i in leased], t_sent + min(i.lease_ttl_s for i in leased) * LEASE_MARGIN)

    def release_leases(self, keys: Sequence[str], until: float | None = None) -> None:
        """Let go of read leases taken and not used (one message, no reply; best effort:
        an unreleased lease lapses). ``until``: the monotonic time (seconds) after which
        the leases may have lapsed; from then on nothing is sent, since the master may
        count another reader's lease on a key, which the release would end."""
        if keys and (until is None or time.monotonic() < until):
            for a in range(0, len(keys), M.MAX_BATCH_KEYS):
                self.rpc.send_nowait(M.ReleaseLeases(list(keys[a:a + M.MAX_BATCH_KEYS])))

    @staticmethod
    def _valid(keys: Sequence[str], results: list) -> list[int]:
        """Indices of valid keys; InvalidKey errors go into ``results``."""
        todo = []
        for i, k in enumerate(keys):
            try:
                validate_key(k)
                todo.append(i)
            except KVPoolError as e:
                results[i] = e
        return todo

    def _get_rounds(self, keys, lays, results, todo: list[int], views: list, alloc: list | None = None) -> None:
        """Leased lookup + read, retried with a fresh lease up to ``lease_retries`` times.
        With ``alloc``, buffers are made to each object's size after the lookup.

        A first round of more than ``2 * PIPELINE_KEYS`` keys is pipelined: it goes in
        slices of that many keys, and each slice's reads run while the master answers the
        next slice's lookup (the ``meanwhile`` of :meth:`MasterRPC.call`), so only the first
        slice's lookup is waited for. Each slice holds its own leases."""
        if len(todo) > 2 * PIPELINE_KEYS:
            todo, first = self._pipelined_round(keys, lays, results, todo, views, alloc), 1
        else:
            first = 0
        for attempt in range(first, self.lease_retries + 1):
            if not todo:
                return
            early = (self.hints.start(keys, todo, views) if attempt == 0 and alloc is None and self.read_hook is None
                     else None)  # (a read hook times reads under their lease)
            try:
                t_sent, infos = self._leased_lookup(keys, todo)
            except BaseException:
                if early is not None:  # its reply is never read: the stream goes
                    self.data.abandon_reads(early[2])
                raise
            if early is not None:  # a one-key get whose read went out with its lookup (connector/hinted_reads.py)
                todo, infos = self.hints.end(early, keys, lays, results, todo, infos, t_sent)
                if not todo:
                    return
            self._sized(alloc, views, todo, infos)
            todo = self._read(keys, views, lays, results, todo, infos, t_sent, attempt == self.lease_retries)

    def _pipelined_round(self, keys, lays, results, todo: list[int], views: list, alloc: list | None) -> list[int]:
        """The first round of a big batch (see :meth:`_get_rounds`); returns the indices
        to retry. Every lease granted is released, also when a call or a read fails: a
        slice whose lookup answered is read (its reads release it) or released unread."""
        last = self.lease_retries == 0
        retry: list[int] = []
        prev: tuple | None = None  # the slice looked up and not yet read: (indices, t_sent, infos)
        failed: list[BaseException] = []  # what a read inside the next lookup raised

        def read_prev(_answered=None) -> None:
            nonlocal prev
            part, t_sent, infos = prev
            prev = None
            try:
                retry.extend(self._read(keys, views, lays, results, part, infos, t_sent, last))
            except BaseException as e:  # noqa: BLE001 - raised once the next slice's leases are let go
                failed.append(e)

        try:
            for a in range(0, len(todo), PIPELINE_KEYS):
                part = todo[a:a + PIPELINE_KEYS]
                t_sent = time.monotonic()
                infos = self.rpc.call(M.Lookup([keys[i] for i in part], lease=True),
                                      meanwhile=read_prev if prev is not None else None)
                prev = (part, t_sent, infos)
                if failed:
                    raise failed[0]
                self._sized(alloc, views, part, infos)
            if prev is not None:
                read_prev()
            if failed:
                raise failed[0]
        finally:
            if prev is not None:  # looked up, never read: its leases go back now
                self._release_live([info for info in prev[2] if isinstance(info, M.ObjectInfo)], prev[1])
        return retry

    @staticmethod
    def _sized(alloc: list | None, views: list, todo: list[int], infos: list) -> None:
        """With ``alloc`` (``get_batch``), make each found object's buffer to its size."""
        if alloc is not None:
            for i, info in zip(todo, infos):
                if isinstance(info, M.ObjectInfo):
                    alloc[i] = bytearray(info.size)
                    views[i] = memoryview(alloc[i])

    def _leased_lookup(self, keys, todo: list[int]) -> tuple[float, list]:
        t_sent = time.monotonic()
        return t_sent, self._batched(lambda part: M.Lookup([keys[i] for i in part], lease=True), todo)

    def _batched(self, request: Callable[[Sequence], Any], items: Sequence) -> list:
        """``request(part)`` for each slice of at most ``MAX_BATCH_KEYS`` of ``items`` (the
        master's limit per request), the replies' lists joined in order. A slice whose answer
        would not fit in a frame (ReplyTooLarge: large layouts) is asked again in halves."""
        out: list = []
        for a in range(0, len(items), M.MAX_BATCH_KEYS):
            part = items[a:a + M.MAX_BATCH_KEYS]
            try:
                out += self.rpc.call(request(part))
            except ReplyTooLarge:
                if len(part) < 2:
                    raise
                half = len(part) // 2
                out += self._batched(request, part[:half]) + self._batched(request, part[half:])
        return out

    def _read(self, keys, views, lays, results, todo: list[int], infos, t_sent: float, last: bool) -> list[int]:
        """Read looked-up objects into ``views``; returns the indices to retry with a fresh lease."""
        pending: dict[int, tuple[M.ObjectInfo, list[M.ExtentRef]]] = {}
        for i, info in zip(todo, infos):
            if isinstance(info, M.ErrorInfo):
                err = from_wire(info)
                results[i] = _missing(results[i]) if isinstance(err, NotFound) else err
                continue
            try:
                if lays[i] is not None and raw_layout(lays[i]) != info.wire_layout:  # equal bytes need no field walk
                    check_layout(lays[i], info.layout, info.key)
                if len(views[i]) < info.size:
                    raise InvalidRequest(f"buffer for {info.key!r} holds {len(views[i])} bytes; the object "
                                         f"has {info.size}", key=info.key, size=info.size)
            except KVPoolError as e:
                results[i] = e
                continue
            order = self.replica_reads.order(info.replicas)  # same host first, nodes that just failed last
            if not order:
                results[i] = _missing(results[i])  # every replica was lost: a clean miss
                continue
            pending[i] = (info, order)
        leased = [info for info in infos if isinstance(info, M.ObjectInfo)]  # refused ones too
        try:
            return self._read_leased(views, results, pending, t_sent, last)
        finally:
            self._release_live(leased, t_sent)

    def _read_leased(self, views, results, pending, t_sent: float, last: bool) -> list[int]:
        """The reads of :meth:`_read` while their leases are held (released by the caller)."""
        retry: list[int] = []
        errors: dict[int, KVPoolError] = {}
        while pending:
            by_node: dict[str, list[ReadOp]] = defaultdict(list)
            op_of: dict[int, ReadOp] = {}
            for i, (info, order) in pending.items():
                op = self.replica_reads.op(order, views[i])
                op_of[i] = op
                by_node[op.ref.data_addr].append(op)  # per stream: a node's disk tier has sockets of its own
            self._parallel(self.replica_reads.read, by_node)  # with replica deadlines and hedges
            nxt = {}
            for i, op in op_of.items():
                info, order = pending[i]
                if op.ref is not order[0]:  # a hedged read of the next replica delivered
                    order = order[1:]
                err = op.error
                if type(err) is NodeUnavailable:
                    self.replica_reads.failed(op.ref.node_id)
                if err is None:
                    if self.read_hook is not None:
                        self.read_hook(info.key)
                    if info.lease_ttl_s and time.monotonic() > t_sent + info.lease_ttl_s * LEASE_MARGIN:
                        err = LeaseExpired(f"read of {info.key!r} finished after its {info.lease_ttl_s:g}s lease "
                                           "lapsed; the bytes were discarded. Retry, or raise master.lease_ttl "
                                           "for slow readers", key=info.key)
                    elif (op.digest if type(op.digest) is int  # hashed as the bytes landed, still in cache
                          else xxhash.xxh3_64_intdigest(views[i][:info.size])) != info.checksum:
                        err = ChecksumMismatch(f"bytes of {info.key!r} read from {op.ref.node_id} fail the xxh3 "
                                               "checksum", key=info.key, node=op.ref.node_id)
                        # under a live lease the extent cannot have been reused: the replica is
                        # corrupt. The master drops it, so the key heals (a later put stores it again)
                        self.rpc.send_nowait(M.ReportCorrupt(info.key, op.ref.node_id, op.ref.gen, op.ref.incarnation))
                    else:
                        results[i] = info.size
                        self.hints.remember(info.key, op.ref)
                        continue
                errors[i] = err
                if type(err) is StaleExtent and time.monotonic() < t_sent + info.lease_ttl_s * LEASE_MARGIN:
                    # under a live lease the extent must exist: the node never recorded the write
                    self.rpc.send_nowait(M.ReportCorrupt(info.key, op.ref.node_id, op.ref.gen, op.ref.incarnation))
                if isinstance(err, LeaseExpired):
                    retry.append(i)
                elif isinstance(err, LoadCancelled):  # the pages' owner wants no more reads of it
                    results[i] = err
                elif len(order) > 1:
                    nxt[i] = (info, order[1:])
                elif isinstance(err, (StaleExtent, NodeUnavailable, ChecksumMismatch)) and not last:
                    retry.append(i)
                    if isinstance(err, ChecksumMismatch):
                        results[i] = err  # the cause, should the retry find the key gone (see _missing)
                else:
                    results[i] = err
            pending = nxt
        if last:
            for i in retry:
                results[i] = errors[i]
            return []
        return retry

    # ---- metadata -------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.exists_batch([key])[0]

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        """Existence without a lease and without touching LRU order (side-effect free)."""
        return self._batched(lambda part: M.Exists(list(part)), keys)

    def lookup(self, keys: Sequence[str]) -> list[M.ObjectInfo | None]:
        """Headers and replicas, without a lease."""
        res = self._batched(lambda part: M.Lookup(list(part), lease=False), keys)
        return [r if isinstance(r, M.ObjectInfo) else None for r in res]

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``; raises NotFound, HasLease or Pinned (unless force)."""
        e = self.remove_batch([key], force)[0]
        if e is not None:
            raise e

    def remove_batch(self, keys: Sequence[str], force: bool = False) -> list[KVPoolError | None]:
        self.hints.forget(keys)
        return [None if e is None else from_wire(e) for e in self._batched(lambda part: M.Remove(list(part), force),
                                                                             keys)]

    def ls(self, prefix: str = "", limit: int = 10000) -> list[M.ObjectMeta]:
        return self.rpc.call(M.ListObjects(prefix, limit))

    def story(self, key: str, limit: int = 100) -> list[M.StoryEntry]:
        """What the leading master recorded about ``key``, oldest first (at most ``limit``
        entries; ``t`` in Unix seconds): stored, replicas lost and repaired, demoted,
        promoted, pinned, evicted and why, removed (master/story.py). Empty for a key the
        master's bounded log no longer holds, or one it never saw."""
        return self.rpc.call(M.Story(key, limit))

    def stats(self) -> M.ClusterStats:
        return self.rpc.call(M.Stats())

    def pin(self, key: str, ttl_s: float | None = None) -> None:
        """Hard pin (``ttl_s=None``: never evicted) or soft pin for ``ttl_s`` seconds."""
        self.rpc.call(M.Pin(key, ttl_s))

    def unpin(self, key: str) -> None:
        self.rpc.call(M.Unpin(key))

    def evict(self, selector: M.EvictSelector, dry_run: bool = False, force: bool = False) -> M.EvictReport:
        return self.rpc.call(M.Evict(selector, dry_run, force))

    def config(self) -> M.ClusterSettings:
        """The cluster-wide settings the leader applies (kept in etcd)."""
        return self.rpc.call(M.GetConfig())

    def set_config(self, **changes: float) -> M.ClusterSettings:
        """Change cluster settings (fields of :class:`~protocol.messages.ClusterSettings`,
        seconds and fractions), all or nothing; returns the new settings once etcd recorded
        them. Raises ConfigError/InvalidRequest for bad values or names (nothing changed),
        EtcdUnavailable when etcd does not answer."""
        return self.rpc.call(M.SetConfig({k: float(v) for k, v in changes.items()}))

    def drain(self, node_id: str, undo: bool = False) -> None:
        """Stop placing on ``node_id`` and move its pinned/held objects off (``undo``: resume)."""
        self.rpc.call(M.Drain(node_id, undo))

    # ---- P/D hand-off ---------------------------------------------------------------------

    def handoff_publish(self, request_id: str, keys_by_group: dict[str, list[str]],
                        layouts: dict[str, LayoutSpec], ttl_s: float, num_tokens: int = 0,
                        extra: dict | None = None, producer: str = "") -> M.HandoffRecord:
        """Hold the (already stored) blocks for a consumer until ack/release or ``ttl_s``
        seconds pass; durable in etcd. The hold is sent as a duration and counted on the
        leader's monotonic clock from when it accepts the publish (this host's wall clock
        plays no part; after a master failover the new leader holds for the full ``ttl_s``
        again). Idempotent. Raises InvalidRequest for a ``ttl_s`` that is not finite, not > 0
        or above the cluster's max_handoff_ttl, NotFound naming missing keys."""
        rec = M.HandoffRecord(request_id, {str(g): list(k) for g, k in keys_by_group.items()},
                              {str(g): lay for g, lay in layouts.items()}, producer or self.host_id,
                              float(ttl_s), num_tokens, extra or {})
        return self.rpc.call(M.HandoffPublish(rec))

    def handoff_claim(self, request_id: str) -> M.HandoffRecord:
        """The record; raises HandoffNotFound or HandoffExpired."""
        return self.rpc.call(M.HandoffClaim(request_id))

    def handoff_ack(self, request_id: str) -> None:
        self.rpc.call(M.HandoffAck(request_id))

    def handoff_release(self, request_id: str) -> None:
        self.rpc.call(M.HandoffRelease(request_id))


def _missing(earlier: int | None | KVPoolError) -> None | KVPoolError:
    """A key's result when a (re)lookup finds it gone: None (a miss), or the
    ChecksumMismatch of an earlier attempt of this call. A corrupt replica is reported
    and the master drops it, so the retry finds the key gone when it had one replica;
    the reader is told why, not that it was never there."""
    return earlier if isinstance(earlier, ChecksumMismatch) else None


def lanes(ops: Sequence, k: int) -> list[list]:
    """Split one node's ops into at most ``k`` lanes of about equal bytes (largest first,
    each to the lightest lane; order kept within a lane). One lane when ``k`` is 1, there
    is one op, or they total under :data:`_LANE_MIN` bytes (a stream's setup would cost
    more than the overlap)."""
    if k <= 1 or len(ops) < 2 or sum(op.ref.size for op in ops) < _LANE_MIN:
        return [list(ops)]
    k = min(k, len(ops))
    load, member = [0] * k, [0] * len(ops)
    for i in sorted(range(len(ops)), key=lambda i: -ops[i].ref.size):
        j = load.index(min(load))
        load[j] += ops[i].ref.size
        member[i] = j
    return [g for g in ([op for op, m in zip(ops, member) if m == j] for j in range(k)) if g]


def disk_lanes(ops: Sequence) -> list[list]:
    """Reads of one node's disk tier split round-robin into at most :data:`DISK_STREAMS`
    lanes: each is a stream of its own, served by one of the node's disk-read threads, so
    the files are read in parallel (a disk answers a few reads at once faster than one
    after the other)."""
    k = min(DISK_STREAMS, len(ops))
    return [list(ops[j::k]) for j in range(k)]


REQUEST_BYTES = 16 << 20  # bytes of keys and layouts one put request carries at most (the frame limit is 64 MiB)


def _request_cuts(keys: Sequence[str], lays: Sequence[LayoutSpec | None]) -> list[int]:
    """Where to cut a put batch into requests: at most ``MAX_BATCH_KEYS`` items and about
    :data:`REQUEST_BYTES` of keys and encoded layouts each. Returns the cut positions, 0
    and ``len(keys)`` included."""
    cuts, size = [0], 0
    for i, (k, lay) in enumerate(zip(keys, lays)):
        item = (len(k) if isinstance(k, str) else 0) + 32 + (len(raw_layout(lay)) if isinstance(lay, LayoutSpec) else 0)
        if i > cuts[-1] and (i - cuts[-1] >= M.MAX_BATCH_KEYS or size + item > REQUEST_BYTES):
            cuts.append(i)
            size = 0
        size += item
    cuts.append(len(keys))
    return cuts


def _per_key(v, n: int) -> list:
    if v is None or isinstance(v, LayoutSpec):
        return [v] * n
    v = list(v)
    if len(v) != n:
        raise InvalidRequest(f"expected {n} layouts, got {len(v)}")
    return v
