"""The cluster-wide settings of a master (etcd's ``config`` record): a part owned by
:class:`master.server.MasterServer` (its ``settings``). Which of a master's settings they
are (:func:`_settings_of`), adopting the record when this master starts leading, and
changing them with ``SetConfig`` (written to etcd first, applied once written).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import msgspec

from kvpool.master.durable import DurableWrites, Pending
from kvpool.master.state import MasterSettings, MasterState
from kvpool.protocol import messages as M
from kvpool.protocol.errors import DECODE_ERRORS, ConfigError, EtcdUnavailable, InvalidRequest, KVPoolError
from kvpool.protocol.etcd import Keys

log = logging.getLogger("kvpool.master")


class ClusterSettingsPart:
    """Adopts and changes the cluster settings of the state ``state()`` returns (the
    leadership's current :class:`~master.state.MasterState`): changes are written through
    ``durable`` (:class:`~master.durable.DurableWrites`) under ``keys.config``."""

    def __init__(self, state: Callable[[], MasterState], durable: DurableWrites, keys: Keys) -> None:
        self._state, self.durable, self.keys = state, durable, keys
        self._settings_write: Pending | None = None  # the change on its way to etcd, if any

    def adopt(self, raw: bytes) -> None:
        """Apply the cluster settings recorded in etcd (over this process's flags)."""
        try:
            cs = msgspec.json.decode(raw, type=M.ClusterSettings).check()
        except (*DECODE_ERRORS, KVPoolError) as e:
            log.error("master: ignoring the cluster settings in etcd (%s); using this master's flags. "
                      "Fix them with `kvpool settings --set KEY=VALUE`", e)
            return
        if cs != _settings_of(self._state().s):
            log.info("master: cluster settings from etcd override this master's flags: %s", cs)
        self._apply(cs)

    def _apply(self, cs: M.ClusterSettings) -> M.ClusterSettings:
        st = self._state()
        st.s = msgspec.structs.replace(st.s, **msgspec.structs.asdict(cs))
        return cs

    def change(self, changes: dict[str, float]) -> Pending:
        """Validate ``changes`` against the current settings, write the result to etcd and
        apply it once written (a durable answer)."""
        cur = msgspec.structs.asdict(_settings_of(self._state().s))
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
                                                  lambda: self._apply(new))
        return self._settings_write



def _settings_of(s: MasterSettings) -> M.ClusterSettings:
    """The cluster-wide part of a master's settings (what etcd's ``config`` record holds)."""
    return M.ClusterSettings(**{f: getattr(s, f) for f in M.ClusterSettings.__struct_fields__})
