"""Layout descriptors: what the bytes of a stored block mean (DESIGN.md §4, §9).

A :class:`LayoutSpec` names the cache-group kind, dtype, tokens per block, the
per-block sub-tensors (name, shape, dtype), head geometry, TP size/rank and the
parallel mode. Its :meth:`LayoutSpec.fingerprint` (xxh3_64 over a canonical
msgpack encoding, TP rank excluded so that all ranks of one layout share it) goes
into every group key, so incompatible layouts never alias; the full descriptor
also travels with the object so a reader detects a mismatch (:class:`LayoutMismatch`).
"""
from __future__ import annotations

import math
from typing import Annotated

import msgspec
import xxhash

from kvpool.protocol.errors import DECODE_ERRORS, InvalidRequest, LayoutMismatch

KINDS = ("full_attention", "sliding_window", "mla", "mamba", "raw")
PARALLEL = ("split", "replicate")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1,
               "int32": 4, "int64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
FORMAT_VERSION = 1
# tensors one layout describes at most (a group's layers, two per layer for a Mamba state);
# decoding refuses longer lists before reading them
MAX_LAYOUT_TENSORS = 4096


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One named sub-tensor of a block: ``shape`` (elements) and ``dtype`` name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


class LayoutSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Layout of one block of one cache group.

    Fields: ``kind`` in KINDS; ``tokens_per_block`` (for mamba: tokens per state slot);
    ``tensors`` the contiguous sub-tensors packed back to back in the object, in order;
    ``num_kv_heads``/``head_size`` (attention), ``latent_dim`` (MLA); ``tp_size``/``tp_rank``
    and ``parallel`` ("split": per-rank heads, keyed per rank; "replicate": one copy for all
    ranks, e.g. MLA); ``sliding_window`` in tokens; ``version`` the format version.
    """

    kind: str
    tokens_per_block: int
    tensors: Annotated[tuple[TensorSpec, ...], msgspec.Meta(max_length=MAX_LAYOUT_TENSORS)]
    num_kv_heads: int = 0
    head_size: int = 0
    latent_dim: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    parallel: str = "split"
    sliding_window: int = 0
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"layout kind {self.kind!r} unknown; accepted: {', '.join(KINDS)}")
        if self.parallel not in PARALLEL:
            raise InvalidRequest(f"layout parallel {self.parallel!r} unknown; accepted: split, replicate")
        if self.tokens_per_block <= 0:
            raise InvalidRequest("layout tokens_per_block must be > 0")
        if not self.tensors:
            raise InvalidRequest("layout needs at least one tensor")
        if len(self.tensors) > MAX_LAYOUT_TENSORS:
            raise InvalidRequest(f"layout has {len(self.tensors)} tensors; the limit is {MAX_LAYOUT_TENSORS}")
        for t in self.tensors:
            if t.dtype not in DTYPE_BYTES:
                raise InvalidRequest(f"layout tensor {t.name!r} dtype {t.dtype!r} unknown; "
                                     f"accepted: {', '.join(DTYPE_BYTES)}")
            if any(d <= 0 for d in t.shape):
                raise InvalidRequest(f"layout tensor {t.name!r} has a non-positive dimension {t.shape}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidRequest(f"layout tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.kind == "mla" and self.parallel != "replicate":
            raise InvalidRequest("mla layouts are REPLICATE across TP ranks (one latent copy)")

    @property
    def nbytes(self) -> int:
        """Bytes of one block: the sum of its sub-tensors."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def replicated(self) -> bool:
        return self.parallel == "replicate"

    def canonical(self) -> "LayoutSpec":
        """The layout with what does not change the bytes zeroed: tp_rank always (the rank
        goes into the key instead), and tp_size too for REPLICATE layouts (one copy serves
        every TP size)."""
        return msgspec.structs.replace(self, tp_rank=0, tp_size=1 if self.replicated else self.tp_size)

    def fingerprint(self) -> str:
        """Stable 16-hex-digit xxh3_64 of the :meth:`canonical` layout's msgpack encoding."""
        return xxhash.xxh3_64_hexdigest(msgspec.msgpack.encode(self.canonical()))

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> "LayoutSpec":
        """Decode a descriptor; raises InvalidRequest for malformed bytes."""
        try:
            return msgspec.msgpack.decode(data, type=LayoutSpec)
        except DECODE_ERRORS as e:
            raise InvalidRequest(f"malformed layout descriptor: {e}") from None


