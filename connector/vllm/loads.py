"""Loads of the kvpool vLLM connector's worker: fetch a step's hits into the requests'
KV cache blocks. Host caches are filled straight from a same-host node's mapped segment,
one copy per page (``get_into_batch`` into a :class:`~connector.scatter_out.ScatterOut`
per block: layout checked before the copy, checksum on the bytes as they landed; a read
over the network lands in a private buffer and is copied in once it passed). Device
caches go through staging memory first, whose blocks are then scattered into the cache,
and so do blocks a hand-off holds at another TP size (``LoadJob.reads``): each stored
rank's objects are read into staging of their own and their head ranges placed into the
blocks' staging (:func:`~connector.vllm.pages.place_heads`) before the scatter.
A block that fails its checks is reported failed, and vLLM recomputes it before any
output depends on it (a layer-wise step's output of that request is discarded, its
later blocks evicted).

* asynchronous jobs run as one batch per step on the loader thread; ``get_finished``
  reports the requests whose loads completed and ``take_invalid`` the blocks that did
  not load (for multi-group models, where block ids are ambiguous, the request is
  reported failed instead);
* layer-wise jobs (``LoadJob.layerwise``) feed the step's own forward pass: staged ones
  scatter one layer at a time and ``wait_for_layer_load`` waits for its layer only
  (:mod:`connector.vllm.layer_loads`); the step's output reports the blocks that did not load.
"""
from __future__ import annotations

import contextlib
import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import msgspec
import torch

from kvpool.connector.client import LEASE_MARGIN
from kvpool.connector.vllm.layer_loads import LayerLoads
from kvpool.connector.read_leases import ReadLeases
from kvpool.connector.scatter_out import ScatterOut
from kvpool.connector.vllm.meta import (
    ConnectorSettings,
    GroupLayout,
    KVPoolConnectorMetadata,
    LoadJob,
    TpRead,
    WorkerTally,
    block_keys,
    monotonic,
    source_group,
)
from kvpool.connector.vllm.pages import TORCH_DTYPES, PageRuns, block_parts, host_bytes, place_heads, staging
from kvpool.connector.vllm.plan import NULL_BLOCK
from kvpool.protocol.errors import ChecksumMismatch, KVPoolError

log = logging.getLogger("kvpool.vllm")

LOAD_ARENA_BYTES = 64 << 20  # load staging kept per worker (at most the KV cache's size); larger steps allocate
IDLE_WAIT_S = 0.01  # longest wait for a load in a step with nothing else to do (seconds)


@dataclass
class _LoadResult:
    req_id: str
    failed_blocks: set[int]
    n_failed: int
    n_ok: int
    nbytes: int
    seconds: float
    group_bytes: dict[int, int] = field(default_factory=dict)
    n_corrupt: int = 0  # blocks whose bytes failed their checksum


@dataclass
class _Plan:
    """What of one load job's fetched blocks goes into the cache: ``spans[g]`` is the
    staging buffer of group ``g`` and how many of its blocks to scatter (a prefix);
    ``reason`` the first failure ("" when every block loaded), ``ok_upto`` the loaded
    blocks of the single-group case, ``failed_groups`` the blocks lost per group,
    ``n_corrupt`` the blocks that failed their checksum."""

    n: int
    reason: str
    ok_upto: int
    failed_groups: dict[int, int]
    spans: list[tuple[torch.Tensor | None, int]]
    n_corrupt: int = 0


