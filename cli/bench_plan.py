"""What one ``kvpool bench`` run measures, and in which order: pure data, no I/O.

A run is ``rounds`` rounds. In every round every *cell* (object size × client processes ×
batch × replicas) runs every *system* once (a put phase of fresh keys, then a get phase
of the same keys), in an order that rotates from round to round, beside the ceilings of
that round: the same-size TCP request→reply ceilings (get-shaped and put-shaped) once per
size and round, inside the cells' rotation, and the size-free ceilings (memcpy, raw
streams) as one block whose place among the cells rotates too. Ratios are then taken
within a round (kvpool ÷ peer, kvpool ÷ ceiling), so each compares moments seconds apart,
not minutes, on a machine whose load swings.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# where each kvpool transport's bytes go, and the ceiling each path is held against
PATH_OF = {"auto": "shm", "shm": "shm", "tcp": "tcp", "unix": "unix", "ucx": "ucx"}
STREAM_CEILING = {"shm": "memcpy", "tcp": "tcp", "unix": "unix", "ucx": "ucx"}
TRANSPORTS = ("auto", "tcp", "unix", "ucx")
BASELINES = ("redis", "mooncake")
# Mooncake Store's two client paths: Python buffers (put/put_batch, get/get_batch) and
# buffers registered with its transfer engine (put_from/batch_put_from, get_into/batch_get_into);
# its row per round is the faster of the two (its best put path, and its best get path)
MOONCAKE_VARIANTS = ("py", "reg")
RR_SHAPES = ("tcp_rr_get", "tcp_rr_put")  # request→reply ceilings at a cell's object size
META_BATCHES = (1, 64, 256)  # keys per metadata call


@dataclass(frozen=True)
class Cell:
    """One workload: ``clients`` processes each moving ``batch``-object calls of ``size``
    bytes, stored with ``replicas`` copies."""

    size: int
    clients: int
    batch: int
    replicas: int

    @property
    def key(self) -> str:
        return f"{self.size}/{self.clients}/{self.batch}/{self.replicas}"

    @property
    def label(self) -> str:
        return f"{_fmt(self.size)} ×{self.clients} b{self.batch} r{self.replicas}"


@dataclass(frozen=True)
class System:
    """One measured system: ``family`` kvpool | redis | mooncake; ``group`` the name its
    rows are reported under (Mooncake's variants report as one group, the faster per
    round); ``path`` where its bytes go (shm | tcp | unix | ucx); ``settings`` the kvpool
    client's (name, value) pairs; ``variant`` Mooncake's client path (py | reg)."""

    name: str
    family: str
    path: str
    transport: str = ""
    settings: tuple[tuple[str, object], ...] = ()
    variant: str = ""
    group: str = ""
    max_replicas: int = 16

    @property
    def id(self) -> str:
        """Unique within a run: kvpool's name with its transport (``kvpool@tcp``)."""
        return f"{self.name}@{self.transport}" if self.family == "kvpool" else self.name

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "family": self.family, "group": self.group or self.name, "path": self.path,
                "transport": self.transport, "settings": dict(self.settings), "variant": self.variant}


@dataclass(frozen=True)
class Step:
    """One item of a round: ``kind`` "system" (the system whose id is ``name``, on ``cell``), "ceiling" (``name``
    at object ``size``; 0 for a size-free ceiling) or "metadata" (master ops from
    ``clients`` processes in calls of ``batch`` keys)."""

    kind: str
    name: str
    cell: Cell | None = None
    size: int = 0
    clients: int = 0
    batch: int = 0
    round: int = 0

    def prefix(self, run_id: str) -> str:
        """The key prefix of a system step: one per run, round, system and cell, so every
        put phase writes keys that no earlier phase wrote (a put of an existing key is a
        no-op in kvpool and in Mooncake Store, and would measure nothing)."""
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.name).strip("-")
        return f"bench/{run_id}/r{self.round}/{slug}/{self.cell.key if self.cell else self.size}"

    @property
    def label(self) -> str:
        if self.kind == "system":
            return f"{self.name} {self.cell.label}"
        if self.kind == "metadata":
            return f"metadata ×{self.clients} b{self.batch}"
        return f"ceiling {self.name}" + (f" {_fmt(self.size)}" if self.size else "")


