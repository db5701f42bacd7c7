"""The one typed configuration tree.

Precedence: defaults < YAML file (``configs/local.yaml`` is the embedded default)
< environment ``KVPOOL_<SECTION>__<KEY>`` < explicit overrides (CLI flags). Objects
are passed into constructors; nothing reads global settings.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import yaml

from protocol.errors import ConfigError
from protocol.units import parse_duration, parse_size

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "local.yaml"


class EtcdConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """etcd endpoint; ``endpoint=None`` means: start an embedded etcd child process."""

    endpoint: str | None = None
    data_dir: str | None = None


class MasterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    rpc_port: int = 0
    metrics_port: int | None = None
    replicas: int = 1
    lease_ttl: str = "5s"
    put_timeout: str = "30s"
    quarantine: str = "5s"
    node_ttl: str = "3s"
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    handoff_ttl: str = "60s"
    membership_poll: str = "250ms"


class StoreNodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str | None = None
    memory: str = "1GiB"
    host: str = "127.0.0.1"
    data_port: int = 0
    host_id: str | None = None
    device: str = "cpu"


class ClientConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transport: str = "auto"
    rpc_timeout: str = "10s"
    io_timeout: str = "30s"
    host_id: str | None = None


class ClusterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cluster: str = "default"
    etcd: EtcdConfig = EtcdConfig()
    master: MasterConfig = MasterConfig()
    storenodes: list[StoreNodeConfig] = msgspec.field(default_factory=lambda: [StoreNodeConfig(), StoreNodeConfig()])
    client: ClientConfig = ClientConfig()

    def validate(self) -> "ClusterConfig":
        """Check values; raise ConfigError naming the key and accepted values."""
        m = self.master
        for key in ("lease_ttl", "put_timeout", "quarantine", "node_ttl", "handoff_ttl", "membership_poll"):
            parse_duration(getattr(m, key), key=f"master.{key}")
        if not 0 < m.low_watermark <= m.high_watermark <= 1:
            raise ConfigError(
                "master.low_watermark/high_watermark: need 0 < low <= high <= 1, got "
                f"{m.low_watermark}/{m.high_watermark}", key="master.high_watermark")
        if m.replicas < 1:
            raise ConfigError(f"master.replicas: must be >= 1, got {m.replicas}", key="master.replicas")
        for i, n in enumerate(self.storenodes):
            parse_size(n.memory, key=f"storenodes[{i}].memory")
            if not (n.device == "cpu" or n.device.startswith("cuda")):
                raise ConfigError(f"storenodes[{i}].device: {n.device!r}; accepted: cpu, cuda:N",
                                  key=f"storenodes[{i}].device")
        if self.client.transport not in ("auto", "tcp", "shm"):
            raise ConfigError(f"client.transport: {self.client.transport!r}; accepted: auto, tcp, shm",
                              key="client.transport")
        return self


def _env_overrides(environ: dict[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, value in environ.items():
        if not name.startswith("KVPOOL_") or "__" not in name:
            continue
        section, key = name[len("KVPOOL_"):].lower().split("__", 1)
        out.setdefault(section, {})[key] = yaml.safe_load(value)
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> ClusterConfig:
    """Build a ClusterConfig from defaults, a YAML file, the environment and overrides.

    ``path=None`` uses ``configs/local.yaml``. Raises ConfigError for an unreadable file,
    unknown keys or values of the wrong type.
    """
    p = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found; pass --config with an existing YAML file",
                          key="config") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}", key="config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at top level", key="config")
    data = _merge(data, _env_overrides(dict(os.environ if environ is None else environ)))
    data = _merge(data, overrides or {})
    try:
        cfg = msgspec.convert(data, ClusterConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid config {p}: {e}", key="config") from None
    return cfg.validate()
