"""Read leases taken by one lookup and used by another reader on the same host.

A leased ``Lookup`` answers each found key with its header and replicas
(:class:`~protocol.messages.ObjectInfo`) and a read lease that runs ``lease_ttl_s``
seconds from when the request was sent. :class:`ReadLeases` carries those answers from
whoever looked the keys up (the vLLM scheduler's background lookup, which must learn which
blocks are stored anyway) to whoever reads them (the worker's load, a step later), so the
read needs no master round trip of its own. The reader releases each lease it used
(:meth:`connector.client.KVPoolClient.get_into_batch`).

The lease's time is counted on the looking-up host's ``CLOCK_MONOTONIC``: a reader on
another host (another boot) takes none of the answers and looks the keys up itself; an
answer whose lease is past :data:`~connector.client.LEASE_MARGIN` of its TTL is not used
either. A lease is released only while it is live (:meth:`ReadLeases.until`): once it
lapsed, the master may count another reader's lease on the key, which a late release
would cut short. Leases nobody releases lapse.

No sockets: the data, and this host's boot id.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kvpool.protocol import messages as M

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@functools.cache
def boot_id() -> str:
    """This host's boot id (the identity of its ``CLOCK_MONOTONIC``); "" when unknown."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class ReadLeases:
    """``infos``: the leased lookup's answers by key; ``sent_at``: when the lookup was
    sent (``time.monotonic()`` seconds on the host whose boot id is ``boot``); ``ttl``:
    the shortest lease granted (seconds from ``sent_at``; 0: none)."""

    infos: dict[str, M.ObjectInfo] = field(default_factory=dict)
    sent_at: float = 0.0
    boot: str = ""
    ttl: float = 0.0

    @classmethod
    def of(cls, infos, sent_at: float) -> ReadLeases:
        """The found answers among a leased lookup's replies ``infos`` (ObjectInfo or
        ErrorInfo), sent at monotonic ``sent_at`` from this host."""
        found = {i.key: i for i in infos if isinstance(i, M.ObjectInfo)}
        return cls(found, sent_at, boot_id(), min((i.lease_ttl_s for i in found.values()), default=0.0))

    def until(self, margin: float) -> float:
        """The monotonic time (seconds, on host ``boot``) up to which every lease is live
        with ``margin`` (a fraction of the TTL) to spare."""
        return self.sent_at + self.ttl * margin

    def usable(self, now: float, margin: float) -> bool:
        """Whether a reader on this host at monotonic time ``now`` may use the answers:
        the same boot, and no lease past ``margin`` (a fraction) of its TTL."""
        if not self.infos or not self.boot or self.boot != boot_id():
            return False
        return self.ttl > 0 and now < self.until(margin)

    def take(self, key: str) -> M.ObjectInfo | None:
        """The answer for ``key``, removed (each lease is used once), or None."""
        return self.infos.pop(key, None)

    def keep(self, keys) -> list[str]:
        """Keep the answers of ``keys`` only; returns the keys dropped (the caller
        releases their leases)."""
        keys = set(keys)
        gone = [k for k in self.infos if k not in keys]
        for k in gone:
            del self.infos[k]
        return gone

    def merge(self, other: ReadLeases) -> list[str]:
        """Add ``other``'s answers; the earlier send time counts for all (conservative).
        Returns the keys both hold: a second lease on each, which this one does not
        carry (the caller releases them while they are live)."""
        if not other.infos:
            return []
        if not self.infos:
            self.sent_at, self.boot, self.ttl = other.sent_at, other.boot, other.ttl
        elif other.boot != self.boot:
            return []  # another host's clock: not comparable, not used
        else:
            self.sent_at, self.ttl = min(self.sent_at, other.sent_at), min(self.ttl, other.ttl)
        twice = [k for k in other.infos if k in self.infos]
        self.infos.update(other.infos)
        return twice
