"""A small deterministic torch decoder with a block-paged KV cache (the demo's engine).

The model is a pre-norm transformer decoder in float32 with seeded weights, so two
processes that build it with the same :class:`ModelConfig` hold bit-identical
parameters. Architecture (per layer): RMSNorm -> multi-head self-attention with
rotary position embeddings (RoPE, Su et al. 2021, "RoFormer", rotate-half form) ->
residual -> RMSNorm (Zhang & Sennrich 2019) -> SwiGLU MLP (Shazeer 2020, "GLU
Variants Improve Transformer") -> residual; a final RMSNorm and an untied LM head.

KV cache: pages of ``block_size`` tokens. One page of the whole model is a float32
tensor ``[layers, 2, heads, block_size, head_dim]`` (index 0 of dim 1 = K, 1 = V);
K is stored *after* RoPE, so a page is position-dependent and only valid for the
exact prefix it was computed from (which the chained block hash guarantees).

``prefill(token_ids, cached_kv)`` computes only the tokens after the cached prefix;
restoring the first ``k`` pages and computing the suffix gives the same next-token
logits as a full recompute up to float32 reduction-order rounding (~1e-7 here).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from kvpool.protocol.layout import LayoutSpec, TensorSpec

__all__ = ["ModelConfig", "PagedKVCache", "ReferenceModel", "rope_cos_sin", "apply_rope", "rms_norm"]


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of the reference decoder. ``vocab`` 256 = byte-level tokens."""

    vocab: int = 256
    dim: int = 128
    layers: int = 2
    heads: int = 4
    head_dim: int = 32
    mlp_hidden: int = 512
    block_size: int = 16
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    seed: int = 1234


