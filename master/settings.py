"""The master's tunables (pure data): :class:`MasterSettings`. An operator's change
(``kvpool`` cluster settings, master/cluster_settings.py) replaces the state's object
whole, so the state's parts read it through a callable that returns the current one."""
from __future__ import annotations

from kvpool.protocol.config import MasterConfig
from kvpool.protocol.messages import ClusterSettings


class MasterSettings(ClusterSettings, frozen=True):
    """Tunables in seconds and fractions (see ``protocol.config.MasterConfig``): the
    cluster-wide ones kept in etcd (:class:`~protocol.messages.ClusterSettings`) plus this
    process's own."""

    suspect_s: float = 3.0  # how long a node reported dead is not placed on (its etcd TTL)
    repair_rate: float = MasterConfig().repair_rate  # re-replication copies started per second (average)
    repair_in_flight: int = MasterConfig().repair_in_flight  # re-replication copies in flight at most
    max_objects: int = MasterConfig().max_objects  # objects in the index (committed + pending) at most; 0: no bound
