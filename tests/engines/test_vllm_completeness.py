"""The connector against the installed vLLM's interface, without running an engine:
every abstract method implemented with vLLM's signature, settings and layouts derived
from real vLLM config objects, and kvpool importable without vLLM."""
from __future__ import annotations

import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest

from harness import REPO

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="checks the installed vLLM's interface (pip install '.[vllm]')")

import vllm.distributed.kv_transfer.kv_connector.v1.base as base  # noqa: E402 (installed by .ci/setup --test)


def _params(fn) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_implements_every_abstract_method_with_matching_signature():
    from kvpool.connector.vllm.connector import KVPoolConnector

    assert issubclass(KVPoolConnector, base.KVConnectorBase_V1)
    assert issubclass(KVPoolConnector, base.SupportsHMA) and base.supports_hma(KVPoolConnector)
    assert not KVPoolConnector.__abstractmethods__, KVPoolConnector.__abstractmethods__
    abstract = set(base.KVConnectorBase_V1.__abstractmethods__) | set(base.SupportsHMA.__abstractmethods__)
    assert abstract, "the installed vLLM declares no abstract connector methods?"
    for name in sorted(abstract):
        ours = KVPoolConnector.__dict__.get(name)
        assert ours is not None, f"{name} is not implemented by KVPoolConnector itself"
        theirs = getattr(base.KVConnectorBase_V1, name, None) or getattr(base.SupportsHMA, name)
        assert _params(ours) == _params(theirs), f"{name}: {inspect.signature(ours)} != {inspect.signature(theirs)}"


def test_overridden_hooks_keep_vllm_signatures():
    from kvpool.connector.vllm.connector import KVPoolConnector

    for name, ours in KVPoolConnector.__dict__.items():
        theirs = getattr(base.KVConnectorBase_V1, name, None)
        if name.startswith("_") or theirs is None or not callable(theirs):
            continue
        ours = ours.__func__ if isinstance(ours, classmethod) else ours
        theirs = inspect.getattr_static(base.KVConnectorBase_V1, name)
        theirs = theirs.__func__ if isinstance(theirs, classmethod) else theirs
        if isinstance(ours, property) or isinstance(theirs, property):
            continue
        assert [p[0] for p in _params(ours)] == [p[0] for p in _params(theirs)], name


def test_kvpool_imports_without_vllm():
    code = ("import sys, kvpool, kvpool.client, kvpool.connector.demo_engine, kvpool.connector.vllm.plugin; "
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=str(REPO), check=True, timeout=60)


def _vllm_config(extra: dict, role: str = "kv_both", policy: str = "fail", tp: int = 1, cache_dtype: str = "auto"):
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KVPoolConnector", kv_role=role, kv_load_failure_policy=policy,
                           kv_connector_module_path="kvpool.connector.vllm.connector", kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=ktc, model_config=SimpleNamespace(model="/models/org/tiny"),
                           cache_config=SimpleNamespace(block_size=32, cache_dtype=cache_dtype),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                                           decode_context_parallel_size=1))


def test_settings():
    from kvpool.connector.vllm.meta import ConnectorSettings
    from kvpool.protocol.errors import ConfigError

    s = ConnectorSettings.from_vllm(_vllm_config({"master": "tcp://127.0.0.1:1"}))
    assert (s.model_id, s.namespace, s.policy, s.loads, s.saves) == ("models--org--tiny", "vllm", "fail", True, True)
    s = ConnectorSettings.from_vllm(_vllm_config({"etcd": "http://127.0.0.1:2379", "load_failure_policy":
                                                  "recompute"}, role="kv_producer"))
    assert (s.policy, s.loads, s.saves, s.producer) == ("recompute", False, True, True)
    for bad in ({}, {"master": "x", "colour": 1}, {"master": "x", "load_failure_policy": "retry"},
                {"master": "x", "handoff_ttl_s": "soon"}, {"master": "x", "transport": "ib"},
                {"master": "x", "load_mode": "eager"}):
        with pytest.raises(ConfigError):
            ConnectorSettings.from_vllm(_vllm_config(bad))


