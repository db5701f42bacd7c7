"""A small deterministic *hybrid* decoder (Kimi-K3 style) for the reference engine (issue 6).

Layer kinds (chosen per layer by ``HybridConfig.pattern``), each with its own cache
group and block size:

- ``attn``: multi-head softmax attention with RoPE. Cache: K (after RoPE) and V per
  token. Group kind ``full_attention``, SPLIT by heads across TP ranks, 16-token blocks.
- ``swa``: the same with a sliding window of ``window`` tokens (kind
  ``sliding_window``).
- ``mla``: latent attention in the manner of DeepSeek-V2 (DeepSeek-AI 2024, "DeepSeek-V2",
  §2.1): per token a compressed latent ``c_kv = RMSNorm(h W_dkv)`` plus one decoupled
  RoPE key ``k_pe`` shared by all heads; per-head keys/values are up-projections of the
  latent. Cache: ``c_kv`` and ``k_pe`` only (no per-head K/V). Group kind ``mla``,
  REPLICATE (every TP rank needs the whole latent), 32-token pages.
- ``kda``: linear attention with a short causal depthwise convolution and a
  delta-rule recurrent state with channel-wise decay, after Kimi Delta Attention
  (Moonshot AI 2025, "Kimi Linear") and Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024):
  ``S_t = (I - b_t k_t k_t^T) diag(a_t) S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T q_t``.
  Cache: the conv history (last ``conv-1`` pre-conv inputs) and the recurrent state
  ``S`` — a state *slot* that is only valid at exactly the token count it was taken at.
  Group kind ``mamba``, SPLIT by heads, one slot per aligned 64-token boundary.

Every layer is pre-norm (RMSNorm) with a SwiGLU MLP; float32; weights from a seeded
generator. TP is simulated in one process: each mixer's heads are split into
``tp_size`` ranks, each rank's partial output projection is summed in rank order (a
row-parallel all-reduce), and the cache groups are exported/imported per rank.

The store glue (blocks, state checkpoints, partial tails, the transfer projection, the
common-boundary prefix hit, heterogeneous TP) is :class:`connector.hybrid_store.HybridStore`;
this model implements its :class:`~connector.hybrid_store.HybridEngineModel` interface.
The end of this module is the demo's hybrid engine (:class:`HybridEngine`, run by
``connector.demo_engine.worker --engine hybrid``) and its report section.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kvpool.connector.hybrid_store import HybridStore, StateSlot, pack_tensors, unpack_tensors
from kvpool.connector.demo_engine.model import apply_rope, causal_attention, rms_norm, rope_cos_sin
from kvpool.connector.demo_engine.tokenizer import demo_requests, encode, user_turn
from kvpool.protocol.errors import InvalidRequest, KVPoolError
from kvpool.protocol.groups import CacheGroupSpec, TransferProjection, describe, project
from kvpool.protocol.layout import LayoutSpec, TensorSpec

__all__ = ["HybridConfig", "HybridCache", "HybridModel", "HybridEngine"]

LAYER_KINDS = ("attn", "swa", "mla", "kda")


@dataclass(frozen=True)
class HybridConfig:
    """Geometry of the hybrid decoder.

    Model identity (weights): vocab, dim, pattern, heads, head_dim, mlp_hidden, mla_latent,
    mla_rope, kda_conv, window, rope_base, seed. Cache geometry (not weights):
    ``*_block`` tokens per block/slot per group, ``group_order`` (declaration order of
    the cache groups; default: by first layer) and ``split_kda_groups`` (one group per
    KDA layer instead of one for all) — engine choices that change the projection.
    """

    vocab: int = 256
    dim: int = 128
    pattern: tuple[str, ...] = ("attn", "kda", "mla", "kda")
    heads: int = 4
    head_dim: int = 32
    mlp_hidden: int = 256
    mla_latent: int = 64
    mla_rope: int = 16
    kda_conv: int = 4
    window: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    seed: int = 4321
    attn_block: int = 16
    swa_block: int = 16
    mla_block: int = 32
    kda_block: int = 64
    group_order: tuple[str, ...] | None = None
    split_kda_groups: bool = False

    def block_of(self, kind: str) -> int:
        return {"attn": self.attn_block, "swa": self.swa_block, "mla": self.mla_block, "kda": self.kda_block}[kind]


@dataclass
class HybridCache:
    """All cache state of one prompt after ``n_tokens`` tokens (global heads, all ranks).

    ``attn[layer] = (K, V)`` float32 ``[heads, n, head_dim]`` (K after RoPE; ``swa``
    layers too); ``mla[layer] = (c_kv [n, latent], k_pe [n, rope_dim])``;
    ``kda[layer] = (conv [conv-1, 3*heads*head_dim], state [heads, head_dim, head_dim])``
    valid after exactly ``n_tokens`` tokens; ``checkpoints[t][layer]`` the KDA states at
    every aligned boundary ``t`` computed in this pass.
    """

    n_tokens: int
    attn: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    mla: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kda: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    checkpoints: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


class HybridModel:
    """The hybrid decoder (see module docstring). ``tp_size`` splits every mixer's heads.
    It restores attention at any token (and recurrent state from partial tails), so its
    hits may end at any token: ``hit_alignment`` 1."""

    hit_alignment = 1

    def __init__(self, config: HybridConfig | None = None, tp_size: int = 1) -> None:
        self.config = c = config or HybridConfig()
        self.tp_size = tp_size
        for k in c.pattern:
            if k not in LAYER_KINDS:
                raise ValueError(f"layer kind {k!r} unknown; accepted: {', '.join(LAYER_KINDS)}")
        if c.heads % tp_size:
            raise ValueError(f"{c.heads} heads do not split over tp_size={tp_size}")
        g = torch.Generator().manual_seed(c.seed)

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float32) / math.sqrt(fan_in)

        hd = c.heads * c.head_dim
        self.embed = torch.randn(c.vocab, c.dim, generator=g, dtype=torch.float32)
        self.layers: list[dict[str, torch.Tensor]] = []
        for kind in c.pattern:
            p: dict[str, torch.Tensor] = {"norm1": torch.ones(c.dim), "norm2": torch.ones(c.dim)}
            if kind in ("attn", "swa"):
                p.update(wq=w(c.dim, hd, fan_in=c.dim), wk=w(c.dim, hd, fan_in=c.dim),
                         wv=w(c.dim, hd, fan_in=c.dim), wo=w(hd, c.dim, fan_in=hd))
            elif kind == "mla":
                p.update(w_dkv=w(c.dim, c.mla_latent, fan_in=c.dim), kv_norm=torch.ones(c.mla_latent),
                         w_kr=w(c.dim, c.mla_rope, fan_in=c.dim), w_qn=w(c.dim, hd, fan_in=c.dim),
                         w_qr=w(c.dim, c.heads * c.mla_rope, fan_in=c.dim),
                         w_uk=w(c.mla_latent, hd, fan_in=c.mla_latent),
                         w_uv=w(c.mla_latent, hd, fan_in=c.mla_latent), wo=w(hd, c.dim, fan_in=hd))
            else:  # kda
                p.update(w_qkv=w(c.dim, 3 * hd, fan_in=c.dim),
                         conv=torch.randn(3 * hd, c.kda_conv, generator=g) / math.sqrt(c.kda_conv),
                         w_a=w(c.dim, hd, fan_in=c.dim), w_b=w(c.dim, c.heads, fan_in=c.dim),
                         wo=w(hd, c.dim, fan_in=hd))
            p.update(w_gate=w(c.dim, c.mlp_hidden, fan_in=c.dim), w_up=w(c.dim, c.mlp_hidden, fan_in=c.dim),
                     w_down=w(c.mlp_hidden, c.dim, fan_in=c.mlp_hidden))
            self.layers.append(p)
        self.final_norm = torch.ones(c.dim)
        self.lm_head = w(c.dim, c.vocab, fan_in=c.dim)

    # ------------------------------------------------------------------ identity
    @property
    def model_id(self) -> str:
        """Weights identity (not cache geometry, not TP): ``ref-hybrid-<8 hex>``."""
        c = self.config
        ident = {k: v for k, v in asdict(c).items()
                 if k not in ("attn_block", "swa_block", "mla_block", "kda_block", "group_order",
                              "split_kda_groups")}
        return "ref-hybrid-" + hashlib.sha256(repr(sorted(ident.items())).encode()).hexdigest()[:8]

    def weights_digest(self) -> str:
        h = hashlib.sha256()
        for t in [self.embed, *[p[k] for p in self.layers for k in sorted(p)], self.final_norm, self.lm_head]:
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.config.pattern) if k == kind)

    # ------------------------------------------------------------------ groups
    def group_layout(self, kind: str, layers: Sequence[int], rank: int = 0) -> LayoutSpec:
        """Per-rank layout of one block/slot of a group of ``kind`` over ``layers``."""
        c, tp = self.config, self.tp_size
        hl, nl, b = c.heads // tp, len(layers), c.block_of(kind)
        if kind in ("attn", "swa"):
            return LayoutSpec(kind="full_attention" if kind == "attn" else "sliding_window", tokens_per_block=b,
                              tensors=(TensorSpec("kv", (nl, 2, hl, b, c.head_dim), "float32"),),
                              num_kv_heads=hl, head_size=c.head_dim, tp_size=tp, tp_rank=rank,
                              sliding_window=c.window if kind == "swa" else 0)
        if kind == "mla":
            return LayoutSpec(kind="mla", tokens_per_block=b,
                              tensors=(TensorSpec("kv_c", (nl, b, c.mla_latent), "float32"),
                                       TensorSpec("k_pe", (nl, b, c.mla_rope), "float32")),
                              num_kv_heads=1, head_size=c.mla_latent + c.mla_rope, latent_dim=c.mla_latent,
                              parallel="replicate", tp_size=tp, tp_rank=rank)
        return LayoutSpec(kind="mamba", tokens_per_block=b,
                          tensors=(TensorSpec("conv_state", (nl, c.kda_conv - 1, 3 * hl * c.head_dim), "float32"),
                                   TensorSpec("ssm_state", (nl, hl, c.head_dim, c.head_dim), "float32")),
                          num_kv_heads=hl, head_size=c.head_dim, tp_size=tp, tp_rank=rank)

    def cache_groups(self, rank: int = 0) -> list[CacheGroupSpec]:
        """Every cache group this engine declares, in declaration order."""
        c = self.config
        groups: list[CacheGroupSpec] = []
        for kind in ("attn", "swa", "mla", "kda"):
            layers = self.layers_of(kind)
            if not layers:
                continue
            if kind == "kda" and c.split_kda_groups:
                for layer in layers:
                    groups.append(CacheGroupSpec(name=f"kda{layer}", layers=(layer,),
                                                 layout=self.group_layout(kind, (layer,), rank)))
            else:
                groups.append(CacheGroupSpec(name=kind, layers=layers, layout=self.group_layout(kind, layers, rank)))
        if c.group_order:
            order = {n: i for i, n in enumerate(c.group_order)}
            groups.sort(key=lambda g: order.get(g.name, len(order)))
        else:
            groups.sort(key=lambda g: g.layers[0])
        return groups

    def projection(self, rank: int = 0) -> TransferProjection:
        return project(self.cache_groups(rank))

    # ------------------------------------------------------------------ compute
    def _row_parallel(self, o: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
        """``o @ wo`` as TP ranks do it: each rank multiplies its head columns by its rows of
        ``wo``; the partial outputs are summed in rank order (all-reduce)."""
        if self.tp_size == 1:
            return o @ wo
        step = o.shape[1] // self.tp_size
        out = None
        for r in range(self.tp_size):
            part = o[:, r * step:(r + 1) * step] @ wo[r * step:(r + 1) * step]
            out = part if out is None else out + part
        return out

    def _attention(self, p, h, L, n, cos, sin, prev, window: int):
        c = self.config
        s = h.shape[0]
        q = apply_rope((h @ p["wq"]).view(s, c.heads, c.head_dim).transpose(0, 1), cos, sin)
        k = apply_rope((h @ p["wk"]).view(s, c.heads, c.head_dim).transpose(0, 1), cos, sin)
        v = (h @ p["wv"]).view(s, c.heads, c.head_dim).transpose(0, 1)
        if prev is not None:
            k = torch.cat([prev[0][:, :L], k], dim=1)
            v = torch.cat([prev[1][:, :L], v], dim=1)
        if window:
            o = _windowed_attention(q, k, v, L, window)
        else:
            o = causal_attention(q, k, v, L)
        return self._row_parallel(o.transpose(0, 1).reshape(s, -1), p["wo"]), (k, v)

    def _mla(self, p, h, L, n, cos_r, sin_r, prev):
        c = self.config
        s = h.shape[0]
        ckv = rms_norm(h @ p["w_dkv"], p["kv_norm"], c.norm_eps)
        kpe = apply_rope(h @ p["w_kr"], cos_r, sin_r)  # [s, rope] shared by all heads
        if prev is not None:
            ckv = torch.cat([prev[0][:L], ckv], dim=0)
            kpe = torch.cat([prev[1][:L], kpe], dim=0)
        t = ckv.shape[0]
        qn = (h @ p["w_qn"]).view(s, c.heads, c.head_dim).transpose(0, 1)
        qr = apply_rope((h @ p["w_qr"]).view(s, c.heads, c.mla_rope).transpose(0, 1), cos_r, sin_r)
        kn = (ckv @ p["w_uk"]).view(t, c.heads, c.head_dim).transpose(0, 1)
        v = (ckv @ p["w_uv"]).view(t, c.heads, c.head_dim).transpose(0, 1)
        q = torch.cat([qn, qr], dim=-1)
        k = torch.cat([kn, kpe.unsqueeze(0).expand(c.heads, t, c.mla_rope)], dim=-1)
        o = causal_attention(q, k, v, L)
        return self._row_parallel(o.transpose(0, 1).reshape(s, -1), p["wo"]), (ckv, kpe)

    def _kda(self, p, h, L, prev, boundaries: list[int]):
        """Returns (output, (conv, state) after the last token, {t: (conv, state)} at ``boundaries``)."""
        c = self.config
        s, hd, kc = h.shape[0], c.heads * c.head_dim, c.kda_conv
        u = h @ p["w_qkv"]  # [s, 3*hd] pre-conv inputs
        hist = prev[0] if prev is not None else torch.zeros(kc - 1, 3 * hd)
        win = torch.cat([hist, u], dim=0)  # rows: tokens L-(kc-1) .. n-1
        y = p["conv"][:, 0] * win[0:s]
        for j in range(1, kc):  # fixed summation order: identical in full and suffix passes
            y = y + p["conv"][:, j] * win[j:j + s]
        y = F.silu(y)
        q = F.normalize(y[:, :hd].view(s, c.heads, c.head_dim), dim=-1, eps=1e-6)
        k = F.normalize(y[:, hd:2 * hd].view(s, c.heads, c.head_dim), dim=-1, eps=1e-6)
        v = y[:, 2 * hd:].view(s, c.heads, c.head_dim)
        a = torch.sigmoid(h @ p["w_a"] + 4.0).view(s, c.heads, c.head_dim)  # channel-wise decay
        b = torch.sigmoid(h @ p["w_b"])  # [s, heads]
        st0 = prev[1] if prev is not None else torch.zeros(c.heads, c.head_dim, c.head_dim)
        # the recurrence runs token by token; numpy's per-op cost on these [heads, 32, 32]
        # arrays is far below torch's, and both passes run the same ops in the same order
        st = st0.numpy().copy()
        an, qn, kn, vn = a.numpy(), q.numpy(), k.numpy(), v.numpy()
        bk = (b.unsqueeze(-1) * k).numpy()
        on = np.empty((s, c.heads, c.head_dim), dtype=np.float32)
        ckpts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        want = set(boundaries)
        for i in range(s):
            st *= an[i][:, :, None]
            pred = np.einsum("hk,hkv->hv", kn[i], st)
            st += bk[i][:, :, None] * (vn[i] - pred)[:, None, :]
            on[i] = np.einsum("hk,hkv->hv", qn[i], st)
            if L + i + 1 in want:
                ckpts[L + i + 1] = (win[i + 1:i + kc].clone(), torch.from_numpy(st.copy()))
        o = torch.from_numpy(on)
        st = torch.from_numpy(st)
        return self._row_parallel(o.reshape(s, hd), p["wo"]), (win[s:s + kc - 1].clone(), st), ckpts

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], restore: HybridCache | None = None
                ) -> tuple[torch.Tensor, HybridCache]:
        """Run the prompt; return (next-token logits float32 ``[vocab]``, cache after all tokens).

        ``restore`` holds every layer's cache for the first ``restore.n_tokens`` tokens
        (attention/MLA may hold more and are truncated; KDA states must be exactly at
        ``restore.n_tokens``); only the suffix is computed, which must be non-empty.
        """
        c = self.config
        toks = torch.as_tensor(list(token_ids), dtype=torch.long)
        n = int(toks.numel())
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if int(toks.min()) < 0 or int(toks.max()) >= c.vocab:
            raise ValueError(f"token ids must be in [0, {c.vocab})")
        L = 0 if restore is None else restore.n_tokens
        if L >= n:
            raise ValueError(f"restored {L} tokens of a {n}-token prompt: at least the last token must be "
                             "computed (restore at most len - 1)")
        if restore is not None:
            self._check_restore(restore)
        pos = torch.arange(L, n)
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_base)
        cos_r, sin_r = rope_cos_sin(pos, c.mla_rope, c.rope_base)
        kb = c.kda_block
        boundaries = list(range((L // kb + 1) * kb, n + 1, kb))
        out = HybridCache(n_tokens=n)
        x = self.embed[toks[L:]]
        for li, (kind, p) in enumerate(zip(c.pattern, self.layers)):
            h = rms_norm(x, p["norm1"], c.norm_eps)
            if kind in ("attn", "swa"):
                prev = restore.attn.get(li) if restore is not None else None
                o, out.attn[li] = self._attention(p, h, L, n, cos, sin, prev, c.window if kind == "swa" else 0)
            elif kind == "mla":
                prev = restore.mla.get(li) if restore is not None else None
                o, out.mla[li] = self._mla(p, h, L, n, cos_r, sin_r, prev)
            else:
                prev = restore.kda.get(li) if restore is not None else None
                o, out.kda[li], ck = self._kda(p, h, L, prev, boundaries)
                for t, v in ck.items():
                    out.checkpoints.setdefault(t, {})[li] = v
            x = x + o
            h = rms_norm(x, p["norm2"], c.norm_eps)
            x = x + (F.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        logits = rms_norm(x[-1], self.final_norm, c.norm_eps) @ self.lm_head
        return logits, out

    def _check_restore(self, r: HybridCache) -> None:
        c = self.config
        for li, kind in enumerate(c.pattern):
            src = r.attn if kind in ("attn", "swa") else r.mla if kind == "mla" else r.kda
            if li not in src:
                raise ValueError(f"restore has no cache for layer {li} ({kind})")
            if kind in ("attn", "swa") and src[li][0].shape[1] < r.n_tokens:
                raise ValueError(f"layer {li}: restored K/V hold {src[li][0].shape[1]} tokens < {r.n_tokens}")
            if kind == "mla" and src[li][0].shape[0] < r.n_tokens:
                raise ValueError(f"layer {li}: restored latent holds {src[li][0].shape[0]} tokens < {r.n_tokens}")

    # ------------------------------------------------------------------ export / import
    def _head_slice(self, rank: int) -> slice:
        hl = self.config.heads // self.tp_size
        return slice(rank * hl, (rank + 1) * hl)

    def _conv_channels(self, rank: int) -> torch.Tensor:
        c = self.config
        hd, hl = c.heads * c.head_dim, c.heads // self.tp_size
        lo, hi = rank * hl * c.head_dim, (rank + 1) * hl * c.head_dim
        return torch.cat([torch.arange(lo, hi) + j * hd for j in range(3)])

    def export_range(self, cache: HybridCache, group: CacheGroupSpec, rank: int, lo: int, hi: int) -> torch.Tensor:
        """Bytes (flat ``uint8``, :func:`~connector.hybrid_store.pack_tensors` order) of tokens
        ``[lo, hi)`` of paged ``group`` for ``rank``: a block when ``hi - lo`` is the block
        size, else a partial tail. Attention: ``[layers, 2, heads/tp, hi-lo, head_dim]``
        float32 (K then V, ``rank``'s heads); MLA: ``kv_c [layers, hi-lo, latent]`` then
        ``k_pe [layers, hi-lo, rope]``. Raises InvalidRequest for a state group."""
        kind = group.layout.kind
        if kind in ("full_attention", "sliding_window"):
            hs = self._head_slice(rank)
            return pack_tensors([torch.stack([torch.stack([cache.attn[li][0][hs, lo:hi], cache.attn[li][1][hs, lo:hi]])
                                              for li in group.layers])])
        if kind == "mla":
            return pack_tensors([torch.stack([cache.mla[li][0][lo:hi] for li in group.layers]),
                                 torch.stack([cache.mla[li][1][lo:hi] for li in group.layers])])
        raise InvalidRequest(f"group {group.name!r} ({kind}) has no token blocks")

    def export_block(self, cache: HybridCache, group: CacheGroupSpec, rank: int, index: int) -> torch.Tensor:
        """Bytes of block ``index`` of paged ``group`` for ``rank`` (see :meth:`export_range`)."""
        b = group.layout.tokens_per_block
        return self.export_range(cache, group, rank, index * b, (index + 1) * b)

    def state_slot(self, states: dict[int, tuple[torch.Tensor, torch.Tensor]], group: CacheGroupSpec, rank: int,
                   tokens: int, tail: bool = False) -> StateSlot:
        """The KDA slot of ``group`` for ``rank`` from per-layer ``(conv, state)`` taken after
        ``tokens`` tokens: ``conv_state [layers, conv-1, 3*heads/tp*head_dim]`` and
        ``ssm_state [layers, heads/tp, head_dim, head_dim]``, float32."""
        ch, hs = self._conv_channels(rank), self._head_slice(rank)
        return StateSlot({"conv_state": torch.stack([states[li][0][:, ch] for li in group.layers]),
                          "ssm_state": torch.stack([states[li][1][hs] for li in group.layers])},
                         tokens=tokens, tail=tail)

    def state_slot_at(self, cache: HybridCache, group: CacheGroupSpec, rank: int, tokens: int) -> StateSlot | None:
        """The slot after exactly ``tokens`` tokens if ``cache`` holds that state: an aligned
        checkpoint, or the final state (a tail when off a boundary); else None."""
        if tokens in cache.checkpoints:
            return self.state_slot(cache.checkpoints[tokens], group, rank, tokens)
        if tokens == cache.n_tokens:
            return self.state_slot(cache.kda, group, rank, tokens,
                                   tail=tokens % group.layout.tokens_per_block != 0)
        return None

    def empty_cache(self, n_tokens: int) -> HybridCache:
        """Zeroed cache tensors for ``n_tokens`` tokens, to load restored blocks into."""
        c = self.config
        r = HybridCache(n_tokens=n_tokens)
        for li, kind in enumerate(c.pattern):
            if kind in ("attn", "swa"):
                r.attn[li] = (torch.zeros(c.heads, n_tokens, c.head_dim), torch.zeros(c.heads, n_tokens, c.head_dim))
            elif kind == "mla":
                r.mla[li] = (torch.zeros(n_tokens, c.mla_latent), torch.zeros(n_tokens, c.mla_rope))
            else:
                r.kda[li] = (torch.zeros(c.kda_conv - 1, 3 * c.heads * c.head_dim),
                             torch.zeros(c.heads, c.head_dim, c.head_dim))
        return r

    def import_range(self, cache: HybridCache, layout: LayoutSpec, layers: Sequence[int], data: torch.Tensor,
                     lo: int, hi: int, heads: slice | None = None, src_heads: slice | None = None) -> None:
        """Write stored bytes ``data`` (``layout``: a block or a tail) into tokens
        ``[lo, hi)`` of ``layers``; for attention, stored heads ``src_heads`` go to global
        heads ``heads``. Raises InvalidRequest for a state layout (see :meth:`import_state`)."""
        kind = layout.kind
        n = hi - lo
        if kind in ("full_attention", "sliding_window"):
            (t,) = unpack_tensors(data, layout)  # [layers, 2, heads, tokens, head_dim]
            src_heads = src_heads or slice(0, layout.num_kv_heads)
            heads = heads or slice(0, self.config.heads)
            for i, li in enumerate(layers):
                cache.attn[li][0][heads, lo:hi] = t[i, 0, src_heads, :n]
                cache.attn[li][1][heads, lo:hi] = t[i, 1, src_heads, :n]
        elif kind == "mla":
            kvc, kpe = unpack_tensors(data, layout)
            for i, li in enumerate(layers):
                cache.mla[li][0][lo:hi] = kvc[i, :n]
                cache.mla[li][1][lo:hi] = kpe[i, :n]
        else:
            raise InvalidRequest(f"{kind} groups restore through import_state")

    def import_state(self, cache: HybridCache, layout: LayoutSpec, layers: Sequence[int], data: torch.Tensor,
                     rank: int) -> None:
        """Write a stored KDA slot (``layout``, as stored by ``rank``) into ``cache``."""
        conv, ssm = unpack_tensors(data, layout)
        ch, hs = self._conv_channels(rank), self._head_slice(rank)
        for i, li in enumerate(layers):
            cache.kda[li][0][:, ch] = conv[i]
            cache.kda[li][1][hs] = ssm[i]


def _windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int) -> torch.Tensor:
    """Causal attention where query ``i`` (absolute ``q_start+i``) sees keys
    ``(q_start+i-window, q_start+i]``. Shapes as :func:`causal_attention`."""
    s, t, d = q.shape[1], k.shape[1], q.shape[2]
    out = q.new_empty((q.shape[0], s, v.shape[2]))
    kpos = torch.arange(t)
    for a in range(0, s, 512):
        b = min(s, a + 512)
        qpos = torch.arange(q_start + a, q_start + b)
        k0 = max(0, q_start + a - window + 1)
        k1 = min(t, q_start + b)
        sc = torch.matmul(q[:, a:b], k[:, k0:k1].transpose(1, 2)) / math.sqrt(d)
        kp = kpos[k0:k1]
        mask = (kp[None, :] > qpos[:, None]) | (kp[None, :] <= qpos[:, None] - window)
        sc = sc.masked_fill(mask, float("-inf"))
        out[:, a:b] = torch.matmul(torch.softmax(sc, dim=-1), v[:, k0:k1])
    return out


# ============================================================================ demo engine


def hybrid_requests(quick: bool) -> tuple[list, list]:
    """(A's, B's) requests for the hybrid demo: shared documents + questions, a repeat, a
    new question, a multi-turn continuation of A's first prompt (restored exactly at its
    end through the stored partial tails) and a miss."""
    from kvpool.connector.demo_engine.tokenizer import Request

    a, b = demo_requests(quick=True)  # one document: the KDA recurrence runs token by token
    a = a[:2]
    follow_up = "Who said it, and where?"
    cont = a[0].prompt + " All men are created equal.\n" + user_turn(follow_up)
    b_rows = [Request("h0", a[0].prompt, a[0].label), Request("h1", b[2].prompt, b[2].label),
              Request("h2", cont, f"{a[0].label} -> answer -> {follow_up}"), Request("h3", b[-1].prompt, b[-1].label)]
    return [Request(f"g{i}", r.prompt, r.label) for i, r in enumerate(a)], b_rows


class HybridEngine:
    """The worker's hybrid engine: same interface as ``connector.demo_engine.worker.Engine``."""

    def __init__(self, master: str | None, namespace: str, config: HybridConfig | None = None, tp_size: int = 1,
                 source_tp: int | None = None, rpc_timeout_s: float = 10.0) -> None:
        self.model = HybridModel(config, tp_size)
        self.client = self.store = None
        if master:
            from kvpool.connector.client import KVPoolClient

            self.client = KVPoolClient(master=master, rpc_timeout_s=rpc_timeout_s)
            self.store = HybridStore(self.client, self.model, namespace, source_tp=source_tp)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def warm_up(self) -> None:
        self.model.prefill(encode("warm up " * 20))

    def describe(self) -> dict:
        c = self.model.config
        return {"model_id": self.model.model_id, "pattern": list(c.pattern), "tp_size": self.model.tp_size,
                "projection_fingerprint": self.model.projection().fingerprint(),
                "groups": describe(self.model.projection())}

    def produce(self, rid: str, prompt: str) -> dict:
        ids = encode(prompt)
        t0 = time.perf_counter()
        _, cache = self.model.prefill(ids)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        st = self.store.put(ids, cache)
        return {"request_id": rid, "prompt_tokens": len(ids), "prefill_ms": round(prefill_ms, 3),
                "put_ms": round((time.perf_counter() - t0) * 1e3, 3), **st}

    def consume(self, rid: str, prompt: str, reps: int = 1) -> dict:
        ids = encode(prompt)
        best_no, best, ref = float("inf"), None, None
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            ref, _ = self.model.prefill(ids)
            best_no = min(best_no, (time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            lr = self.store.load(ids)
            t1 = time.perf_counter()
            logits, _ = self.model.prefill(ids, lr.cache)
            t2 = time.perf_counter()
            run = {"ttft_store_ms": round((t2 - t0) * 1e3, 3), "load_ms": round((t1 - t0) * 1e3, 3),
                   "compute_ms": round((t2 - t1) * 1e3, 3), "lr": lr, "logits": logits}
            if best is None or run["ttft_store_ms"] < best["ttft_store_ms"]:
                best = run
        lr, logits = best.pop("lr"), best.pop("logits")
        diff = float((logits - ref).abs().max())
        return {"request_id": rid, "prompt_tokens": len(ids), "hit_tokens": lr.tokens,
                "computed_tokens": len(ids) - lr.tokens, "per_group": lr.per_group, "via_tail": lr.via_tail,
                "bytes_loaded": lr.bytes_loaded, "objects_loaded": lr.objects, **best,
                "ttft_no_store_ms": round(best_no, 3), "max_abs_diff": diff, "match": diff <= 1e-5,
                "same_next_token": int(logits.argmax()) == int(ref.argmax()), "errors": []}


def hybrid_demo_section(master_addr: str, namespace: str, quick: bool, run_pair, timeout_s: float, log_dir: str,
                        rpc_timeout_s: float = 10.0) -> dict:
    """Run the hybrid engine pair (through ``cli.demo._run_pair``) and return its report part."""
    reqs_a, reqs_b = hybrid_requests(quick)
    res_a, res_b, _ = run_pair(master_addr, namespace + "-hybrid", "hybrid", reqs_a, reqs_b, timeout_s, log_dir,
                               reps=2, rpc_timeout_s=rpc_timeout_s)
    if res_a["weights_digest"] != res_b["weights_digest"]:
        raise KVPoolError("hybrid engines A and B built different weights")
    kinds = {"h0": "repeat", "h1": "new q", "h2": "continue", "h3": "miss"}
    rows = []
    for req, r in zip(reqs_b, res_b["rows"]):
        no, yes = r["ttft_no_store_ms"], r["ttft_store_ms"]
        rows.append({**r, "kind": kinds.get(r["request_id"], ""), "question": req.label,
                     "speedup": round(no / yes, 2) if yes > 0 else None})
    return {"engine": res_a.get("engine_info", {}), "producer": {"pid": res_a["pid"], "rows": res_a["rows"]},
            "consumer": {"pid": res_b["pid"], "timing_reps": 2}, "requests": rows,
            "all_match": all(r["match"] for r in rows),
            "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=0.0)}


def render_hybrid_section(h: dict, console, request_table, size) -> None:
    """Print the hybrid part of the demo report (used by ``cli.demo.render_demo``); every
    line fits 80 columns for the usual values."""
    from rich.markup import escape

    e = h["engine"]
    groups = e.get("groups", [])
    console.print(f"\n[bold]hybrid engine[/] {e.get('model_id', '')}: layers {' / '.join(e.get('pattern', []))}")
    console.print(f"transfer projection {e.get('projection_fingerprint', '')}, {len(groups)} groups:")
    for g in groups:
        console.print(f"  {g['index']} {g['name']}: {g['kind']}, layers {g['layers']}, "
                      f"{g['tokens_per_block']} tokens/{'slot' if g['kind'] == 'mamba' else 'block'}, "
                      f"{size(g['block_bytes'])}, {g['parallel']}")
    console.print(request_table("hybrid engine B: common-boundary restore vs full recompute", h["requests"], 1e-5))
    for r in h["requests"]:
        per = ", ".join(f"{k} {v}" for k, v in r["per_group"].items())
        console.print(f"  [dim]{r['request_id']}:[/] {escape(r.get('question', ''))}", overflow="ellipsis",
                      no_wrap=True)
        console.print(f"      restored at {r['hit_tokens']}{' (via tails)' if r['via_tail'] else ''}; "
                      f"stored: {per}")
