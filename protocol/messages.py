"""RPC messages between clients, masters and store nodes (msgpack via msgspec; no pickle).

A request is one of the ``Request`` union's Structs, tagged by ``op``. A reply is a
:class:`Reply` whose ``result`` is msgpack decoded by the caller with the type it
expects (``RESULT_TYPES[op]``), or whose ``error`` carries an
:class:`~protocol.errors.ErrorInfo`. Batch forms take lists and report per-key results.
"""
from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from kvpool.protocol.errors import DECODE_ERRORS, ConfigError, ErrorInfo, InvalidRequest
from kvpool.protocol.layout import NO_LAYOUT, LayoutSpec, layout_of

MAX_BATCH_KEYS = 16_384  # keys (or items) one request carries at most; the client splits larger batches
MAX_GROUPS = 1024  # cache groups (times TP ranks) one hand-off record names at most
MAX_REQUEST_LAYOUTS = 64  # distinct layouts the items of one request carry at most (a batch per cache group)


def _batch(tp: Any) -> Any:
    """``tp`` (a list) of at most MAX_BATCH_KEYS entries: decoding refuses a longer one before
    reading its entries."""
    return Annotated[tp, msgspec.Meta(max_length=MAX_BATCH_KEYS)]

WIRE_VERSION = 5
"""Version of every message and data frame kvpool processes exchange. Bump it with any
change an older process would misread. A master does not place on a store node of
another version (``ClusterStats.refused``); a client refuses a master of another version
(:class:`HelloReply`). Processes that predate the field publish and answer 0."""


MEMORY, DISK = 0, 1
"""Tiers of a replica (:attr:`ExtentRef.tier`, :attr:`ExtentEntry.tier`): a store node's
memory segment, or its disk tier (``storenodes[].disk_dir``, :mod:`storenode.disk_tier`)."""


class ExtentRef(msgspec.Struct, frozen=True, array_like=True):
    """Where one replica lives: node, its incarnation (segment generation), data-plane
    address, same-host shared-memory path, host id, byte offset/size in the segment, the
    extent's allocation generation ``gen`` and the write ``token`` (see
    :func:`protocol.grants.grant_token`; empty in read replies).

    ``tier``: :data:`MEMORY` (0) or :data:`DISK` (1). A disk replica is one file of the
    node's disk tier: ``gen`` is its disk id, ``offset`` is 0, and ``data_addr`` /
    ``shm_path`` are the node's disk-read sockets (TCP, and Unix for same-host readers),
    read with the ``dread`` data op; it is never mapped through shared memory."""

    node_id: str
    incarnation: str
    data_addr: str
    shm_path: str
    host_id: str
    offset: int
    size: int
    gen: int
    token: bytes = b""
    ucx_addr: str = ""  # the node's ucx:// data address when it serves one ("" otherwise)
    tier: int = MEMORY  # MEMORY or DISK (last: older decoders ignore it)


class NodeDesc(msgspec.Struct, frozen=True):
    """What a store node publishes in etcd under ``nodes/<node_id>`` (under its lease).
    ``data_addr`` is the TCP data address; ``shm_path`` the node's Unix socket address
    (``unix:///path``) that serves same-host data and hands out the segment memfd."""

    node_id: str
    incarnation: str
    data_addr: str
    ctrl_addr: str
    shm_path: str
    host_id: str
    capacity: int
    device: str = "cpu"
    grant_key: bytes = b""
    ucx_addr: str = ""  # ucx:// data address (``--ucx``), "" when the node serves none
    wire: int = 0  # the node's WIRE_VERSION (0: predates it)
    # the disk tier (storenodes[].disk_dir; 0 bytes: none): its capacity in bytes, its
    # watermarks (fractions of that capacity) and the addresses of its disk-read server
    # (TCP, and unix:// for same-host readers)
    disk_capacity: int = 0
    disk_high_watermark: float = 0.0
    disk_low_watermark: float = 0.0
    disk_addr: str = ""
    disk_path: str = ""


