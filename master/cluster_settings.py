"""The cluster-wide settings of a master (etcd's ``config`` record), mixed into
:class:`master.server.MasterServer`: which of a master's settings they are
(:func:`_settings_of`), adopting the record when this master starts leading, and changing
them with ``SetConfig`` (written to etcd first, applied once written).
"""
from __future__ import annotations

import logging
import math

import msgspec

from kvpool.master.durable import Pending
from kvpool.master.state import MasterSettings
from kvpool.protocol import messages as M
from kvpool.protocol.errors import ConfigError, EtcdUnavailable, InvalidRequest, KVPoolError

log = logging.getLogger("kvpool.master")


class _ClusterSettings:
    """The settings part of a :class:`~master.server.MasterServer` (mixed into it; uses its
    ``state``, ``durable``, ``keys`` and ``_settings_write``)."""

    def _adopt_settings(self, raw: bytes) -> None:
        """Apply the cluster settings recorded in etcd (over this process's flags)."""
        try:
            cs = msgspec.json.decode(raw, type=M.ClusterSettings).check()
        except (msgspec.DecodeError, msgspec.ValidationError, KVPoolError) as e:
            log.error("master: ignoring the cluster settings in etcd (%s); using this master's flags. "
                      "Fix them with `kvpool settings --set KEY=VALUE`", e)
            return
        if cs != _settings_of(self.state.s):
            log.info("master: cluster settings from etcd override this master's flags: %s", cs)
        self._apply_settings(cs)

    def _apply_settings(self, cs: M.ClusterSettings) -> M.ClusterSettings:
        self.state.s = msgspec.structs.replace(self.state.s, **msgspec.structs.asdict(cs))
        return cs

    def _set_settings(self, changes: dict[str, float]) -> Pending:
        """Validate ``changes`` against the current settings, write the result to etcd and
        apply it once written (a durable answer)."""
        cur = msgspec.structs.asdict(_settings_of(self.state.s))
        unknown = sorted(set(changes) - set(cur))
        if unknown:
            raise InvalidRequest(f"unknown setting(s) {', '.join(unknown)}; accepted: {', '.join(cur)}")
        if "replicas" in changes:
            r = changes["replicas"]
            if not (math.isfinite(r) and r == int(r)):
                raise ConfigError(f"replicas: {r!r}; must be a whole number", key="replicas")
            changes = {**changes, "replicas": int(r)}
        new = M.ClusterSettings(**{**cur, **changes}).check()
        if self._settings_write is not None and not self._settings_write.answered:
            # built on the settings of now: a change still on its way to etcd would be undone
            raise EtcdUnavailable("another settings change is being recorded in etcd; nothing was changed, "
                                  "retry in a moment")
        key, val = self.keys.config, msgspec.json.encode(new)
        self._settings_write = self.durable.write(key, lambda e: e.put(key, val), "cluster settings",
                                                  lambda: self._apply_settings(new))
        return self._settings_write



def _settings_of(s: MasterSettings) -> M.ClusterSettings:
    """The cluster-wide part of a master's settings (what etcd's ``config`` record holds)."""
    return M.ClusterSettings(**{f: getattr(s, f) for f in M.ClusterSettings.__struct_fields__})
