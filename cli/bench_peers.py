"""The peers ``kvpool bench`` runs beside kvpool, on loopback: a redis-server, and a Mooncake
Store cluster (``mooncake-transfer-engine-non-cuda`` from PyPI, the ``bench`` extra).

The Mooncake cluster mirrors kvpool's: a metadata server, ``mooncake_master`` and as many
store processes as kvpool has store nodes, each holding as much memory as its kvpool
counterpart; the bench's workers are Mooncake clients that store nothing themselves
(global segment 0). Every listener binds 127.0.0.1: the metadata server is Mooncake's own
(``python -m mooncake.http_metadata_server --host 127.0.0.1``) rather than the master's
built-in one (``--enable_http_metadata_server``), which binds every interface whatever
``--http_metadata_server_host`` says in 0.3.13.post1. Clients read it only while they set
up and on their first transfer to a segment, never per put or get.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpool.cli.bench_worker import Proc, stop_all

READY_TIMEOUT_S = 30.0


class PeerUnavailable(RuntimeError):
    """A peer could not be started here; the message says why and what to install."""


def _wait_port(port: int, proc: subprocess.Popen, what: str, deadline: float) -> None:
    while True:
        if proc.poll() is not None:  # first: an exited process is not the one a connect would reach
            raise PeerUnavailable(f"{what} exited (code {proc.returncode}) before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                if proc.poll() is None:
                    return
                continue  # it exited meanwhile: another process holds the port
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise PeerUnavailable(f"{what} did not listen on port {port} within {READY_TIMEOUT_S:g} s")
        time.sleep(0.05)


def _end(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class RedisServer:
    """A throwaway redis-server on a free loopback port: no persistence, ``maxmemory``
    bytes (the kvpool cluster's capacity)."""

    def __init__(self, maxmemory: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise PeerUnavailable("redis-server is not installed (apt-get install redis-server; "
                                  "`.ci/setup --test` does)")
        from kvpool.cli.cluster import free_port

        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.dir, "--maxmemory", str(maxmemory),
                                      "--proto-max-bulk-len", str(max(512 << 20, 2 * maxmemory))],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise PeerUnavailable("redis-server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        _end(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def mooncake_master_binary() -> str:
    """The ``mooncake_master`` executable: the one inside the installed ``mooncake``
    package, else the console script next to this Python or on PATH. Raises
    PeerUnavailable naming the extra to install."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.origin:
        p = Path(spec.origin).parent / "mooncake_master"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    for p in (Path(sys.executable).parent / "mooncake_master", shutil.which("mooncake_master")):
        if p and Path(p).is_file():
            return str(p)
    raise PeerUnavailable("Mooncake Store is not installed: pip install 'kvpool[bench]' "
                          "(mooncake-transfer-engine-non-cuda; it needs Debian's libibverbs1)")


class MooncakeCluster:
    """Metadata server, master and one store process per entry of ``segments`` (bytes each),
    all on free loopback ports; ``log_dir`` receives their logs. :attr:`metadata_url` and
    :attr:`master_addr` are what a client's ``setup`` needs. Raises PeerUnavailable
    (with the failing part's log tail) when any part does not come up."""

    def __init__(self, segments: list[int], log_dir: str, local_buffer: int = 16 << 20) -> None:
        from kvpool.cli.cluster import free_port

        self.procs: list[subprocess.Popen] = []
        self.stores: list[Proc] = []
        self.log_dir = log_dir
        try:
            master = mooncake_master_binary()
            ports: set[int] = set()
            while len(ports) < 3:  # three distinct ports (a port just released may be handed out again)
                ports.add(free_port())
            meta_port, rpc_port, metrics_port = sorted(ports)
            deadline = time.monotonic() + READY_TIMEOUT_S
            meta = self._start([sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
                                "--port", str(meta_port), "--log-level", "WARNING"], "metadata")
            mst = self._start([master, f"--rpc_port={rpc_port}", "--rpc_address=127.0.0.1",
                               "--enable_metric_reporting=false", "--metrics_host=127.0.0.1",
                               f"--metrics_port={metrics_port}"], "master")
            _wait_port(meta_port, meta, "Mooncake's metadata server", deadline)
            _wait_port(rpc_port, mst, "mooncake_master", deadline)
            self.metadata_url = f"http://127.0.0.1:{meta_port}/metadata"
            self.master_addr = f"127.0.0.1:{rpc_port}"
            self.stores = [Proc(log_dir=log_dir, name="mooncake-store") for _ in segments]
            for p, seg in zip(self.stores, segments):
                p.send({"cmd": "mooncake_store", "metadata_url": self.metadata_url, "master_addr": self.master_addr,
                        "segment": int(seg), "local_buffer": local_buffer})
            for p in self.stores:
                try:
                    p.recv(max(1.0, deadline + READY_TIMEOUT_S - time.monotonic()))
                except RuntimeError as e:
                    hint = " (Debian: apt-get install libibverbs1)" if "libibverbs" in str(e) else ""
                    raise PeerUnavailable(f"a Mooncake store process failed: {e}{hint}") from None
        except BaseException:
            self.close()
            raise

    def _start(self, argv: list[str], name: str) -> subprocess.Popen:
        with open(os.path.join(self.log_dir, f"mooncake-{name}.log"), "wb") as log:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def close(self) -> None:
        stop_all(self.stores)
        for p in reversed(self.procs):
            _end(p)
