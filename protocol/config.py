"""The one typed configuration tree.

Precedence: defaults < YAML file (``configs/local.yaml``, installed as ``kvpool/configs``, is the default)
< environment ``KVPOOL_<SECTION>__<KEY>`` < explicit overrides (CLI flags). Objects
are passed into constructors; nothing reads global settings.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvpool.protocol.errors import ConfigError
from kvpool.protocol.messages import ClusterSettings
from kvpool.protocol.spin import SPIN_WAIT_MAX_S
from kvpool.protocol.units import parse_duration, parse_size

MIN_SEGMENT = 1 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")
DEVICE_RE = r"cpu|cuda(:\d+)?"  # a store node segment's device: cpu (shared memory) or cuda[:N]
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "local.yaml"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # bind addresses meaning "every interface": never advertised


class EtcdConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """etcd endpoint(s); ``endpoint=None`` means: start an embedded etcd child process.

    ``endpoint``: ``http://host:port``, several comma-separated (or a list), all members of
    one etcd cluster; processes fail over between them. The other keys apply to the embedded
    etcd only (an external etcd is configured by its operator):

    * ``data_dir``: its data directory (kept after stop); default: inside the cluster's run
      directory, removed at stop.
    * ``quota_backend``: its space quota (etcd ``--quota-backend-bytes``; the default is etcd's own).
      A full etcd refuses new pins and hand-offs (:class:`~protocol.errors.EtcdFull`).
    * ``auto_compaction_mode`` / ``auto_compaction_retention``: etcd's own history compaction.
      ``periodic``: retention is a duration; etcd compacts every retention period (every hour
      for longer ones) to the revision of one period before, so its history stays within
      about two periods of writes whatever the write rate. ``revision``: retention is a number of
      revisions, checked every 5 minutes. A retention of 0 turns it off.
    """

    endpoint: str | list[str] | None = None
    # credentials of an external etcd (protocol/etcd.py EtcdAuth): an etcd user (password
    # inline or the first line of password_file), and TLS: ca (PEM) verifies etcd's server
    # certificate and turns TLS on; cert/key: this process's client certificate
    username: str | None = None
    password: str | None = None
    password_file: str | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    data_dir: str | None = None
    quota_backend: str | int = "2GiB"
    auto_compaction_mode: str = "periodic"
    auto_compaction_retention: str | int = "5m"

    def endpoints(self) -> list[str]:
        """The configured endpoints, normalised (empty for an embedded etcd)."""
        from kvpool.protocol.etcd import parse_endpoints

        return [] if self.endpoint is None else parse_endpoints(self.endpoint, key="etcd.endpoint")

    def compaction_flags(self) -> list[str]:
        """The embedded etcd's ``--auto-compaction-*`` and ``--quota-backend-bytes`` flags."""
        if self.auto_compaction_mode == "revision":
            keep = str(self.auto_compaction_retention)
        else:  # periodic: a Go duration; "0" turns it off
            sec = parse_duration(self.auto_compaction_retention, key="etcd.auto_compaction_retention")
            keep = f"{round(sec * 1000)}ms" if sec > 0 else "0"
        return [f"--auto-compaction-mode={self.auto_compaction_mode}", f"--auto-compaction-retention={keep}",
                f"--quota-backend-bytes={parse_size(self.quota_backend, key='etcd.quota_backend')}"]


class MasterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"  # bind address of the RPC port (0.0.0.0: every interface)
    # the host others reach this master at, published as the etcd leader key (null: ``host``,
    # or for a wildcard ``host`` this machine's primary address; protocol/transport.py)
    advertise: str | None = None
    rpc_port: int = 0
    metrics_port: int | None = None
    replicas: int = 1
    lease_ttl: str | float = "5s"
    put_timeout: str | float = "30s"
    quarantine: str | float = "5s"
    node_ttl: str | float = "3s"
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    max_handoff_ttl: str | float = "24h"  # longest hold a hand-off publish may ask for
    membership_poll: str | float = "250ms"
    # the leader compacts etcd's history this often (0 = never) to its revision minus this many
    # revisions, for etcd clusters without auto-compaction
    etcd_compaction_interval: str | float = "60s"
    etcd_compaction_retention: int = 10000
    # re-replication of objects below their replica count (master/repair.py): at most this
    # many copies started per second on average, and this many in flight at once
    repair_rate: float = 50.0
    repair_in_flight: int = 8
    # objects (committed + being written) the master indexes at most; past it a put evicts
    # the least recently used object, or fails with NoSpace when none can be evicted; 0: no bound
    max_objects: int = 10_000_000
    # asking a joining store node for its extent table (master/joins.py): deadline of a first
    # attempt; after a failure wait join_backoff before the next; each further failure doubles
    # both, up to join_backoff_max
    join_timeout: str | float = "2s"
    join_backoff: str | float = "500ms"
    join_backoff_max: str | float = "30s"

    def join_settings(self, key_prefix: str = "master.") -> tuple[float, float, float]:
        """``(join_timeout, join_backoff, join_backoff_max)`` in seconds. Raises ConfigError
        unless each is a duration > 0 and ``join_backoff_max`` is at least the other two."""
        vals = []
        for key in ("join_timeout", "join_backoff", "join_backoff_max"):
            v = parse_duration(getattr(self, key), key=f"{key_prefix}{key}")
            if not v > 0:
                raise ConfigError(f"{key_prefix}{key}: {getattr(self, key)!r}; accepted: a duration > 0 "
                                  "(e.g. 2s, 500ms)", key=f"{key_prefix}{key}")
            vals.append(v)
        if vals[2] < max(vals[0], vals[1]):
            raise ConfigError(f"{key_prefix}join_backoff_max: {self.join_backoff_max!r} is shorter than "
                              f"{key_prefix}join_timeout or {key_prefix}join_backoff; accepted: at least both",
                              key=f"{key_prefix}join_backoff_max")
        return vals[0], vals[1], vals[2]

    def check_joins(self, key_prefix: str = "master.") -> None:
        """Raise ConfigError for bad join settings (see :meth:`join_settings`)."""
        self.join_settings(key_prefix)

    def check_repair(self, key_prefix: str = "master.") -> None:
        """Raise ConfigError unless ``repair_rate`` is a number of copies per second in
        (0, 1e6], ``repair_in_flight`` a count from 1 to 10000 and ``max_objects`` a count
        up to 2**40 (0: no bound)."""
        if not 0 < self.repair_rate <= 1e6:  # also refuses NaN
            raise ConfigError(f"{key_prefix}repair_rate: {self.repair_rate!r}; copies per second, accepted: "
                              "> 0 up to 1e6", key=f"{key_prefix}repair_rate")
        if not 1 <= self.repair_in_flight <= 10000:
            raise ConfigError(f"{key_prefix}repair_in_flight: {self.repair_in_flight!r}; accepted: 1 to 10000",
                              key=f"{key_prefix}repair_in_flight")
        if not 0 <= self.max_objects <= 1 << 40:
            raise ConfigError(f"{key_prefix}max_objects: {self.max_objects!r}; accepted: a count from 1 to 2**40, "
                              "or 0 for no bound", key=f"{key_prefix}max_objects")


class StoreNodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str | None = None
    memory: str | int = "1GiB"
    host: str = "127.0.0.1"  # bind address of the data, control and UCX ports (0.0.0.0: every interface)
    # the host published in the node's etcd descriptor (null: like master.advertise)
    advertise: str | None = None
    data_port: int = 0  # 0: any free port, for this and the next two
    control_port: int = 0  # the master's zmq control connection
    ucx_port: int = 0  # ucx:// data (with ucx: true)
    host_id: str | None = None
    device: str = "cpu"
    ucx: bool = False  # also serve the data plane on ucx:// (needs the [ucx] extra)
    metrics_port: int | None = None  # /metrics, /healthz, /readyz over HTTP (0: any free port; null: off)
    # threads serving data requests (1..1024); idle connections wait on one selector thread
    # and cost none (storenode/connpool.py)
    data_workers: int = 16
    # the disk tier under the memory segment (storenode/disk_tier.py; off while disk_dir is
    # null): a directory of its own (a local NVMe path in production; one node per
    # directory), the bytes of object files it may hold, and its watermarks (fractions of
    # disk_capacity: above the high one the master evicts disk objects, least recently used
    # first, down to the low one). Objects the memory watermark would evict are demoted
    # there instead, and a restarted node brings back what it holds.
    disk_dir: str | None = None
    disk_capacity: str | int = "10GiB"
    disk_high_watermark: float = 0.95
    disk_low_watermark: float = 0.90
    # threads serving disk reads on the tier's own sockets (a disk read never holds a
    # memory-read worker); demotions are written by one thread at most disk_write_rate
    # bytes per second on average (0: as fast as the disk takes them)
    disk_readers: int = 4
    disk_write_rate: str | int = 0
    disk_port: int = 0  # the disk tier's TCP read port (0: any free port)


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``kvpool proxy``: the prefill and decode vLLM server URLs, where it listens, and its
    deadlines (``health_interval`` between health-check rounds, ``timeout`` of one backend
    request including a whole stream, ``read_timeout`` for a client's request body);
    ``max_in_flight`` generate requests served at once. ``master`` (or the cluster's etcd)
    is used only to release hand-offs no decode server took. ``api_key_file``: the key
    clients must present on ``/v1/*`` (required when ``host`` is not loopback, unless
    ``allow_no_api_key``); ``backend_api_key_file``: the vLLM servers' key."""

    prefill: list[str] = msgspec.field(default_factory=list)
    decode: list[str] = msgspec.field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    health_interval: str | float = "2s"
    timeout: str | float = "300s"
    read_timeout: str | float = "30s"
    max_in_flight: int = 1024
    master: str | None = None
    api_key_file: str | None = None  # clients must send this key (else KVPOOL_PROXY_API_KEY)
    backend_api_key_file: str | None = None  # sent to the vLLM servers (else KVPOOL_BACKEND_API_KEY)
    # bound beyond loopback, the proxy needs an API key unless this is true (it then warns)
    allow_no_api_key: bool = False


class ClientConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transport: str = "auto"
    rpc_timeout: str | float = "10s"
    io_timeout: str | float = "30s"
    host_id: str | None = None
    streams_per_node: int = 1  # network connections one batch uses per store node (1..16)
    # a network read of a replica waits at most this long on its node while another replica is
    # left to read (null: io_timeout), and reads the next one as well after hedge_after without a
    # first byte (null: no hedging); connector/hedge.py
    replica_timeout: str | float | None = "1s"
    hedge_after: str | float | None = "100ms"
    # a put's write of one replica waits at most this long on its node (null: io_timeout); then
    # the put is placed again without that node
    write_timeout: str | float | None = "2s"
    # extents reserved ahead of need, so a put is one copy and one round trip to the master
    # (connector/reserved_puts.py): bytes held at most across object sizes (0: off), and the
    # largest object put that way
    reserve: str | int = "64MiB"
    reserve_max_object: str | int = "64MiB"
    # a wait for a reply from the master or a store node polls its socket this long, yielding
    # the CPU, before it sleeps (protocol/spin.py): no wake-up for a quick reply; 0 = sleep at once
    spin_wait: str | float = "100us"

    def client_kwargs(self) -> dict:
        """These settings as :class:`~connector.client.KVPoolClient` keyword arguments
        (durations in seconds, sizes in bytes, parsed here once); ``None`` where unset."""
        def secs(name):
            v = getattr(self, name)
            return None if v is None else parse_duration(v, key=f"client.{name}")
        return dict(transport=self.transport, host_id=self.host_id, rpc_timeout_s=secs("rpc_timeout"),
                    io_timeout_s=secs("io_timeout"), streams_per_node=self.streams_per_node,
                    replica_timeout_s=secs("replica_timeout"), hedge_after_s=secs("hedge_after"),
                    write_timeout_s=secs("write_timeout"),
                    reserve_bytes=parse_size(self.reserve, key="client.reserve"),
                    reserve_max_object_bytes=parse_size(self.reserve_max_object, key="client.reserve_max_object"),
                    spin_wait_s=secs("spin_wait"))


CLIENT_DEFAULTS = ClientConfig().client_kwargs()  # the one place client defaults are stated


class SecurityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Peer authentication and TLS (:mod:`protocol.auth`).

    * ``secret_file``: file holding the cluster secret (>= 16 bytes); every socket then
      refuses peers that do not prove it. Unset: ``KVPOOL_SECRET_FILE`` or ``KVPOOL_SECRET``
      from the environment; none at all: open sockets (``kvpool up`` makes its own secret).
    * ``tls_cert`` / ``tls_key``: PEM certificate chain and key the TCP servers present.
    * ``tls_ca``: PEM CA that clients verify servers against (and servers verify client
      certificates against, with ``tls_client_certs``).
    * ``max_conns``: connections one server (master RPC, a store node's data server) holds
      at once; more are refused with :class:`~protocol.errors.Overloaded`.
    * ``frame_timeout``: the master closes a client that leaves a request frame half-sent
      this long with no whole frame meanwhile; a store node's data server closes a
      connection whose blocking ``recv`` or ``send`` waits this long.
    * ``insecure``: let a master or store node start without a secret (every socket open
      to anyone who reaches it); without it, such a start is refused.
    """

    secret_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_client_certs: bool = False
    max_conns: int = 1024
    frame_timeout: str | float = "30s"
    insecure: bool = False


class ClusterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cluster: str = "default"
    log_level: str = "info"  # of every process: debug, info, warning, error (protocol/logs.py)
    etcd: EtcdConfig = EtcdConfig()
    master: MasterConfig = MasterConfig()
    storenodes: list[StoreNodeConfig] = msgspec.field(default_factory=lambda: [StoreNodeConfig(), StoreNodeConfig()])
    client: ClientConfig = ClientConfig()
    proxy: ProxyConfig = ProxyConfig()
    security: SecurityConfig = SecurityConfig()

    def storenode(self, name: str | None) -> StoreNodeConfig:
        """The ``storenodes`` entry of a ``kvpool storenode`` process: the one named ``name``
        (a name not listed: the defaults under that name); without a name, the only entry.
        Raises ConfigError when several are listed and no name picks one."""
        if name is not None:
            return next((n for n in self.storenodes if n.name == name), StoreNodeConfig(name=name))
        if len(self.storenodes) > 1:
            raise ConfigError(f"the config lists {len(self.storenodes)} store nodes "
                              f"({', '.join(str(n.name) for n in self.storenodes)}); pick one with --name",
                              key="storenodes")
        return self.storenodes[0] if self.storenodes else StoreNodeConfig()

    def validate(self) -> "ClusterConfig":
        """Check values; raise ConfigError naming the key and accepted values."""
        m = self.master
        for key in ("lease_ttl", "put_timeout", "quarantine", "node_ttl", "max_handoff_ttl", "membership_poll",
                    "etcd_compaction_interval"):
            parse_duration(getattr(m, key), key=f"master.{key}")
        m.check_joins()
        if not 0 < m.low_watermark <= m.high_watermark <= 1:
            raise ConfigError(
                "master.low_watermark/high_watermark: need 0 < low <= high <= 1, got "
                f"{m.low_watermark}/{m.high_watermark}", key="master.high_watermark")
        try:  # the bounds the cluster settings in etcd obey (what the first leader records)
            ClusterSettings(m.replicas, parse_duration(m.lease_ttl), parse_duration(m.put_timeout),
                            parse_duration(m.quarantine), m.high_watermark, m.low_watermark,
                            parse_duration(m.max_handoff_ttl)).check()
        except ConfigError as e:
            raise ConfigError(f"master.{e}", key=f"master.{e.fields.get('key', '')}") from None
        self._validate_etcd()
        if m.etcd_compaction_retention < 0:
            raise ConfigError(f"master.etcd_compaction_retention: {m.etcd_compaction_retention}; a number of "
                              "revisions >= 0", key="master.etcd_compaction_retention")
        m.check_repair()
        for key in ("rpc_timeout", "io_timeout", "replica_timeout", "hedge_after", "write_timeout"):
            if getattr(self.client, key) is None and key in ("replica_timeout", "hedge_after", "write_timeout"):
                continue  # off
            if parse_duration(getattr(self.client, key), key=f"client.{key}") <= 0:
                raise ConfigError(f"client.{key}: must be > 0", key=f"client.{key}")
        if not 0 <= parse_duration(self.client.spin_wait, key="client.spin_wait") <= SPIN_WAIT_MAX_S:
            raise ConfigError(f"client.spin_wait: {self.client.spin_wait!r}; accepted: 0 (off) to 10ms, e.g. 100us",
                              key="client.spin_wait")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: {self.log_level!r}; accepted: {', '.join(LOG_LEVELS)}", key="log_level")
        ports = [("master.metrics_port", m.metrics_port), ("master.rpc_port", m.rpc_port),
                 ("proxy.port", self.proxy.port)]
        ports += [(f"storenodes[{i}].{k}", getattr(n, k)) for i, n in enumerate(self.storenodes)
                  for k in ("metrics_port", "data_port", "control_port", "ucx_port", "disk_port")]
        for key, port in ports:
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{key}: {port}; accepted: 0 (any free port) to 65535", key=key)
        hosts = [("master.advertise", m.advertise)] + [(f"storenodes[{i}].advertise", n.advertise)
                                                        for i, n in enumerate(self.storenodes)]
        for key, host in hosts:
            if host is not None:
                check_advertise(host, key)
        self._validate_proxy()
        names = [n.name for n in self.storenodes if n.name]
        if len(names) != len(set(names)):
            raise ConfigError(f"storenodes: names must be unique, got {names}", key="storenodes")
        for i, n in enumerate(self.storenodes):
            if parse_size(n.memory, key=f"storenodes[{i}].memory") < MIN_SEGMENT:
                raise ConfigError(f"storenodes[{i}].memory: at least 1MiB, got {n.memory!r}",
                                  key=f"storenodes[{i}].memory")
            if n.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", n.name):
                raise ConfigError(f"storenodes[{i}].name: {n.name!r}; use letters, digits, '_', '.', '-'",
                                  key=f"storenodes[{i}].name")
            if not 1 <= n.data_workers <= 1024:
                raise ConfigError(f"storenodes[{i}].data_workers: {n.data_workers!r}; accepted: 1 to 1024",
                                  key=f"storenodes[{i}].data_workers")
            if not re.fullmatch(DEVICE_RE, n.device):
                raise ConfigError(f"storenodes[{i}].device: {n.device!r}; accepted: cpu, cuda:N",
                                  key=f"storenodes[{i}].device")
            check_disk(n, f"storenodes[{i}].")
        if parse_duration(self.security.frame_timeout, key="security.frame_timeout") <= 0:
            raise ConfigError("security.frame_timeout: must be > 0", key="security.frame_timeout")
        if not 1 <= self.security.max_conns <= 1 << 20:
            raise ConfigError(f"security.max_conns: {self.security.max_conns}; accepted: 1 to 1048576",
                              key="security.max_conns")
        if not 1 <= self.client.streams_per_node <= 16:
            raise ConfigError(f"client.streams_per_node: {self.client.streams_per_node}; accepted: 1 to 16",
                              key="client.streams_per_node")
        if self.client.transport not in ("auto", "tcp", "unix", "shm", "ucx"):
            raise ConfigError(f"client.transport: {self.client.transport!r}; accepted: auto, tcp, unix, shm, ucx",
                              key="client.transport")
        return self

    def _validate_proxy(self) -> None:
        p = self.proxy
        for key in ("health_interval", "timeout", "read_timeout"):
            if not 0 < parse_duration(getattr(p, key), key=f"proxy.{key}") < float("inf"):
                raise ConfigError(f"proxy.{key}: must be > 0", key=f"proxy.{key}")
        if p.max_in_flight < 1:
            raise ConfigError(f"proxy.max_in_flight: {p.max_in_flight}; at least 1", key="proxy.max_in_flight")

    def _validate_etcd(self) -> None:
        e = self.etcd
        e.endpoints()  # each URL checked: ConfigError naming it
        if (e.username is None) != (e.password is None and e.password_file is None):
            raise ConfigError("etcd.username needs etcd.password or etcd.password_file, and they need a username",
                              key="etcd.username")
        if e.password is not None and e.password_file is not None:
            raise ConfigError("etcd.password and etcd.password_file: give one", key="etcd.password")
        if (e.cert is None) != (e.key is None):
            raise ConfigError("etcd.cert and etcd.key go together (a client certificate and its key)", key="etcd.cert")
        if e.cert is not None and e.ca is None:
            raise ConfigError("etcd.cert needs etcd.ca (TLS is on when etcd.ca is set)", key="etcd.ca")
        if parse_size(e.quota_backend, key="etcd.quota_backend") < MIN_SEGMENT:
            raise ConfigError(f"etcd.quota_backend: at least 1MiB, got {e.quota_backend!r}", key="etcd.quota_backend")
        if e.auto_compaction_mode not in ("periodic", "revision"):
            raise ConfigError(f"etcd.auto_compaction_mode: {e.auto_compaction_mode!r}; accepted: periodic, revision",
                              key="etcd.auto_compaction_mode")
        r = e.auto_compaction_retention
        if e.auto_compaction_mode == "revision" and not (isinstance(r, int) and r >= 0):
            raise ConfigError(f"etcd.auto_compaction_retention: {r!r}; with mode revision, a number of revisions "
                              ">= 0 (0 = off)", key="etcd.auto_compaction_retention")
        e.compaction_flags()  # periodic: a duration (ConfigError naming the key)


def check_disk(n: StoreNodeConfig, prefix: str = "storenodes[].") -> None:
    """Raise ConfigError naming the key for bad disk-tier settings of store node ``n``:
    ``disk_dir`` an empty string, ``disk_capacity`` under 1MiB, watermarks outside
    ``0 < low <= high <= 1``, ``disk_readers`` outside 1..64, a negative ``disk_write_rate``."""
    if n.disk_dir is not None and not str(n.disk_dir).strip():
        raise ConfigError(f"{prefix}disk_dir: empty; give a directory, or null for no disk tier",
                          key=f"{prefix}disk_dir")
    if parse_size(n.disk_capacity, key=f"{prefix}disk_capacity") < MIN_SEGMENT:
        raise ConfigError(f"{prefix}disk_capacity: at least 1MiB, got {n.disk_capacity!r}",
                          key=f"{prefix}disk_capacity")
    if not 0 < n.disk_low_watermark <= n.disk_high_watermark <= 1:  # also refuses NaN
        raise ConfigError(f"{prefix}disk_low_watermark/disk_high_watermark: need 0 < low <= high <= 1, got "
                          f"{n.disk_low_watermark}/{n.disk_high_watermark}", key=f"{prefix}disk_high_watermark")
    if not 1 <= n.disk_readers <= 64:
        raise ConfigError(f"{prefix}disk_readers: {n.disk_readers!r}; accepted: 1 to 64", key=f"{prefix}disk_readers")
    if parse_size(n.disk_write_rate, key=f"{prefix}disk_write_rate") < 0:
        raise ConfigError(f"{prefix}disk_write_rate: {n.disk_write_rate!r}; bytes per second, 0 for no bound",
                          key=f"{prefix}disk_write_rate")


def check_advertise(host: str, key: str) -> str:
    """``host`` as an advertised address (a host name or an IP, no scheme or port); raises
    ConfigError naming ``key`` for an empty value, a wildcard address or a URL."""
    h = host.strip().strip("[]")
    if not h or h in WILDCARD_HOSTS:
        raise ConfigError(f"{key}: {host!r} cannot be advertised; give the address other hosts reach this "
                          "process at, e.g. 10.0.0.5 or node1.example.com", key=key)
    if "/" in h or (":" in h and not re.fullmatch(r"[0-9A-Fa-f:.]+", h)) or not re.fullmatch(r"[\w.:-]+", h):
        raise ConfigError(f"{key}: {host!r}; accepted: a host name or an IP address, without scheme or port",
                          key=key)
    return h


def _env_overrides(environ: dict[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``KVPOOL_SECTION__KEY=value`` → ({section: {key: value}}, {"section.key": variable name})."""
    out: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    for name, value in environ.items():
        if not name.startswith("KVPOOL_") or "__" not in name:
            continue
        section, key = name[len("KVPOOL_"):].lower().split("__", 1)
        try:
            out.setdefault(section, {})[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{name}={value!r} is not a valid value (YAML scalar expected)", key=name) from None
        names[f"{section}.{key}"] = name
    return out, names


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
    if path is None and not p.exists():
        p = Path("<built-in defaults>")  # installed without the repo's configs/: same values
    try:
        if p.name == "<built-in defaults>":
            raise FileNotFoundError
        data = yaml.safe_load(p.read_text()) or {}
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as e:
        raise ConfigError(f"config file {p} cannot be read ({type(e).__name__}); pass a UTF-8 YAML file",
                          key="config") from None
    except FileNotFoundError:
        if path is not None:
            raise ConfigError(f"config file {p} not found; pass --config with an existing YAML file",
                              key="config") from None
        data = {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}", key="config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at top level", key="config")
    env, env_names = _env_overrides(dict(os.environ if environ is None else environ))
    data = _merge(_merge(data, env), overrides or {})
    try:
        cfg = msgspec.convert(data, ClusterConfig)
    except msgspec.ValidationError as e:
        m = re.search(r"\$\.(\w+)\.(\w+)", str(e))
        where = env_names.get(f"{m.group(1)}.{m.group(2)}") if m else None
        raise ConfigError(f"invalid config: {e} (set by {where})" if where else f"invalid config {p}: {e}",
                          key=where or "config") from None
    try:
        return cfg.validate()
    except ConfigError as e:
        where = env_names.get(str(e.fields.get("key", "")))
        if where:
            raise ConfigError(f"{e} (set by {where})", key=where) from None
        raise
