"""One master process's settings: :class:`MasterServerSettings`, built from the cluster's
config tree (:mod:`protocol.config`) and given to :class:`~master.server.MasterServer` and
its parts (:class:`~master.etcd_thread.EtcdThread`, :class:`~master.nodes.StoreNodes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.master.state import MasterSettings
from kvpool.protocol.auth import OPEN, Security
from kvpool.protocol.config import ClusterConfig, MasterConfig, SecurityConfig
from kvpool.protocol.errors import ConfigError
from kvpool.protocol.etcd import NO_AUTH, EtcdAuth

_JOIN = MasterConfig().join_settings()  # (timeout, backoff, backoff max) in seconds


@dataclass(frozen=True)
class MasterServerSettings:
    """One master process's settings (seconds where ``_s``); defaults: those of
    :class:`~protocol.config.MasterConfig` (build it with :meth:`from_config`)."""

    etcd: str
    cluster: str = ClusterConfig().cluster
    host: str = MasterConfig().host
    rpc_port: int = MasterConfig().rpc_port
    metrics_port: int | None = MasterConfig().metrics_port
    membership_poll_s: float = MasterConfig().membership_poll
    node_ttl_s: float = MasterConfig().node_ttl
    state: MasterSettings = field(default_factory=MasterSettings)
    # while leading, compact etcd's history every this many seconds (0 = never) to the current
    # revision minus ``etcd_compaction_retention`` revisions
    etcd_compaction_interval_s: float = MasterConfig().etcd_compaction_interval
    etcd_compaction_retention: int = MasterConfig().etcd_compaction_retention
    # asking a joining store node for its extent table: deadline of a first attempt, and the
    # wait before the next after a failure, each doubled per further failure up to
    # join_backoff_max_s (seconds; defaults: MasterConfig's join_* keys)
    join_timeout_s: float = _JOIN[0]
    join_backoff_s: float = _JOIN[1]
    join_backoff_max_s: float = _JOIN[2]
    # the cluster secret and TLS (protocol/auth.py), and the client connections served at once
    security: Security = OPEN
    max_conns: int = SecurityConfig().max_conns
    frame_timeout_s: float = SecurityConfig().frame_timeout
    advertise: str | None = MasterConfig().advertise  # published host (protocol/transport.py advertise_host)
    etcd_auth: EtcdAuth = NO_AUTH  # etcd user/password and TLS
    # after serving a request, the RPC loop polls for the next one this long before it
    # sleeps (protocol/spin.py; 0 = off)
    spin_wait_s: float = MasterConfig().spin_wait

    @classmethod
    def from_config(cls, cfg: ClusterConfig) -> "MasterServerSettings":
        """The settings of one master of ``cfg`` (a tree :func:`~protocol.config.load_config`
        validated), whose ``etcd.endpoint`` must be set: a master never starts etcd. Raises
        ConfigError."""
        m, eps = cfg.master, cfg.etcd.endpoints()
        if not eps:
            raise ConfigError("no etcd endpoint: pass --etcd http://host:port or set etcd.endpoint in the --config "
                              "file (a master does not start etcd; `kvpool up` does)", key="etcd.endpoint")
        st = MasterSettings(m.replicas, m.lease_ttl, m.put_timeout, m.quarantine, m.high_watermark, m.low_watermark,
                            m.max_handoff_ttl, suspect_s=m.node_ttl, repair_rate=m.repair_rate,
                            repair_in_flight=m.repair_in_flight, max_objects=m.max_objects)
        return cls(",".join(eps), cfg.cluster, m.host, m.rpc_port, m.metrics_port, m.membership_poll,
                   m.node_ttl, st, m.etcd_compaction_interval, m.etcd_compaction_retention,
                   *m.join_settings(), security=Security.for_server(cfg.security, "this master"),
                   max_conns=cfg.security.max_conns, frame_timeout_s=cfg.security.frame_timeout,
                   advertise=m.advertise, etcd_auth=EtcdAuth.from_config(cfg.etcd), spin_wait_s=m.spin_wait)
