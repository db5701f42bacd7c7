"""Write grants: the master authorises each extent write with a keyed BLAKE2b token.

A store node makes a random ``grant_key`` per incarnation and publishes it to the master
in its etcd descriptor; the master puts ``grant_token(...)`` in every ExtentRef it grants
for writing; the node refuses a ``write``/``written`` whose token does not match. So a
buggy or stale client cannot overwrite extents it was never granted (reads are guarded by
the extent generation instead). The token names the object key too, so a grant cannot
be used to write or commit another key (a writer's ``commit`` copy, see
:mod:`protocol.dataplane`, rebuilds the index after a master failover). Same-host clients
that map the segment are trusted, as in Mooncake Store and LMCache: the token guards the
network path and the commit record.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import struct

_FMT = struct.Struct("<QQQ")


class Grants:
    """The tokens of one node incarnation (its ``grant_key`` and ``incarnation``): the keyed
    BLAKE2b state after the incarnation is made once and copied per token, never updated
    itself, so threads may share one."""

    __slots__ = ("_prefix",)

    def __init__(self, grant_key: bytes, incarnation: str) -> None:
        self._prefix = hashlib.blake2b(incarnation.encode(), key=grant_key, digest_size=16)

    def token(self, offset: int, size: int, gen: int, key: str) -> bytes:
        """:func:`grant_token` of this incarnation: 16 bytes."""
        h = self._prefix.copy()
        h.update(_FMT.pack(offset, size, gen) + key.encode())
        return h.digest()

    def check(self, offset: int, size: int, gen: int, key: str, token: bytes) -> bool:
        """Whether ``token`` is this incarnation's grant of that extent (bytes offset and
        size, generation) for object ``key`` (compared in constant time)."""
        h = self._prefix.copy()
        h.update(_FMT.pack(offset, size, gen) + key.encode())
        return hmac.compare_digest(h.digest(), token)


@functools.lru_cache(maxsize=256)
def grants_of(grant_key: bytes, incarnation: str) -> Grants:
    """The :class:`Grants` of one node incarnation, made once (the last 256 kept)."""
    return Grants(grant_key, incarnation)


def grant_token(grant_key: bytes, incarnation: str, offset: int, size: int, gen: int, key: str) -> bytes:
    """16-byte keyed BLAKE2b of (incarnation, offset, size, gen, object key): a grant lets
    its holder write, and commit, that one object in that one extent."""
    return grants_of(grant_key, incarnation).token(offset, size, gen, key)


def check_token(grant_key: bytes, incarnation: str, offset: int, size: int, gen: int, key: str,
                token: bytes) -> bool:
    return grants_of(grant_key, incarnation).check(offset, size, gen, key, token)
