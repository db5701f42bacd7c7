"""Multi-group store glue for hybrid-attention engines (Kimi-K3 style; DESIGN.md §4, §9).

:class:`HybridStore` stores the transfer groups of one engine (every TP rank it runs)
in kvpool and restores them:

- **put**: full blocks of paged groups (attention, sliding window, MLA), state
  checkpoints of mamba/KDA groups at aligned boundaries, and optionally the partial
  tail at the prompt's end (one tail object per group, reusable only as a
  continuation). The engine's transfer projection is published once per model and TP
  size; a producer with a different projection gets ``LayoutMismatch``.
- **lookup**: the longest length at which *every* group can be restored (the common
  boundary: paged groups need all blocks up to it, mamba groups a checkpoint exactly
  there), or a stored tail that extends it. Existence checks only; no leases.
- **load**: reads every object of the hit in one batch and writes it into a fresh
  engine cache, reslicing heads for SPLIT attention groups when the data was stored
  with another TP size (REPLICATE groups such as MLA: one copy serves every rank).

The store knows nothing about an engine's tensors: the engine implements
:class:`HybridEngineModel` (export/import of byte ranges and state slots). Every stored
object's bytes are its layout's sub-tensors packed back to back in order
(:func:`pack_tensors` / :func:`unpack_tensors`).

Keys (``ns`` = namespace, ``model`` = the engine's model id):

- blocks: ``<ns>/<model>/<group index>:<fp>[/tp<r>]/<chain hash>``
- state checkpoints: the block key of the prefix ``+ "@<tokens>"``
- partial tails: ``<ns>/<model>/<group index>:<fp>[/tp<r>]/tail/<prefix hash>@<tokens>``
- projection manifest: ``<ns>/<model>/projection/tp<T>``

Each group hashes the prompt with its own block size (chained hashes as in
``protocol.keys.block_hashes``, with the model id as extra bytes).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

from kvpool.protocol.errors import InvalidRequest, KVPoolError
from kvpool.protocol.groups import (CacheGroupSpec, PrefixHit, ReadPiece, SlotInfo, TransferGroup, TransferProjection,
                             check_projection, common_prefix, project, slot_key, storage_layout, tail_hash,
                             tail_key, tail_layout, validate_state_slot)
from kvpool.protocol.keys import ROOT_HASH, block_hashes, extra_bytes, group_key
from kvpool.protocol.layout import LayoutSpec

__all__ = ["HybridEngineModel", "HybridStore", "LoadResult", "StateSlot", "pack_tensors", "unpack_tensors"]


# ---------------------------------------------------------------------------- bytes


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidRequest(f"dtype {name!r} has no torch equivalent")
    return dt


def pack_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The stored byte order of a multi-tensor layout: each tensor's bytes (row-major),
    back to back, as one contiguous CPU ``uint8`` tensor of ``sum(nbytes)`` elements.
    Tensors may differ in dtype and shape."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack_tensors(data: torch.Tensor, layout: LayoutSpec) -> list[torch.Tensor]:
    """Views of ``layout.tensors`` inside ``data`` (the inverse of :func:`pack_tensors`).

    ``data``: a contiguous 1-D tensor of at least ``layout.nbytes`` bytes (any dtype; it
    is reinterpreted as bytes). Returns one view per :class:`~protocol.layout.TensorSpec`,
    with its shape and dtype, sharing memory with ``data``. Raises InvalidRequest when
    ``data`` is too small.
    """
    raw = data.reshape(-1).view(torch.uint8)
    if raw.numel() < layout.nbytes:
        raise InvalidRequest(f"{raw.numel()} bytes hold no {layout.kind} block of {layout.nbytes} bytes")
    out, off = [], 0
    for t in layout.tensors:
        n = t.nbytes
        out.append(raw[off:off + n].view(_torch_dtype(t.dtype)).view(t.shape))
        off += n
    return out


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- engine side


@dataclass
class StateSlot:
    """One mamba/KDA state slot to publish.

    ``tensors``: the named sub-tensors (e.g. ``conv_state`` and ``ssm_state``), each
    with the shape and dtype the group's layout declares for this TP rank; ``tokens``:
    the token count the state represents (the state after exactly that many tokens);
    ``tail``: a partial-tail state (``tokens`` not on a block boundary); ``speculative``:
    a scratch state of unaccepted tokens (never published).
    """

    tensors: dict[str, torch.Tensor]
    tokens: int
    tail: bool = False
    speculative: bool = False

    def info(self) -> SlotInfo:
        """The slot's shape summary, as :func:`protocol.groups.validate_state_slot` takes it."""
        return SlotInfo(tensors={k: tuple(v.shape) for k, v in self.tensors.items()}, tokens=self.tokens,
                        tail=self.tail, speculative=self.speculative)


