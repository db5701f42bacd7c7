"""Drive real vLLM engines in their own processes (see engine_proc.py) from tests.

Engines start in the background as soon as they are created, so several boot in
parallel; every call has a deadline and a dead engine fails the test with the tail of
its log instead of hanging.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREFIX = "KVPOOL_ENGINE "
MODEL_ID = "tiny-llama"
# Engines run below the cluster's priority: where several engines share the cores with the
# cluster, a starved master or store node would let its etcd lease lapse, as a dedicated
# control-plane host never does.
ENGINE_NICE = ["nice", "-n", "5"]


def kv_config(role: str, master: str, namespace: str, policy: str | None = None, **extra) -> dict:
    """A kv_transfer_config for the kvpool connector (``policy`` via vLLM's own field). The
    connector is named only: kvpool's ``vllm.general_plugins`` entry point registers it."""
    cfg = {"kv_connector": "KVPoolConnector", "kv_role": role,
           "kv_connector_extra_config": {"master": master, "namespace": namespace, "model_id": MODEL_ID,
                                         **extra}}
    if policy is not None:
        cfg["kv_load_failure_policy"] = policy
    return cfg


class Engine:
    """One vLLM engine process. ``generate`` returns the engine's JSON outputs."""

    def __init__(self, name: str, model: str, log_dir: str, kv_transfer_config: dict | None = None,
                 multiprocess: bool = False, log_stats: bool = False, startup_timeout_s: float = 240.0,
                 engine_kwargs: dict | None = None, env: dict[str, str | None] | None = None) -> None:
        """``env``: changes to the engine's environment (a None value removes the variable)."""
        self.name = name
        self.log_path = os.path.join(log_dir, f"engine-{name}.log")
        cfg = {"model": model, "kv_transfer_config": kv_transfer_config, "multiprocess": multiprocess,
               "log_stats": log_stats, "engine_kwargs": engine_kwargs or {}}
        changes = env or {}
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        for k, v in changes.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*ENGINE_NICE, sys.executable, str(Path(__file__).with_name("engine_proc.py")),
                                      json.dumps(cfg)],
                                     cwd=str(REPO), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._startup_timeout_s = startup_timeout_s
        self.startup_s: float | None = None

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._answers.put(json.loads(line[len(PREFIX):]))
        self._answers.put(None)

    def _recv(self, timeout_s: float) -> dict:
        try:
            ans = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"engine {self.name} did not answer within {timeout_s:g}s; log tail:\n"
                                 f"{self.tail()}") from None
        if ans is None:
            raise AssertionError(f"engine {self.name} exited (code {self.proc.poll()}); log tail:\n{self.tail()}")
        return ans

    def ready(self) -> "Engine":
        if self.startup_s is None:
            ans = self._recv(self._startup_timeout_s)
            assert ans.get("ready"), ans
            self.startup_s = ans["startup_s"]
        return self

    def call(self, cmd: dict, timeout_s: float = 120.0) -> dict:
        self.ready()
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        ans = self._recv(timeout_s)
        if "error" in ans:
            raise AssertionError(f"engine {self.name}: {ans['error']}\n{self.tail()}")
        return ans

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, params: list | None = None,
                 timeout_s: float = 120.0) -> list[dict]:
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "params": params},
                         timeout_s)["outputs"]

    def metrics(self) -> dict[str, float]:
        return self.call({"op": "metrics"})["metrics"]

    def log_text(self) -> str:
        self._log.flush()
        return Path(self.log_path).read_text(errors="replace")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def quit(self) -> None:
        """Ask the engine to exit (without waiting; ``close`` waits)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
            except OSError:
                pass

    def close(self, timeout_s: float = 30.0) -> None:
        self.quit()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        try:  # the engine and anything it started (vLLM's engine-core process)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        self._log.close()


def close_all(engines) -> None:
    """Stop engines in parallel (each takes seconds to shut down)."""
    for e in engines:
        e.quit()
    for e in engines:
        e.close()


def corrupt(client, key: str, offset: int = 128) -> None:
    """Flip 8 bytes of a stored object in the store node's memory, behind its checksum
    (the test process reaches the node's segment through same-host shared memory)."""
    info = client.lookup([key])[0]
    ref = info.replicas[0]
    seg = client.data.segmaps.segment(ref)
    assert seg is not None, "test needs same-host shared memory to reach the store node's segment"
    for i in range(8):
        seg[ref.offset + offset + i] ^= 0xFF