def test_load_mode_is_layerwise_only_where_vllm_can_take_its_errors():
    from kvpool.connector.vllm.meta import ConnectorSettings, layerwise_loads
    from kvpool.protocol.errors import ConfigError

    def mode(m):
        return ConnectorSettings.from_vllm(_vllm_config({"master": "tcp://127.0.0.1:1", "load_mode": m}))

    assert ConnectorSettings.from_vllm(_vllm_config({"master": "tcp://127.0.0.1:1"})).load_mode == "auto"
    assert layerwise_loads(mode("auto"), 1) and not layerwise_loads(mode("auto"), 2)
    assert not layerwise_loads(mode("async"), 1) and layerwise_loads(mode("layerwise"), 1)
    with pytest.raises(ConfigError, match="one KV cache group"):
        layerwise_loads(mode("layerwise"), 3)  # hybrids: a request that already ran cannot report per group


def _cache_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"l{i}.a", f"l{i}.b"], sp) for i, sp in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_layouts_from_vllm_specs():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    from kvpool.connector.vllm.meta import group_layouts

    full = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.float32)
    (g,) = group_layouts(_vllm_config({"master": "x"}, tp=2), _cache_config(full), tp_rank=1)
    assert g.page_shape == (4, 32, 64) and g.dtype == "float32"
    assert g.layout.nbytes == 2 * 4 * 32 * 64 * 4
    assert (g.layout.kind, g.layout.parallel, g.layout.tp_size, g.layout.tp_rank) == ("full_attention", "split", 2, 1)
    (g0,) = group_layouts(_vllm_config({"master": "x"}, tp=2), _cache_config(full), tp_rank=0)
    assert g0.layout.fingerprint() == g.layout.fingerprint()  # ranks share a fingerprint, keys differ by rank
    half = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.float16)
    (gh,) = group_layouts(_vllm_config({"master": "x"}), _cache_config(half))
    (gf,) = group_layouts(_vllm_config({"master": "x"}), _cache_config(full))
    assert gh.layout.fingerprint() != gf.layout.fingerprint()
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    (gm,) = group_layouts(_vllm_config({"master": "x"}, tp=4), _cache_config(mla), tp_rank=3)
    assert (gm.layout.kind, gm.replicated, gm.page_shape) == ("mla", True, (1, 32, 576))
    # REPLICATE: the same latent bytes at every TP size, one fingerprint (and key) for all
    (gm1,) = group_layouts(_vllm_config({"master": "x"}, tp=1), _cache_config(mla), tp_rank=0)
    assert gm1.layout.fingerprint() == gm.layout.fingerprint() and gm1.layout == gm.layout
    # SPLIT: each rank holds its heads; another TP size is another layout
    (g1,) = group_layouts(_vllm_config({"master": "x"}, tp=1), _cache_config(full), tp_rank=0)
    assert g1.layout.fingerprint() != g.layout.fingerprint()
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.float32, sliding_window=128)
    gf2, gs = group_layouts(_vllm_config({"master": "x"}), _cache_config(full, swa))
    assert (gs.layout.kind, gs.layout.sliding_window, gs.rule.kind, gs.rule.window_blocks) == \
        ("sliding_window", 128, "sliding_window", 4)  # ceil(127 / 32)
    assert gs.layout.fingerprint() != gf2.layout.fingerprint() and gf2.rule.kind == "full_attention"
    # without the hybrid manager vLLM keeps every block of a windowed layer: full attention,
    # but a window-aware fingerprint (never aliased with a true full-attention group)
    hma_off = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.float32, sliding_window=128)
    (go,) = group_layouts(_vllm_config({"master": "x"}), _cache_config(hma_off))
    assert go.rule.kind == "full_attention" and go.layout.sliding_window == 128
    assert go.layout.fingerprint() != gf.layout.fingerprint()


