"""``kvpool.errors``: the typed errors every kvpool call raises (see :mod:`kvpool.protocol.errors`)."""

from kvpool.protocol.errors import (ChecksumMismatch, ConfigError, EtcdFull, EtcdUnavailable, HandoffExpired,
                                    HandoffLoadFailed, HandoffNotFound, HasLease, InvalidKey, InvalidRequest,
                                    KVPoolError, LayoutMismatch, LeaseExpired, NodeUnavailable, NotFound, NotLeader,
                                    NoSpace, ObjectTooLarge, Pinned, PutInFlight, PutRevoked, StaleExtent, Timeout)

__all__ = ["ChecksumMismatch", "ConfigError", "EtcdFull", "EtcdUnavailable", "HandoffExpired", "HandoffLoadFailed",
           "HandoffNotFound", "HasLease", "InvalidKey", "InvalidRequest", "KVPoolError", "LayoutMismatch",
           "LeaseExpired", "NodeUnavailable", "NotFound", "NotLeader", "NoSpace", "ObjectTooLarge", "Pinned",
           "PutInFlight", "PutRevoked", "StaleExtent", "Timeout"]