def _fmt(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def kvpool_systems(transports: list[str], settings: list[dict]) -> list[System]:
    """One kvpool system per transport × client setting. ``settings``: dicts of client
    options (``spin_wait_s``, ``reserve_bytes``; None = the client's default); a setting
    whose values differ across the list is named in the system's name, e.g.
    ``kvpool[spin=0]``."""
    varying = [k for k in (settings[0] if settings else {}) if len({repr(s.get(k)) for s in settings}) > 1]
    out = []
    for t in transports:
        for s in settings or [{}]:
            tag = ",".join(f"{_SHORT.get(k, k)}={_show(k, s[k])}" for k in varying)
            name = "kvpool" + (f"[{tag}]" if tag else "")
            out.append(System(name=name, family="kvpool", path=PATH_OF[t], transport=t,
                              settings=tuple(sorted(s.items()))))
    return out


_SHORT = {"spin_wait_s": "spin", "reserve_bytes": "reserve"}


def _show(key: str, v) -> str:
    if v is None:
        return "default"
    if key == "spin_wait_s":
        return "0" if v == 0 else (f"{v * 1e6:g}us" if v < 1e-3 else f"{v * 1e3:g}ms")
    if key == "reserve_bytes":
        return _fmt(int(v)) if v else "0"
    return str(v)


def peer_systems(baselines: list[str]) -> list[System]:
    """Redis (SET/GET, MSET/MGET pipelined; one copy, so replicas 1 only) and Mooncake
    Store's two client paths, both over TCP on loopback."""
    out = []
    if "redis" in baselines:
        out.append(System(name="redis", family="redis", path="tcp", transport="redis", max_replicas=1))
    if "mooncake" in baselines:
        out += [System(name=f"mooncake[{v}]", family="mooncake", path="tcp", transport="mooncake", variant=v,
                       group="mooncake") for v in MOONCAKE_VARIANTS]
    return out


def _rotate(items: list, r: int) -> list:
    if not items:
        return []
    k = r % len(items)
    return items[k:] + items[:k]


def plan_rounds(cells: list[Cell], systems: list[System], rounds: int, global_ceilings: list[str],
                rr_ceilings: bool = True, metadata: list[tuple[int, int]] = ()) -> list[list[Step]]:
    """The steps of every round, in order.

    Round ``r``: the cells rotated by ``r``; inside each cell its systems (those that can
    store ``cell.replicas`` copies) plus, at the first cell of each object size in the
    round, the request→reply ceilings at that size, rotated by ``r``; the block of
    ``global_ceilings`` placed before cell ``r mod (cells + 1)``; the metadata steps
    (``(clients, batch)`` pairs) last. Over ``n`` rounds each of ``n`` systems of a cell
    takes each place once."""
    plan: list[list[Step]] = []
    for r in range(rounds):
        steps: list[Step] = []
        blocks: list[list[Step]] = []
        seen_sizes: set[int] = set()
        for cell in _rotate(list(cells), r):
            entries = [Step("system", s.id, cell, cell.size, round=r) for s in systems
                       if cell.replicas <= s.max_replicas]
            if rr_ceilings and cell.size not in seen_sizes:
                seen_sizes.add(cell.size)
                entries += [Step("ceiling", name, None, cell.size, round=r) for name in RR_SHAPES]
            blocks.append(_rotate(entries, r))
        ceil_block = [Step("ceiling", name, None, 0, round=r) for name in global_ceilings]
        blocks.insert(r % (len(blocks) + 1), ceil_block)
        for b in blocks:
            steps += b
        steps += [Step("metadata", "metadata", None, 0, nc, b, round=r) for nc, b in metadata]
        plan.append(steps)
    return plan
