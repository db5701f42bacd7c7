"""connector.vllm.plan against hand-made patterns and against vLLM's own hybrid KV cache
coordinator (``find_longest_cache_hit``) as an oracle.

The oracle builds real vLLM spec objects and a real coordinator, then swaps its block
pool for a duck-typed one whose ``get_cached_block`` answers from a test-controlled set
of stored (group, position) pairs, exactly like ``BlockPool.get_cached_block`` (a list
with one block per asked group when every group has the hash, else None). A second
oracle pass fills a *real* ``BlockPool``'s hash map instead, to show the duck-typed pool
changes nothing.
"""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvpool.connector.vllm.plan import (
    NULL_BLOCK,
    PAGED,
    STATE,
    WINDOWED,
    GroupRule,
    find_hit,
    needed,
    window_blocks,
)

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="the oracle is vLLM's own coordinator (pip install '.[vllm]')")

import torch  # noqa: E402
from vllm.v1.core.block_pool import BlockHashToBlockMap  # noqa: E402 (installed by .ci/setup --test)
from vllm.v1.core.kv_cache_coordinator import (  # noqa: E402
    HybridKVCacheCoordinator,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock, make_block_hash_with_group_id  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

B = 16  # block size of every group (== scheduler and hash block size)

FULL = GroupRule("full_attention")
MLA = GroupRule("mla")
MAMBA = GroupRule("mamba")


def swa(wb: int) -> GroupRule:
    return GroupRule("sliding_window", window_blocks=wb)


def present(*positions, below_start: int = 0, calls: list[int] | None = None) -> Callable[[int], bool]:
    """A ``have`` callable over a fixed set; records every probed position in ``calls``
    and fails the test if a position below ``below_start`` is asked for."""
    stored = set()
    for p in positions:
        stored.update(p if isinstance(p, (range, set, frozenset)) else [p])

    def has(i: int) -> bool:
        assert i >= below_start, f"asked for position {i} below start {below_start}"
        if calls is not None:
            calls.append(i)
        return i in stored

    return has


# --------------------------------------------------------------------------- unit tests


def test_group_rule_validation():
    with pytest.raises(ValueError):
        GroupRule("cross_attention")
    with pytest.raises(ValueError):
        GroupRule("sliding_window")
    with pytest.raises(ValueError):
        GroupRule("sliding_window", window_blocks=0)
    assert MAMBA.is_state and not FULL.is_state and not swa(2).is_state and not MLA.is_state
    assert FULL.kind in PAGED and MLA.kind in PAGED and swa(1).kind == WINDOWED and MAMBA.kind == STATE
    assert NULL_BLOCK == 0


def test_window_blocks_values():
    assert window_blocks(40, 16) == 3  # 39 tokens before the boundary span 3 blocks
    assert window_blocks(16, 16) == 1
    assert window_blocks(17, 16) == 1
    assert window_blocks(18, 16) == 2
    assert window_blocks(33, 16) == 2
    assert window_blocks(49, 16) == 3
    assert window_blocks(50, 16) == 4
    assert window_blocks(4096, 16) == 256
    assert window_blocks(2, 16) == 1
    assert window_blocks(1, 16) == 1  # never 0


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_window_blocks_matches_vllm_contiguous_blocks(block_size):
    # vLLM returns 0 for a 1-token window, but its right-to-left scan increments the run
    # before comparing, so one cached block is still required: the effective need is >= 1.
    for w in range(1, 300):
        theirs = SlidingWindowManager._contiguous_blocks_for_hit(w, block_size, False)
        assert window_blocks(w, block_size) == max(1, theirs), (w, block_size)


def test_needed_full_attention_and_mla():
    for rule in (FULL, MLA):
        assert needed(rule, 0, 5) == [0, 1, 2, 3, 4]
        assert needed(rule, 2, 5) == [2, 3, 4]
        assert needed(rule, 5, 5) == []
        assert needed(rule, 6, 5) == []
        assert needed(rule, 0, 0) == []


def test_needed_sliding_window():
    r = swa(3)
    assert needed(r, 0, 10) == [7, 8, 9]
    assert needed(r, 8, 10) == [8, 9]  # below start is already held locally
    assert needed(r, 0, 2) == [0, 1]  # prefix shorter than the window
    assert needed(r, 0, 3) == [0, 1, 2]
    assert needed(r, 10, 10) == []


def test_needed_mamba_state():
    assert needed(MAMBA, 0, 7) == [6]
    assert needed(MAMBA, 3, 7) == [6]
    assert needed(MAMBA, 6, 7) == [6]
    assert needed(MAMBA, 7, 7) == []
    assert needed(MAMBA, 0, 1) == [0]


def test_find_hit_full_attention_contiguous_run():
    assert find_hit([FULL], [present(range(6), 7, 8)], 0, 10) == 6
    assert find_hit([FULL], [present(range(20))], 0, 10) == 10  # capped
    assert find_hit([FULL], [present(range(20))], 0, 4) == 4
    assert find_hit([FULL], [present(range(1, 20))], 0, 10) == 0  # hole at 0
    assert find_hit([FULL], [present()], 0, 10) == 0
    assert find_hit([MLA], [present(range(3))], 0, 10) == 3


def test_find_hit_sliding_window():
    r = swa(3)
    # only the last 3 blocks before the boundary matter; holes further back do not
    assert find_hit([r], [present(7, 8, 9)], 0, 10) == 10
    assert find_hit([r], [present(0, 7, 8, 9)], 0, 10) == 10
    # a hole inside the window does
    pat = present(set(range(10)) - {8})
    assert find_hit([r], [pat], 0, 10) == 8  # b=10 needs 7,8,9; b=9 needs 6,7,8; b=8 needs 5,6,7
    # the window is found further left when the right end lacks it
    assert find_hit([r], [present(2, 3, 4, 8, 9)], 0, 10) == 5
    # capped
    assert find_hit([r], [present(range(20))], 0, 10) == 10
    assert find_hit([r], [present(7, 8, 9)], 0, 9) == 0  # b<=9 windows all miss something


def test_find_hit_sliding_window_short_prefix():
    r = swa(3)
    assert find_hit([r], [present(0, 1)], 0, 10) == 2  # shorter than the window: all of [0, b)
    assert find_hit([r], [present(0, 1, 5, 6)], 0, 10) == 2  # a 2-run elsewhere is not a window
    assert find_hit([r], [present(1, 2)], 0, 10) == 0  # [0, b) must be complete
    assert find_hit([r], [present(0)], 0, 10) == 1
    assert find_hit([r], [present(0, 1, 2)], 0, 2) == 2  # max_boundary below the window


def test_find_hit_mamba_state_slot():
    assert find_hit([MAMBA], [present(3, 9)], 0, 10) == 10  # slot 9 -> boundary 10
    assert find_hit([MAMBA], [present(3, 9)], 0, 9) == 4  # slot 9 is past the cap
    assert find_hit([MAMBA], [present(10)], 0, 10) == 0  # slot 10 is boundary 11
    assert find_hit([MAMBA], [present(0)], 0, 10) == 1
    # only the exact slot b - 1 counts, never neighbours
    calls: list[int] = []
    assert find_hit([MAMBA], [present(5, calls=calls)], 0, 10) == 6
    assert calls == [9, 8, 7, 6, 5]


def test_find_hit_hybrid_picks_largest_common_boundary():
    rules = [FULL, swa(3), MAMBA]
    # swa valid at b in {6, 10}; mamba valid at b in {6, 9}; the per-group maxima (10, 9)
    # have no common point above 6
    full = present(range(12))
    win = present(3, 4, 5, 7, 8, 9)
    state = present(5, 8)
    assert find_hit(rules, [full, win, state], 0, 11) == 6
    # full attention's run caps everything
    assert find_hit(rules, [present(range(5)), win, state], 0, 11) == 0
    assert find_hit(rules, [present(range(7)), present(range(10)), present(range(10))], 0, 11) == 7
    # all present: the cap wins
    allp = present(range(30))
    assert find_hit(rules, [allp, allp, allp], 0, 11) == 11
    assert find_hit(rules, [allp, allp, allp], 0, 0) == 0
    # a group with nothing stored blocks every boundary
    assert find_hit(rules, [allp, allp, present()], 0, 11) == 0


def test_find_hit_local_start_never_asks_below_start():
    rules = [FULL, swa(3), MAMBA]
    start = 4
    calls: list[list[int]] = [[], [], []]
    have = [present(range(start, 9), below_start=start, calls=calls[0]),
            present(range(start, 9), below_start=start, calls=calls[1]),
            present(5, 7, below_start=start, calls=calls[2])]
    assert find_hit(rules, have, start, 11) == 8  # full run to 9, mamba slot 7
    assert all(i >= start for c in calls for i in c)
    # window reaching below start: boundary 5 needs only position 4 of the window
    have = [present(range(start, 5), below_start=start), present(4, below_start=start),
            present(4, below_start=start)]
    assert find_hit(rules, have, start, 11) == 5
    # nothing beyond start: returns start without probing below it
    have = [present(below_start=start), present(below_start=start), present(below_start=start)]
    assert find_hit(rules, have, start, 11) == start
    # start at the cap: nothing to do
    assert find_hit(rules, have, 11, 11) == 11
    assert needed(FULL, start, 8) == [4, 5, 6, 7] and needed(swa(3), start, 5) == [4]


def _brute_force(rules, have, start, max_boundary):
    """Largest b in (start, max_boundary] by the module docstring's rules, no shortcuts."""
    def ok(rule, has, b):
        if rule.kind in PAGED:
            pos = range(start, b)
        elif rule.kind == WINDOWED:
            pos = range(max(start, b - rule.window_blocks), b)
        else:
            pos = [b - 1]
        return all(has(i) for i in pos)

    best = start
    for b in range(start + 1, max_boundary + 1):
        if all(ok(r, h, b) for r, h in zip(rules, have)):
            best = b
    return best


def test_find_hit_matches_brute_force_random():
    rng = random.Random(20240601)
    kinds = [FULL, MLA, swa(1), swa(2), swa(3), swa(5), MAMBA]
    for _ in range(2000):
        rules = [rng.choice(kinds) for _ in range(rng.randint(1, 4))]
        top = rng.randint(0, 24)
        start = rng.randint(0, top)
        have = []
        for _r in rules:
            p = rng.choice([0.3, 0.6, 0.9, 1.0])
            stored = {i for i in range(start, top + 3) if rng.random() < p}
            have.append(present(stored, below_start=start))
        assert find_hit(rules, have, start, top) == _brute_force(rules, have, start, top), (rules, start, top)


# --------------------------------------------------------------------------- vLLM oracle


def _full_spec(head_size: int = 8):
    return FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=head_size, dtype=torch.float16)