@dataclass
class PagedKVCache:
    """K/V of the first ``n_tokens`` tokens, in pages.

    ``pages``: float32 ``[num_pages, layers, 2, heads, block_size, head_dim]`` with
    ``num_pages >= ceil(n_tokens / block_size)``; slots past ``n_tokens`` are unused.
    """

    pages: torch.Tensor
    n_tokens: int

    @property
    def num_full_blocks(self) -> int:
        return self.n_tokens // self.pages.shape[4]

    def truncate(self, n_tokens: int) -> "PagedKVCache":
        """A view of the first ``n_tokens`` tokens (no copy)."""
        if not 0 <= n_tokens <= self.n_tokens:
            raise ValueError(f"cannot truncate a cache of {self.n_tokens} tokens to {n_tokens}")
        bs = self.pages.shape[4]
        return PagedKVCache(self.pages[: -(-n_tokens // bs)], n_tokens)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, float32 ``[len(positions), head_dim]`` for absolute positions.

    Angles are computed in float64 per absolute position, so a position's rotation is
    identical whether it is computed in a full pass or a suffix pass.
    """
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(torch.float32), ang.sin().to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x[..., seq, head_dim]``."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Softmax attention of queries at absolute positions ``q_start..`` over keys ``0..T-1``.

    q, k: ``[heads, S|T, d]``; v: ``[heads, T, dv]`` -> ``[heads, S, dv]``. Query ``i`` sees
    keys ``j <= q_start + i``. Queries are processed in chunks to bound memory.
    """
    s, t, d = q.shape[1], k.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(d)
    out = q.new_empty((q.shape[0], s, v.shape[2]))
    kpos = torch.arange(t)
    chunk = 512
    for a in range(0, s, chunk):
        b = min(s, a + chunk)
        kend = min(t, q_start + b)  # keys past the chunk's last query are all masked
        qpos = torch.arange(q_start + a, q_start + b)
        scores = torch.matmul(q[:, a:b], k[:, :kend].transpose(1, 2)) * scale
        scores = scores.masked_fill(kpos[None, :kend] > qpos[:, None], float("-inf"))
        out[:, a:b] = torch.matmul(torch.softmax(scores, dim=-1), v[:, :kend])
    return out


class ReferenceModel:
    """Deterministic float32 decoder; see the module docstring for the architecture.

    Weights come from ``torch.Generator().manual_seed(config.seed)``: normal with std
    ``1/sqrt(fan_in)`` for projections, std 1 for the embedding, ones for norms.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = cfg = config or ModelConfig()
        if cfg.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float32) / math.sqrt(fan_in)

        hd = cfg.heads * cfg.head_dim
        self.embed = torch.randn(cfg.vocab, cfg.dim, generator=g, dtype=torch.float32)
        self.layers = []
        for _ in range(cfg.layers):
            self.layers.append({
                "attn_norm": torch.ones(cfg.dim),
                "wq": w(cfg.dim, hd, fan_in=cfg.dim),
                "wk": w(cfg.dim, hd, fan_in=cfg.dim),
                "wv": w(cfg.dim, hd, fan_in=cfg.dim),
                "wo": w(hd, cfg.dim, fan_in=hd),
                "mlp_norm": torch.ones(cfg.dim),
                "w_gate": w(cfg.dim, cfg.mlp_hidden, fan_in=cfg.dim),
                "w_up": w(cfg.dim, cfg.mlp_hidden, fan_in=cfg.dim),
                "w_down": w(cfg.mlp_hidden, cfg.dim, fan_in=cfg.mlp_hidden),
            })
        self.final_norm = torch.ones(cfg.dim)
        self.lm_head = w(cfg.dim, cfg.vocab, fan_in=cfg.dim)

    # ------------------------------------------------------------------ identity
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def model_id(self) -> str:
        """Stable id of architecture + weights seed, e.g. ``ref-decoder-3f2a9c1b``; use it
        as the model part of keys and of the block-hash ``extra``."""
        h = hashlib.sha256(repr(sorted(asdict(self.config).items())).encode()).hexdigest()[:8]
        return f"ref-decoder-{h}"

    def weights_digest(self) -> str:
        """sha256 (hex, 16 digits) over all parameters: equal in two processes iff the
        weights are bit-identical."""
        h = hashlib.sha256()
        for t in [self.embed, *[p for lay in self.layers for p in lay.values()], self.final_norm, self.lm_head]:
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def page_shape(self) -> tuple[int, int, int, int, int]:
        c = self.config
        return (c.layers, 2, c.heads, c.block_size, c.head_dim)

    def layout(self) -> LayoutSpec:
        """Layout of one stored block: one float32 tensor ``kv`` of :meth:`page_shape`."""
        c = self.config
        return LayoutSpec(kind="full_attention", tokens_per_block=c.block_size,
                          tensors=(TensorSpec("kv", self.page_shape(), "float32"),),
                          num_kv_heads=c.heads, head_size=c.head_dim)

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.page_shape()) * 4

    # ------------------------------------------------------------------ compute
    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], cached_kv: PagedKVCache | None = None
                ) -> tuple[torch.Tensor, PagedKVCache]:
        """Run the prompt; return (next-token logits float32 ``[vocab]``, cache of all tokens).

        ``cached_kv`` holds K/V for the first ``cached_kv.n_tokens`` tokens of this same
        prompt; only the suffix is computed. At least the last prompt token is always
        computed (a cache covering the whole prompt is used up to ``len - 1`` tokens), as
        the logits need its hidden state. ``None`` = full recompute.
        """
        c = self.config
        toks = torch.as_tensor(list(token_ids), dtype=torch.long)
        n = int(toks.numel())
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if int(toks.min()) < 0 or int(toks.max()) >= c.vocab:
            raise ValueError(f"token ids must be in [0, {c.vocab})")
        n_cached = 0
        if cached_kv is not None:
            if tuple(cached_kv.pages.shape[1:]) != self.page_shape():
                raise ValueError(f"cached pages have shape {tuple(cached_kv.pages.shape[1:])}, "
                                 f"this model uses {self.page_shape()}")
            n_cached = min(cached_kv.n_tokens, n - 1)
        bs = c.block_size
        n_pages = -(-n // bs)
        pages = torch.zeros((n_pages, *self.page_shape()), dtype=torch.float32)
        if n_cached:
            k_pages = -(-n_cached // bs)
            pages[:k_pages] = cached_kv.pages[:k_pages]
        s = n - n_cached
        cos, sin = rope_cos_sin(torch.arange(n_cached, n), c.head_dim, c.rope_base)
        x = self.embed[toks[n_cached:]]  # [S, dim]
        for li, p in enumerate(self.layers):
            last = li == c.layers - 1
            h = rms_norm(x, p["attn_norm"], c.norm_eps)
            q = (h @ p["wq"]).view(s, c.heads, c.head_dim).transpose(0, 1)
            k = (h @ p["wk"]).view(s, c.heads, c.head_dim).transpose(0, 1)
            v = (h @ p["wv"]).view(s, c.heads, c.head_dim).transpose(0, 1)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            # write the suffix into the pages, then read all keys back from the pages so the
            # attention uses exactly the bytes that kv_to_blocks will export
            flat = pages[:, li].permute(1, 2, 0, 3, 4).reshape(2, c.heads, n_pages * bs, c.head_dim)
            flat[0, :, n_cached:n] = k
            flat[1, :, n_cached:n] = v
            pages[:, li] = flat.reshape(2, c.heads, n_pages, bs, c.head_dim).permute(2, 0, 1, 3, 4)
            k_all, v_all = flat[0, :, :n], flat[1, :, :n]
            if last:  # only the last position's output is needed past the final K/V write
                q, x = q[:, -1:], x[-1:]
                attn = causal_attention(q, k_all, v_all, n - 1)
            else:
                attn = causal_attention(q, k_all, v_all, n_cached)
            x = x + attn.transpose(0, 1).reshape(x.shape[0], -1) @ p["wo"]
            h = rms_norm(x, p["mlp_norm"], c.norm_eps)
            x = x + (torch.nn.functional.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        logits = rms_norm(x[-1], self.final_norm, c.norm_eps) @ self.lm_head
        return logits, PagedKVCache(pages, n)

    # ------------------------------------------------------------------ blocks
    def kv_to_blocks(self, kv: PagedKVCache, n_tokens: int | None = None) -> list[torch.Tensor]:
        """One contiguous float32 tensor ``[layers, 2, heads, block_size, head_dim]`` per
        FULL block among the first ``n_tokens`` tokens (default: all cached tokens)."""
        n = kv.n_tokens if n_tokens is None else n_tokens
        if n > kv.n_tokens:
            raise ValueError(f"cache holds {kv.n_tokens} tokens, {n} asked")
        return [kv.pages[i].contiguous() for i in range(n // self.block_size)]

    def empty_blocks(self, n: int) -> list[torch.Tensor]:
        """``n`` zeroed page tensors to load blocks into (``get_into`` targets)."""
        buf = torch.empty((n, *self.page_shape()), dtype=torch.float32)
        return [buf[i] for i in range(n)]

    def blocks_to_kv(self, blocks: Sequence[torch.Tensor]) -> PagedKVCache:
        """Cache of ``len(blocks) * block_size`` tokens from full-block page tensors."""
        shape = self.page_shape()
        for i, b in enumerate(blocks):
            if tuple(b.shape) != shape or b.dtype != torch.float32:
                raise ValueError(f"block {i} has shape {tuple(b.shape)} dtype {b.dtype}; "
                                 f"expected {shape} float32")
        if not blocks:
            return PagedKVCache(torch.zeros((0, *shape), dtype=torch.float32), 0)
        return PagedKVCache(torch.stack(list(blocks)), len(blocks) * self.block_size)