class PutItem(msgspec.Struct, frozen=True, array_like=True):
    """An object to place: key, size (bytes), xxh3_64 checksum (0: sent at put_end) and
    its layout as raw msgpack (:func:`~protocol.layout.raw_layout`; read it as ``.layout``)."""

    key: str
    size: int
    checksum: int
    wire_layout: msgspec.Raw = NO_LAYOUT

    @property
    def layout(self) -> LayoutSpec | None:
        return layout_of(self.wire_layout)


class PutGrant(msgspec.Struct, frozen=True, array_like=True, tag="grant"):
    """``status`` is "write" (write every replica, then put_end) or "exists" (no-op).
    ``replicas_wanted``: the object's replica count (the cluster default resolved)."""

    key: str
    status: str
    put_id: int = 0
    replicas: list[ExtentRef] = []
    replicas_wanted: int = 0


class ObjectInfo(msgspec.Struct, frozen=True, array_like=True, tag="obj"):
    """A committed object's header and replicas. ``lease_ttl_s`` > 0 when a read lease
    was granted (seconds, counted from when the request was sent)."""

    key: str
    size: int
    checksum: int
    wire_layout: msgspec.Raw  # the layout as raw msgpack; read it as ``.layout``
    replicas: list[ExtentRef]
    lease_ttl_s: float = 0.0

    @property
    def layout(self) -> LayoutSpec | None:
        return layout_of(self.wire_layout)


class ObjectMeta(msgspec.Struct, frozen=True):
    """One row of ``ls``. ``created`` and ``last_access`` are Unix times (seconds) on the
    master's wall clock, converted from its monotonic clock when the listing was made (for
    display; they move with that clock). ``age_s`` and ``idle_s`` are the seconds since
    creation and since the last access, measured on the master's monotonic clock (they do
    not depend on any host's wall clock). ``pin`` is "", "hard" or "soft"."""

    key: str
    size: int
    kind: str
    nodes: list[str]
    created: float
    last_access: float
    leased: bool
    pin: str
    held: bool
    replicas_wanted: int = 1
    age_s: float = 0.0
    idle_s: float = 0.0
    tiers: list[str] = []  # per entry of ``nodes``: "memory" or "disk"


class NodeStats(msgspec.Struct, frozen=True):
    node_id: str
    data_addr: str
    host_id: str
    capacity: int
    used: int
    objects: int
    alive: bool
    draining: bool = False
    incarnation: str = ""
    device: str = "cpu"  # where the segment lives: cpu (shared memory) or cuda:N
    reserved: int = 0  # bytes of ``used`` reserved ahead of need for writers (master/reservations.py)
    # the disk tier (0 capacity: none): bytes, files (objects; ``objects`` counts those in
    # memory) and the master's tier moves to and from it: demotions (memory -> disk) and
    # promotions (disk -> memory) done, and the sums of their latencies on the node
    # (seconds from the start of a move's write or read to its publish, a demotion group's
    # fsync included)
    disk_capacity: int = 0
    disk_used: int = 0
    disk_objects: int = 0
    demotions: int = 0
    demotion_s: float = 0.0
    promotions: int = 0
    promotion_s: float = 0.0
    tier_moves: int = 0  # demotions and promotions in flight


class ClusterStats(msgspec.Struct, frozen=True):
    leader: str
    cluster: str
    nodes: list[NodeStats]
    objects: int
    pending: int
    used: int
    capacity: int
    held_bytes: int
    high_watermark: float
    low_watermark: float
    under_replicated: int
    counters: dict[str, int]
    refused: dict[str, int] = {}  # node id -> wire version of store nodes not placed on (another version)
    repairs_in_flight: int = 0  # re-replication copies under way (``under_replicated``: objects short of replicas)
    joining: dict[str, str] = {}  # node id -> why a published store node is not taken in (placed on) yet
    reserved_bytes: int = 0  # bytes of extents reserved ahead of need (in ``used``; master/reservations.py)
    disk_capacity: int = 0  # the store nodes' disk tiers (bytes; 0: none)
    disk_used: int = 0
    disk_objects: int = 0  # replicas on disk