def _mla_spec():
    return MLAAttentionSpec(block_size=B, num_kv_heads=1, head_size=16, dtype=torch.float16)


def _swa_spec(window: int):
    return SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float16,
                             sliding_window=window)


def _mamba_spec():
    return MambaSpec(block_size=B, shapes=((2, 4),), dtypes=(torch.float16,), mamba_cache_mode="align")


LAYOUTS = {
    "full+swa40": lambda: [_full_spec(), _swa_spec(40)],
    "full+mamba": lambda: [_full_spec(), _mamba_spec()],
    "full+swa40+mamba": lambda: [_full_spec(), _swa_spec(40), _mamba_spec()],
    "swa40": lambda: [_swa_spec(40)],
    "mamba": lambda: [_mamba_spec()],
    "mla+swa100": lambda: [_mla_spec(), _swa_spec(100)],
    # two groups with the same spec are looked up jointly (one get_cached_block call)
    "full+swa40+swa40+mamba": lambda: [_full_spec(), _swa_spec(40), _swa_spec(40), _mamba_spec()],
    # windows at block edges (1, 16, 17 tokens: 1 block; 33: 2) and two full specs
    "full+full+swa17+swa33+mamba": lambda: [_full_spec(), _full_spec(16), _swa_spec(17), _swa_spec(33),
                                            _mamba_spec()],
    "full+swa1+swa16": lambda: [_full_spec(), _swa_spec(1), _swa_spec(16)],
}