class HybridEngineModel(Protocol):
    """What :class:`HybridStore` needs from an engine (``connector.demo_engine.hybrid.HybridModel``
    is one). ``cache`` is the engine's own cache object; the store never looks inside it.

    All data crossing this interface is flat CPU tensors in the group's layout order:
    a paged group's tokens ``[lo, hi)`` are the layout's tensors with the token axis cut
    to ``hi - lo`` (:func:`protocol.groups.tail_layout`), packed as :func:`pack_tensors`
    does.
    """

    # Optional: ``hit_alignment`` (tokens), where a hit may end for this engine (see
    # protocol.groups.common_prefix). Absent: vLLM's rule, a block boundary of every group.

    @property
    def model_id(self) -> str:
        """Weights identity (goes into every key and the block hashes)."""

    @property
    def tp_size(self) -> int:
        """TP ranks this engine runs (the store handles all of them)."""

    def cache_groups(self, rank: int = 0) -> list[CacheGroupSpec]:
        """Every cache group, in declaration order, with ``rank``'s layouts."""

    def export_range(self, cache: Any, group: CacheGroupSpec, rank: int, lo: int, hi: int) -> torch.Tensor:
        """Flat bytes of tokens ``[lo, hi)`` of paged ``group`` for ``rank``; ``hi - lo`` is
        one block, or less for a partial tail."""

    def state_slot_at(self, cache: Any, group: CacheGroupSpec, rank: int, tokens: int) -> StateSlot | None:
        """``rank``'s state slot of mamba ``group`` after exactly ``tokens`` tokens, or None
        when ``cache`` does not hold that state. Off a block boundary it is a tail."""

    def empty_cache(self, n_tokens: int) -> Any:
        """A cache for ``n_tokens`` tokens to load restored data into."""

    def import_range(self, cache: Any, layout: LayoutSpec, layers: Sequence[int], data: torch.Tensor, lo: int,
                     hi: int, heads: slice | None = None, src_heads: slice | None = None) -> None:
        """Write stored bytes ``data`` (in ``layout``) into tokens ``[lo, hi)`` of ``layers``;
        for attention, stored heads ``src_heads`` go to the engine's global heads ``heads``."""

    def import_state(self, cache: Any, layout: LayoutSpec, layers: Sequence[int], data: torch.Tensor,
                     rank: int) -> None:
        """Write a stored state slot (``layout``, as stored by ``rank``) into ``cache``."""


@dataclass
class LoadResult:
    """What :meth:`HybridStore.load` restored.

    ``cache``: the engine cache holding the first ``tokens`` tokens (``None`` on a miss);
    ``tokens``: the common restored length; ``per_group``: each group's own stored
    length in tokens (see :class:`protocol.groups.PrefixHit`); ``via_tail``: restored
    through partial-tail objects; ``bytes_loaded``: bytes copied from the store;
    ``objects``: objects read.
    """

    cache: Any
    tokens: int
    per_group: dict[str, int]
    via_tail: bool
    bytes_loaded: int
    objects: int


# ---------------------------------------------------------------------------- the store


