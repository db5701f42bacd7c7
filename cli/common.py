"""Shared CLI pieces: reusable options, finding the cluster, typed errors → one-line
messages and exit codes (tracebacks only with KVPOOL_DEBUG=1)."""
from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer
from rich.console import Console
from rich.markup import escape

from kvpool.cli.cluster import RUN_DIR_PREFIX, probe_run_dir
from kvpool.protocol import errors as E
from kvpool.protocol.config import ClusterConfig, load_config

# a pipe or a file (no terminal, no $COLUMNS) would squeeze tables to 80 columns and cut addresses
console = Console() if sys.stdout.isatty() or os.environ.get("COLUMNS") else Console(width=200)
err_console = Console(stderr=True)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="Cluster YAML (default: configs/local.yaml, shipped with kvpool)")]
MasterOpt = Annotated[Optional[str], typer.Option("--master", help="Master RPC address tcp://host:port")]
EtcdOpt = Annotated[Optional[str], typer.Option("--etcd", help="etcd endpoint http://host:port (several: "
                                                                "comma-separated)")]
ClusterOpt = Annotated[Optional[str], typer.Option("--cluster", help="Cluster name (etcd prefix)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts")]
LogLevelOpt = Annotated[Optional[str], typer.Option("--log-level", help="debug, info, warning or error (config: "
                                                                        "log_level)")]

EXIT_CODES: dict[type, int] = {E.NotFound: 3, E.ConfigError: 2, E.InvalidRequest: 2, E.InvalidKey: 2,
                               E.Timeout: 4, E.EtcdUnavailable: 4, E.NotLeader: 4, E.NoSpace: 5, E.HasLease: 6,
                               E.Pinned: 6, E.AuthFailed: 7, E.Overloaded: 8}


def state_file(cluster: str) -> Path:
    """Where `kvpool up` records the running local cluster's addresses."""
    return Path(tempfile.gettempdir()) / f"kvpool-{os.getuid()}" / f"{cluster}.json"


def _load_record(f: Path) -> dict | None:
    """The JSON object in record ``f``; None when it is missing, unreadable or not an object."""
    try:
        info = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _recorded(f: Path) -> dict | None:
    """The record in ``f`` if the `kvpool up` that wrote it still runs, else None. Its run
    directory's owner lock decides when there is one (held: up, even if its pid is not
    visible from here; free: gone, even if its pid was reused); else its pid does."""
    import psutil

    info = _load_record(f)
    try:
        pid = int(info["pid"])
    except (KeyError, TypeError, ValueError, OverflowError):  # None (no record) is a TypeError
        return None
    d = _own_run_dir(f, info)
    state, fd = probe_run_dir(d) if d is not None else ("none", None)
    if fd is not None:
        os.close(fd)
    if state != "none":
        return info if state == "held" else None
    try:
        return info if psutil.pid_exists(pid) else None
    except (OverflowError, ValueError):
        return None


def claim_record(cluster: str) -> Path:
    """Claim the local record of ``cluster`` for this `kvpool up` before it starts anything.
    Raises ConfigError while another live `kvpool up` holds it; a record whose `kvpool up`
    is gone (killed) is replaced, and the run directory it names removed."""
    f = state_file(cluster)
    f.parent.mkdir(parents=True, exist_ok=True)
    mine = json.dumps({"pid": os.getpid()})
    for _ in range(2):
        try:
            with open(f, "x") as fh:
                fh.write(mine)
            return f
        except FileExistsError:
            info = _recorded(f)
            if info is None and _fresh(f):  # just created by another `kvpool up`, not written yet
                break
            if info is not None or not _remove_run_dir(f):
                pid = info["pid"] if info is not None else "unknown"
                raise E.ConfigError(f"cluster {cluster!r} is already up here (kvpool up, pid {pid}); stop it "
                                    f"first (Ctrl-C there, or kill -TERM {pid}), or start this one with "
                                    "another --cluster name", key="cluster") from None
            f.unlink(missing_ok=True)
    raise E.ConfigError(f"cannot claim {f}; another `kvpool up --cluster {cluster}` is starting", key="cluster")


def _own_run_dir(f: Path, info: dict) -> Path | None:
    """The run directory named in record ``f`` (parsed: ``info``) when it can be one of this
    user's LocalCluster run directories: ``<tmp>/kvpool-cluster-*``, a real directory, and
    both it and the record owned by this uid; else None."""
    try:
        d = Path(info["run_dir"])
        if not (d.parent == Path(tempfile.gettempdir()) and d.name.startswith(RUN_DIR_PREFIX)):
            return None
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or os.lstat(f).st_uid != os.getuid():
            return None
        return d
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_run_dir(f: Path) -> bool:
    """Delete the run directory (etcd data, logs) that the dead `kvpool up` of record ``f``
    left: only a LocalCluster run directory of this user (:func:`_own_run_dir`), taken with
    its owner lock (or, for one without a lock file, whose recorded pid is gone). False
    when the lock is held after all: its owner lives, keep the record."""
    import shutil

    info = _load_record(f)
    d = None if info is None else _own_run_dir(f, info)
    if d is None:
        return True
    state, fd = probe_run_dir(d, take=True)
    if state == "held":
        return False
    try:
        shutil.rmtree(d, ignore_errors=True)  # "none": a run dir from before the lock; the pid was checked
    finally:
        if fd is not None:
            os.close(fd)
    return True


