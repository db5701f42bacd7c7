"""The master's per-object record, kept lean: one :class:`Obj` per stored or pending object.

An index of millions of objects spends most of its memory on per-object Python objects,
so an :class:`Obj` is a msgspec Struct without a GC header holding the key (the same str
object the index and the LRU lists use), one ``bytes`` record packing the numbers that
change rarely (size, checksum, put id, creation time, state, replica count wanted and each
replica's node number, offset and generation), the layout's encoding (interned by the state), the
access and lease fields a read updates, and ``ext`` for what few objects carry (a
writer's deadline, a pin, hand-off holds, re-replication bookkeeping), None otherwise.
Replicas refer to store nodes by number (:func:`node_number`); :attr:`Obj.replicas`
rebuilds the :class:`~protocol.messages.ExtentRef` list (without write tokens) on demand.
An Obj never refers to another Obj or to the state, so skipping the GC is safe.
"""
from __future__ import annotations

import struct

import msgspec

from kvpool.protocol.messages import DISK, MEMORY, ExtentRef, NodeDesc

PENDING, COMMITTED = 0, 1
# size, checksum (xxh3_64), put id, created (monotonic s), state, replicas wanted
_HEAD = struct.Struct("<QQQdBB")
_REP = struct.Struct("<IQQ")  # node number, offset (bytes), generation
_HS, _RS = _HEAD.size, _REP.size
_EMPTY: frozenset[str] = frozenset()

# node number -> (node_id, incarnation, data_addr, shm_path, host_id, ucx_addr, tier); numbers
# are per process and per published node description and tier (a node's disk tier has its
# own read addresses, so its replicas have a number of their own), so every state in a
# process shares them
_NODE_INFO: list[tuple[str, str, str, str, str, str, int]] = []
_NODE_NUM: dict[tuple[str, str, str, str, str, str, int], int] = {}


def node_number(desc: NodeDesc) -> int:
    """The small number replicas on ``desc`` (one incarnation of a node) are stored under."""
    return _num((desc.node_id, desc.incarnation, desc.data_addr, desc.shm_path, desc.host_id, desc.ucx_addr, MEMORY))


def disk_ref(desc: NodeDesc, size: int, disk_id: int) -> ExtentRef:
    """The replica of ``size`` bytes held in file ``disk_id`` of ``desc``'s disk tier (read
    through its disk-read sockets)."""
    return ExtentRef(desc.node_id, desc.incarnation, desc.disk_addr, desc.disk_path, desc.host_id, 0, size, disk_id,
                     b"", "", DISK)


def _num(info: tuple[str, str, str, str, str, str, int]) -> int:
    n = _NODE_NUM.get(info)
    if n is None:
        n = _NODE_NUM[info] = len(_NODE_INFO)
        _NODE_INFO.append(info)
    return n


def _pack_reps(refs: list[ExtentRef]) -> bytes:
    return b"".join(_REP.pack(_num((r.node_id, r.incarnation, r.data_addr, r.shm_path, r.host_id, r.ucx_addr,
                                    r.tier)), r.offset, r.gen) for r in refs)


class Ext(msgspec.Struct):
    """What few objects carry (see the module docstring); all defaults: no Ext at all."""

    writer_deadline: float = 0.0
    pin: str = ""
    pin_until: float = 0.0
    holds: set[str] | None = None
    repairing: bool = False
    queued: int = 0

    def idle(self) -> bool:
        return (not self.writer_deadline and not self.pin and not self.pin_until and not self.holds
                and not self.repairing and not self.queued)


def _ext_field(name: str, default: object) -> property:
    def get(self: Obj) -> object:
        e = self.ext
        return default if e is None else getattr(e, name)

    def set_(self: Obj, v: object) -> None:
        e = self.ext
        if e is None:
            if v == default:
                return
            e = self.ext = Ext()
        setattr(e, name, v)
        if v == default and e.idle():
            self.ext = None

    return property(get, set_)


def _head_field(i: int) -> property:
    def get(self: Obj) -> object:
        return _HEAD.unpack_from(self.rec)[i]

    def set_(self: Obj, v: object) -> None:
        h = list(_HEAD.unpack_from(self.rec))
        h[i] = v
        self.rec = _HEAD.pack(*h) + self.rec[_HS:]

    return property(get, set_)


