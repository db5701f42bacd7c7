"""Build a tiny random-weight Llama and a local WordLevel tokenizer for vLLM tests.

Everything is created offline in a directory the caller gives (a tmp dir): no hub
access. The model is deterministic (fixed seed), so two builds are byte-identical.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

VOCAB_SIZE = 1000
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 4
HEAD_DIM = 32
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024


def _write_tokenizer(path: Path) -> None:
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
        "model_max_length": MAX_MODEL_LEN, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }))
    (path / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}))


def _write_model(path: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": 4 * HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
        "attention_bias": False, "mlp_bias": False,
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
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


def build_tiny_llama(path: str | os.PathLike, seed: int = 1234) -> str:
    """Write config, weights and tokenizer of a tiny Llama into ``path``; return it."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    if not (p / "model.safetensors").exists():
        _write_tokenizer(p)
        _write_model(p, seed)
    return str(p)


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` pseudo-random in-vocab token ids (no specials) from ``seed``."""
    import random

    r = random.Random(seed)
    return [r.randrange(4, VOCAB_SIZE) for _ in range(n)]