class EvictSelector(msgspec.Struct, frozen=True):
    """Admin eviction selector; exactly one of key/prefix/model/node/older_than_s/all."""

    key: str | None = None
    prefix: str | None = None
    model: str | None = None
    node: str | None = None
    older_than_s: float | None = None
    all: bool = False


class EvictReport(msgspec.Struct, frozen=True):
    removed: int
    removed_bytes: int
    skipped_leased: int
    skipped_pinned: int
    skipped_held: int
    dry_run: bool
    keys: list[str] = []


class HandoffRecord(msgspec.Struct, frozen=True):
    """Durable P/D hand-off record (DESIGN.md §7), as published, claimed and kept in etcd.
    ``keys`` maps group id → keys in block order.

    ``ttl_s`` is how long the objects are held, in seconds: a duration, never a
    timestamp. The leader counts it on its own monotonic clock from when it accepted the
    publish, so no host's wall clock (the producer's or the master's) shortens or
    stretches it. A leader that rebuilds from etcd after a failover does not know how much
    of the hold has passed and never shortens it: it holds for the full ``ttl_s`` again,
    counted from the rebuild, so a hold may outlive its ttl by up to one ttl per failover.
    ``published_at`` is the accepting master's wall-clock time of the publish (Unix
    seconds), for operators only: no decision uses it (clients send 0)."""

    request_id: str
    keys: Annotated[dict[str, _batch(list[str])], msgspec.Meta(max_length=MAX_GROUPS)]
    layouts: Annotated[dict[str, LayoutSpec], msgspec.Meta(max_length=MAX_GROUPS)]
    producer: str
    ttl_s: float
    num_tokens: int = 0
    extra: dict[str, Any] = {}
    published_at: float = 0.0


# ---- requests -------------------------------------------------------------------------

class PutStart(msgspec.Struct, tag="put_start"):
    items: _batch(list[PutItem])
    host_id: str = ""
    replicas: int = 0


class PutEnd(msgspec.Struct, tag="put_end"):
    """Commit written puts. ``checksums`` (xxh3_64, one per key) replace those given at
    put_start: a same-host writer hashes while it copies, so it knows them only now."""

    keys: _batch(list[str])
    put_ids: _batch(list[int])
    checksums: _batch(list[int]) = []


class PutRevoke(msgspec.Struct, tag="put_revoke"):
    keys: _batch(list[str])
    put_ids: _batch(list[int])


class Reserve(msgspec.Struct, tag="reserve"):
    """Reserve extents of ``size`` bytes (``replicas`` each, 0: the cluster default) for a
    writer on ``host_id``: ``count`` needed now (placed as a put is, evicting when memory
    is short) and ``ahead`` more for later objects (only from free memory under the high
    watermark); ``release``: reservations given back first (:mod:`master.reservations`)."""

    size: int
    count: int
    host_id: str = ""
    replicas: int = 0
    release: _batch(list[int]) = []
    ahead: int = 0


class Reservation(msgspec.Struct, frozen=True, array_like=True):
    """Extents reserved for one object of the reserved size: write grants whose tokens
    name no key (``res_id`` names the reservation in :class:`PutReserved`)."""

    res_id: int
    replicas: list[ExtentRef]


class Reserved(msgspec.Struct, frozen=True, array_like=True, tag="reserved"):
    """Reservations granted; each is the master's for ``ttl_s`` seconds from the request.
    ``error``: why none could be placed (empty ``reservations``)."""

    reservations: list[Reservation]
    ttl_s: float
    replicas_wanted: int
    error: ErrorInfo | None = None


class ReservedPut(msgspec.Struct, frozen=True, array_like=True):
    """An object written into reservation ``res_id``: its key, size (bytes, the
    reservation's), xxh3_64 checksum and layout."""

    key: str
    res_id: int
    size: int
    checksum: int
    wire_layout: msgspec.Raw = NO_LAYOUT  # raw msgpack (protocol.layout.raw_layout); read it as ``.layout``

    @property
    def layout(self) -> LayoutSpec | None:
        return layout_of(self.wire_layout)