def _fresh(f: Path, seconds: float = 5.0) -> bool:
    import time

    try:
        return time.time() - f.stat().st_mtime < seconds and not f.read_text().strip()
    except OSError:
        return False


def write_record(f: Path, info: dict) -> None:
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    os.replace(tmp, f)


def release_record(f: Path) -> None:
    """Remove ``f`` if this process wrote it (never another `kvpool up`'s record)."""
    if (_load_record(f) or {}).get("pid") == os.getpid():
        try:
            f.unlink()
        except OSError:
            pass


def build_config(config: Path | None, cluster: str | None = None, etcd: str | None = None) -> ClusterConfig:
    over: dict = {}
    if cluster:
        over["cluster"] = cluster
    if etcd:
        over["etcd"] = {"endpoint": etcd}
    return load_config(config, over)


def process_config(config: Path | None, cluster: str | None, etcd: str | None, log_level: str | None,
                   over: dict, logs: bool = True) -> ClusterConfig:
    """The config tree of one process (master, store node, proxy): defaults < ``config``
    (default configs/local.yaml) < environment < flags (``cluster``, ``etcd``,
    ``log_level`` and the section overrides ``over``; None flags are left out). With
    ``logs``, logging is set up at the tree's ``log_level``. Raises ConfigError."""
    from kvpool.protocol.logs import setup_logging

    tree = dict(over)
    if cluster:
        tree["cluster"] = cluster
    if etcd:
        tree["etcd"] = {**tree.get("etcd", {}), "endpoint": etcd}
    if log_level is not None:
        tree["log_level"] = log_level.lower()
    cfg = load_config(config, tree)
    if logs:
        setup_logging(cfg.log_level)
    return cfg


def connect(config: Path | None, master: str | None, etcd: str | None, cluster: str | None):
    """A KVPoolClient for a running cluster: --master, else --etcd/config, else the local
    cluster recorded by `kvpool up`."""
    from kvpool.connector.client import KVPoolClient

    cfg = build_config(config, cluster, etcd)
    if not master and not cfg.etcd.endpoint:
        f = state_file(cfg.cluster)
        info = _recorded(f) if f.exists() else None
        if info is None or "master" not in info:
            gone = " (the `kvpool up` that recorded it is gone)" if f.exists() else ""
            raise E.ConfigError(f"no running cluster {cfg.cluster!r} found{gone}: start one with `kvpool up`, or "
                                "pass --master tcp://host:port or --etcd http://host:port", key="master")
        # follow the leader through etcd (survives a master failover); the recorded master
        # address is the fallback
        from kvpool.protocol.auth import Security

        sec = cfg.security
        if info.get("secret_file") and not _secret_given(sec):  # the secret `kvpool up` made for its cluster
            sec = msgspec.structs.replace(sec, secret_file=info["secret_file"])
        kw = {k: v for k, v in cfg.client.client_kwargs().items() if k in ("transport", "host_id", "rpc_timeout_s")}
        return KVPoolClient(None if info.get("etcd") else info["master"], etcd=info.get("etcd"),
                            cluster=cfg.cluster, security=Security.from_config(sec), **kw)
    return KVPoolClient.from_config(cfg, master)


def _secret_given(sec) -> bool:
    """A secret or credential was named for this command (config ``security.secret_file``,
    ``KVPOOL_SECRET_FILE`` or ``KVPOOL_SECRET``): it, not the local cluster's recorded
    secret, is what the command proves."""
    from kvpool.protocol.auth import SECRET_ENV, SECRET_FILE_ENV

    return bool(sec.secret_file or os.environ.get(SECRET_FILE_ENV) or os.environ.get(SECRET_ENV))


def recorded_secret_file(cluster: str | None) -> str | None:
    """The secret file the running `kvpool up` of ``cluster`` recorded, if any."""
    f = state_file(cluster or "default")
    info = _recorded(f) if f.exists() else None
    return (info or {}).get("secret_file") or None


def local_metrics(config: Path | None, master: str | None, etcd: str | None, cluster: str | None) -> dict[str, str]:
    """The metrics base URLs (process name -> ``http://host:port``) that the running `kvpool
    up` of the cluster recorded; empty when the command addresses a cluster by --master or
    etcd, or the record has none."""
    cfg = build_config(config, cluster, etcd)
    if master or cfg.etcd.endpoint:
        return {}
    f = state_file(cfg.cluster)
    urls = ((_recorded(f) if f.exists() else None) or {}).get("metrics")
    return {str(k): str(v) for k, v in urls.items()} if isinstance(urls, dict) else {}


def fail(e: Exception) -> None:
    if os.environ.get("KVPOOL_DEBUG"):
        raise e
    code = next((c for cls, c in EXIT_CODES.items() if isinstance(e, cls)), 1)
    err_console.print(f"[bold red]error[/]: {escape(str(e))}", soft_wrap=True, highlight=False)
    sys.exit(code)