def _rule_for(spec) -> GroupRule:
    if isinstance(spec, MambaSpec):
        return MAMBA
    if isinstance(spec, SlidingWindowSpec):
        return swa(window_blocks(spec.sliding_window, B))
    if isinstance(spec, MLAAttentionSpec):
        return MLA
    assert isinstance(spec, FullAttentionSpec) and spec.sliding_window is None
    return FULL


def _coordinator(specs):
    cfg = KVCacheConfig(
        num_blocks=512,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
    )
    coord = get_kv_cache_coordinator(
        cfg, max_model_len=4096, max_in_flight_tokens=2048, use_eagle=False, enable_caching=True,
        enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
        scheduler_block_size=B, hash_block_size=B)
    expected = UnitaryKVCacheCoordinator if len(specs) == 1 else HybridKVCacheCoordinator
    assert type(coord) is expected
    if isinstance(coord, HybridKVCacheCoordinator):
        # block-aligned hits only (no Mamba sub-block hits: mamba block == hash block)
        assert not coord.enable_partial_hash_hits and coord._cache_hit_alignment_tokens == B
    return coord


def _hash(pos: int) -> BlockHash:
    return BlockHash(b"kvpool-plan-test" + pos.to_bytes(8, "little"))


class FakePool:
    """Duck-typed BlockPool: what the managers' ``find_longest_cache_hit`` touches
    (``null_block``, ``hash_block_size``, ``get_cached_block``)."""

    def __init__(self, stored: list[set[int]]):
        self.hash_block_size = B
        self.null_block = KVCacheBlock(block_id=0)
        self.null_block.is_null = True
        self._pos = {}
        self.blocks: dict[tuple[int, int], KVCacheBlock] = {}
        next_id = 1
        for g, positions in enumerate(stored):
            for p in sorted(positions):
                self.blocks[(g, p)] = KVCacheBlock(block_id=next_id)
                next_id += 1
        self.stored = stored
        self.calls = 0

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        self.calls += 1
        pos = int.from_bytes(block_hash[-8:], "little")
        assert block_hash == _hash(pos)
        out = []
        for g in kv_cache_group_ids:
            blk = self.blocks.get((g, pos))
            if blk is None:
                return None
            out.append(blk)
        return out