class PutReserved(msgspec.Struct, tag="put_reserved"):
    """Commit objects written into reservations; ``refill``: a Reserve answered in the same
    reply."""

    items: _batch(list[ReservedPut])
    refill: Reserve | None = None


class PutReservedReply(msgspec.Struct, frozen=True, array_like=True):
    """Per item: None (committed), "exists"/"in_flight" (not indexed; the reservation stays
    the writer's) or an ErrorInfo; ``tokens``: per item, the keyed write token of each
    replica (for the writer's ``commit`` copy; empty unless committed); ``refill``: the
    answer to the request's ``refill``."""

    results: list[Union[ErrorInfo, str, None]]
    tokens: list[list[bytes]]
    refill: Reserved | None = None


class Lookup(msgspec.Struct, tag="lookup"):
    keys: _batch(list[str])
    lease: bool = True


class ReleaseLeases(msgspec.Struct, tag="release"):
    """The reader is done with these keys' leases (sent without waiting for a reply)."""

    keys: _batch(list[str])


class Story(msgspec.Struct, tag="story"):
    """What the leading master recorded about ``key`` (master/story.py): its newest
    ``limit`` entries, oldest first."""

    key: str
    limit: int = 100


class StoryEntry(msgspec.Struct, frozen=True, array_like=True):
    t: float  # wall-clock seconds (Unix time) at the master
    event: str  # stored, replica lost, repair started / done / failed, evicted, removed, ...
    detail: str = ""


class Exists(msgspec.Struct, tag="exists"):
    keys: _batch(list[str])


class Remove(msgspec.Struct, tag="remove"):
    keys: _batch(list[str])
    force: bool = False


class ListObjects(msgspec.Struct, tag="list"):
    prefix: str = ""
    limit: int = 10000


class Stats(msgspec.Struct, tag="stats"):
    pass


class Pin(msgspec.Struct, tag="pin"):
    key: str
    ttl_s: float | None = None


class Unpin(msgspec.Struct, tag="unpin"):
    key: str


class PinRecord(msgspec.Struct, frozen=True, array_like=True):
    """A pin as kept in etcd under ``pins/<key>`` so it survives a master failover:
    ``ttl_s`` is the soft pin's duration in seconds (None for a hard pin), never a
    timestamp; ``size`` and ``checksum`` name the pinned object, so a later object under
    the same key with other bytes is not pinned by a record left behind. A leader that
    rebuilds from the record re-arms a soft pin for its full ``ttl_s`` from the rebuild (it
    cannot know how much has passed and never shortens a pin: it may outlive its ttl by up
    to one ttl per failover). ``pinned_at`` is the master's wall-clock time of the pin (Unix
    seconds), for operators only; 0 marks a record of wire version 1, whose second field
    is an absolute Unix-time deadline instead of a duration."""

    key: str
    ttl_s: float | None = None
    size: int = 0
    checksum: int = 0
    pinned_at: float = 0.0


class ClusterSettings(msgspec.Struct, frozen=True):
    """Cluster-wide master settings, kept in etcd under ``config`` (JSON) so that every
    leader applies the same ones (DESIGN.md §3): the first leader writes its own, later
    leaders adopt what is there, ``kvpool settings --set`` changes them. Units: seconds and
    fractions of a node's capacity. ``replicas`` applies to puts made after a change;
    ``max_handoff_ttl_s`` is the longest hold a hand-off publish may ask for. Fields a newer
    master adds are ignored by older ones (no ``forbid_unknown_fields``)."""

    replicas: int = 1
    lease_ttl_s: float = 5.0
    put_timeout_s: float = 30.0
    quarantine_s: float = 5.0
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    max_handoff_ttl_s: float = 24 * 3600.0

    def check(self) -> "ClusterSettings":
        """Self, or ConfigError naming the first bad field and what it accepts."""
        if not 1 <= self.replicas <= 16:
            raise ConfigError(f"replicas: {self.replicas}; accepted: 1 to 16", key="replicas")
        for name, low in (("lease_ttl_s", 0.1), ("put_timeout_s", 0.1), ("max_handoff_ttl_s", 1.0),
                          ("quarantine_s", 0.0)):
            v = getattr(self, name)
            if not low <= v <= 1e7:  # also refuses NaN
                user = name.removesuffix("_s")  # the name config files and `settings --set` use
                raise ConfigError(f"{user}: {v:g} seconds; accepted: {low:g} to 1e7 seconds", key=user)
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(f"watermarks: need 0 < low_watermark <= high_watermark <= 1, got "
                              f"{self.low_watermark}/{self.high_watermark}", key="high_watermark")
        return self


