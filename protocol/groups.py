"""Cache groups of hybrid models and their transfer projection (DESIGN.md §4, §9; issue 6).

An engine declares every cache group it has (:class:`CacheGroupSpec`: a name, the
layers whose cache it holds, the per-block :class:`~protocol.layout.LayoutSpec`, and
whether it takes part in KV transfer). :func:`project` keeps the transfer groups in the
engine's declared order and numbers them; the resulting :class:`TransferProjection` is
fingerprinted (names, layers, kinds, block sizes and layout fingerprints), published
once per model and TP size, and checked by every reader with :func:`check_projection`,
which raises :class:`~protocol.errors.LayoutMismatch` naming the first differing group
and field instead of letting group order drift silently.

Also here, free of I/O:

- :func:`storage_layout`: the layout a group's objects are stored under (REPLICATE
  layouts in canonical form: one copy serves every TP size and rank).
- :func:`tp_read_plan`: which stored TP ranks and head ranges a reader rank needs
  (heterogeneous TP for SPLIT attention groups; rejects what cannot be sliced exactly);
  :func:`layout_at_tp`: the layout such a group has at another TP size (what an engine of
  that size stores, so its keys can be looked up).
- :func:`validate_state_slot`: mamba/KDA state slots must carry every sub-tensor (conv
  history *and* recurrent state), name the token count they represent, sit on an
  aligned boundary (or be a declared tail), and never be speculative.
- :func:`common_prefix`: the longest length at which every required group can be
  restored (mamba needs a checkpoint exactly there), or the per-group ("divergent")
  lengths.
- Key helpers for state slots (``.../<hash>@<tokens>``) and partial tails
  (``.../tail/<hash of the whole prefix>@<tokens>``) that can never be mistaken for a
  full block.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import xxhash

from kvpool.protocol.errors import DECODE_ERRORS, InvalidRequest, LayoutMismatch
from kvpool.protocol.keys import group_key, validate_key
from kvpool.protocol.layout import LayoutSpec

ATTENTION_KINDS = ("full_attention", "sliding_window")
PAGED_KINDS = ("full_attention", "sliding_window", "mla")  # restorable at any length <= stored
CONV_PREFIXES = ("conv",)
STATE_PREFIXES = ("ssm", "state", "recurrent")
PROJECTION_VERSION = 1


class CacheGroupSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One cache group as the engine declares it.

    ``name``: stable group name (e.g. ``"attn"``); ``layers``: indices of the model layers
    whose cache the group holds, ascending; ``layout``: one block (or one state slot) of
    the group for this TP rank; ``enable_kv_transfer``: stored in kvpool or engine-local
    only (e.g. a draft model's scratch cache).
    """

    name: str
    layers: tuple[int, ...]
    layout: LayoutSpec
    enable_kv_transfer: bool = True


class TransferGroup(msgspec.Struct, frozen=True, kw_only=True):
    """A stored group: ``index`` (its position in the projection; the key's group id),
    name, kind, layers, tokens per block, and the fingerprint of its storage layout."""

    index: int
    name: str
    kind: str
    layers: tuple[int, ...]
    tokens_per_block: int
    fingerprint: str
    layout: LayoutSpec


