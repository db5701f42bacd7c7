"""Shared fixtures: real etcd + master + store nodes on free loopback ports.

``cluster`` is one module-scoped cluster (2 nodes × 256 MiB); ``make_cluster(**cfg)``
starts a fresh one per test with config overrides (``master_env={...}``: extra environment
of its master processes). Every cluster is checked at teardown:
all its processes gone and no kvpool shared memory left behind.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import psutil
import pytest

from kvpool.cli.cluster import LocalCluster
from kvpool.protocol.config import load_config

# processes the tests start by hand (not through LocalCluster) may run without a secret;
# tests/test_roles.py checks the refusal without this
os.environ.setdefault("KVPOOL_SECURITY__INSECURE", "true")


def wait_for(cond: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "condition"):
    """Poll ``cond`` until truthy (returned) or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state ``T`` or ``t``)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                    return False
        except FileNotFoundError:  # the thread exited
            pass
    return True


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and wait until all its threads have stopped. A stop is
    delivered to one thread, which then stops the others: until it has run (later on a
    busy machine), the process's other threads keep serving."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: stopped(pid), timeout_s, interval_s=0.005, what=f"process {pid} to stop")


def _shm_files() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if "kvpool" in f}
    except FileNotFoundError:
        return set()


def cluster_config(nodes: int = 2, memory: str = "256MiB", etcd: dict | None = None, **master):
    over = {"storenodes": [{"name": f"node-{i}", "memory": memory} for i in range(nodes)]}
    if master:
        over["master"] = master
    if etcd:
        over["etcd"] = etcd
    return load_config(None, over, environ={})


class _Started:
    def __init__(self) -> None:
        self.clusters: list[LocalCluster] = []
        self.shm_before = _shm_files()

    def start(self, nodes: int = 2, memory: str = "256MiB", etcd: dict | None = None,
              master_env: dict[str, str] | None = None, metrics: bool = False, **master) -> LocalCluster:
        lc = LocalCluster(cluster_config(nodes, memory, etcd, **master), master_env=master_env, metrics=metrics)
        self.clusters.append(lc)
        lc.__enter__()
        for c in [*lc.nodes.values(), *lc.masters]:
            assert c.alive(), f"{c.name} died at start:\n{c.tail()}"
        return lc

    def close(self) -> None:
        for lc in self.clusters:
            pids = lc.pids()
            lc.stop()
            for pid in pids:
                wait_for(lambda p=pid: not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie",
                         5, what=f"process {pid} to exit")
            assert not os.path.exists(lc.run_dir), "run dir left behind"
        assert _shm_files() <= self.shm_before, "kvpool shared memory left in /dev/shm"


@pytest.fixture(scope="module")
def cluster():
    s = _Started()
    lc = s.start()
    yield lc
    s.close()


@pytest.fixture
def make_cluster():
    s = _Started()
    yield s.start
    s.close()


@pytest.fixture
def client(cluster):
    c = cluster.client()
    yield c
    c.close()