class HybridStore:
    """All transfer groups of one engine (every TP rank it runs) in kvpool.

    ``client``: a :class:`~connector.client.KVPoolClient` (the store uses its ``get``,
    ``put``, ``put_batch``, ``exists_batch`` and ``get_into_batch``); ``model``: the
    engine (:class:`HybridEngineModel`); ``namespace``: the first key component;
    ``source_tp``: the TP size the data to load was stored with (default: the engine's):
    SPLIT attention groups are resliced, anything else must match; ``tails``: store and
    use partial tails.

    Raises (besides the client's errors): ``LayoutMismatch`` when the engine's transfer
    projection disagrees with the published one (naming the first differing group and
    field), ``InvalidRequest`` for a state slot that must not be published, and
    ``KVPoolError`` when hit data vanishes between lookup and load.
    """

    def __init__(self, client, model: HybridEngineModel, namespace: str = "demo", *, source_tp: int | None = None,
                 tails: bool = True) -> None:
        self.client = client
        self.model = model
        self.ns = namespace
        self.mid = model.model_id
        self.extra = extra_bytes(self.mid)
        self.tp = model.tp_size
        self.source_tp = source_tp or self.tp
        self.tails = tails
        self.groups = [model.cache_groups(r) for r in range(self.tp)]
        self.local = [project(g) for g in self.groups]
        self._source: TransferProjection | None = None
        self._plans: list[dict[str, list[ReadPiece]]] | None = None

    # ---- projection -------------------------------------------------------------------
    def manifest_key(self, tp_size: int) -> str:
        """Key of the projection manifest of this model stored with ``tp_size`` ranks."""
        return f"{self.ns}/{self.mid}/projection/tp{tp_size}"

    def publish_projection(self) -> None:
        """Producer: publish this engine's projection. If one is already published for this
        model and TP size it must be the same, else LayoutMismatch."""
        key = self.manifest_key(self.tp)
        existing = self.client.get(key)
        if existing is not None:
            check_projection(TransferProjection.decode(existing), self.local[0], allow_tp_reshard=False)
            return
        self.client.put(key, self.local[0].encode())

    def open(self) -> bool:
        """Consumer: read the source projection and check it against every local rank's
        (LayoutMismatch on disagreement). False when nothing was published (all misses)."""
        if self._plans is not None:
            return True
        raw = self.client.get(self.manifest_key(self.source_tp))
        if raw is None:
            return False
        src = TransferProjection.decode(raw)
        self._plans = [check_projection(src, self.local[r]) for r in range(self.tp)]
        self._source = src
        return True

    # ---- keys -------------------------------------------------------------------------
    def _hashes(self, ids: Sequence[int], block: int) -> list[bytes]:
        return block_hashes(ids, block, self.extra)

    def _rank_of(self, g: TransferGroup, rank: int) -> int | None:
        """The key's TP rank: None for REPLICATE groups (one copy for all ranks)."""
        return None if g.layout.replicated else rank

    def _block_keys(self, g: TransferGroup, hashes: Sequence[bytes], rank: int) -> list[str]:
        r = self._rank_of(g, rank)
        return [group_key(self.ns, self.mid, g.index, g.fingerprint, h, r) for h in hashes]

    def _tail_id(self, ids: Sequence[int], t: int) -> bytes:
        """Hash naming the whole prefix ``ids[:t]``, anchored to the smallest block size."""
        anchor = min(g.tokens_per_block for g in self.local[0].groups)
        hs = self._hashes(ids[:t], anchor)
        parent = hs[-1] if hs else ROOT_HASH
        return tail_hash(parent, ids[len(hs) * anchor:t], self.extra)

    # ---- put --------------------------------------------------------------------------
    def put_slot(self, group_name: str, block_hash: bytes | None, slot: StateSlot, rank: int = 0,
                 tail_id: bytes | None = None) -> KVPoolError | None:
        """Publish one mamba/KDA state slot of ``group_name`` for ``rank``.

        A checkpoint is keyed by ``block_hash`` (the chain hash of its prefix at the
        group's block size), a tail (``slot.tail``) by ``tail_id``. The slot is validated
        first; a speculative slot, a missing or extra sub-tensor (e.g. a recurrent state
        without its conv history), a wrong shape or dtype, or a checkpoint off a block
        boundary raises InvalidRequest and nothing is stored. Returns the put's per-key
        result: None on success (or when already stored), else the error.
        """
        g = self.local[rank].group(group_name)
        self._check_slot(g, slot)
        lay = storage_layout(g.layout)
        r = self._rank_of(g, rank)
        if slot.tail:
            key = tail_key(self.ns, self.mid, g, tail_id, slot.tokens, r)
        else:
            key = slot_key(self.ns, self.mid, g, block_hash, slot.tokens, r)
        return self.client.put_batch([key], [pack_tensors([slot.tensors[t.name] for t in g.layout.tensors])],
                                     lay)[0]

    @staticmethod
    def _check_slot(g: TransferGroup, slot: StateSlot) -> None:
        validate_state_slot(g.layout, slot.info(), g.name)
        for t in g.layout.tensors:
            if _dtype_name(slot.tensors[t.name]) != t.dtype:
                raise InvalidRequest(f"group {g.name!r}: state tensor {t.name!r} is "
                                     f"{_dtype_name(slot.tensors[t.name])}, layout says {t.dtype}")

    def put(self, ids: Sequence[int], cache: Any) -> dict:
        """Store every transfer group of a prefilled prompt ``ids`` (token ids) from ``cache``.

        Stores full blocks, state checkpoints at aligned boundaries that ``cache`` holds,
        and (``tails``) the partial tail at ``len(ids)``; objects already stored are
        skipped (one existence check for all). Publishes the projection first
        (LayoutMismatch if another one is published). Returns ``objects_put``,
        ``objects_skipped``, ``bytes_put`` and ``errors`` (per-object put errors as
        ``"Type: message"`` strings).
        """
        self.publish_projection()
        n = len(ids)
        cands: dict[str, tuple[Any, LayoutSpec]] = {}  # key -> (source, layout); replicated keys once
        for rank in range(self.tp):
            for spec in self.groups[rank]:
                if not spec.enable_kv_transfer:
                    continue
                g = self.local[rank].group(spec.name)
                lay = storage_layout(g.layout)
                r = self._rank_of(g, rank)
                b = g.tokens_per_block
                hashes = self._hashes(ids, b)
                if g.kind == "mamba":
                    for i, h in enumerate(hashes):
                        slot = self.model.state_slot_at(cache, spec, rank, (i + 1) * b)
                        if slot is not None:
                            self._check_slot(g, slot)
                            cands.setdefault(slot_key(self.ns, self.mid, g, h, slot.tokens, r), (slot, lay))
                else:
                    for i, k in enumerate(self._block_keys(g, hashes, rank)):
                        cands.setdefault(k, ((spec, rank, i * b, (i + 1) * b), lay))
                if self.tails and n % b:
                    key = tail_key(self.ns, self.mid, g, self._tail_id(ids, n), n, r)
                    if g.kind == "mamba":
                        slot = self.model.state_slot_at(cache, spec, rank, n)
                        if slot is not None:
                            self._check_slot(g, slot)
                            cands.setdefault(key, (slot, lay))
                    else:
                        lo = n // b * b
                        cands.setdefault(key, ((spec, rank, lo, n), tail_layout(lay, n - lo)))
        keys = list(cands)
        have = self.client.exists_batch(keys) if keys else []
        todo = [k for k, h in zip(keys, have) if not h]
        datas, lays = [], []
        for k in todo:
            src, lay = cands[k]
            if isinstance(src, StateSlot):
                datas.append(pack_tensors([src.tensors[x.name] for x in lay.tensors]))
            else:
                spec, rank, lo, hi = src
                datas.append(self.model.export_range(cache, spec, rank, lo, hi))
            lays.append(lay)
        res = self.client.put_batch(todo, datas, lays) if todo else []
        errs = [f"{type(e).__name__}: {e}" for e in res if e is not None]
        return {"objects_put": len(todo) - len(errs), "objects_skipped": len(keys) - len(todo),
                "bytes_put": sum(d.numel() * d.element_size() for d, e in zip(datas, res) if e is None),
                "errors": errs}

    # ---- lookup -----------------------------------------------------------------------
    def lookup(self, ids: Sequence[int], *, max_tokens: int | None = None, divergent: bool = False
               ) -> tuple[PrefixHit, int | None]:
        """Find the restorable prefix of ``ids`` (token ids); no leases are taken.

        Returns ``(hit, tail)``. ``hit.tokens`` is the longest length at which every
        group can be restored from full blocks and checkpoints, capped at ``max_tokens``
        (default ``len(ids) - 1``: the engine computes at least the last token).
        ``tail`` is, when stored partial tails extend that, the longer length they
        restore to, else None. ``hit.per_group`` holds each group's own length
        (``divergent``: mamba groups report their longest checkpoint, not only those
        under the paged groups' length); ``hit.tokens`` is the common one either way.
        Raises LayoutMismatch when the published projection disagrees.
        """
        cap = len(ids) - 1 if max_tokens is None else max_tokens
        if not self.open():
            return PrefixHit(tokens=0, per_group={g.name: 0 for g in self.local[0].groups}), None
        src = self._source
        keys, spans = [], {}
        for g in src.groups:
            hashes = self._hashes(ids, g.tokens_per_block)
            ranks = self._source_ranks(g.name)
            start = len(keys)
            for r in ranks:
                if g.kind == "mamba":
                    keys += [slot_key(self.ns, self.mid, g, h, (i + 1) * g.tokens_per_block, self._rank_of(g, r))
                             for i, h in enumerate(hashes)]
                else:
                    keys += self._block_keys(g, hashes, r)
            spans[g.name] = (start, len(hashes), len(ranks))
        found = self.client.exists_batch(keys) if keys else []
        stored = {name: [all(found[start + j * nb + i] for j in range(nr)) for i in range(nb)]
                  for name, (start, nb, nr) in spans.items()}
        hit = common_prefix(src, stored, max_tokens=cap, divergent=divergent,
                            alignment=getattr(self.model, "hit_alignment", None))
        tail = self._probe_tail(ids, src, hit, stored, cap) if self.tails else None
        return hit, tail

    def _source_ranks(self, name: str) -> list[int]:
        """Stored ranks the local ranks need for group ``name`` (0 for a replicated copy)."""
        ranks: list[int] = []
        for plans in self._plans:
            for piece in plans[name]:
                r = 0 if piece.src_rank is None else piece.src_rank
                if r not in ranks:
                    ranks.append(r)
        return ranks

    def _probe_tail(self, ids: Sequence[int], src: TransferProjection, hit: PrefixHit,
                    stored: Mapping[str, list[bool]], cap: int) -> int | None:
        """Largest ``t`` in ``(hit.tokens, cap]`` at which every group restores exactly at
        ``t``: from its full blocks/checkpoint where ``t`` is on its boundary, else from
        its full blocks plus a stored tail object."""
        hi = cap
        for g in src.groups:
            if g.kind != "mamba":
                hi = min(hi, hit.per_group[g.name] + g.tokens_per_block - 1)
        cands = list(range(hit.tokens + 1, hi + 1))
        if not cands:
            return None
        keys, owners = [], []
        for t in cands:
            tid = self._tail_id(ids, t)
            for g in src.groups:
                if t % g.tokens_per_block == 0:
                    continue
                for r in self._source_ranks(g.name):
                    keys.append(tail_key(self.ns, self.mid, g, tid, t, self._rank_of(g, r)))
                    owners.append(t)
        if not keys:
            return None
        found = self.client.exists_batch(keys)
        ok = {t: True for t in cands}
        present_any = set()
        for t, f in zip(owners, found):
            ok[t] = ok[t] and f
            if f:
                present_any.add(t)
        for t in sorted(cands, reverse=True):
            if not (ok[t] and t in present_any):
                continue
            good = True  # groups with t on a boundary need their block/slot at t
            for g in src.groups:
                if t % g.tokens_per_block == 0:
                    i = t // g.tokens_per_block - 1
                    s = stored[g.name]
                    good &= (i < len(s) and s[i]) if g.kind == "mamba" else all(s[:i + 1])
            if good:
                return t
        return None

    # ---- load -------------------------------------------------------------------------
    def load(self, ids: Sequence[int], *, max_tokens: int | None = None) -> LoadResult:
        """Look up and load the longest restorable prefix of ``ids`` into a fresh cache
        (:meth:`HybridEngineModel.empty_cache`), every local TP rank's part of it.

        Returns a :class:`LoadResult` (``cache=None``, ``tokens=0`` on a miss). Raises
        LayoutMismatch (projection or stored layout disagrees), KVPoolError when an
        object vanishes between lookup and load (retry the request), and the client's
        read errors (LeaseExpired, ChecksumMismatch, NodeUnavailable).
        """
        hit, tail = self.lookup(ids, max_tokens=max_tokens)
        L = tail or hit.tokens
        if L == 0:
            return LoadResult(None, 0, hit.per_group, False, 0, 0)
        cache = self.model.empty_cache(L)
        reqs: dict[str, tuple[torch.Tensor, LayoutSpec]] = {}  # key -> (byte buffer, layout to check)
        todo = []  # (group, local rank, piece, key, lo, hi, is_state)
        tid = self._tail_id(ids, L) if tail else None

        def want(key: str, lay: LayoutSpec) -> str:
            reqs.setdefault(key, (torch.empty(lay.nbytes, dtype=torch.uint8), lay))
            return key

        for g in self._source.groups:
            lay = storage_layout(g.layout)
            b = g.tokens_per_block
            hashes = self._hashes(ids, b)
            for rank in range(self.tp):
                for piece in self._plans[rank][g.name]:
                    sr = None if lay.replicated else (piece.src_rank if piece.src_rank is not None else rank)
                    rl = lay if sr is None else msgspec.structs.replace(lay, tp_rank=sr)  # as the source rank stored it
                    if g.kind == "mamba":
                        key = (slot_key(self.ns, self.mid, g, hashes[L // b - 1], L, sr) if L % b == 0
                               else tail_key(self.ns, self.mid, g, tid, L, sr))
                        todo.append((g, rank, piece, want(key, rl), 0, L, True))
                        continue
                    nfull = L // b
                    for i in range(nfull):
                        key = self._block_keys(g, [hashes[i]], 0 if sr is None else sr)[0]
                        todo.append((g, rank, piece, want(key, rl), i * b, (i + 1) * b, False))
                    if L % b:
                        if tail:
                            key = tail_key(self.ns, self.mid, g, tid, L, sr)
                            todo.append((g, rank, piece, want(key, tail_layout(rl, L - nfull * b)),
                                         nfull * b, L, False))
                        else:  # the block holding L is stored (hit.tokens <= stored run); use its head
                            key = self._block_keys(g, [hashes[nfull]], 0 if sr is None else sr)[0]
                            todo.append((g, rank, piece, want(key, rl), nfull * b, L, False))
        keys = list(reqs)
        res = self.client.get_into_batch(keys, [reqs[k][0] for k in keys], [reqs[k][1] for k in keys])
        nbytes = 0
        for k, r in zip(keys, res):
            if isinstance(r, BaseException):
                raise r
            if r is None:
                raise KVPoolError(f"object {k!r} vanished between lookup and load; retry the request")
            nbytes += r
        for g, rank, piece, key, lo, hi, is_state in todo:
            buf, lay = reqs[key]
            if is_state:
                self.model.import_state(cache, lay, g.layers, buf, rank)
            elif lay.kind in ("full_attention", "sliding_window"):
                hl = self.local[rank].group(g.name).layout.num_kv_heads  # this engine's heads per rank
                dst = rank * hl + piece.dst_lo
                self.model.import_range(cache, lay, g.layers, buf, lo, hi,
                                        heads=slice(dst, dst + piece.head_hi - piece.head_lo),
                                        src_heads=slice(piece.head_lo, piece.head_hi))
            else:
                self.model.import_range(cache, lay, g.layers, buf, lo, hi)
        return LoadResult(cache, L, hit.per_group, bool(tail), nbytes, len(keys))