class Hello(msgspec.Struct, tag="hello"):
    """A client's first request on a new master connection (answered by standbys too)."""

    host_id: str = ""
    wire: int = 0


class HelloReply(msgspec.Struct, frozen=True):
    """The master's same-host shortcut: ``alias`` (``unix://@<random name>``, "" when it has
    none), its ``pid`` and ``host_id``. A client on that host connects to the alias and
    uses it only if the peer's SO_PEERCRED pid is ``pid`` (nobody else can serve it)."""

    alias: str
    pid: int
    host_id: str
    wire: int = 0  # the master's WIRE_VERSION (0: predates it)


class GetConfig(msgspec.Struct, tag="get_config"):
    pass


class SetConfig(msgspec.Struct, tag="set_config"):
    """Change cluster settings: field name of :class:`ClusterSettings` → new value. Applied
    once written to etcd (all or nothing)."""

    changes: dict[str, float]


class Evict(msgspec.Struct, tag="evict"):
    selector: EvictSelector
    dry_run: bool = False
    force: bool = False


class ReportDead(msgspec.Struct, tag="report_dead"):
    node_id: str
    incarnation: str


class ReportCorrupt(msgspec.Struct, tag="report_corrupt"):
    """A reader found a replica failing its checksum under a live lease."""

    key: str
    node_id: str
    gen: int
    incarnation: str = ""


class Drain(msgspec.Struct, tag="drain"):
    node_id: str
    undo: bool = False


class HandoffPublish(msgspec.Struct, tag="handoff_publish"):
    record: HandoffRecord


class HandoffClaim(msgspec.Struct, tag="handoff_claim"):
    request_id: str


class HandoffAck(msgspec.Struct, tag="handoff_ack"):
    request_id: str


class HandoffRelease(msgspec.Struct, tag="handoff_release"):
    request_id: str


Request = Union[PutStart, PutEnd, PutRevoke, Reserve, PutReserved, Lookup, ReleaseLeases, Exists, Remove, ListObjects, Stats, Pin, Unpin,
                Story,
                Evict, ReportDead, ReportCorrupt, Drain, HandoffPublish, HandoffClaim, HandoffAck, HandoffRelease,
                GetConfig, SetConfig, Hello]

_BATCH_FIELD = {PutStart: "items", PutEnd: "keys", PutRevoke: "keys", PutReserved: "items", Lookup: "keys",
                ReleaseLeases: "keys", Exists: "keys", Remove: "keys", Reserve: "release"}


def batch_len(req: Any) -> int:
    """How many keys (or items) request ``req`` carries; 0 for requests about one thing.
    The master refuses more than :data:`MAX_BATCH_KEYS`: one request's work, and its
    reply, stay bounded (16,384 misses of 512-byte keys answer in about 18 MiB, inside
    ``protocol.rpcwire.MAX_FRAME``)."""
    if type(req) is HandoffPublish:  # its record's keys, all groups together (etcd holds the record too)
        return sum(len(v) for v in req.record.keys.values()) + len(req.record.keys)
    if type(req) is PutReserved and req.refill is not None:  # and the reservations it gives back
        return len(req.items) + len(req.refill.release)
    field = _BATCH_FIELD.get(type(req))
    return len(getattr(req, field)) if field else 0


