"""Worker side of the kvpool vLLM connector.

* ``register_kv_caches``: records each layer's cache tensor as a ``[blocks, H, N, C]``
  view (kernel sub-blocks folded back into manager blocks) and checks it against the
  group's :class:`LayoutSpec`.
* loads run on a background thread, layer-wise or asynchronous
  (:mod:`connector.vllm.loads`).
* saves: ``save_kv_layer`` copies the layer's pages of every block saved this step
  into the job's staging buffer (one contiguous object per block) right after the
  layer ran; ``wait_for_save`` completes any layer vLLM did not pass and then puts the
  objects from a background thread — except a producer's last prompt chunk, which is
  committed before returning so the hand-off can be published when the request ends.
  Host-memory pages of paged groups (full attention, MLA, sliding window) are copied on
  a gather thread, beside the layers that follow, and the next step's
  ``bind_connector_metadata`` waits for those copies before its forward pass. That is the
  earliest a saved block can change: a saved block is full and no layer writes its pages
  again in this step, and a block freed by this step (request finished or preempted,
  out of a sliding window) is handed out and written only in a later step, after that
  bind; loads into newly allocated blocks start in ``start_load_kv``, after it too. State
  groups (their checkpoints can be copied between blocks before a forward) and device
  caches copy inside the forward, as before. After ``wait_for_save`` returns, no vLLM block
  is read by a save once the next step's metadata is bound.
"""
from __future__ import annotations

import logging
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from kvpool.connector.vllm.affinity import format_cpus, host_topology, io_cpus, omp_cpus, pin_thread
from kvpool.connector.vllm.loads import WorkerLoads
from kvpool.connector.vllm.meta import (
    ConnectorSettings,
    GroupLayout,
    KVPoolConnectorMetadata,
    KVPoolConnectorStats,
    KVPoolWorkerMetadata,
    SaveJob,
    WorkerTally,
    block_keys,
    group_layouts,
    monotonic,
)
from kvpool.connector.vllm.plan import PAGED
from kvpool.connector.vllm.pages import (
    TORCH_DTYPES,
    MergedPages,
    PageRuns,
    block_parts,
    copy_pages,
    host_bytes,
    move_dtype,
    staging,
)
from kvpool.protocol.errors import ConfigError, KVPoolError

log = logging.getLogger("kvpool.vllm")


@dataclass
class _Staged:
    """A save job being staged: one ``[n, block_nbytes]`` uint8 buffer per group."""

    job: SaveJob
    bufs: list[torch.Tensor]
    done_layers: set[str] = field(default_factory=set)
    gathers: list[Future] = field(default_factory=list)  # host copies still running on the gather thread


