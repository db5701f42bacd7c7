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

import hashlib
import hmac
import struct

_FMT = struct.Struct("<QQQ")


def grant_token(grant_key: bytes, incarnation: str, offset: int, size: int, gen: int, key: str) -> bytes:
    """16-byte keyed BLAKE2b of (incarnation, offset, size, gen, object key): a grant lets
    its holder write, and commit, that one object in that one extent."""
    h = hashlib.blake2b(incarnation.encode() + _FMT.pack(offset, size, gen) + key.encode(), key=grant_key,
                        digest_size=16)
    return h.digest()


def check_token(grant_key: bytes, incarnation: str, offset: int, size: int, gen: int, key: str,
                token: bytes) -> bool:
    return hmac.compare_digest(grant_token(grant_key, incarnation, offset, size, gen, key), token)
