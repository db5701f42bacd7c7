"""The one typed configuration tree.

Precedence: defaults < YAML file (``configs/local.yaml``, installed as ``kvpool/configs``, is the default)
< environment ``KVPOOL_<SECTION>__<KEY>`` < explicit overrides (CLI flags). Objects
are passed into constructors; nothing reads global settings.

Durations (``"250ms"``, ``"30s"``, or a number of seconds) and sizes (``"2GiB"``, or a
number of bytes) are parsed once, as each struct is built (``__post_init__``): from then on
a duration field holds seconds (float) and a size field bytes (int), whatever wrote it, and
a value that does not parse is a ConfigError naming its key. A field's declared default
stays the text a user would write (what ``--help`` shows).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml

from kvpool.protocol.errors import ConfigError
from kvpool.protocol.messages import ClusterSettings
from kvpool.protocol.spin import SPIN_WAIT_MAX_S
from kvpool.protocol.units import check_wait, parse_duration, parse_size


class _Described:
    """``D[T, "text"]``: field type ``T`` described by ``text`` (``Annotated[T,
    msgspec.Meta(description=text)]``), read by the generated CLI flags and JSON schema."""

    def __class_getitem__(cls, item: tuple[Any, str]) -> Any:
        tp, text = item
        return Annotated[tp, msgspec.Meta(description=text)]


D = _Described
MIN_SEGMENT = 1 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")
DEVICE_RE = r"cpu|cuda(:\d+)?"  # a store node segment's device: cpu (shared memory) or cuda[:N]
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "local.yaml"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # bind addresses meaning "every interface": never advertised


def _parse_units(obj: msgspec.Struct, prefix: str, durations: tuple[str, ...] = (), sizes: tuple[str, ...] = ()) -> None:
    """Parse ``obj``'s duration fields to seconds (float) and size fields to bytes (int) in
    place, once, as the struct is built (YAML, environment, flags or code alike), so every
    consumer reads numbers. Raises ConfigError naming ``prefix + field`` for a bad value."""
    for f in durations:
        v = getattr(obj, f)
        if v is not None:
            msgspec.structs.force_setattr(obj, f, parse_duration(v, key=prefix + f))
    for f in sizes:
        v = getattr(obj, f)
        if v is not None:
            msgspec.structs.force_setattr(obj, f, parse_size(v, key=prefix + f))


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

    def __post_init__(self) -> None:
        _parse_units(self, "etcd.", sizes=("quota_backend",))

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
                f"--quota-backend-bytes={self.quota_backend}"]


class MasterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``master`` section. Each field's description is also its ``kvpool master`` flag's
    help (cli/config_flags.py)."""

    host: D[str, "Bind address of the RPC port (0.0.0.0: every interface)"] = "127.0.0.1"
    advertise: D[str | None, "Address other hosts reach this master at, published as etcd's leader key (null: "
                             "host; for 0.0.0.0 the host's primary address)"] = None
    rpc_port: D[int, "RPC port (0: any free port; clients find it through etcd's leader key)"] = 0
    metrics_port: D[int | None, "Serve /metrics, /healthz, /readyz here (0: any free port; null: off)"] = None
    replicas: D[int, "Replicas per object unless a put asks otherwise"] = 1
    lease_ttl: D[str | float, "How long a reader's lease keeps an object from eviction"] = "5s"
    put_timeout: D[str | float, "A put not committed within this is revoked and its space freed"] = "30s"
    quarantine: D[str | float, "The range of a revoked write waits this long before it is placed again"] = "5s"
    node_ttl: D[str | float, "etcd lease TTL of the leadership and of store-node registrations"] = "3s"
    high_watermark: D[float, "Used fraction of memory above which eviction starts"] = 0.90
    low_watermark: D[float, "Used fraction eviction brings memory down to"] = 0.80
    max_handoff_ttl: D[str | float, "Longest hold a hand-off publish may ask for"] = "24h"
    membership_poll: D[str | float, "How often the master reads store-node membership from etcd"] = "250ms"
    etcd_compaction_interval: D[str | float, "How often the leader compacts etcd's history (0: never), for etcd "
                                             "clusters without auto-compaction"] = "60s"
    etcd_compaction_retention: D[int, "Revisions of history that compaction keeps"] = 10000
    repair_rate: D[float, "Re-replication copies started per second, on average (master/repair.py)"] = 50.0
    repair_in_flight: D[int, "Re-replication copies in flight at most"] = 8
    max_objects: D[int, "Objects (committed + being written) the master indexes at most; past it a put evicts "
                        "the least recently used one, or fails with NoSpace (0: no bound)"] = 10_000_000
    join_timeout: D[str | float, "Deadline of a first request for a joining store node's extent table "
                                 "(master/joins.py)"] = "2s"
    join_backoff: D[str | float, "Wait after a failed join request before the next (doubled per failure)"] = "500ms"
    join_backoff_max: D[str | float, "Cap of the doubled join deadline and wait"] = "30s"
    spin_wait: D[str | float, "How long the RPC loop keeps polling for the next request after serving one, "
                              "yielding the CPU, before it sleeps (protocol/spin.py): a client sending one "
                              "request per reply then finds it awake; 0 = sleep at once"] = "300us"

    def __post_init__(self) -> None:  # durations in seconds from here on
        _parse_units(self, "master.", durations=(
            "lease_ttl", "put_timeout", "quarantine", "node_ttl", "max_handoff_ttl", "membership_poll",
            "etcd_compaction_interval", "join_timeout", "join_backoff", "join_backoff_max", "spin_wait"))

    def join_settings(self, key_prefix: str = "master.") -> tuple[float, float, float]:
        """``(join_timeout, join_backoff, join_backoff_max)`` in seconds. Raises ConfigError
        unless each is a duration > 0 and ``join_backoff_max`` is at least the other two."""
        vals = []
        for key in ("join_timeout", "join_backoff", "join_backoff_max"):
            v = getattr(self, key)
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
    """One ``storenodes`` entry. Each field's description is also its ``kvpool storenode``
    flag's help (cli/config_flags.py). The disk tier (storenode/disk_tier.py) is off while
    ``disk_dir`` is null; objects the memory watermark would evict are demoted there, and a
    restarted node brings back what it holds."""

    name: D[str | None, "Node id; with --config, picks its storenodes entry (default: the only entry, else "
                        "random)"] = None
    memory: D[str | int, "Segment size, e.g. 2GiB"] = "1GiB"
    host: D[str, "Bind address of the data, control and UCX ports (0.0.0.0: every interface)"] = "127.0.0.1"
    advertise: D[str | None, "Address other hosts reach this node at, published in etcd (null: host; for "
                             "0.0.0.0 the host's primary address)"] = None
    data_port: D[int, "Data port (0: any free port)"] = 0
    control_port: D[int, "Port of the master's control connection (0: any free port)"] = 0
    ucx_port: D[int, "Port of ucx:// data, with ucx (0: any free port)"] = 0
    host_id: D[str | None, "Host identity (default: derived from the machine); same-host clients map memory"] = None
    device: D[str, "cpu (shared memory) or cuda:N (device memory, served through pinned staging)"] = "cpu"
    ucx: D[bool, "Also serve data on ucx:// (needs the ucx extra)"] = False
    metrics_port: D[int | None, "Serve /metrics, /healthz, /readyz here (0: any free port; null: off)"] = None
    data_workers: D[int, "Threads serving data requests (1..1024); idle connections cost none "
                         "(storenode/connpool.py)"] = 16
    disk_dir: D[str | None, "Directory of a disk tier under the memory segment (one node per directory; kept "
                            "across restarts)"] = None
    disk_capacity: D[str | int, "Bytes of objects the disk tier may hold, e.g. 100GiB"] = "10GiB"
    disk_high_watermark: D[float, "Used fraction of disk_capacity above which disk objects are evicted"] = 0.95
    disk_low_watermark: D[float, "Used fraction disk eviction brings the tier down to"] = 0.90
    disk_readers: D[int, "Threads serving disk reads on the tier's own sockets"] = 4
    disk_write_rate: D[str | int, "Bytes per second demotions are written at most, on average (0: unbounded)"] = 0
    disk_port: D[int, "Port of the disk tier's reads, with disk_dir (0: any free port)"] = 0

    def __post_init__(self) -> None:  # sizes in bytes from here on
        _parse_units(self, f"storenodes[{self.name or ''}].", sizes=("memory", "disk_capacity", "disk_write_rate"))


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``kvpool proxy``: the prefill and decode vLLM server URLs, where it listens, and its
    deadlines (``health_interval`` between health-check rounds, ``timeout`` of one backend
    request including a whole stream, ``read_timeout`` for a client's request body);
    ``max_in_flight`` generate requests served at once. ``master`` (or the cluster's etcd)
    is used only to release hand-offs no decode server took. ``api_key_file``: the key
    clients must present on ``/v1/*`` (required when ``host`` is not loopback, unless
    ``allow_no_api_key``); ``backend_api_key_file``: the vLLM servers' key."""

    prefill: D[list[str], "Prefill (kv_producer) vLLM server URLs"] = msgspec.field(default_factory=list)
    decode: D[list[str], "Decode (kv_consumer) vLLM server URLs"] = msgspec.field(default_factory=list)
    host: D[str, "Bind address"] = "127.0.0.1"
    port: D[int, "Port (0: any free port)"] = 8000
    health_interval: D[str | float, "Between health checks of every server"] = "2s"
    timeout: D[str | float, "Deadline of one backend request, a whole stream included"] = "300s"
    read_timeout: D[str | float, "Deadline for a client to send its request body"] = "30s"
    max_in_flight: D[int, "Generate requests served at once; more get 503"] = 1024
    master: D[str | None, "kvpool master tcp://host:port: release the hand-offs no decode server took"] = None
    api_key_file: D[str | None, "File with the API key clients must send (Authorization: Bearer); else "
                                "$KVPOOL_PROXY_API_KEY"] = None
    backend_api_key_file: D[str | None, "File with the vLLM servers' --api-key; else $KVPOOL_BACKEND_API_KEY"] = None
    allow_no_api_key: D[bool, "Serve a non-loopback host without an API key (warns loudly)"] = False

    def __post_init__(self) -> None:  # durations in seconds from here on
        _parse_units(self, "proxy.", durations=("health_interval", "timeout", "read_timeout"))


class ClientConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transport: str = "auto"
    # every wait below: more than 0 and at most 1 day (protocol/units.py check_wait)
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

    def __post_init__(self) -> None:  # durations in seconds, sizes in bytes from here on
        _parse_units(self, "client.", durations=("rpc_timeout", "io_timeout", "replica_timeout", "hedge_after",
                                                 "write_timeout", "spin_wait"),
                     sizes=("reserve", "reserve_max_object"))

    def client_kwargs(self) -> dict:
        """These settings as :class:`~connector.client.KVPoolClient` keyword arguments
        (durations in seconds, sizes in bytes); ``None`` where unset."""
        return dict(transport=self.transport, host_id=self.host_id, rpc_timeout_s=self.rpc_timeout,
                    io_timeout_s=self.io_timeout, streams_per_node=self.streams_per_node,
                    replica_timeout_s=self.replica_timeout, hedge_after_s=self.hedge_after,
                    write_timeout_s=self.write_timeout, reserve_bytes=self.reserve,
                    reserve_max_object_bytes=self.reserve_max_object, spin_wait_s=self.spin_wait)


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

    secret_file: D[str | None, "File holding the cluster secret (env KVPOOL_SECRET_FILE or KVPOOL_SECRET)"] = None
    tls_cert: D[str | None, "PEM certificate chain the TCP servers present"] = None
    tls_key: D[str | None, "PEM private key of tls_cert"] = None
    tls_ca: D[str | None, "PEM CA that verifies servers, and client certificates with tls_client_certs"] = None
    tls_client_certs: D[bool, "Require client certificates signed by tls_ca"] = False
    max_conns: D[int, "Connections one server holds at once; more are refused with Overloaded"] = 1024
    frame_timeout: D[str | float, "Longest wait for a half-sent request frame, or one blocking send"] = "30s"
    insecure: D[bool, "Start without a cluster secret: every port open to anyone who reaches it"] = False

    def __post_init__(self) -> None:  # seconds from here on
        _parse_units(self, "security.", durations=("frame_timeout",))


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
        for key, least, why in (("node_ttl", 1.0, "etcd grants no shorter lease than its own minimum"),
                                ("membership_poll", 0.01, "a shorter poll keeps a core busy reading etcd")):
            if getattr(m, key) < least:
                raise ConfigError(f"master.{key}: {getattr(m, key)!r}; accepted: a duration of at least {least:g}s "
                                  f"({why})", key=f"master.{key}")
        m.check_joins()
        if not 0 < m.low_watermark <= m.high_watermark <= 1:
            raise ConfigError(
                "master.low_watermark/high_watermark: need 0 < low <= high <= 1, got "
                f"{m.low_watermark}/{m.high_watermark}", key="master.high_watermark")
        try:  # the bounds the cluster settings in etcd obey (what the first leader records)
            ClusterSettings(m.replicas, m.lease_ttl, m.put_timeout, m.quarantine, m.high_watermark,
                            m.low_watermark, m.max_handoff_ttl).check()
        except ConfigError as e:
            raise ConfigError(f"master.{e}", key=f"master.{e.fields.get('key', '')}") from None
        self._validate_etcd()
        if m.etcd_compaction_retention < 0:
            raise ConfigError(f"master.etcd_compaction_retention: {m.etcd_compaction_retention}; a number of "
                              "revisions >= 0", key="master.etcd_compaction_retention")
        m.check_repair()
        for key in ("rpc_timeout", "io_timeout", "replica_timeout", "hedge_after", "write_timeout"):
            check_wait(getattr(self.client, key), key=f"client.{key}",
                       none=key in ("replica_timeout", "hedge_after", "write_timeout"))
        for key, v in (("client.spin_wait", self.client.spin_wait), ("master.spin_wait", m.spin_wait)):
            if not 0 <= v <= SPIN_WAIT_MAX_S:
                raise ConfigError(f"{key}: {v!r}; accepted: 0 (off) to 10ms, e.g. 100us", key=key)
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
            if n.memory < MIN_SEGMENT:
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
        if self.security.frame_timeout <= 0:
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
            if not 0 < getattr(p, key) < float("inf"):
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
        if e.quota_backend < MIN_SEGMENT:
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
    if n.disk_capacity < MIN_SEGMENT:
        raise ConfigError(f"{prefix}disk_capacity: at least 1MiB, got {n.disk_capacity!r}",
                          key=f"{prefix}disk_capacity")
    if not 0 < n.disk_low_watermark <= n.disk_high_watermark <= 1:  # also refuses NaN
        raise ConfigError(f"{prefix}disk_low_watermark/disk_high_watermark: need 0 < low <= high <= 1, got "
                          f"{n.disk_low_watermark}/{n.disk_high_watermark}", key=f"{prefix}disk_high_watermark")
    if not 1 <= n.disk_readers <= 64:
        raise ConfigError(f"{prefix}disk_readers: {n.disk_readers!r}; accepted: 1 to 64", key=f"{prefix}disk_readers")
    if n.disk_write_rate < 0:
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
    except ConfigError as e:  # a duration or size that does not parse (raised as the struct is built)
        where = env_names.get(str(e.fields.get("key", "")))
        if where:
            raise ConfigError(f"{e} (set by {where})", key=where) from None
        raise
    except msgspec.ValidationError as e:
        m = re.search(r"\$\.(\w+)\.(\w+)", str(e))
        where = env_names.get(f"{m.group(1)}.{m.group(2)}") if m else None
        over = (overrides or {}).get(m.group(1)) if m else None
        if where is None and isinstance(over, dict) and m.group(2) in over:
            where = f"--{m.group(2).replace('_', '-')}"  # a command-line flag (or a caller's override)
        raise ConfigError(f"invalid config: {e} (set by {where})" if where else f"invalid config {p}: {e}",
                          key=where or "config") from None
    try:
        return cfg.validate()
    except ConfigError as e:
        where = env_names.get(str(e.fields.get("key", "")))
        if where:
            raise ConfigError(f"{e} (set by {where})", key=where) from None
        raise