def check_layouts(req: Any) -> None:
    """Decode (once each) the distinct layouts the items of ``req`` carry, so that a bad one
    refuses the whole request before any item is acted on. Raises InvalidRequest for a
    malformed layout, more than :data:`MAX_REQUEST_LAYOUTS` distinct ones, or an item
    whose size (bytes) is not the size its layout describes (``LayoutSpec.nbytes``)."""
    if type(req) is not PutStart and type(req) is not PutReserved:
        return
    distinct: dict[bytes, tuple[LayoutSpec | None, int]] = {}  # encoding -> (layout, its nbytes)
    prev, lay, nbytes = None, None, 0
    for it in req.items:
        w = it.wire_layout
        if prev is None or w != prev:  # items of a batch come in runs of one layout: compared, not copied
            prev, b = w, bytes(w)
            if b not in distinct:
                if len(distinct) == MAX_REQUEST_LAYOUTS:
                    raise InvalidRequest(f"{type(req).__name__} carries more than {MAX_REQUEST_LAYOUTS} distinct "
                                         "layouts, the limit per request: send one batch per cache group",
                                         limit=MAX_REQUEST_LAYOUTS)
                got = layout_of(b)
                distinct[b] = (got, got.nbytes if got is not None else 0)
            lay, nbytes = distinct[b]
        if lay is not None and it.size != nbytes:
            raise InvalidRequest(f"{type(req).__name__}: item {getattr(it, 'key', '?')!r} has {it.size} bytes but its "
                                 f"{lay.kind} layout describes {lay.nbytes}", key=getattr(it, "key", ""))


_OPTIONAL_LISTS = {PutEnd: ("checksums",)}  # per-key lists a batch may leave empty


def slice_request(req: Any, start: int, stop: int) -> Any:
    """Items ``start:stop`` of batch request ``req``, each of its per-key list fields sliced
    alike (an empty optional one, e.g. PutEnd's ``checksums``, stays empty). Raises
    InvalidRequest when a per-key list's length differs from the batch's, so a mismatched
    batch is refused whole, never partly applied."""
    field = _BATCH_FIELD[type(req)]
    n = len(getattr(req, field))
    optional = _OPTIONAL_LISTS.get(type(req), ())
    cut = {}
    for f in req.__struct_fields__:
        v = getattr(req, f)
        if type(v) is list and (v or f not in optional):
            if len(v) != n:
                raise InvalidRequest(f"{type(req).__name__}: {n} {field} but {len(v)} {f}; send one per key")
            cut[f] = v[start:stop]
    return msgspec.structs.replace(req, **cut)


RESULT_TYPES: dict[type, Any] = {
    PutStart: list[Union[PutGrant, ErrorInfo]],
    PutEnd: list[Union[ErrorInfo, None]],
    PutRevoke: list[Union[ErrorInfo, None]],
    Reserve: Reserved,
    PutReserved: PutReservedReply,
    Lookup: list[Union[ObjectInfo, ErrorInfo]],
    Exists: list[bool],
    Story: list[StoryEntry],
    ReleaseLeases: None,
    Remove: list[Union[ErrorInfo, None]],
    ListObjects: list[ObjectMeta],
    Stats: ClusterStats,
    Pin: None,
    Unpin: None,
    Evict: EvictReport,
    ReportDead: None,
    ReportCorrupt: None,
    Drain: None,
    HandoffPublish: HandoffRecord,
    HandoffClaim: HandoffRecord,
    HandoffAck: None,
    HandoffRelease: None,
    GetConfig: ClusterSettings,
    SetConfig: ClusterSettings,
    Hello: HelloReply,
}


class Reply(msgspec.Struct, frozen=True, array_like=True):
    """A master's (or store node's control) answer. ``term``: the leader term the answer was
    given under (:mod:`protocol.terms`; 0 from a standby or a process without one)."""

    result: msgspec.Raw = msgspec.Raw(b"\xc0")
    error: ErrorInfo | None = None
    term: int = 0


# ---- master -> store node control -------------------------------------------------------

class ExtentEntry(msgspec.Struct, frozen=True, array_like=True):
    """A store node's extent-table row."""

    key: str
    offset: int
    size: int
    gen: int
    checksum: int
    layout: bytes | None = None
    committed: bool = False
    replicas: int = 0  # the object's wanted replica count (0: unknown, the cluster default)
    tier: int = MEMORY  # DISK: a file of the disk tier (``gen`` its disk id, ``offset`` 0)


