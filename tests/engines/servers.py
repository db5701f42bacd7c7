"""Real vLLM OpenAI servers and ``kvpool proxy`` processes, for tests and benchmarks.

Every child runs in its own session (so a signal reaches a vLLM server and its engine
core together) and logs to a file whose tail is shown when it fails; every wait has a
deadline. The servers run the tiny Llama of ``tiny_model.py`` under the served name
``MODEL`` with a chat template that renders the contents only (a chat request has the
same tokens as the completion of its text) and ``--enable-prompt-tokens-details`` (the
answers' ``usage.prompt_tokens_details.cached_tokens``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from kvpool.cli.cluster import free_port

from harness import ENGINE_NICE, REPO
from tiny_model import BLOCK_SIZE, MAX_MODEL_LEN, prompt_ids

MODEL = "tiny"  # --served-model-name of every server
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # content only: same tokens as the prompt
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")


class Proc:
    """A child process in its own session, logging to a file; ``url`` is where it serves."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, port: int) -> None:
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=str(REPO), env=ENV, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, n: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_healthy(self, deadline: float, ok=lambda status, doc: status == 200) -> None:
        """Poll GET /health until ``ok`` (or fail with the log tail at ``deadline``)."""
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited (code {self.proc.returncode}); log tail:\n{self.tail()}")
            try:
                st, _, body = http("GET", self.url + "/health", timeout=5)
                if ok(st, json_or_none(body)):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not healthy in time; log tail:\n{self.tail()}")
            time.sleep(0.25)

    def signal(self, sig: int) -> None:
        """Signal the whole process group (a vLLM server and its engine-core child)."""
        try:  # the group may outlive its leader (the engine core)
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL it (and its children) and reap it."""
        self.signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()


def stop_all(procs: Iterable[Proc], grace_s: float = 20.0) -> None:
    """SIGTERM every process at once, SIGKILL what is left after ``grace_s`` seconds."""
    procs = list(procs)
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        p.kill()


def json_or_none(body: bytes):
    try:
        return json.loads(body)
    except ValueError:
        return None


def http(method: str, url: str, body=None, headers: dict | None = None, timeout: float = 60.0):
    """(status, headers, body bytes); ``body`` a dict (sent as JSON) or raw bytes."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def prompt_text(seed: int, n: int) -> str:
    """``n`` pseudo-random words from ``seed``: ``n`` prompt tokens ("w<k>" is token id k + 4)."""
    return " ".join(f"w{t - 4}" for t in prompt_ids(seed, n))


def write_chat_template(directory: Path) -> Path:
    """Write ``CHAT_TEMPLATE`` into ``directory``; return its path."""
    path = Path(directory) / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


def start_vllm_server(name: str, model: str, log_dir: Path, chat_template: Path,
                      kv_transfer_config: dict | None = None, max_model_len: int = MAX_MODEL_LEN,
                      dtype: str = "float32", block_size: int | None = BLOCK_SIZE,
                      kv_cache_bytes: int = 64 << 20) -> Proc:
    """Start ``vllm.entrypoints.openai.api_server`` on a free port (``dtype``, eager,
    ``kv_cache_bytes`` of KV cache, sequences of up to ``max_model_len`` tokens, blocks of
    ``block_size`` tokens or, None, vLLM's choice); ``kv_transfer_config`` None: plain
    vLLM, no connector. It boots in the background: ``wait_healthy`` before sending it
    requests."""
    port = free_port()
    argv = [*ENGINE_NICE, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1",
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes), "--chat-template", str(chat_template),
            "--enable-prompt-tokens-details"]
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return Proc(name, argv, log_dir, port)


def start_proxy(name: str, args: list[str], log_dir: Path) -> Proc:
    """Start ``python -m cli proxy --port <free> *args`` (``args``: --prefill, --decode, ...)."""
    port = free_port()
    return Proc(name, [sys.executable, "-m", "kvpool.cli", "proxy", "--port", str(port), *args], log_dir, port)


def every_backend_healthy(status: int, doc) -> bool:
    """A ``wait_healthy`` check for a proxy: 200 and every server it fronts healthy."""
    return status == 200 and all(b["healthy"] for b in doc["prefill"] + doc["decode"])
