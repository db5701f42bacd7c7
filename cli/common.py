"""Shared CLI pieces: reusable options, finding the cluster, typed errors → one-line
messages and exit codes (tracebacks only with KVPOOL_DEBUG=1)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from protocol import errors as E
from protocol.config import ClusterConfig, load_config
from protocol.units import parse_duration

console = Console()
err_console = Console(stderr=True)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="Cluster YAML (default configs/local.yaml)")]
MasterOpt = Annotated[Optional[str], typer.Option("--master", help="Master RPC address tcp://host:port")]
EtcdOpt = Annotated[Optional[str], typer.Option("--etcd", help="etcd endpoint http://host:port")]
ClusterOpt = Annotated[Optional[str], typer.Option("--cluster", help="Cluster name (etcd prefix)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts")]

EXIT_CODES: dict[type, int] = {E.NotFound: 3, E.ConfigError: 2, E.InvalidRequest: 2, E.InvalidKey: 2,
                               E.Timeout: 4, E.EtcdUnavailable: 4, E.NoSpace: 5, E.HasLease: 6, E.Pinned: 6}


def state_file(cluster: str) -> Path:
    """Where `kvpool up` records the running local cluster's addresses."""
    return Path(tempfile.gettempdir()) / f"kvpool-{os.getuid()}" / f"{cluster}.json"


def build_config(config: Path | None, cluster: str | None = None, etcd: str | None = None) -> ClusterConfig:
    over: dict = {}
    if cluster:
        over["cluster"] = cluster
    if etcd:
        over["etcd"] = {"endpoint": etcd}
    return load_config(config, over)


def connect(config: Path | None, master: str | None, etcd: str | None, cluster: str | None):
    """A KVPoolClient for a running cluster: --master, else --etcd/config, else the local
    cluster recorded by `kvpool up`."""
    from connector.client import KVPoolClient

    cfg = build_config(config, cluster, etcd)
    if not master and not cfg.etcd.endpoint:
        f = state_file(cfg.cluster)
        if not f.exists():
            raise E.ConfigError(f"no running cluster {cfg.cluster!r} found: start one with `kvpool up`, or pass "
                                "--master tcp://host:port or --etcd http://host:port", key="master")
        info = json.loads(f.read_text())
        # follow the leader through etcd (survives a master failover); the recorded master
        # address is the fallback
        return KVPoolClient(None if info.get("etcd") else info["master"], etcd=info.get("etcd"),
                            cluster=cfg.cluster, transport=cfg.client.transport, host_id=cfg.client.host_id,
                            rpc_timeout_s=parse_duration(cfg.client.rpc_timeout))
    return KVPoolClient.from_config(cfg, master)


def fail(e: Exception) -> None:
    if os.environ.get("KVPOOL_DEBUG"):
        raise e
    code = next((c for cls, c in EXIT_CODES.items() if isinstance(e, cls)), 1)
    err_console.print(f"[bold red]error[/]: {escape(str(e))}", soft_wrap=True, highlight=False)
    sys.exit(code)