class NodeCommit(msgspec.Struct, tag="commit"):
    """Committed extents, as whole rows: the node records them as they are (a same-host
    writer copies straight into the segment and tells the node nothing)."""

    rows: list[ExtentEntry]
    term: int = 0  # the sender's leader term (protocol.terms): a node refuses older ones


class NodeFree(msgspec.Struct, tag="free"):
    extents: list[tuple[int, int]]
    term: int = 0


class NodeList(msgspec.Struct, tag="list_extents"):
    """Ask for the extent table; from now on the node refuses notices of terms below ``term``."""

    term: int = 0


class NodeCopy(msgspec.Struct, tag="copy"):
    """Copy one committed extent to another node's extent (re-replication). ``src_tier``
    DISK: the source is the disk file ``src_gen`` (its disk id) of this node."""

    src_offset: int
    src_gen: int
    dst: ExtentRef
    key: str
    checksum: int
    layout: bytes | None = None
    term: int = 0
    src_tier: int = MEMORY


class NodeDemote(msgspec.Struct, tag="demote"):
    """Write the committed extent ``(offset, gen)`` of object ``key`` (``size`` bytes) to the
    node's disk tier, durably (file fsync'ed, renamed, directory fsync'ed), and answer with
    a :class:`TierDone` naming the new file's disk id. The extent stays as it is: the
    master frees it (NodeFree) only once it has the answer (:mod:`master.tiers`)."""

    offset: int
    gen: int
    size: int
    key: str
    term: int = 0


class NodePromote(msgspec.Struct, tag="promote"):
    """Copy disk file ``disk_id`` (object ``key``) into the memory extent ``dst`` of this
    node, verifying the file's checksum, and record it committed; answer with a
    :class:`TierDone`. The file stays until a :class:`NodeDiskFree` names it."""

    disk_id: int
    dst: ExtentRef
    key: str
    term: int = 0


class NodeDiskFree(msgspec.Struct, tag="disk_free"):
    """Delete these files (disk ids) of the node's disk tier."""

    ids: list[int]
    term: int = 0


class TierDone(msgspec.Struct, frozen=True, array_like=True, tag="tier"):
    """A store node's answer to :class:`NodeDemote` / :class:`NodePromote` (the ``result``
    of its Reply, also beside an error): ``op`` "demote" or "promote", the object ``key``,
    the memory extent's generation (the demoted source, or the promoted destination), the
    disk file's id (0 when a demotion wrote none) and the move's latency on the node in
    seconds (from the start of its write or read to its publish: a demotion's includes its
    group's fsync)."""

    op: str
    key: str
    gen: int
    disk_id: int = 0
    seconds: float = 0.0


NodeRequest = Union[NodeCommit, NodeFree, NodeList, NodeCopy, NodeDemote, NodePromote, NodeDiskFree]

_req_decoder = msgspec.msgpack.Decoder(Request)
_node_decoder = msgspec.msgpack.Decoder(NodeRequest)
_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode_request(data: bytes) -> Any:
    """Decode a client request; raises InvalidRequest for malformed or truncated frames, and
    for lists past their limits (refused before their entries are read)."""
    try:
        return _req_decoder.decode(data)
    except msgspec.ValidationError as e:
        if "length <=" in str(e):
            raise InvalidRequest(f"request refused: {e}; at most {MAX_BATCH_KEYS} keys per request (KVPoolClient "
                                 "splits larger batches): split it", limit=MAX_BATCH_KEYS) from None
        raise InvalidRequest(f"malformed request: {e}") from None
    except DECODE_ERRORS as e:  # (its ValidationError is answered above)
        raise InvalidRequest(f"malformed request: {e}") from None


def decode_node_request(data: bytes) -> Any:
    try:
        return _node_decoder.decode(data)
    except DECODE_ERRORS as e:
        raise InvalidRequest(f"malformed node request: {e}") from None


def decode_result(data: bytes, typ: Any) -> Any:
    try:
        return msgspec.msgpack.decode(data, type=typ)
    except DECODE_ERRORS as e:
        raise InvalidRequest(f"malformed reply: {e}") from None