class TransferProjection(msgspec.Struct, frozen=True, kw_only=True):
    """The ordered transfer groups of one engine (one TP rank's view)."""

    groups: tuple[TransferGroup, ...]
    version: int = PROJECTION_VERSION

    def fingerprint(self) -> str:
        """xxh3_64 (16 hex digits) over version and, per group in order: index, name, kind,
        layers, tokens per block and storage-layout fingerprint (TP rank excluded)."""
        canon = [self.version] + [[g.index, g.name, g.kind, list(g.layers), g.tokens_per_block, g.fingerprint]
                                  for g in self.groups]
        return xxhash.xxh3_64_hexdigest(msgspec.msgpack.encode(canon))

    def group(self, name: str) -> TransferGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no transfer group {name!r}; groups: {', '.join(g.name for g in self.groups)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> "TransferProjection":
        try:
            return msgspec.msgpack.decode(data, type=TransferProjection)
        except DECODE_ERRORS as e:
            raise InvalidRequest(f"malformed transfer projection: {e}") from None


# ---------------------------------------------------------------------------- layouts


def storage_layout(layout: LayoutSpec) -> LayoutSpec:
    """The layout objects of this group are stored under (the descriptor that travels with
    each object): REPLICATE layouts are :meth:`~protocol.layout.LayoutSpec.canonical` (no
    TP size or rank: one copy serves every TP size and rank); SPLIT layouts keep both,
    since each rank's object holds that rank's heads. Its fingerprint is the layout's own
    (fingerprints are taken over the canonical form)."""
    return layout.canonical() if layout.replicated else layout


def _tensor_role(name: str) -> str | None:
    if name.startswith(CONV_PREFIXES):
        return "conv"
    if name.startswith(STATE_PREFIXES):
        return "state"
    return None


def validate_group_layout(layout: LayoutSpec, name: str = "?") -> None:
    """Kind-specific checks: SPLIT attention tensors end in ``[heads, tokens, head_size]``;
    MLA has ``num_kv_heads == 1`` and a latent dim; mamba names a conv-history tensor
    (``conv*``) and a recurrent-state tensor (``ssm*``/``state*``/``recurrent*``)."""
    if layout.kind in ATTENTION_KINDS:
        for t in layout.tensors:
            if len(t.shape) < 3 or tuple(t.shape[-3:]) != (layout.num_kv_heads, layout.tokens_per_block,
                                                          layout.head_size):
                raise InvalidRequest(
                    f"group {name!r}: attention tensor {t.name!r} shape {t.shape} must end in "
                    f"[num_kv_heads={layout.num_kv_heads}, tokens={layout.tokens_per_block}, "
                    f"head_size={layout.head_size}]")
    elif layout.kind == "mla":
        if layout.num_kv_heads != 1 or layout.latent_dim <= 0:
            raise InvalidRequest(f"group {name!r}: mla layouts have num_kv_heads=1 and a latent_dim > 0")
    elif layout.kind == "mamba":
        roles = {_tensor_role(t.name) for t in layout.tensors}
        missing = [r for r in ("conv", "state") if r not in roles]
        if missing:
            raise InvalidRequest(
                f"group {name!r}: a mamba state slot needs a conv-history tensor (name conv*) and a "
                f"recurrent-state tensor (name ssm*/state*/recurrent*); missing: {', '.join(missing)}")


def project(groups: Sequence[CacheGroupSpec]) -> TransferProjection:
    """Keep the ``enable_kv_transfer`` groups, in the declared order, numbered 0..n-1.

    Raises InvalidRequest for duplicate names, a layer in two groups, unsorted layers,
    or a layout that fails :func:`validate_group_layout`.
    """
    seen_names: set[str] = set()
    seen_layers: dict[int, str] = {}
    out = []
    for g in groups:
        if g.name in seen_names:
            raise InvalidRequest(f"cache group name {g.name!r} declared twice")
        seen_names.add(g.name)
        if not g.layers or list(g.layers) != sorted(set(g.layers)):
            raise InvalidRequest(f"cache group {g.name!r}: layers must be ascending and distinct, got {g.layers}")
        for layer in g.layers:
            if layer in seen_layers:
                raise InvalidRequest(f"layer {layer} is in cache groups {seen_layers[layer]!r} and {g.name!r}")
            seen_layers[layer] = g.name
        validate_group_layout(g.layout, g.name)
        if not g.enable_kv_transfer:
            continue
        out.append(TransferGroup(index=len(out), name=g.name, kind=g.layout.kind, layers=tuple(g.layers),
                                 tokens_per_block=g.layout.tokens_per_block, fingerprint=g.layout.fingerprint(),
                                 layout=g.layout))
    return TransferProjection(groups=tuple(out))


# ---------------------------------------------------------------------------- TP


class ReadPiece(msgspec.Struct, frozen=True, array_like=True):
    """Read stored TP rank ``src_rank`` (``None``: the replicated copy), take heads
    ``[head_lo, head_hi)`` of it along the head axis, place them at ``dst_lo`` in the
    reader's block. For non-head-split reads the head range is the whole block."""

    src_rank: int | None
    head_lo: int
    head_hi: int
    dst_lo: int


def _first_diff(a: LayoutSpec, b: LayoutSpec) -> str | None:
    """First differing field, scalar fields (kind, block size, heads, head size, ...) before
    the tensor list, so the message names the most telling difference."""
    for f in a.__struct_fields__:
        if f != "tensors" and getattr(a, f) != getattr(b, f):
            return f
    return "tensors" if a.tensors != b.tensors else None


def _same_but_tp(stored: LayoutSpec, local: LayoutSpec) -> str | None:
    """First field other than TP geometry where two layouts differ."""
    ignore = {"tp_size", "tp_rank", "num_kv_heads", "tensors"}
    for f in stored.__struct_fields__:
        if f not in ignore and getattr(stored, f) != getattr(local, f):
            return f
    if len(stored.tensors) != len(local.tensors):
        return "tensors"
    for a, b in zip(stored.tensors, local.tensors):
        if a.name != b.name or a.dtype != b.dtype or tuple(a.shape[:-3]) != tuple(b.shape[:-3]) \
                or tuple(a.shape[-2:]) != tuple(b.shape[-2:]):
            return "tensors"
    return None


def tp_read_plan(stored: LayoutSpec, local: LayoutSpec, group: str = "?") -> list[ReadPiece]:
    """How the reader rank ``local.tp_rank`` (of ``local.tp_size``) assembles one block from
    blocks stored with ``stored``'s TP geometry.

    - REPLICATE: read the one copy (``src_rank=None``), whatever both TP sizes are.
    - SPLIT, same TP size: read the reader's own rank.
    - SPLIT attention with different TP sizes: the reader's global heads
      ``[r*h_local, (r+1)*h_local)`` are gathered from the stored ranks that hold them
      (slicing when the reader has more ranks, concatenating when it has fewer).
    - Anything else (mamba/KDA state split differently, total heads differing or not
      divisible, a tensor whose head axis (``shape[-3]``) is not ``num_kv_heads``, other
      fields differing) raises LayoutMismatch naming the group and field; bytes are never
      converted.
    """
    if stored.replicated != local.replicated:
        raise LayoutMismatch(f"group {group!r}: stored parallel mode {stored.parallel}, this engine "
                             f"uses {local.parallel}", field="parallel", group=group)
    if stored.replicated or stored.tp_size == local.tp_size:
        # the same bytes or nothing: canonical() sets aside the rank (and, for REPLICATE, the TP size)
        f = _first_diff(stored.canonical(), local.canonical())
        if f is not None:
            raise LayoutMismatch(f"group {group!r}: stored {f}={getattr(stored, f)!r}, this engine "
                                 f"uses {getattr(local, f)!r}", field=f, group=group)
        if stored.replicated:
            return [ReadPiece(None, 0, 0, 0)]
        return [ReadPiece(local.tp_rank, 0, local.num_kv_heads, 0)]
    if stored.kind not in ATTENTION_KINDS:
        raise LayoutMismatch(
            f"group {group!r} ({stored.kind}) was stored with tp_size={stored.tp_size} and this engine "
            f"uses tp_size={local.tp_size}; {stored.kind} state is split differently across ranks and "
            "is not converted. Use the same TP size on both sides for this group.",
            field="tp_size", group=group)
    f = _same_but_tp(stored, local)
    if f is not None:
        raise LayoutMismatch(f"group {group!r}: stored {f}={getattr(stored, f)!r}, this engine uses "
                             f"{getattr(local, f)!r}", field=f, group=group)
    for lay, side in ((stored, "stored blocks have"), (local, "this engine has")):
        bad = _headless_tensor(lay)
        if bad is not None:
            raise LayoutMismatch(f"group {group!r}: {side} tensor {bad.name!r} of shape {tuple(bad.shape)}, "
                                 f"without a head axis of {lay.num_kv_heads} (num_kv_heads) at dimension -3; "
                                 "heads are not regathered", field="tensors", group=group)
    total_s, total_l = stored.num_kv_heads * stored.tp_size, local.num_kv_heads * local.tp_size
    if total_s != total_l:
        raise LayoutMismatch(f"group {group!r}: stored blocks hold {total_s} KV heads in total "
                             f"({stored.tp_size} ranks x {stored.num_kv_heads}), this engine has {total_l} "
                             f"({local.tp_size} x {local.num_kv_heads})", field="num_kv_heads", group=group)
    lo, hi = local.tp_rank * local.num_kv_heads, (local.tp_rank + 1) * local.num_kv_heads
    pieces = []
    h = lo
    while h < hi:
        src = h // stored.num_kv_heads
        src_lo = h - src * stored.num_kv_heads
        take = min(hi - h, stored.num_kv_heads - src_lo)
        pieces.append(ReadPiece(src, src_lo, src_lo + take, h - lo))
        h += take
    return pieces


def layout_at_tp(layout: LayoutSpec, tp_size: int, group: str = "?") -> LayoutSpec:
    """The layout (rank 0) of SPLIT attention group ``layout`` as an engine with
    ``tp_size`` ranks stores it: the same heads in total, ``num_kv_heads * layout.tp_size /
    tp_size`` per rank, each tensor's head axis (``shape[-3]``, heads outermost in a page)
    set to that; everything else unchanged. Its fingerprint names that engine's keys, and
    :func:`tp_read_plan` ``(layout_at_tp(l, t), l)`` reads them. Raises LayoutMismatch
    (naming ``group``) for a REPLICATE layout (one copy serves every TP size already), a
    kind other than full or sliding-window attention (states are split otherwise), a
    ``tp_size`` below 1, or heads that ``tp_size`` ranks cannot share evenly."""
    if layout.replicated:
        raise LayoutMismatch(f"group {group!r} is replicated: one stored copy serves every TP size",
                             field="parallel", group=group)
    if layout.kind not in ATTENTION_KINDS:
        raise LayoutMismatch(f"group {group!r} ({layout.kind}) is split across TP ranks in a way kvpool does "
                             "not convert; only attention heads are regathered", field="kind", group=group)
    total = layout.num_kv_heads * layout.tp_size
    if tp_size < 1 or total % tp_size:
        raise LayoutMismatch(f"group {group!r}: {total} KV heads cannot be shared evenly by {tp_size} TP ranks",
                             field="num_kv_heads", group=group)
    bad = _headless_tensor(layout)
    if bad is not None:
        raise LayoutMismatch(f"group {group!r}: tensor {bad.name!r} of shape {tuple(bad.shape)} has no head axis "
                             f"of {layout.num_kv_heads} at dimension -3", field="tensors", group=group)
    heads = total // tp_size
    tensors = tuple(msgspec.structs.replace(t, shape=(*t.shape[:-3], heads, *t.shape[-2:])) for t in layout.tensors)
    return msgspec.structs.replace(layout, num_kv_heads=heads, tp_size=tp_size, tp_rank=0, tensors=tensors)


def _headless_tensor(layout: LayoutSpec):
    """The first tensor of ``layout`` whose page has no head axis of ``num_kv_heads`` at
    dimension -3 (heads outermost in a page, as SPLIT attention stores them), or None."""
    return next((t for t in layout.tensors if len(t.shape) < 3 or t.shape[-3] != layout.num_kv_heads), None)


def check_projection(stored: TransferProjection, local: TransferProjection, *,
                     allow_tp_reshard: bool = True) -> dict[str, list[ReadPiece]]:
    """Check that a reader's projection matches the one the data was stored under.

    Returns, per group name, the :func:`tp_read_plan`. Raises LayoutMismatch naming the
    first differing group (index and name) and field: group count, order (name), layers,
    kind, tokens per block, or the layout itself. With ``allow_tp_reshard=False`` a TP
    size difference is a mismatch too.
    """
    n = max(len(stored.groups), len(local.groups))
    plans: dict[str, list[ReadPiece]] = {}
    for i in range(n):
        s = stored.groups[i] if i < len(stored.groups) else None
        lg = local.groups[i] if i < len(local.groups) else None
        if s is None or lg is None:
            extra = lg if s is None else s
            side = "this engine has" if s is None else "the stored projection has"
            raise LayoutMismatch(
                f"transfer group {i} ({extra.name!r}): {side} it but the other side does not "
                f"(stored {len(stored.groups)} groups {list(stored.names)}, this engine "
                f"{len(local.groups)} groups {list(local.names)}); both sides must declare the same "
                "transfer groups in the same order", field="groups", group=extra.name, index=i)
        for f in ("name", "layers", "kind", "tokens_per_block"):
            if getattr(s, f) != getattr(lg, f):
                raise LayoutMismatch(
                    f"transfer group {i}: stored {f}={getattr(s, f)!r}, this engine {f}={getattr(lg, f)!r} "
                    f"(stored order {list(stored.names)}, this engine {list(local.names)})",
                    field=f, group=lg.name, index=i)
        if not allow_tp_reshard and s.layout.tp_size != lg.layout.tp_size:
            raise LayoutMismatch(f"transfer group {i} ({s.name!r}): stored tp_size={s.layout.tp_size}, "
                                 f"this engine tp_size={lg.layout.tp_size}", field="tp_size", group=s.name,
                                 index=i)
        try:
            plans[s.name] = tp_read_plan(s.layout, lg.layout, s.name)
        except LayoutMismatch as e:
            raise LayoutMismatch(f"transfer group {i}: {e.message}", index=i, **e.fields) from None
    return plans


# ---------------------------------------------------------------------------- state slots


class SlotInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a caller publishes as one mamba/KDA state slot: the sub-tensor names and shapes
    it carries, the token count the state represents, whether it is a partial tail (state
    after a non-aligned prefix) and whether it is speculative (scratch)."""

    tensors: Mapping[str, tuple[int, ...]]
    tokens: int
    tail: bool = False
    speculative: bool = False


def validate_state_slot(layout: LayoutSpec, slot: SlotInfo, group: str = "?") -> None:
    """Reject, at put time, a state slot that could be restored wrongly.

    Raises InvalidRequest when: the slot is speculative; a sub-tensor of the layout is
    missing (e.g. the recurrent state without its conv history) or extra, or has another
    shape; the token count is not positive; a non-tail slot is not on an aligned
    boundary (a multiple of ``tokens_per_block``); a tail slot is on one.
    """
    if layout.kind != "mamba":
        raise InvalidRequest(f"group {group!r} is {layout.kind}, not a mamba/KDA state group")
    if slot.speculative:
        raise InvalidRequest(f"group {group!r}: speculative state slots are never published; publish "
                             "only stable checkpoints (after the tokens are accepted)")
    want = {t.name: tuple(t.shape) for t in layout.tensors}
    got = {k: tuple(v) for k, v in slot.tensors.items()}
    missing = [k for k in want if k not in got]
    if missing:
        roles = {_tensor_role(k) for k in missing}
        what = "its conv history" if "conv" in roles else "its recurrent state" if "state" in roles else "tensors"
        raise InvalidRequest(f"group {group!r}: state slot at {slot.tokens} tokens published without {what} "
                             f"(missing {', '.join(missing)}); a mamba/KDA state is restorable only with "
                             "both conv history and recurrent state")
    extra = [k for k in got if k not in want]
    if extra:
        raise InvalidRequest(f"group {group!r}: state slot has tensors the layout does not declare: "
                             f"{', '.join(extra)}")
    for k, shape in want.items():
        if got[k] != shape:
            raise InvalidRequest(f"group {group!r}: state tensor {k!r} has shape {got[k]}, layout says {shape}")
    if slot.tokens <= 0:
        raise InvalidRequest(f"group {group!r}: a state slot must represent at least one token")
    aligned = slot.tokens % layout.tokens_per_block == 0
    if not slot.tail and not aligned:
        raise InvalidRequest(f"group {group!r}: checkpoint at {slot.tokens} tokens is not on a "
                             f"{layout.tokens_per_block}-token boundary; publish it as a tail instead")
    if slot.tail and aligned:
        raise InvalidRequest(f"group {group!r}: a tail at {slot.tokens} tokens is on a boundary; publish "
                             "it as a checkpoint slot")


# ---------------------------------------------------------------------------- keys


def slot_key(namespace: str, model: str, group: TransferGroup, block_hash: bytes, tokens: int,
             tp_rank: int | None) -> str:
    """Key of a state slot: the group key of the chain hash naming the first ``tokens``
    tokens, suffixed ``@<tokens>`` so the key names the token count it represents."""
    return validate_key(group_key(namespace, model, group.index, group.fingerprint, block_hash, tp_rank)
                        + f"@{tokens}")


def tail_hash(parent: bytes, tail_tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """xxh3_128 naming a whole non-aligned prefix: ``parent`` is the chain hash of its last
    full block (of the group whose block size tails are anchored to) and ``tail_tokens``
    the tokens after it (little-endian int64, as in block hashes)."""
    import numpy as np

    return xxhash.xxh3_128_digest(b"tail" + parent + np.asarray(tail_tokens, dtype="<i8").tobytes() + extra)


def tail_key(namespace: str, model: str, group: TransferGroup, prefix_hash: bytes, tokens: int,
             tp_rank: int | None) -> str:
    """Key of a partial-tail object: ``.../<group>:<fp>[/tp<r>]/tail/<prefix hash>@<tokens>``.
    It sits under ``tail/`` so it never matches a full-block key; its layout (tokens per
    block = tail length for paged groups) differs from a block's as well."""
    base = group_key(namespace, model, group.index, group.fingerprint, prefix_hash, tp_rank)
    head, _, hexhash = base.rpartition("/")
    return validate_key(f"{head}/tail/{hexhash}@{tokens}")


def tail_layout(layout: LayoutSpec, tail_tokens: int) -> LayoutSpec:
    """Layout of a partial tail of ``tail_tokens`` tokens: paged groups' token axis (the
    second-to-last dim for attention, the token dim after the layer dim for MLA) shrinks
    to the tail length; mamba slots keep their shapes (a state is a state)."""
    if layout.kind == "mamba":
        return layout
    if not 0 < tail_tokens < layout.tokens_per_block:
        raise InvalidRequest(f"tail of {tail_tokens} tokens must be shorter than a "
                             f"{layout.tokens_per_block}-token block")
    tensors = []
    for t in layout.tensors:
        shape = list(t.shape)
        ax = len(shape) - 2  # attention [..., tokens, head]; mla [layers, tokens, dim]
        if shape[ax] != layout.tokens_per_block:
            raise InvalidRequest(f"tensor {t.name!r} shape {t.shape}: no {layout.tokens_per_block}-token axis "
                                 "at position -2")
        shape[ax] = tail_tokens
        tensors.append(msgspec.structs.replace(t, shape=tuple(shape)))
    return msgspec.structs.replace(layout, tokens_per_block=tail_tokens, tensors=tuple(tensors))


# ---------------------------------------------------------------------------- prefix hits


class PrefixHit(msgspec.Struct, frozen=True, kw_only=True):
    """``tokens``: the common restorable length; ``per_group``: each group's own
    restorable length (attention/MLA: contiguous stored blocks in tokens; mamba: its
    longest checkpoint not beyond the paged groups' common length)."""

    tokens: int
    per_group: dict[str, int]


def hit_alignment(projection: TransferProjection) -> int:
    """The tokens a hit of an engine that restores groups only on their own block
    boundaries is a multiple of: the least common multiple of every group's block size
    (vLLM's ``HybridKVCacheCoordinator``: a hit must end on a block boundary of every
    group)."""
    return math.lcm(*(g.tokens_per_block for g in projection.groups)) if projection.groups else 1


def common_prefix(projection: TransferProjection, stored: Mapping[str, Sequence[bool]], *,
                  max_tokens: int | None = None, extra_points: Mapping[str, Sequence[int]] | None = None,
                  divergent: bool = False, alignment: int | None = None) -> PrefixHit:
    """Longest length ``L`` at which every transfer group can be restored.

    ``alignment`` (tokens): the engine's rule for where a hit may end; ``L`` is a
    multiple of it. None: :func:`hit_alignment` (vLLM's rule: a block boundary of every
    group, so attention blocks of 32 stored up to 64 and state checkpoints of 16-token
    blocks at 32 and 48 give 32, not 48). An engine that restores attention at any token
    (and reads partial tails, ``extra_points``) passes 1.

    ``stored[name][i]`` says whether block/slot ``i`` of that group is stored: for paged
    groups (attention, MLA) block ``i`` covers tokens ``[i*B, (i+1)*B)`` and a group can be
    restored at any ``L`` up to its contiguous stored run; for mamba groups slot ``i`` is
    the state after ``(i+1)*B`` tokens and the group restores only at ``L`` equal to a
    stored slot (or 0). ``extra_points[name]``: further exact lengths a mamba group can
    restore at (e.g. stored tails). ``max_tokens`` caps ``L`` (an engine must compute at
    least the last prompt token, so it passes ``len(prompt) - 1``).

    ``per_group`` holds each group's own length: paged groups their contiguous run; mamba
    groups their longest checkpoint not beyond the paged groups' common length, or with
    ``divergent=True`` their longest checkpoint at all (for engines that catch recurrent
    state up from an earlier checkpoint). ``tokens`` is the common length either way.
    """
    align = hit_alignment(projection) if alignment is None else int(alignment)
    if align < 1:
        raise InvalidRequest(f"hit alignment must be >= 1 token, got {alignment!r}")
    cap = max_tokens if max_tokens is not None else 1 << 62
    per: dict[str, int] = {}
    paged_len = cap
    for g in projection.groups:
        if g.kind in PAGED_KINDS:
            run = 0
            for ok in stored.get(g.name, ()):
                if not ok:
                    break
                run += 1
            per[g.name] = run * g.tokens_per_block
            paged_len = min(paged_len, per[g.name])
    candidates: set[int] | None = None
    for g in projection.groups:
        if g.kind in PAGED_KINDS:
            continue
        pts = {(i + 1) * g.tokens_per_block for i, ok in enumerate(stored.get(g.name, ())) if ok}
        pts |= set((extra_points or {}).get(g.name, ()))
        pts = {p for p in pts if p <= cap}
        own = max(pts, default=0)
        pts = {p for p in pts if p <= paged_len}
        per[g.name] = own if divergent else max(pts, default=0)
        candidates = pts if candidates is None else candidates & pts
    if candidates is None:
        length = min(paged_len, cap) // align * align
    else:
        length = max((p for p in candidates if p % align == 0), default=0)
    return PrefixHit(tokens=max(0, min(length, cap)), per_group=per)


def describe(projection: TransferProjection) -> list[dict[str, Any]]:
    """Plain rows (index, name, kind, layers, tokens/block, bytes/block, parallel, tp,
    fingerprint) for reports."""
    return [{"index": g.index, "name": g.name, "kind": g.kind, "layers": list(g.layers),
             "tokens_per_block": g.tokens_per_block, "block_bytes": g.layout.nbytes,
             "parallel": g.layout.parallel, "tp_size": g.layout.tp_size, "fingerprint": g.fingerprint}
            for g in projection.groups]
