"""Keys, block hashes and group keys (DESIGN.md §4).

Block hash chain: ``h_i = xxh3_128(h_{i-1} || token_ids of block i || extra)`` with
``h_{-1}`` = 16 zero bytes, token ids packed as little-endian int64 and ``extra`` the
caller's stable bytes (model id, LoRA/adapter id, multimodal hashes). Only full blocks
are hashed, so a block's hash names its whole prefix.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from kvpool.protocol.errors import InvalidKey

MAX_KEY_BYTES = 512
ROOT_HASH = bytes(16)


def validate_key(key: str | bytes) -> str:
    """Return ``key`` as str; raise InvalidKey when empty, over 512 UTF-8 bytes, or not UTF-8."""
    if type(key) is str and 0 < len(key) <= MAX_KEY_BYTES and key.isascii():  # one byte per character
        return key
    if isinstance(key, (bytes, bytearray)):
        try:
            key = bytes(key).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidKey("key is not valid UTF-8; keys are text of at most 512 bytes") from None
    if not isinstance(key, str):
        raise InvalidKey(f"key must be str, got {type(key).__name__}")
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidKey("key is not valid UTF-8 (lone surrogate); keys are text of at most 512 bytes") from None
    if n == 0:
        raise InvalidKey("key is empty")
    if n > MAX_KEY_BYTES:
        raise InvalidKey(f"key is {n} bytes of UTF-8; the limit is {MAX_KEY_BYTES}", size=n)
    return key


def extra_bytes(*parts: str | bytes | None) -> bytes:
    """Join the extra hash inputs (model id, adapter id, mm hashes) unambiguously."""
    out = bytearray()
    for p in parts:
        b = b"" if p is None else (p.encode() if isinstance(p, str) else bytes(p))
        out += len(b).to_bytes(4, "little") + b
    return bytes(out)


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, extra: bytes = b"",
                 parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chained xxh3_128 hashes (16 bytes each) of every *full* block of ``token_ids``."""
    toks = np.asarray(token_ids, dtype="<i8")
    out: list[bytes] = []
    h = parent
    for i in range(len(toks) // block_size):
        h = xxhash.xxh3_128_digest(h + toks[i * block_size:(i + 1) * block_size].tobytes() + extra)
        out.append(h)
    return out


def group_key(namespace: str, model: str, group_id: int | str, fingerprint: str, block_hash: bytes,
              tp_rank: int | None) -> str:
    """``<namespace>/<model>/<group_id>:<fingerprint>[/tp<rank>]/<block_hash hex>``; rank
    omitted (``None``) for REPLICATE layouts."""
    rank = "" if tp_rank is None else f"/tp{tp_rank}"
    return validate_key(f"{namespace}/{model}/{group_id}:{fingerprint}{rank}/{block_hash.hex()}")
