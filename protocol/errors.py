"""One error hierarchy for every kvpool process.

On the wire an error travels as ``{code, message, fields}`` (:class:`ErrorInfo`) and
is mapped back to the same class on the receiving side by :func:`from_wire`. Each
message ends with what to do next, in the manner of Ray's ``ObjectStoreFullError``.
"""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec

# what decoding untrusted bytes (a socket's, etcd's, a record's) raises when they are malformed:
# bad msgpack, the wrong types, or nesting deeper than the decoder's stack (RecursionError)
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


class ErrorInfo(msgspec.Struct, frozen=True, tag="err", array_like=True):
    """Wire form of an error: a stable ``code`` string, the message, extra fields."""

    code: str
    message: str
    fields: dict[str, Any] = {}


class KVPoolError(Exception):
    """Base of all kvpool errors. ``code`` is stable and travels on the wire."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str = "", **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def to_wire(self) -> ErrorInfo:
        return ErrorInfo(self.code, self.message, _plain(self.fields))


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in fields.items():
        out[k] = v if isinstance(v, (str, int, float, bool, type(None), list, dict, bytes)) else str(v)
    return out


class NotFound(KVPoolError):
    """The key is not stored (or not yet committed)."""

    code = "not_found"


class InvalidKey(KVPoolError):
    """A key is empty, longer than 512 bytes of UTF-8, or not valid UTF-8."""

    code = "invalid_key"


class InvalidRequest(KVPoolError):
    """A malformed, truncated or semantically invalid message or argument."""

    code = "invalid_request"


class ReplyTooLarge(InvalidRequest):
    """The answer to a batch would exceed the RPC frame limit (``reply_bytes`` against
    ``limit``): ask for fewer keys per request (KVPoolClient halves such a batch itself)."""

    code = "reply_too_large"


class LayoutMismatch(KVPoolError):
    """The stored layout differs from the one the reader asked for."""

    code = "layout_mismatch"


class LeaseExpired(KVPoolError):
    """A read finished after its read lease lapsed; the bytes were discarded."""

    code = "lease_expired"


class HasLease(KVPoolError):
    """Remove refused: the object has a live read lease (pass force=True to override)."""

    code = "has_lease"


class Pinned(KVPoolError):
    """Remove refused: the object is pinned or held (pass force=True to override)."""

    code = "pinned"


class NoSpace(KVPoolError):
    """No store node has room for the object, even after eviction."""

    code = "no_space"


class ObjectTooLarge(NoSpace):
    """The object is larger than any node's whole segment."""

    code = "object_too_large"


class NodeUnavailable(KVPoolError):
    """A store node is dead, unreachable, or restarted with a new generation."""

    code = "node_unavailable"


class StaleExtent(NodeUnavailable):
    """A data-plane request named an extent that was freed or reused (old generation)."""

    code = "stale_extent"


class ChecksumMismatch(KVPoolError):
    """Bytes read did not match the object's xxh3 checksum."""

    code = "checksum_mismatch"


class PutRevoked(KVPoolError):
    """A put was revoked (its writer was silent past put_timeout, or it was superseded):
    put_end, or a store node asked to take the put's bytes, refuses it."""

    code = "put_revoked"


class ExtentBusy(KVPoolError):
    """A store node refused a write into memory that a revoked writer may still be copying
    into (see :mod:`storenode.extents`); the put is placed again elsewhere."""

    code = "extent_busy"


class PutInFlight(KVPoolError):
    """Another writer is storing the same key and did not commit it in time."""

    code = "put_in_flight"


class HandoffNotFound(NotFound):
    """No hand-off record exists for this request id."""

    code = "handoff_not_found"


class HandoffExpired(KVPoolError):
    """The hand-off record's deadline passed; its objects are no longer held."""

    code = "handoff_expired"


class HandoffLoadFailed(KVPoolError):
    """A consumer with policy ``fail`` could not load some hand-off blocks."""

    code = "handoff_load_failed"


class NotLeader(KVPoolError):
    """This master is a standby; retry against the current leader."""

    code = "not_leader"


class StaleTerm(NotLeader):
    """A message of a deposed leadership: its term (DESIGN.md §8, :mod:`protocol.terms`)
    is older than one the receiver has seen. Nothing was changed; look the leader up
    again (etcd's ``leader`` key) and retry there."""

    code = "stale_term"


class Timeout(KVPoolError):
    """A wait passed its deadline."""

    code = "timeout"


class LoadCancelled(KVPoolError):
    """The owner of a get's destination pages cancelled the load (a lapsed step deadline)
    before this object was written into them: none of its bytes were."""

    code = "load_cancelled"


class ConfigError(KVPoolError):
    """A configuration value is missing or invalid; the message names key and accepted values."""

    code = "config_error"


class EtcdUnavailable(KVPoolError):
    """etcd could not be reached at the configured endpoint."""

    code = "etcd_unavailable"


class EtcdFull(EtcdUnavailable):
    """etcd answers but refuses new records: its database reached its space quota (alarm
    NOSPACE, "mvcc: database space exceeded"). Reads and deletes still work; the message
    says how to free space (compact, defragment, disarm the alarm) or raise the quota."""

    code = "etcd_full"


class LeaderFenced(EtcdUnavailable):
    """The leader could not renew its leadership lease in etcd for half the lease's TTL, so
    it acknowledges no change until it renews it (or a new leader is elected): reads of
    known objects still work. Clients retry it like NotLeader until their deadline."""

    code = "leader_fenced"


class AuthFailed(KVPoolError):
    """A peer was refused, or refused us, at connect: no cluster secret, a wrong one, a
    stalled handshake, or a TLS certificate that does not verify. ``fields['cause']``
    names which (``missing_secret``, ``wrong_secret``, ``server_without_secret``,
    ``timeout``, ``closed``, ``tls_verify``)."""

    code = "auth_failed"


class Forbidden(AuthFailed):
    """The peer's role may not do this (an engine's ``client`` credential asking for an
    operator's request: settings, evictions by selector, forced removals, drains)."""

    code = "forbidden"


class Overloaded(KVPoolError):
    """A server refused work beyond its bounds (connections, queued copies); retry later
    or raise the bound named in the message."""

    code = "overloaded"


_BY_CODE: dict[str, type[KVPoolError]] = {}


def _register(cls: type[KVPoolError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(KVPoolError)


def from_wire(info: ErrorInfo) -> KVPoolError:
    """Rebuild the typed exception for a wire error; unknown codes map to KVPoolError."""
    cls = _BY_CODE.get(info.code, KVPoolError)
    err = cls(info.message, **(info.fields or {}))
    return err
