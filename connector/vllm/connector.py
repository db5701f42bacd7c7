"""kvpool as a vLLM KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``).

Select it with::

    kv_transfer_config = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.connector.vllm.connector",
        "kv_role": "kv_both",                      # or kv_producer / kv_consumer (P/D)
        "kv_load_failure_policy": "recompute",     # or "fail" (vLLM's default)
        "kv_connector_extra_config": {"master": "tcp://127.0.0.1:PORT", "namespace": "vllm"},
    }

Roles: ``kv_both`` is a shared prefix cache (every engine loads what any engine
saved); ``kv_producer`` saves its prompts' blocks and publishes a hand-off when a
request finishes, returning ``{"kvpool": {"handoff_id": ..., "num_blocks": ...}}`` as
the request's ``kv_transfer_params``; ``kv_consumer`` takes those params (the router
passes them on), claims the hand-off, loads, and acks. The scheduler-side logic lives in
:mod:`connector.vllm.scheduler`, the worker side in :mod:`connector.vllm.worker`; this
class only routes vLLM's calls to the half that runs in this process.

This module imports vLLM; ``kvpool.connector`` and ``kvpool.connector.client`` do not.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.connector.vllm.meta import (
    ConnectorSettings,
    KVPoolConnectorMetadata,
    KVPoolConnectorStats,
    KVPoolPromMetrics,
    KVPoolWorkerMetadata,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.vllm")

__all__ = ["KVPoolConnector", "KVPoolConnectorMetadata", "KVPoolConnectorStats", "KVPoolWorkerMetadata"]


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM connector backed by a kvpool cluster (see the module docstring)."""

    _cache_hit_source = getattr(CacheHitSource, "HOST", CacheHitSource.EXTERNAL_UNSPECIFIED)

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_vllm(vllm_config)
        ktc = vllm_config.kv_transfer_config
        if ktc.kv_load_failure_policy != self.settings.policy:
            # The scheduler reads kv_load_failure_policy after building its connector.
            log.info("kvpool: load_failure_policy=%s from kv_connector_extra_config overrides "
                     "kv_load_failure_policy=%s", self.settings.policy, ktc.kv_load_failure_policy)
            ktc.kv_load_failure_policy = self.settings.policy
        self.sched = None
        self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvpool.connector.vllm.scheduler import KVPoolScheduler

            self.sched = KVPoolScheduler(self.settings, vllm_config, kv_cache_config)
        else:
            from kvpool.connector.vllm.worker import KVPoolWorker

            self.worker = KVPoolWorker(self.settings, vllm_config, kv_cache_config)
        log.info("kvpool connector: role=%s kv_role=%s namespace=%s model=%s policy=%s", role.name,
                 self.settings.role, self.settings.namespace, self.settings.model_id, self.settings.policy)

    @property
    def requires_kv_delivery(self) -> bool:
        # kv_both is a best-effort cache (a lost save is a later miss); a producer's
        # hand-off must be delivered.
        return self.settings.producer

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is not None:
            self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker is not None:
            self.worker.clear()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Submit this step's loads to the background loader: layer-wise ones (before the
        forward pass, which waits per layer) and asynchronous ones (their requests wait in
        WAITING_FOR_REMOTE_KVS until ``get_finished`` reports them)."""
        if self.worker is not None:
            # a full CUDA graph replays without Python: no wait_for_layer_load, so wait here
            mode = getattr(forward_context, "cudagraph_runtime_mode", None)
            self.worker.loads.start(whole=getattr(mode, "name", "") == "FULL")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True with ``load_mode: layerwise``: attention must run outside CUDA graphs for
        its ``wait_for_layer_load`` to run. (With ``auto`` a full graph's step waits for
        its whole load in ``start_load_kv`` instead.)"""
        return (extra_config or {}).get("load_mode") == "layerwise"

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's layer-wise loads have written ``layer_name``'s pages
        (bounded by the step's load deadline; nothing to wait for with async loads)."""
        if self.worker is not None:
            self.worker.loads.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Copy this layer's pages of the blocks saved this step into staging memory."""
        if self.worker is not None:
            self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """Finish staging and queue the puts; no vLLM block is read after this returns."""
        if self.worker is not None:
            self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        done, failed = self.worker.loads.get_finished()
        return KVConnectorTransferResults(finished_sending=set(), finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.loads.take_invalid() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVPoolWorkerMetadata | None:
        return self.worker.take_report() if self.worker is not None else None

    def get_kv_connector_stats(self) -> KVPoolConnectorStats | None:
        part = self.worker if self.worker is not None else self.sched
        return part.take_stats() if part is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPoolConnectorStats:
        return KVPoolConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPoolPromMetrics:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for part in (self.worker, self.sched):
            if part is not None:
                part.close()

    # ==============================
    # Scheduler-side methods
    # ==============================

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.sched is not None:
            self.sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.sched is not None
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.sched is not None
        return self.sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.sched is not None:
            self.sched.update_connector_output(connector_output)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """False: when vLLM's local full-attention hit reaches deeper than the local
        recurrent state, vLLM reconciles to the boundary every group agrees on and kvpool
        extends the hit from there (the store holds checkpoints on block boundaries, so a
        lagging state is restored from kvpool only at a boundary it was saved at)."""
        return False

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """Every group kvpool stores (vLLM's prefix-cacheable transfer groups): a load
        restores each of them to the hit boundary, so vLLM skips zeroing their blocks."""
        if self.sched is not None:
            return self.sched.loaded_group_ids()
        return super().get_loaded_kv_cache_group_ids(request)

    def register_finished_partial_tail(self, request: "Request", block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]) -> bool:
        """Declined (False): kvpool stores full blocks and block-aligned state checkpoints;
        the state after a prompt's sub-block tail (fewer than ``block_size`` tokens) is
        recomputed by the next engine, and no block is held past the request for it."""
        return False

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Never delays freeing (saves read staging copies, not vLLM blocks); a producer
        returns the hand-off ``kv_transfer_params``."""
        assert self.sched is not None
        return self.sched.request_finished(request, block_ids)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        return self.sched.take_events() if self.sched is not None else ()