class Obj(msgspec.Struct, gc=False):
    """One object of the index. Build with :meth:`new`; numbers are in bytes and seconds
    on the master's monotonic clock."""

    key: str
    rec: bytes
    layout: bytes | None  # the layout's msgpack encoding, one shared object per distinct layout
    last_access: float
    lease_until: float = 0.0
    lease_count: int = 0
    ext: Ext | None = None

    @classmethod
    def new(cls, key: str, size: int, checksum: int, layout: bytes | None, replicas: list[ExtentRef],
            state: int, put_id: int, created: float, last_access: float, writer_deadline: float = 0.0,
            replicas_wanted: int = 1) -> Obj:
        obj = cls(key, _HEAD.pack(size, checksum, put_id, created, state, replicas_wanted) + _pack_reps(replicas),
                  layout, last_access)
        if writer_deadline:
            obj.ext = Ext(writer_deadline)
        return obj

    size = _head_field(0)
    checksum = _head_field(1)
    put_id = _head_field(2)
    created = _head_field(3)
    state = _head_field(4)
    replicas_wanted = _head_field(5)
    writer_deadline = _ext_field("writer_deadline", 0.0)
    pin = _ext_field("pin", "")
    pin_until = _ext_field("pin_until", 0.0)
    repairing = _ext_field("repairing", False)
    queued = _ext_field("queued", 0)  # where it waits for re-replication (master/repair.py), 0: nowhere

    @property
    def holds(self) -> set[str] | frozenset[str]:
        """Request ids of the open hand-offs holding this object (read-only view; change it
        with :meth:`add_holds` and :meth:`discard_hold`)."""
        e = self.ext
        return _EMPTY if e is None or e.holds is None else e.holds

    def add_holds(self, request_ids: set[str] | list[str]) -> None:
        if not request_ids:
            return
        if self.ext is None:
            self.ext = Ext()
        if self.ext.holds is None:
            self.ext.holds = set()
        self.ext.holds.update(request_ids)

    def discard_hold(self, request_id: str) -> None:
        e = self.ext
        if e is not None and e.holds:
            e.holds.discard(request_id)
            if not e.holds:
                e.holds = None
                if e.idle():
                    self.ext = None

    @property
    def replicas(self) -> list[ExtentRef]:
        """The replicas, without write tokens (a fresh list: assign to change them)."""
        rec, size = self.rec, _HEAD.unpack_from(self.rec)[0]
        out = []
        for num, off, gen in _REP.iter_unpack(rec[_HS:]):
            i = _NODE_INFO[num]
            out.append(ExtentRef(i[0], i[1], i[2], i[3], i[4], off, size, gen, b"", i[5], i[6]))
        return out

    @replicas.setter
    def replicas(self, refs: list[ExtentRef]) -> None:
        self.rec = self.rec[:_HS] + _pack_reps(refs)

    def replica_count(self) -> int:
        return (len(self.rec) - _HS) // _RS

    def node_ids(self) -> list[str]:
        """Node ids of the replicas, in replica order."""
        rec = self.rec
        return [_NODE_INFO[_REP.unpack_from(rec, p)[0]][0] for p in range(_HS, len(rec), _RS)]

    def tiers(self) -> list[tuple[str, int]]:
        """``(node id, tier)`` of each replica, in replica order."""
        rec = self.rec
        return [(i[0], i[6]) for i in (_NODE_INFO[_REP.unpack_from(rec, p)[0]] for p in range(_HS, len(rec), _RS))]

    def read_view(self) -> tuple[int, int, list[ExtentRef]]:
        """``(size, checksum, replicas without tokens)`` in one unpack (the read path)."""
        rec = self.rec
        size, checksum = _HEAD.unpack_from(rec)[:2]
        refs = []
        for num, off, gen in _REP.iter_unpack(rec[_HS:]):
            i = _NODE_INFO[num]
            refs.append(ExtentRef(i[0], i[1], i[2], i[3], i[4], off, size, gen, b"", i[5], i[6]))
        return size, checksum, refs

    def read_refs(self) -> list[ExtentRef]:
        """Replicas without write tokens (readers never get write authority)."""
        return self.replicas

    def evictable_kind(self) -> str:
        """"" when in the plain LRU, "soft" in the soft-pin LRU, "none" when never evicted."""
        e = self.ext
        if e is None:
            return ""
        if e.holds or e.pin == "hard":
            return "none"
        return "soft" if e.pin == "soft" else ""