class WorkerLoads:
    """The loads of a :class:`~connector.vllm.worker.KVPoolWorker` (its ``loads``): the
    step's load jobs, their futures by request id, this step's layer-wise loads, the blocks
    that did not load, and the staging arena.

    Given ``settings`` (:class:`~connector.vllm.meta.ConnectorSettings`), ``client`` (the
    worker's KVPoolClient), ``groups`` (the worker's :class:`~connector.vllm.meta.
    GroupLayout` list, in cache-group order), ``multi_group`` (vLLM's KV cache has several
    groups: block ids are ambiguous), ``rank`` (TP rank, for keys), the worker's ``loader``
    and ``gatherer`` threads (one-thread executors: loads run on the first, the arena's
    prefault on the second), ``tally`` (:class:`~connector.vllm.meta.WorkerTally`: report
    and stats) and ``kv_bytes`` (bytes of the whole KV cache: bounds the arena). The caches
    come with :meth:`registered`; each step's metadata with :meth:`bind`."""

    def __init__(self, settings: ConnectorSettings, client, groups: list[GroupLayout], multi_group: bool,
                 rank: int, loader: ThreadPoolExecutor, gatherer: ThreadPoolExecutor, tally: WorkerTally,
                 kv_bytes: int) -> None:
        self.s = settings
        self.client = client
        self.groups = groups
        self.multi_group = multi_group
        self.rank = rank
        self.loader = loader
        self.gatherer = gatherer
        self.tally = tally
        self.meta: KVPoolConnectorMetadata | None = None  # this step's, from bind
        self.caches: dict[str, list] = {}  # from registered: see KVPoolWorker.caches
        self.layer_pos: dict[str, tuple[int, int]] = {}
        self.page_runs: list[PageRuns | None] = []
        self.pin = False
        self.pending: dict[str, Future] = {}  # asynchronous loads by request id
        self.last_load: Future | None = None  # the loader's newest job
        self.load_stream = None  # device caches: the loader's CUDA stream
        self.layered: tuple[LayerLoads, Future, list[LoadJob]] | None = None  # this step's layer-wise loads
        self.invalid: set[int] = set()
        self.load_arena = torch.empty(0, dtype=torch.uint8)  # staging kept for loads (see _arena)
        self.arena_ready: Future | None = None
        self.arena_bytes = min(LOAD_ARENA_BYTES, kv_bytes)

    def registered(self, caches: dict[str, list], layer_pos: dict[str, tuple[int, int]],
                   page_runs: list[PageRuns | None], pin: bool) -> None:
        """The worker registered its caches: ``caches`` (layer -> ``(view, shape, dtype)``
        per sub-tensor of a block), ``layer_pos`` (layer -> ``(group index, byte
        offset)``), ``page_runs`` (per group, host caches loads fill straight from a mapped
        segment; None: staged) and ``pin`` (the caches live on a GPU: staging is pinned).
        Allocates the load staging arena and faults its pages in on the gather thread."""
        self.caches, self.layer_pos, self.page_runs, self.pin = caches, layer_pos, page_runs, pin
        if self.s.loads and self.arena_bytes and not all(self.page_runs):  # direct groups need no staging
            self.load_arena = torch.empty(self.arena_bytes, dtype=torch.uint8, pin_memory=self.pin)
            if not self.pin:  # pinned memory is resident already; fault host pages in off the loads' path
                self.arena_ready = self.gatherer.submit(self.load_arena.numpy().fill, 0)

    def _arena(self) -> torch.Tensor:
        """The load staging arena (flat uint8), once its prefault is done. Loads use it on
        the one loader thread only, from fetch to scatter, and every read into it has
        ended when ``get_into_batch`` returns, so each step reuses it from the start."""
        if self.arena_ready is not None:
            self.arena_ready.result()
            self.arena_ready = None
        return self.load_arena

    def bind(self, meta: KVPoolConnectorMetadata | None) -> None:
        """This step's metadata (None: none for kvpool); a step that ended without its
        output (an error in its forward) has its layer-wise loads ended unreported."""
        if self.layered is not None:
            self._end_layered(report=False)
        self.meta = meta

    def start(self, whole: bool = False) -> None:
        """Submit this step's load jobs to the loader thread. Asynchronous jobs go as one
        batch: one ``get_into_batch`` per group for all of them (reads under the read
        leases the scheduler's lookup took, so no master round trip for the blocks those
        cover; fewer GIL hand-offs beside the engine's own steps), then each request's scatter.
        Layer-wise jobs (``LoadJob.layerwise``: vLLM runs them in this step, after this
        call) go the same way but scatter layer by layer (:mod:`connector.vllm.layer_loads`).
        ``whole``: the forward pass will not call ``wait_for_layer_load`` (a full CUDA
        graph replays without Python), so the layer-wise loads are waited for here.

        Layer-wise jobs fail at once, and are recomputed, while the loader still holds an
        earlier fetch (one a lapsed deadline gave up on): queued behind it they would stall
        this step's forward pass as well."""
        if self.meta is None:
            return
        jobs = [job for job in self.meta.loads if job.req_id not in self.pending]
        now = [job for job in jobs if job.layerwise]
        later = [job for job in jobs if not job.layerwise]
        if now:
            ll = LayerLoads((n for g in self.groups for n in g.layer_names),
                            monotonic() + self.s.rpc_timeout_s + self.s.io_timeout_s)
            if self.last_load is not None and not self.last_load.done():
                ll.cancel()
                ll.finish()
                fut: Future = Future()
                fut.set_result({job.req_id: self._failed(job, "the loader is still in an earlier step's fetch")
                                for job in now})
            else:
                after = None
                if self.pin:  # device caches: the copies go after what the forward's stream holds (block zeroing)
                    after = torch.cuda.Event()
                    after.record()
                fut = self.last_load = self.loader.submit(self._load_layers, now, ll, after)
            self.layered = (ll, fut, now)
            if whole:
                for name in ll.ready:
                    if not ll.wait(name):
                        break
        if later:
            fut = self.last_load = self.loader.submit(self._load_batch, later)
            for job in later:
                self.pending[job.req_id] = fut

    def _failed(self, job: LoadJob, reason: str) -> _LoadResult:
        """The result of a job none of whose blocks loaded."""
        return self._result(job, _Plan(max((len(gb.positions) for gb in job.groups), default=0), reason, 0, {},
                                       [(None, 0)] * len(job.groups)), 0.0)

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until this step's layer-wise loads have written ``layer_name``'s pages
        (at most until the step's deadline: then the step's loads are cancelled and
        reported failed)."""
        ll = self.layered[0] if self.layered is not None else None
        if ll is not None and not ll.cancelled and not ll.wait(layer_name):
            if monotonic() < ll.deadline:  # the loader stopped early: its error is logged as the step ends
                log.error("kvpool: layer-wise load of %d request(s) stopped before layer %s (the loader "
                          "failed); their blocks are reported failed", len(self.layered[2]), layer_name)
            else:
                log.error("kvpool: layer-wise load of %d request(s) did not reach layer %s within %.3gs; "
                          "their blocks are reported failed", len(self.layered[2]), layer_name,
                          self.s.rpc_timeout_s + self.s.io_timeout_s)

    def _fetch(self, jobs: list[LoadJob], gate: LayerLoads | None = None) -> tuple[dict[str, list], float]:
        """Every job's blocks, per group one batch call for all jobs: ``(staging buffer,
        per-block results)`` per group by request id, and the seconds it took. Groups in
        host caches (``page_runs``) are read straight into the requests' cache blocks
        (:class:`~connector.scatter_out.ScatterOut`, writes under ``gate``: none after it
        is cancelled); their staging buffer is None."""
        t0 = monotonic()
        todo = [job for job in jobs if not job.error and any(gb.positions for gb in job.groups)]
        fetched: dict[str, list] = {job.req_id: [] for job in todo}
        free = self._arena()
        leases, twice = ReadLeases(), []
        for job in todo:
            if job.leases is not None:
                twice += leases.merge(job.leases)  # two requests loading the same blocks in one step
        if twice and leases.usable(monotonic(), LEASE_MARGIN):
            self.client.release_leases(twice, leases.until(LEASE_MARGIN))
        held = len(leases.infos)
        for gi, g in enumerate(self.groups):
            reads = {job.req_id: job.reads[gi] for job in todo if job.reads and gi in job.reads}
            keys, outs, lays, spans = [], [], [], []
            nb = g.layout.nbytes
            runs = self.page_runs[gi]
            # staged: every block of a group not read straight into the cache, and those assembled from
            # another TP size's blocks
            n = sum(len(job.groups[gi].positions) for job in todo if runs is None or job.req_id in reads)
            if not n:
                room = None
            elif n * nb <= free.numel():  # the kept, prefaulted arena; a step past it gets fresh memory
                room, free = free[:n * nb].view(n, nb), free[n * nb:]
            else:
                room = staging(n, nb, self.pin)
            flat = memoryview(room.numpy()).cast("B") if room is not None else None  # slices: no tensor per block
            at = 0  # rows of room taken
            for job in todo:
                pos = job.groups[gi].positions
                lo, k, read = len(keys), len(pos), reads.get(job.req_id)
                buf = None
                if room is not None and (runs is None or read is not None):
                    buf, at = room[at:at + k], at + k
                if read is not None:
                    spans.append((job, buf, lo, self._tp_sources(g, job, pos, read, keys, outs, lays)))
                    continue
                spans.append((job, buf, lo, None))
                keys += block_keys(self.s, g, self.rank, job.first, job.hashes, pos)
                lays += [g.layout] * k
                if runs is not None:
                    outs += [ScatterOut(runs.pages(b), gate) for b in job.groups[gi].block_ids[:k]]
                else:
                    outs += [flat[i * nb:(i + 1) * nb] for i in range(at - k, at)]
            res: list = []
            if keys:
                tg = monotonic()
                try:
                    res = self.client.get_into_batch(keys, outs, lays, leases)
                except Exception as e:  # noqa: BLE001 - reported as failed blocks, never a hang
                    res = [e if isinstance(e, KVPoolError) else KVPoolError(f"{type(e).__name__}: {e}")] * len(keys)
                with self.tally.lock:
                    self.tally.stats.observe_group(g.group_id, "load_s", monotonic() - tg)
            for job, buf, lo, srcs in spans:
                k = len(job.groups[gi].positions)
                if srcs is None:
                    fetched[job.req_id].append((buf, res[lo:lo + k]))
                    continue
                read = reads[job.req_id]
                got = [res[lo + j * k:lo + (j + 1) * k] for j in range(len(srcs))]
                # a block loads when every stored rank it takes heads from loaded; else the
                # first rank's failure (an error, or None: missing) is the block's
                per_block = []
                for i in range(k):
                    bad = [r[i] for r in got if not isinstance(r[i], int)]
                    per_block.append(bad[0] if bad else sum(r[i] for r in got))
                if k:
                    place_heads(buf.numpy(), {r: sb.numpy() for r, sb in srcs.items()}, read.pieces[self.rank],
                                g.layout, read.layout)
                fetched[job.req_id].append((buf, per_block))
        if held:
            with self.tally.lock:
                self.tally.stats.add("blocks_read_on_lookup_leases", held - len(leases.infos))
        return fetched, monotonic() - t0

    def _tp_sources(self, g: GroupLayout, job: LoadJob, pos: list[int], read: TpRead, keys: list, outs: list,
                    lays: list) -> dict[int, torch.Tensor]:
        """Add the reads of ``job``'s blocks of ``g`` at ``pos`` as another TP size stored them
        (``read``) to a batch (``keys``, ``outs``, ``lays``): for each stored rank this rank
        takes heads from, in ascending order, every block into a staging buffer of its own
        (not the cache: :func:`~connector.vllm.pages.place_heads` assembles the blocks).
        Returns those buffers (``[len(pos), stored block bytes]`` uint8) by stored rank."""
        src = source_group(g, read.layout)
        nb = read.layout.nbytes
        bufs = {}
        for r in read.ranks(self.rank):
            sb = bufs[r] = staging(len(pos), nb, self.pin)
            flat = memoryview(sb.numpy()).cast("B")
            keys += block_keys(self.s, src, r, job.first, job.hashes, pos)
            outs += [flat[i * nb:(i + 1) * nb] for i in range(len(pos))]
            lays += [msgspec.structs.replace(read.layout, tp_rank=r)] * len(pos)
        return bufs

    def _load_batch(self, jobs: list[LoadJob]) -> dict[str, _LoadResult]:
        """Fetch every job's blocks and scatter what loaded; returns the results by
        request id."""
        fetched, fetch_s = self._fetch(jobs)
        out = {}
        for job in jobs:
            t0 = monotonic()
            plan = self._plan(job, fetched.get(job.req_id))
            for gi, g in enumerate(self.groups):
                for name in g.layer_names:
                    self._scatter_layer([(job, plan)], gi, name)
            out[job.req_id] = self._result(job, plan, fetch_s + monotonic() - t0)
        return out

    def _load_layers(self, jobs: list[LoadJob], ll: LayerLoads, after=None) -> dict[str, _LoadResult]:
        """Layer-wise loads of one step: fetch every job's blocks, then scatter them one
        layer at a time (every job's blocks of that layer), marking each layer ready. A
        cancelled step scatters nothing more and fails every block. ``after``: a CUDA
        event on the forward's stream; device copies run on the loader's own stream,
        after it."""
        try:
            fetched, fetch_s = self._fetch(jobs, ll)
            t0 = monotonic()
            plans = [(job, self._plan(job, fetched.get(job.req_id))) for job in jobs]
            with contextlib.ExitStack() as on_stream:
                if after is not None:
                    if self.load_stream is None:
                        self.load_stream = torch.cuda.Stream()
                    on_stream.enter_context(torch.cuda.stream(self.load_stream))
                    self.load_stream.wait_event(after)
                for gi, g in enumerate(self.groups):
                    for name in g.layer_names:
                        ll.scatter(name, lambda gi=gi, name=name: self._scatter_layer(plans, gi, name))
        except BaseException:
            ll.cancel()
            raise
        finally:
            ll.finish()
        took = fetch_s + monotonic() - t0
        if ll.cancelled:
            for _, p in plans:
                p.reason, p.ok_upto = p.reason or "the step's load deadline lapsed", 0
                p.spans = [(buf, 0) for buf, _ in p.spans]
        return {job.req_id: self._result(job, p, took) for job, p in plans}

    def _scatter_layer(self, plans: list[tuple[LoadJob, _Plan]], gi: int, name: str) -> None:
        """Layer ``name`` (of group ``gi``) of every planned job into the cache: jobs whose
        blocks lie back to back in staging (all of them, when every block loaded) go as one
        copy per sub-tensor."""
        g = self.groups[gi]
        run: torch.Tensor | None = None  # the staged rows gathered so far, and their blocks
        ids: list[int] = []
        for job, p in plans:
            buf, k = p.spans[gi]
            if not k or buf is None:  # nothing loaded, or read straight into the cache
                continue
            if run is not None and buf.data_ptr() == run.data_ptr() + run.shape[0] * run.stride(0):
                run = run.as_strided((run.shape[0] + k, run.shape[1]), run.stride())  # widened over buf[:k]
                ids += job.groups[gi].block_ids[:k]
                continue
            if run is not None:
                self._scatter(g, name, run, ids)
            run, ids = buf[:k], list(job.groups[gi].block_ids[:k])
        if run is not None:
            self._scatter(g, name, run, ids)

    def _plan(self, job: LoadJob, fetched: list | None) -> _Plan:
        """What of one job's fetched ``(staging buffer, per-block results)`` per group to
        scatter. A paged group loads a prefix: from its first unloadable block on, nothing
        of the request counts as loaded (with one group vLLM recomputes from there; with
        several, the whole request is reported failed)."""
        n = max((len(gb.positions) for gb in job.groups), default=0)
        reason = job.error or ("" if n else "no blocks")
        ok_upto = 0 if reason else n  # loaded blocks of the single-group case, in load order
        failed_groups: dict[int, int] = {}
        n_corrupt = 0
        if not reason:
            for (g, gb), (_, res) in zip(zip(self.groups, job.groups), fetched):
                m = len(gb.positions)
                n_corrupt += sum(isinstance(r, ChecksumMismatch) for r in res)
                for i, r in enumerate(res):
                    if not isinstance(r, int):
                        failed_groups[g.group_id] = m - i
                        ok_upto = min(ok_upto, i)
                        reason = reason or (f"missing (block {gb.positions[i]})" if r is None
                                            else f"{type(r).__name__}: {r}")
                        break
        take = not reason or (not self.multi_group and ok_upto)
        spans = [(buf, (len(gb.positions) if not reason else ok_upto) if take else 0)
                 for gb, (buf, _) in zip(job.groups, fetched or [(None, ())] * len(job.groups))]
        return _Plan(n, reason, ok_upto, failed_groups, spans, n_corrupt)

    def _result(self, job: LoadJob, plan: _Plan, seconds: float) -> _LoadResult:
        """The outcome of one job whose plan was carried out (logged when blocks failed)."""
        n, reason, ok_upto = plan.n, plan.reason, plan.ok_upto
        per_group = {g.group_id: k * g.layout.nbytes for g, (_, k) in zip(self.groups, plan.spans) if k}
        failed: set[int] = set()
        n_failed = 0
        if reason:
            if not self.multi_group:  # the shared null block is no request's: never reported
                failed.update(b for b in job.groups[0].block_ids[ok_upto:] if b != NULL_BLOCK)
                n_failed = n - ok_upto
            else:
                n_failed = n
                ok_upto = 0
            level = logging.ERROR if self.s.policy == "fail" else logging.WARNING
            fg = plan.failed_groups
            log.log(level, "kvpool: request %s: %d of %d blocks could not be loaded (first failure: %s%s)%s; "
                    "policy=%s", job.req_id, n_failed, n, reason, f" in cache group {min(fg)}" if fg else "",
                    f" from hand-off {job.handoff_id}" if job.handoff_id else "", self.s.policy)
        return _LoadResult(job.req_id, failed, n_failed, n - n_failed, sum(per_group.values()), seconds,
                           per_group, plan.n_corrupt)

    def _scatter(self, g: GroupLayout, name: str, buf: torch.Tensor, block_ids: list[int]) -> None:
        """Copy layer ``name``'s pages of staged blocks into the engine's cache blocks
        ``block_ids``. Host caches are written with one numpy indexed assignment per
        sub-tensor (plain copies, no OpenMP team: a torch op on the loader thread would
        start its own team beside the engine's pinned, spinning one); device caches and
        kernel-block views go through ``index_copy_``."""
        if not block_ids:
            return
        for view, lo, hi, shape, dtype in block_parts(self.caches, self.layer_pos, name):
            src = buf[:, lo:hi].view(TORCH_DTYPES[dtype]).view(len(block_ids), *shape)
            dst = host_bytes(view)
            if dst is not None:
                dst[block_ids] = src.view(torch.uint8).numpy().reshape(len(block_ids), *dst.shape[1:])
                continue
            dev = view.device
            idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
            view.index_copy_(0, idx, src.to(dev, non_blocking=False))
            if dev.type == "cuda":  # landed before the layer (or request) is reported loaded
                torch.cuda.current_stream(dev).synchronize()  # the loader's stream, for layer-wise loads

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished loads, failed loads) completed since the last call. In a step that
        schedules no tokens it first waits up to IDLE_WAIT_S seconds for a load to end: the
        engine would otherwise spin through empty steps, holding the GIL the loader needs."""
        if self.layered is not None:
            self._end_layered()
        if self.pending and self.meta is not None and self.meta.idle:
            wait(list(self.pending.values()), timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        done, failed = set(), set()
        for req_id, fut in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[req_id]
            try:
                r = fut.result()[req_id]
            except Exception as e:  # noqa: BLE001 - a bug in the load must not hang the request
                log.exception("kvpool: load of request %s crashed: %s", req_id, e)
                r = _LoadResult(req_id, set(), 1, 0, 0, 0.0)
                failed.add(req_id)
            done.add(req_id)
            if r.n_failed:
                if self.multi_group or not r.failed_blocks:
                    failed.add(req_id)
                else:
                    self.invalid |= r.failed_blocks
            self._count(r)
        return done, failed

    def _end_layered(self, report: bool = True) -> None:
        """End this step's layer-wise loads before vLLM reads the step's output: wait for
        the loader (until the step's deadline; past it the step is cancelled) and, with
        ``report``, report the blocks that did not load as load errors (vLLM recomputes
        them). Layer-wise loads are only planned for single-group models, whose block ids
        are unambiguous. Without ``report`` (a step that ended without its output), the
        ids are dropped: by the next step they may name other requests' blocks."""
        ll, fut, jobs = self.layered
        self.layered = None
        try:
            results = fut.result(timeout=max(0.0, ll.deadline - monotonic()))
        except Exception as e:  # noqa: BLE001 - deadline or a bug: the blocks are failed, never half-used
            ll.cancel()
            log.error("kvpool: layer-wise load of %d request(s) did not finish (%s: %s); their blocks are "
                      "reported failed", len(jobs), type(e).__name__, e)
            results = {job.req_id: self._failed(job, "not finished") for job in jobs}
        with self.tally.lock:
            self.tally.stats.observe("layer_wait_s", ll.waited_s)
        for r in results.values():
            if report:
                self.invalid |= r.failed_blocks
            self._count(r)

    def _count(self, r: _LoadResult) -> None:
        with self.tally.lock:
            self.tally.report.loads[r.req_id] = r.n_failed
            self.tally.stats.add("loads")
            self.tally.stats.observe("load_s", r.seconds)
            self.tally.stats.add("blocks_loaded", r.n_ok)
            self.tally.stats.add("blocks_load_failed", r.n_failed)
            self.tally.stats.add("bytes_loaded", r.nbytes)
            self.tally.stats.add("blocks_corrupt", r.n_corrupt)
            for gid, nb in r.group_bytes.items():
                self.tally.stats.add_group(gid, "bytes_loaded", nb)

    def take_invalid(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out