class KVPoolWorker:
    """The worker-side connector of one vLLM worker (one TP rank): registration, the
    step's metadata and saves here; loads in its ``loads``
    (:class:`~connector.vllm.loads.WorkerLoads`), what both report in its ``tally``
    (:class:`~connector.vllm.meta.WorkerTally`)."""

    def __init__(self, settings: ConnectorSettings, vllm_config, kv_cache_config, client=None) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.s = settings
        self.num_blocks = int(kv_cache_config.num_blocks)
        try:
            self.rank = int(get_tensor_model_parallel_rank())
        except (AssertionError, AttributeError, RuntimeError):
            self.rank = 0
        self.groups: list[GroupLayout] = group_layouts(vllm_config, kv_cache_config, self.rank)
        self.multi_group = len(kv_cache_config.kv_cache_groups) > 1  # vLLM takes block-level load errors only with one group
        # a save job's groups are put state and sliding-window groups first, full attention and
        # MLA last: a hit's boundary is capped by the run of full-attention blocks, so a lookup
        # that sees a job's full-attention blocks also sees the checkpoints and windows it put
        self.commit_order = sorted(range(len(self.groups)), key=lambda gi: self.groups[gi].rule.kind in PAGED)
        self.client = client if client is not None else settings.make_client()
        self.caches: dict[str, list] = {}  # layer -> (view, shape, dtype) per sub-tensor of a block
        self.layer_pos: dict[str, tuple[int, int]] = {}  # layer -> (group index, byte offset)
        self.page_runs: list[PageRuns | None] = []  # per group, once registered: see register_kv_caches
        self.meta: KVPoolConnectorMetadata | None = None
        self.staged: list[_Staged] = []
        self.barrier: set[str] = set()  # requests whose prompt ended this step with nothing left to stage
        cpus = _io_cpus()  # beside a bound OpenMP team: see connector.vllm.affinity
        pinned = {"initializer": pin_thread, "initargs": (cpus,)} if cpus is not None else {}
        if cpus is not None:
            log.info("kvpool: connector threads run on CPUs %s (the OpenMP team is bound to %s)",
                     format_cpus(cpus), format_cpus(omp_cpus(os.environ) or set()))
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load", **pinned)
        self.saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save", **pinned)
        self.gatherer = ThreadPoolExecutor(1, thread_name_prefix="kvpool-gather", **pinned)
        self.gathers: list[Future] = []  # this step's host copies: awaited before the next forward
        self.tally = WorkerTally()  # report and stats, updated from I/O threads
        self.loads = WorkerLoads(settings, self.client, self.groups, self.multi_group, self.rank, self.loader,
                                 self.gatherer, self.tally, self.num_blocks * sum(g.layout.nbytes for g in self.groups))
        self.saves: list[Future] = []
        self.req_saves: dict[str, list[Future]] = {}  # queued save jobs by request (see wait_for_save)
        self.failed_reqs: set[str] = set()
        self.warned: set[str] = set()
        self.pin = False  # staging in pinned host memory: set when the caches live on a GPU

    # ---- registration ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for gi, g in enumerate(self.groups):
            off = 0
            for name in g.layer_names:
                t = kv_caches.get(name)
                if t is None:
                    raise ConfigError(f"kvpool: layer {name} of cache group {g.group_id} has no KV cache "
                                      "tensor on this worker", key="kv_caches")
                parts = self._state_views(name, t, g) if g.is_state else \
                    [(self._block_view(name, t, g), g.page_shape, move_dtype(g.dtype))]
                self.caches[name] = parts
                self.layer_pos[name] = (gi, off)
                off += g.layer_nbytes
                self.pin = self.pin or any(v.device.type == "cuda" for v, _, _ in parts)
        # host caches whose pages loads fill straight from a mapped segment (no staging)
        self.page_runs = [PageRuns.of([(v, lo, hi) for name in g.layer_names for v, lo, hi, _, _ in
                                       block_parts(self.caches, self.layer_pos, name)], self.num_blocks,
                                      g.layout.nbytes) for g in self.groups]
        self.loads.registered(self.caches, self.layer_pos, self.page_runs, self.pin)
        log.info("kvpool: registered %d layers in %d group(s) (%s); %d bytes per block; rank %d",
                 len(self.caches), len(self.groups), ", ".join(g.layout.kind for g in self.groups),
                 sum(g.layout.nbytes for g in self.groups), self.rank)

    def _state_views(self, name: str, t, g: GroupLayout) -> list:
        """A state layer's cache as ``(view, shape, dtype)`` parts: either one
        ``[blocks, *shape]`` tensor per sub-state (conv history, recurrent state) as
        ``MambaSpec.shapes``/``dtypes`` declare, or the raw per-block page vLLM registers
        for connectors (``[blocks, 1, 1, bytes]`` int8, the sub-states back to back in
        that order), moved as bytes."""
        if not isinstance(t, (list, tuple)):
            raw = t.view(torch.uint8) if t.dtype in (torch.int8, torch.uint8) else None
            if raw is None or raw.shape[0] < self.num_blocks or math.prod(raw.shape[1:]) != g.layer_nbytes:
                raise ConfigError(f"kvpool: state layer {name} cache is {tuple(t.shape)} {t.dtype}; expected "
                                  f"{g.layer_nbytes} bytes per block ({', '.join(str(s) for s, _ in g.parts)})",
                                  key="kv_caches")
            return [(raw.reshape(raw.shape[0], g.layer_nbytes), (g.layer_nbytes,), "uint8")]
        if len(t) != len(g.parts):
            raise ConfigError(f"kvpool: state layer {name} has {len(t)} cache tensors, its spec declares "
                              f"{len(g.parts)}", key="kv_caches")
        for v, (shape, dtype) in zip(t, g.parts):
            if v.dtype != TORCH_DTYPES[dtype] or tuple(v.shape[1:]) != tuple(shape) or v.shape[0] < self.num_blocks:
                raise ConfigError(f"kvpool: state layer {name} cache is {tuple(v.shape)} {v.dtype}, the spec says "
                                  f"[{self.num_blocks}, {', '.join(map(str, shape))}] {dtype}", key="kv_caches")
        return [(v.view(torch.uint8) if move_dtype(dtype) != dtype else v, shape, move_dtype(dtype))
                for v, (shape, dtype) in zip(t, g.parts)]

    def _block_view(self, name: str, t: torch.Tensor, g: GroupLayout) -> torch.Tensor:
        if isinstance(t, (list, tuple)):
            raise ConfigError(f"kvpool: layer {name} has a multi-tensor cache; not supported", key="kv_caches")
        h, n, c = g.page_shape
        want = TORCH_DTYPES[move_dtype(g.dtype)]
        if t.dtype != want:
            if want == torch.uint8 and t.element_size() == 1:  # FP8 / int8 pages, moved as bytes
                t = t.view(torch.uint8)
            else:
                raise ConfigError(f"kvpool: layer {name} cache dtype {t.dtype} differs from the spec's "
                                  f"{g.dtype}", key="kv_caches")
        if t.dim() != 4:
            raise ConfigError(f"kvpool: layer {name} cache has shape {tuple(t.shape)}; expected the "
                              "logical [blocks, heads, tokens, content] view", key="kv_caches")
        nb = t.shape[0]
        if nb != self.num_blocks:  # kernel blocks: fold them back into manager blocks
            if nb % self.num_blocks:
                raise ConfigError(f"kvpool: layer {name} has {nb} kernel blocks for {self.num_blocks} "
                                  "blocks", key="kv_caches")
            r = nb // self.num_blocks
            t = t.unflatten(0, (self.num_blocks, r)).permute(0, 2, 1, 3, 4)
            t = MergedPages(t)  # [B, H, r, Nk, C] seen as [B, H, r*Nk, C]
            shape = (t.shape[1], t.shape[2], t.shape[3])
        else:
            shape = tuple(t.shape[1:])
        if tuple(shape) != (h, n, c):
            raise ConfigError(f"kvpool: layer {name} page is {tuple(shape)}, the layout says {(h, n, c)}",
                              key="kv_caches")
        return t

    # ---- metadata ---------------------------------------------------------------------------

    def _mine(self, g: GroupLayout) -> bool:
        """Whether this rank stores ``g`` (one copy of a replicated layout serves every rank)."""
        return not (g.replicated and self.rank != 0)

    def bind(self, meta) -> None:
        self._drain_gathers()  # before this step's forward can write a block the last step saved
        self.meta = meta if isinstance(meta, KVPoolConnectorMetadata) else None
        self.loads.bind(self.meta)
        self.staged = []
        self.barrier = set()
        if self.meta is None or not self.meta.saves:
            return
        for job in self.meta.saves:
            if not any(self._mine(g) and gb.positions for g, gb in zip(self.groups, job.groups)):
                if job.sync:  # nothing to stage, but the request's earlier saves must land
                    self.barrier.add(job.req_id)
                continue
            bufs = [staging(len(gb.positions), g.layout.nbytes, self.pin) for g, gb in zip(self.groups, job.groups)]
            self.staged.append(_Staged(job, bufs))

    def clear(self) -> None:
        self.meta = None
        self.loads.meta = None
        self.staged = []

    # ---- saves ------------------------------------------------------------------------------

    def save_layer(self, layer_name: str) -> None:
        if layer_name not in self.layer_pos or not self.staged:
            return
        for st in self.staged:
            if layer_name not in st.done_layers:
                self._gather(st, layer_name)

    def _gather(self, st: _Staged, layer_name: str) -> None:
        gi = self.layer_pos[layer_name][0]
        g = self.groups[gi]
        ids = st.job.groups[gi].block_ids
        st.done_layers.add(layer_name)
        if not ids or not self._mine(g):
            return
        for view, lo, hi, shape, dtype in block_parts(self.caches, self.layer_pos, layer_name):
            src = None if g.is_state else host_bytes(view)
            if src is not None:
                fut = self.gatherer.submit(copy_pages, src, st.bufs[gi][:, lo:hi].numpy(), ids)
                st.gathers.append(fut)
                self.gathers.append(fut)
                continue
            idx = torch.tensor(ids, dtype=torch.long, device=view.device)
            pages = view.index_select(0, idx)
            dst = st.bufs[gi][:, lo:hi].view(TORCH_DTYPES[dtype]).view(len(ids), *shape)
            dst.copy_(pages)  # synchronous for CPU caches (and device->host copies)

    def _drain_gathers(self) -> None:
        """Wait for every host copy queued so far (their errors are the saves' to report)."""
        if self.gathers:
            wait(self.gathers)
            self.gathers = []

    def wait_for_save(self) -> None:
        staged, self.staged = self.staged, []
        ends, self.barrier = self.barrier, set()
        sync = []
        for st in staged:
            for name in self.layer_pos:
                if name not in st.done_layers:
                    self._gather(st, name)
            if st.job.sync:
                wait(st.gathers)
                sync.append(st)
                ends.add(st.job.req_id)
            else:
                self._throttle()
                fut = self.saver.submit(self._put, st)
                self.saves.append(fut)
                self.req_saves.setdefault(st.job.req_id, []).append(fut)
        if ends:
            # a prompt ended this step (SaveJob.sync): its earlier saves and this one are
            # committed before the step ends, so a producer publishes its hand-off as the
            # request finishes, and whoever sees the request answered finds its blocks
            self._wait_requests(ends)
            for st in sync:
                self._put(st)

    def _wait_requests(self, req_ids: set[str]) -> None:
        """Wait for the queued saves of ``req_ids`` (at most ``io_timeout_s``)."""
        futs = [f for r in req_ids for f in self.req_saves.pop(r, ())]
        if futs:
            _, late = wait(futs, timeout=self.s.io_timeout_s)
            if late:
                log.warning("kvpool: %d save job(s) of request(s) %s still running after %.3gs; their prompts "
                            "are answered before they are stored", len(late), sorted(req_ids), self.s.io_timeout_s)

    def _throttle(self) -> None:
        self.saves = [f for f in self.saves if not f.done()]
        if len(self.req_saves) > 64:  # forget finished jobs of requests whose prompt never ended (aborted)
            self.req_saves = {r: live for r, fs in self.req_saves.items() if (live := [f for f in fs if not f.done()])}
        while len(self.saves) >= self.s.max_inflight_saves:
            self.saves[0].result()
            self.saves = [f for f in self.saves if not f.done()]

    def _put(self, st: _Staged) -> None:
        t0 = monotonic()
        job = st.job
        failed = 0
        nbytes = 0
        n_paged = 0
        wait(st.gathers)
        bad = next((f.exception() for f in st.gathers if f.exception() is not None), None)
        if bad is not None:  # staging is incomplete: store nothing of this job
            log.error("kvpool: copying the pages of request %s out of the KV cache failed (%s: %s); its blocks are "
                      "not saved", job.req_id, type(bad).__name__, bad)
            with self.tally.lock:
                self.tally.stats.add("blocks_save_failed", max((len(gb.positions) for gb in job.groups), default=0))
            return
        for gi in self.commit_order:
            g = self.groups[gi]
            gb = job.groups[gi]
            n = len(gb.positions)
            if not g.is_state:
                n_paged = max(n_paged, n)
            if not n or not self._mine(g):
                continue
            keys = block_keys(self.s, g, self.rank, job.first, job.hashes, gb.positions)
            buf = st.bufs[gi]
            tg = monotonic()
            try:
                res = self.client.put_batch(keys, [buf[i] for i in range(n)], g.layout)
            except Exception as e:  # noqa: BLE001 - a failed save is a later cache miss, never a crash
                err = e if isinstance(e, KVPoolError) else KVPoolError(f"{type(e).__name__}: {e}")
                res = [err] * n
            with self.tally.lock:
                self.tally.stats.observe_group(g.group_id, "save_s", monotonic() - tg)
            errs = [r for r in res if r is not None]
            failed = max(failed, len(errs))
            nbytes += (n - len(errs)) * g.layout.nbytes
            with self.tally.lock:
                self.tally.stats.add_group(g.group_id, "bytes_saved", (n - len(errs)) * g.layout.nbytes)
                if g.is_state:
                    self.tally.stats.add("states_saved", n - len(errs))
            if errs:
                kind = type(errs[0]).__name__
                if kind not in self.warned:
                    self.warned.add(kind)
                    log.warning("kvpool: %d of %d blocks of cache group %d of request %s were not saved (%s: %s); "
                                "they will be recomputed by whoever needs them", len(errs), n, g.group_id,
                                job.req_id, kind, errs[0])
        first = next((gb.positions[0] for g, gb in zip(self.groups, job.groups)
                      if not g.is_state and gb.positions), job.first)
        with self.tally.lock:
            self.tally.report.saves.append((job.req_id, first, n_paged - min(failed, n_paged), failed))
            self.tally.stats.observe("save_s", monotonic() - t0)
            self.tally.stats.add("blocks_saved", n_paged - min(failed, n_paged))
            self.tally.stats.add("blocks_save_failed", failed)
            self.tally.stats.add("bytes_saved", nbytes)

    def take_report(self) -> KVPoolWorkerMetadata | None:
        return self.tally.take_report()

    def take_stats(self) -> KVPoolConnectorStats | None:
        return self.tally.take_stats()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every queued save (used at shutdown and by tests)."""
        self._drain_gathers()
        for f in list(self.saves):
            f.result(timeout=timeout_s)
        self.saves = []

    def close(self) -> None:
        try:
            self.flush(timeout_s=self.s.io_timeout_s)
        except Exception as e:  # noqa: BLE001 - shutting down anyway
            log.warning("kvpool: saves still pending at shutdown: %s", e)
        self.loader.shutdown(wait=True, cancel_futures=True)
        self.saver.shutdown(wait=True)
        self.gatherer.shutdown(wait=True)
        self.client.close()


def _io_cpus() -> set[int] | None:
    """CPUs for the worker's threads on a CPU platform whose OpenMP team vLLM bound; None
    elsewhere (GPU workers, no binding): threads keep the mask they inherit."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or omp_cpus(os.environ) is None:
        return None
    topo = host_topology()
    return io_cpus(os.environ, topo) if topo is not None else None