def first_difference(a: LayoutSpec, b: LayoutSpec) -> str | None:
    """Name the first field where two layouts differ (``None`` when equal)."""
    for field in a.__struct_fields__:
        if getattr(a, field) != getattr(b, field):
            return field
    return None


def check_layout(expected: LayoutSpec, stored: LayoutSpec | None, key: str) -> None:
    """Raise LayoutMismatch when ``stored`` differs from ``expected`` (tp_rank ignored for
    replicated layouts)."""
    if stored is None:
        raise LayoutMismatch(f"object {key!r} has no layout descriptor but layout {expected.kind} was "
                             "asked for; it was stored as raw bytes", key=key)
    if expected.replicated:
        expected, stored = expected.canonical(), stored.canonical()
    field = first_difference(expected, stored)
    if field is not None:
        raise LayoutMismatch(
            f"object {key!r} was stored with a different layout ({field}: stored "
            f"{getattr(stored, field)!r}, asked {getattr(expected, field)!r}); the bytes were not "
            "reinterpreted. Check that producer and consumer use the same model, dtype and TP setup.",
            key=key, field=field)


# ---- layouts on the wire ------------------------------------------------------------------
# Request and reply items carry their layout as raw msgpack (a field typed ``msgspec.Raw``):
# decoding a batch then costs no Python object per tensor, and each distinct layout is
# decoded once per process (a batch's items share a few layouts) rather than once per item.
# The bytes on the wire are those of an embedded LayoutSpec (or nil), as before.

NO_LAYOUT = msgspec.Raw(b"\xc0")  # msgpack nil: an item without a layout
_NIL = b"\xc0"
MAX_LAYOUT_BYTES = 256 << 10  # a layout's encoding at most (4,096 tensors with plain names take ~200 KiB)
_DECODED_MAX_BYTES = 8 << 20  # encoded bytes of the decoded layouts kept (about ten times that decoded)
_ENCODED_MAX = 4096  # layout objects whose encoding is kept
_decoded: dict[bytes, LayoutSpec] = {}
_decoded_bytes = [0]
_encoded: dict[int, tuple[LayoutSpec, msgspec.Raw]] = {}


def raw_layout(layout: LayoutSpec | None) -> msgspec.Raw:
    """``layout`` as the raw msgpack a ``msgspec.Raw`` wire field carries (:data:`NO_LAYOUT`
    for None). The encoding is kept per layout object, so a batch sharing one layout encodes
    it once."""
    if layout is None:
        return NO_LAYOUT
    got = _encoded.get(id(layout))
    if got is not None and got[0] is layout:
        return got[1]
    raw = msgspec.Raw(layout.encode())
    if len(_encoded) >= _ENCODED_MAX:
        _encoded.clear()
    _encoded[id(layout)] = (layout, raw)
    return raw


def layout_of(raw: msgspec.Raw | bytes) -> LayoutSpec | None:
    """The layout a wire field carries (None for nil). Each distinct encoding is decoded once
    and the result shared (layouts are frozen); raises InvalidRequest for bytes that are not
    a valid layout (e.g. more than :data:`MAX_LAYOUT_TENSORS` tensors, or an encoding over
    :data:`MAX_LAYOUT_BYTES`)."""
    b = bytes(raw)
    if b == _NIL:
        return None
    got = _decoded.get(b)
    if got is None:
        if len(b) > MAX_LAYOUT_BYTES:
            raise InvalidRequest(f"a layout of {len(b)} encoded bytes; the limit is {MAX_LAYOUT_BYTES}",
                                 limit=MAX_LAYOUT_BYTES)
        got = LayoutSpec.decode(b)
        if _decoded_bytes[0] + len(b) > _DECODED_MAX_BYTES:
            _decoded.clear()
            _decoded_bytes[0] = 0
        _decoded[b] = got
        _decoded_bytes[0] += len(b)
    return got


def layout_bytes(raw: msgspec.Raw) -> bytes | None:
    """The encoded layout a wire field carries, as the bytes a store node's commit row
    holds (None for nil)."""
    b = bytes(raw)
    return None if b == _NIL else b