def _install(coord, pool) -> None:
    coord.block_pool = pool
    for m in coord.single_type_managers:
        m.block_pool = pool


def _real_pool(coord, stored: list[set[int]]):
    """The coordinator's own BlockPool with its hash map filled for ``stored``."""
    pool = coord.single_type_managers[0].block_pool
    assert all(m.block_pool is pool for m in coord.single_type_managers)
    pool.cached_block_hash_to_block = BlockHashToBlockMap()
    ids = iter(range(1, pool.num_gpu_blocks))
    blocks = {}
    for g, positions in enumerate(stored):
        for p in sorted(positions):
            blk = pool.blocks[next(ids)]
            pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(_hash(p), g), blk)
            blocks[(g, p)] = blk
    return blocks


def _random_stored(rng: random.Random, num_groups: int, num_blocks: int) -> list[set[int]]:
    stored = []
    limit = num_blocks + 2  # a few past the prompt's full blocks: never to be used
    for _ in range(num_groups):
        p = rng.choice([0.15, 0.4, 0.7, 0.9, 1.0])
        s = {i for i in range(limit) if rng.random() < p}
        if rng.random() < 0.4:  # a stored prefix, as a previous request would leave
            s |= set(range(rng.randint(0, limit)))
        if rng.random() < 0.2:  # an evicted hole
            s.discard(rng.randrange(limit))
        stored.append(s)
    return stored


