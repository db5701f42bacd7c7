"""Build tiny random-weight models and a local WordLevel tokenizer for vLLM tests.

Everything is created offline in a directory the caller gives (a tmp dir): no hub
access. Each model is deterministic (fixed seed), so two builds are byte-identical.

* ``build_tiny_llama``: plain full attention (weights written by hand).
* ``build_tiny_gemma3``: Gemma-3 text, sliding-window layers interleaved with full ones.
* ``build_tiny_mistral_swa``: Mistral, a sliding window on every layer.
* ``build_tiny_qwen3_next``: Qwen3-Next, gated delta net linear attention + full
  attention (bfloat16).
* ``build_tiny_deepseek_v2``: DeepSeek-V2 MLA (576-wide latent: kv_lora_rank 512 +
  rope 64), dense MLP.

All share the tokenizer (vocab ``VOCAB_SIZE``, ids 1/2/3 = bos/eos/pad). The last four
are built by transformers from a config, so their weight names are the real ones.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

VOCAB_SIZE = 1000
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 4
HEAD_DIM = 32
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
SLIDING_WINDOW = 64  # tokens, for the sliding-window models
LOGIT_SCALE = 5.0  # lm_head scale of the transformers-initialised models
SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def _write_tokenizer(path: Path, max_len: int = MAX_MODEL_LEN) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<unk>", "<s>", "</s>", "<pad>"]
    words = [f"w{i}" for i in range(VOCAB_SIZE - len(special))]
    vocab = {t: i for i, t in enumerate(special + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "model_max_length": max_len, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }))
    (path / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}))


def _write_generation_config(path: Path) -> None:
    (path / "generation_config.json").write_text(json.dumps(SPECIAL_IDS))


def _write_model(path: Path, seed: int, max_len: int = MAX_MODEL_LEN) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": 4 * HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
        **SPECIAL_IDS,
        "attention_bias": False, "mlp_bias": False,
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    _write_generation_config(path)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(VOCAB_SIZE, HIDDEN, scale=1.0),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": rnd(VOCAB_SIZE, HIDDEN, scale=0.5),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        t[p + "self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, HIDDEN, scale=0.3)
        t[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN, scale=0.3)
        t[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN, scale=0.3)
        t[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = rnd(4 * HIDDEN, HIDDEN)
        t[p + "mlp.up_proj.weight"] = rnd(4 * HIDDEN, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rnd(HIDDEN, 4 * HIDDEN)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})


def _build(path: str | os.PathLike, write_model: Callable[[Path], None], max_len: int = MAX_MODEL_LEN) -> str:
    """Write the tokenizer and (via ``write_model``) the model into ``path`` unless
    its ``model.safetensors`` is already there; return the path."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    if not (p / "model.safetensors").exists():
        _write_tokenizer(p, max_len)
        write_model(p)
    return str(p)


def build_tiny_llama(path: str | os.PathLike, seed: int = 1234, max_len: int = MAX_MODEL_LEN) -> str:
    """Write config, weights and tokenizer of a tiny Llama into ``path``; return it.
    ``max_len``: its longest sequence in tokens (the weights do not depend on it)."""
    return _build(path, lambda p: _write_model(p, seed, max_len), max_len)


def _write_hf_model(path: Path, seed: int, model_type: str, architecture: str,
                    dtype: str = "float32", **fields: Any) -> None:
    """Build ``model_type``'s config with ``fields`` (over the tiny common ones), let
    transformers initialise the model under ``seed`` and save it as one safetensors
    file. Weights are drawn with std ``initializer_range`` (0.1: activations keep their
    scale through the 128-wide layers); the untied lm_head is then scaled by
    ``LOGIT_SCALE`` so that greedy picks are not near-ties (logit std about 5, like the
    Llama's)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-6, "initializer_range": 0.1, "tie_word_embeddings": False,
        **SPECIAL_IDS}
    cfg = AutoConfig.for_model(model_type, **{**common, **fields})
    cfg.architectures = [architecture]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # initialised in float32 on CPU whatever the dtype: the same numbers each build
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(str(path), safe_serialization=True)
    _write_generation_config(path)  # save_pretrained may write its own: keep ours


def build_tiny_gemma3(path: str | os.PathLike, seed: int = 1234) -> str:
    """A tiny Gemma-3 text model (``Gemma3ForCausalLM``): 4 layers, sliding window of
    ``SLIDING_WINDOW`` tokens on layers 0 and 2, full attention on 1 and 3."""
    layer_types = ["sliding_attention", "full_attention"] * 2
    return _build(path, lambda p: _write_hf_model(
        p, seed, "gemma3_text", "Gemma3ForCausalLM",
        hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=len(layer_types),
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM, sliding_window=SLIDING_WINDOW,
        layer_types=layer_types))


def build_tiny_mistral_swa(path: str | os.PathLike, seed: int = 1234) -> str:
    """A tiny Mistral (``MistralForCausalLM``): 2 layers, all with a sliding window of
    ``SLIDING_WINDOW`` tokens."""
    return _build(path, lambda p: _write_hf_model(
        p, seed, "mistral", "MistralForCausalLM",
        hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
        sliding_window=SLIDING_WINDOW))


def build_tiny_qwen3_next(path: str | os.PathLike, seed: int = 1234) -> str:
    """A tiny Qwen3-Next (``Qwen3NextForCausalLM``, bfloat16): layers linear, linear,
    linear, full; gated delta net with 2 key / 2 value heads of 128; full attention
    with 4 query / 2 kv heads of 64; a small MoE on every layer (4 experts, top 2, plus
    the shared expert: vLLM's Qwen3-Next wants at least one MoE layer)."""
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    return _build(path, lambda p: _write_hf_model(
        p, seed, "qwen3_next", "Qwen3NextForCausalLM", dtype="bfloat16",
        hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=len(layer_types),
        layer_types=layer_types, num_attention_heads=HEADS, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64))


def build_tiny_deepseek_v2(path: str | os.PathLike, seed: int = 1234) -> str:
    """A tiny DeepSeek-V2 (``DeepseekV2ForCausalLM``) with MLA: 2 layers, 4 heads,
    kv_lora_rank 512 + qk_rope_head_dim 64 (the 576-wide latent the CPU MLA kernel
    needs), qk_nope/v head dims 64, no q LoRA; every layer dense
    (``first_k_dense_replace`` = layers)."""
    return _build(path, lambda p: _write_hf_model(
        p, seed, "deepseek_v2", "DeepseekV2ForCausalLM",
        hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=None,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        first_k_dense_replace=LAYERS, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=64))


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` pseudo-random in-vocab token ids (no specials) from ``seed``."""
    import random

    r = random.Random(seed)
    return [r.randrange(4, VOCAB_SIZE) for _ in range(n)]


def build_llama(path: str | os.PathLike, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                seed: int = 1234) -> str:
    """A random Llama (``LlamaForCausalLM``, float32) of the given size, built by
    transformers (for benchmarks: e.g. hidden 768, 6 layers, 12 heads: about 45 M
    parameters)."""
    return _build(path, lambda p: _write_hf_model(
        p, seed, "llama", "LlamaForCausalLM", hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        hidden_act="silu", rope_theta=10000.0, attention_bias=False, mlp_bias=False))