def test_fp8_kv_cache_layouts_from_vllm_specs():
    """FP8 per-tensor KV caches, as vLLM's attention layers describe them (uint8 pages,
    ``KVQuantMode.FP8_PER_TENSOR``): stored one byte per element under their real
    format, so e4m3 and e5m2 caches (the same bytes to vLLM) and a bfloat16 cache never
    share a fingerprint; a spec whose own dtype is float8 names it; other quantized
    formats are refused."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec

    from kvpool.connector.vllm.meta import group_layouts
    from kvpool.connector.vllm.pages import TORCH_DTYPES, move_dtype
    from kvpool.protocol.errors import ConfigError

    def layout(spec, cache_dtype):
        (g,) = group_layouts(_vllm_config({"master": "x"}, cache_dtype=cache_dtype), _cache_config(spec))
        return g

    fp8 = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.uint8,
                            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    e4m3, e4m3b, e5m2 = layout(fp8, "fp8"), layout(fp8, "fp8_e4m3"), layout(fp8, "fp8_e5m2")
    assert (e4m3.dtype, e5m2.dtype) == ("float8_e4m3fn", "float8_e5m2")
    assert e4m3.page_shape == (4, 32, 64) and e4m3.layout.nbytes == 2 * 4 * 32 * 64  # one byte per element
    assert e4m3.layout.fingerprint() == e4m3b.layout.fingerprint() != e5m2.layout.fingerprint()
    bf16 = layout(FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.bfloat16), "auto")
    assert bf16.layout.fingerprint() != e4m3.layout.fingerprint()
    native = layout(FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.float8_e4m3fn), "auto")
    assert native.dtype == "float8_e4m3fn" and native.page_shape == (4, 32, 64)
    assert TORCH_DTYPES[native.dtype] is torch.float8_e4m3fn and move_dtype(native.dtype) == "uint8"
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                           kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    assert layout(mla, "fp8").page_shape == (1, 32, 576) and layout(mla, "fp8").dtype == "float8_e4m3fn"
    int8 = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.int8,
                             kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)
    with pytest.raises(ConfigError, match="int8_per_token_head"):
        layout(int8, "int8_per_token_head")
    # the bytes of a float8 cache move as uint8, exactly
    cache = torch.randn(3, 4, 32, 64).to(torch.float8_e5m2)
    assert torch.equal(cache.view(torch.uint8).view(torch.float8_e5m2).view(torch.uint8), cache.view(torch.uint8))


def test_state_group_layouts_and_refusals():
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec

    from kvpool.connector.vllm.meta import group_layouts
    from kvpool.protocol.errors import ConfigError

    full = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.bfloat16)
    gdn = MambaSpec(block_size=32, shapes=((3, 768), (4, 128, 128)), dtypes=(torch.bfloat16, torch.bfloat16),
                    mamba_cache_mode="align")
    ga, gm = group_layouts(_vllm_config({"master": "x"}), _cache_config(full, gdn))
    assert gm.is_state and gm.layout.kind == "mamba" and gm.parts == (((3, 768), "bfloat16"), ((4, 128, 128), "bfloat16"))
    assert [t.name for t in gm.layout.tensors] == ["conv/l1.a", "ssm/l1.a", "conv/l1.b", "ssm/l1.b"]
    assert gm.layout.nbytes == 2 * (3 * 768 + 4 * 128 * 128) * 2
    for bad, what in ((MambaSpec(block_size=32, shapes=((3, 8),), dtypes=(torch.float32,), mamba_cache_mode="none"),
                       "mamba_cache_mode"),
                      (MambaSpec(block_size=64, shapes=((3, 8),), dtypes=(torch.float32,), mamba_cache_mode="align"),
                       "block size 64"),
                      # prefix caching off: another block size too, but the cause named is the mode
                      (MambaSpec(block_size=1024, shapes=((3, 8),), dtypes=(torch.float32,), mamba_cache_mode="none"),
                       "mamba_cache_mode='none'.*enable prefix caching"),
                      (ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.float32,
                                                 attention_chunk_size=64), "ChunkedLocalAttentionSpec")):
        with pytest.raises(ConfigError, match=what) as ei:
            group_layouts(_vllm_config({"master": "x"}), _cache_config(full, bad))
        assert "cache group 1" in str(ei.value), ei.value


def test_stats_aggregate_and_reduce():
    from kvpool.connector.vllm.connector import KVPoolConnector

    a = KVPoolConnector.build_kv_connector_stats()
    assert a.is_empty()
    a.add("hit_tokens", 64)
    a.observe("load_s", 0.002)
    b = KVPoolConnector.build_kv_connector_stats(dict(hit_tokens=32, load_s=[0.004], blocks_loaded=3))
    a.observe("save_s", 0.010)
    a.add_group(1, "bytes_loaded", 4096)
    a.add_group(1, "bytes_loaded", 0)  # zero adds nothing
    r = a.aggregate(b).reduce()
    assert r["hit_tokens"] == 96 and r["blocks_loaded"] == 3 and r["avg_load_ms"] == pytest.approx(3.0)
    assert r["avg_save_ms"] == pytest.approx(10.0) and r["group/1/bytes_loaded"] == 4096
    assert not KVPoolConnector.build_kv_connector_stats({"group/0/hit_tokens": 32}).is_empty()