def _check_case(coord, rules, stored, num_tokens, start=0, real=False):
    """Compare vLLM's hit with find_hit; return the boundary."""
    num_full_blocks = num_tokens // B
    block_hashes = [_hash(i) for i in range(num_full_blocks)]
    if real:
        blocks = _real_pool(coord, stored)
        null = coord.block_pool.null_block
    else:
        pool = FakePool(stored)
        _install(coord, pool)
        blocks, null = pool.blocks, pool.null_block
    max_len = num_tokens - 1  # KVCacheManager.get_computed_blocks
    hit_blocks, hit_tokens, _uncached = coord.find_longest_cache_hit(block_hashes, max_len)

    max_boundary = (num_tokens - 1) // B
    have = [present(s, below_start=start) for s in stored]
    b = find_hit(rules, have, start=start, max_boundary=max_boundary)
    ctx = dict(rules=rules, stored=[sorted(s) for s in stored], num_tokens=num_tokens, start=start)
    assert hit_tokens % B == 0, ctx
    assert b * B == hit_tokens, {**ctx, "vllm_blocks": hit_tokens // B, "plan": b}

    # per group: vLLM's table is b long, and real blocks sit exactly at needed(rule, 0, b)
    assert len(hit_blocks) == len(rules)
    for g, (rule, blks) in enumerate(zip(rules, hit_blocks)):
        assert len(blks) == b, {**ctx, "group": g}
        real_pos = [i for i, blk in enumerate(blks) if blk is not null]
        assert all(blk.block_id != NULL_BLOCK for i, blk in enumerate(blks) if i in real_pos)
        assert all(blk.block_id == NULL_BLOCK for i, blk in enumerate(blks) if i not in real_pos)
        assert real_pos == needed(rule, 0, b), {**ctx, "group": g, "vllm_real_positions": real_pos}
        for i in real_pos:
            assert blks[i] is blocks[(g, i)], {**ctx, "group": g, "pos": i}
        if start:
            assert needed(rule, start, b) == [i for i in real_pos if i >= start]
    return b


@pytest.fixture(scope="module")
def coordinators():
    return {name: _coordinator(make()) for name, make in LAYOUTS.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_oracle_vllm_coordinator_random(layout, coordinators):
    coord = coordinators[layout]
    specs = [g.kv_cache_spec for g in coord.kv_cache_config.kv_cache_groups]
    rules = [_rule_for(s) for s in specs]
    rng = random.Random(f"plan-{layout}")
    hits = 0
    for _ in range(300):
        num_tokens = rng.randint(1, 20 * B + B - 1)
        stored = _random_stored(rng, len(rules), num_tokens // B)
        hits += _check_case(coord, rules, stored, num_tokens) > 0
    assert hits > 30, "the random patterns hardly ever hit: the test is not exercising anything"


@pytest.mark.parametrize("layout", ["full+swa40+mamba", "full+full+swa17+swa33+mamba", "swa40"])
def test_oracle_with_real_block_pool(layout, coordinators):
    """Same comparison with vLLM's real BlockPool hash map: the duck-typed pool is faithful."""
    coord = _coordinator(LAYOUTS[layout]())
    rules = [_rule_for(g.kv_cache_spec) for g in coord.kv_cache_config.kv_cache_groups]
    rng = random.Random(f"real-{layout}")
    for _ in range(60):
        num_tokens = rng.randint(1, 20 * B + B - 1)
        stored = _random_stored(rng, len(rules), num_tokens // B)
        b_real = _check_case(coord, rules, stored, num_tokens, real=True)
        b_fake = _check_case(coordinators[layout], rules, stored, num_tokens)
        assert b_real == b_fake


@pytest.mark.parametrize("layout", ["full+swa40", "full+mamba", "full+swa40+mamba", "swa40", "mamba",
                                    "full+full+swa17+swa33+mamba"])
def test_oracle_local_start(layout, coordinators):
    """With a local hit of ``start`` blocks (every group holds [0, start) locally), vLLM's
    hit over local ∪ external equals find_hit over the external store from ``start`` —
    which never asks for a position below ``start``."""
    coord = coordinators[layout]
    rules = [_rule_for(g.kv_cache_spec) for g in coord.kv_cache_config.kv_cache_groups]
    rng = random.Random(f"start-{layout}")
    for _ in range(200):
        num_tokens = rng.randint(1, 20 * B + B - 1)
        max_boundary = (num_tokens - 1) // B
        start = rng.randint(0, max_boundary)
        external = _random_stored(rng, len(rules), num_tokens // B)
        union = [s | set(range(start)) for s in external]
        # find_hit sees only positions >= start (present() asserts it), so the external
        # store's content below start is irrelevant; vLLM sees the union.
        assert _check_case(coord, rules, union, num_tokens, start=start) >= start


def test_oracle_hand_made_hybrid(coordinators):
    """The hybrid hand-made case of the unit tests, through vLLM (window 40 = 3 blocks)."""
    coord = coordinators["full+swa40+mamba"]
    rules = [FULL, swa(3), MAMBA]
    stored = [set(range(12)), {3, 4, 5, 7, 8, 9}, {5, 8}]  # needs two coordinator passes
    assert _check_case(coord, rules, stored, 11 * B + 1) == 6
    stored = [set(range(12)), set(range(12)), set(range(12))]
    assert _check_case(coord, rules, stored, 11 * B) == 10  # the last token is recomputed
    assert _check_case(coord, rules, stored, 11 * B + 1) == 11
    assert _check_case(coord, rules, stored, B) == 0
    assert _check_case(coord, rules, [set(), set(), set()], 11 * B) == 0


# ---------------------------------------------------------------------------- mixed block sizes

def _mixed_coordinator(attn_block: int, state_block: int):
    """vLLM's hybrid coordinator for full attention and a Mamba group (align mode) with
    blocks of different sizes: hashes at their gcd, hits aligned to their lcm."""
    import math

    specs = [FullAttentionSpec(block_size=attn_block, num_kv_heads=1, head_size=8, dtype=torch.float16),
             MambaSpec(block_size=state_block, shapes=((2, 4),), dtypes=(torch.float16,), mamba_cache_mode="align")]
    cfg = KVCacheConfig(num_blocks=512, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])
    coord = get_kv_cache_coordinator(
        cfg, max_model_len=4096, max_in_flight_tokens=2048, use_eagle=False, enable_caching=True,
        enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
        scheduler_block_size=math.lcm(attn_block, state_block), hash_block_size=math.gcd(attn_block, state_block))
    assert isinstance(coord, HybridKVCacheCoordinator)
    return coord


@pytest.mark.parametrize("attn_block,state_block", [(32, 16), (16, 32), (32, 48)])
def test_library_common_boundary_matches_vllm_with_mixed_block_sizes(attn_block, state_block):
    """``protocol.groups.common_prefix`` (the library's common boundary, vLLM's rule by
    default) against vLLM's own hybrid coordinator, with real spec objects and a real
    BlockPool, for groups of different block sizes: random stored attention blocks and
    state checkpoints, each keyed at its group's own block size; given the engine's
    alignment, the hit lengths agree. vLLM aligns a hybrid hit to the lcm of the block
    sizes (the library's default), or to the finer hash block when its fine-grained hits
    are on (a state block that is a multiple of a finer hash block)."""
    import math

    from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize

    from kvpool.protocol.groups import CacheGroupSpec, common_prefix, hit_alignment, project
    from kvpool.protocol.layout import LayoutSpec, TensorSpec

    coord = _mixed_coordinator(attn_block, state_block)
    unit = math.gcd(attn_block, state_block)
    # the engine's alignment: the lcm of the block sizes, or (vLLM's fine-grained hits, when
    # the state block is a multiple of a finer hash block) the hash block
    align = coord._cache_hit_alignment_tokens
    assert align == (unit if coord.enable_partial_hash_hits else math.lcm(attn_block, state_block))
    pool = coord.single_type_managers[0].block_pool
    proj = project([
        CacheGroupSpec(name="attn", layers=(0,), layout=LayoutSpec(
            kind="full_attention", tokens_per_block=attn_block, num_kv_heads=1, head_size=8,
            tensors=(TensorSpec("kv", (1, 2, 1, attn_block, 8), "float16"),))),
        CacheGroupSpec(name="ssm", layers=(1,), layout=LayoutSpec(
            kind="mamba", tokens_per_block=state_block, num_kv_heads=1, head_size=8,
            tensors=(TensorSpec("conv_state", (1, 3, 8), "float16"), TensorSpec("ssm_state", (1, 1, 8, 8), "float16"))))])
    if not coord.enable_partial_hash_hits:
        assert hit_alignment(proj) == align  # the library's default is vLLM's lcm rule
    rng = random.Random(f"mixed-{attn_block}-{state_block}")
    hits = 0
    for case in range(200):
        num_tokens = rng.randint(1, 12 * max(attn_block, state_block))
        hashes = [BlockHash(b"kvpool-mixed-%d-" % case + i.to_bytes(8, "little")) for i in range(num_tokens // unit)]
        per_group = [BlockHashListWithBlockSize(hashes, unit, attn_block), BlockHashListWithBlockSize(hashes, unit,
                                                                                                       state_block)]
        stored = {}
        pool.cached_block_hash_to_block = BlockHashToBlockMap()
        ids = iter(range(1, pool.num_gpu_blocks))
        for g, (name, group_hashes) in enumerate(zip(("attn", "ssm"), per_group)):
            p = rng.choice([0.3, 0.7, 1.0])
            have = [rng.random() < p for _ in range(len(group_hashes))]
            stored[name] = have
            for i, ok in enumerate(have):
                if ok:
                    pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(group_hashes[i], g),
                                                           pool.blocks[next(ids)])
        _, vllm_tokens, _ = coord.find_longest_cache_hit(hashes, num_tokens - 1)
        ours = common_prefix(proj, stored, max_tokens=num_tokens - 1, alignment=align).tokens
        assert ours == vllm_tokens, dict(case=case, num_tokens=num_tokens, stored=stored, vllm=vllm_tokens, ours=ours)
        hits += ours > 0
    assert hits > 20  # the cases exercise real hits, not only misses
