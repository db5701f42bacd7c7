"""Aggregation of ``kvpool bench`` measurements: pure functions over plain dicts.

A *row* is one phase (put or get) of one system on one cell in one round: ``round``,
``system`` (its id), ``name``, ``group``, ``family``, ``path``, ``op``, ``size``,
``clients``, ``batch``, ``replicas``, and what :func:`summarise` gives (GB/s, objects/s,
p50/p99 latency in ms, ...) plus its error counts. A *ceiling row* is ``round``, ``name``,
``size`` (0 for a size-free ceiling) and ``gbps``. Ratios are taken within a round and
summarised as min / median / max over the rounds.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

from kvpool.cli.bench_plan import STREAM_CEILING

CELL_KEYS = ("size", "clients", "batch", "replicas")
BAD_KEYS = ("errors", "misses", "stale", "corrupt", "not_fresh")


def pct(sorted_vals: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ascending ``sorted_vals`` (nearest rank); 0.0 if empty."""
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, round(q * (len(sorted_vals) - 1))))
    return sorted_vals[i]


def summarise(parts: list[dict], nbytes_per_obj: int, count_key: str = "objects") -> dict:
    """One phase from every client's part (``start``/``end`` monotonic seconds, ``lat``
    per-call seconds, ``count_key`` objects): rates over the wall time from the first
    client's start to the last one's end, latency quantiles over every call."""
    wall = max(max(p["end"] for p in parts) - min(p["start"] for p in parts), 1e-9)
    objs = sum(p[count_key] for p in parts)
    lat = sorted(x for p in parts for x in p["lat"])
    return {"seconds": round(wall, 6), "objects": objs, "bytes": objs * nbytes_per_obj,
            "gbps": objs * nbytes_per_obj / wall / 1e9, "objects_per_s": objs / wall,
            "p50_ms": pct(lat, 0.50) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3, "calls": len(lat)}


def spread(values: Iterable[float | None]) -> dict:
    """``{"min", "median", "max", "n"}`` of the values that are not None (all 0.0 if none)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"min": 0.0, "median": 0.0, "max": 0.0, "n": 0}
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}


def is_bad(row: dict) -> bool:
    """A phase whose figures do not count: an error, a miss, bytes of an earlier phase
    (stale) or other wrong bytes (corrupt) read back, or a put that stored nothing."""
    return any(row.get(k) for k in BAD_KEYS)


def _cell(row: dict) -> tuple:
    return tuple(row[k] for k in CELL_KEYS)


def group_rows(rows: list[dict]) -> list[dict]:
    """A row per round, cell and op for each group of several systems (Mooncake's client
    paths): a copy of the member row with the highest GB/s among those without errors
    (the first member when all have some), named after the group, ``variant`` = the
    member's name."""
    members: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["group"] != r["system"]:
            members[(r["round"], r["group"], r["op"], _cell(r))].append(r)
    out = []
    for (_, group, _, _), rs in members.items():
        good = [r for r in rs if not is_bad(r)]
        best = max(good, key=lambda r: r["gbps"]) if good else rs[0]
        out.append({**best, "system": group, "name": group, "variant": best["name"]})
    return out


def results(rows: list[dict]) -> list[dict]:
    """Per system, op and cell: the per-round figures and their min / median / max."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by[(r["system"], r["op"], _cell(r))].append(r)
    out = []
    for rs in by.values():
        rs.sort(key=lambda r: r["round"])
        first = rs[0]
        good = [r for r in rs if not is_bad(r)]
        entry = {k: first[k] for k in ("system", "name", "group", "family", "path", "op", *CELL_KEYS)}
        entry["rounds"] = [{k: r.get(k) for k in ("round", "gbps", "objects_per_s", "p50_ms", "p99_ms", "objects",
                                                   *BAD_KEYS, "variant") if k in r} for r in rs]
        for k in ("gbps", "objects_per_s", "p50_ms", "p99_ms"):
            entry[k] = spread(r[k] for r in good)
        for k in BAD_KEYS:
            entry[k] = sum(r.get(k, 0) for r in rs)
        entry["first_error"] = next((r["first_error"] for r in rs if r.get("first_error")), "")
        out.append(entry)
    return out


def ceiling_of(ceilings: list[dict], rnd: int, name: str, size: int = 0) -> float | None:
    for c in ceilings:
        if c["round"] == rnd and c["name"] == name and c["size"] == size:
            return c["gbps"] or None
    return None


def ceiling_summary(ceilings: list[dict]) -> list[dict]:
    """Per ceiling and size: the per-round GB/s and their min / median / max."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for c in ceilings:
        by[(c["name"], c["size"])].append(c)
    return [{"name": n, "size": s, "rounds": [c["gbps"] for c in sorted(cs, key=lambda c: c["round"])],
             "gbps": spread(c["gbps"] for c in cs)} for (n, s), cs in by.items()]


def _ratio(a: dict, b: dict | None) -> float | None:
    if b is None or is_bad(a) or is_bad(b) or not b["gbps"]:
        return None
    return a["gbps"] / b["gbps"]


def round_ratios(rows: list[dict], ceilings: list[dict]) -> list[dict]:
    """Per round: every kvpool system ÷ every peer group (``kind`` "peer") and ÷ every other
    kvpool setting on its path ("setting"); every reported system (not a group's members)
    ÷ its path's stream ceiling and, over TCP, ÷ the request→reply ceiling of its op's
    shape at its object size ("ceiling"). None where a phase had errors or a ceiling is
    missing."""
    reported = [r for r in rows if r["group"] == r["system"]]
    index: dict[tuple, list[dict]] = defaultdict(list)
    for r in reported:
        index[(r["round"], r["op"], _cell(r))].append(r)
    out = []

    def add(r: dict, target: str, kind: str, value: float | None) -> None:
        out.append({"round": r["round"], "system": r["system"], "name": r["name"], "path": r["path"], "op": r["op"],
                    **{k: r[k] for k in CELL_KEYS}, "target": target, "kind": kind, "ratio": value})

    for r in reported:
        if r["family"] == "kvpool":
            for o in index[(r["round"], r["op"], _cell(r))]:
                if o["family"] != "kvpool":
                    add(r, o["system"], "peer", _ratio(r, o))
                elif o["path"] == r["path"] and o["name"] != r["name"]:
                    add(r, o["name"], "setting", _ratio(r, o))
        stream = STREAM_CEILING.get(r["path"])
        if stream:
            c = ceiling_of(ceilings, r["round"], stream)
            add(r, stream, "ceiling", None if c is None or is_bad(r) else r["gbps"] / c)
        if r["path"] == "tcp":
            rr = f"tcp_rr_{r['op']}"
            c = ceiling_of(ceilings, r["round"], rr, r["size"])
            add(r, rr, "ceiling", None if c is None or is_bad(r) else r["gbps"] / c)
    return out


def ratio_summary(per_round: list[dict]) -> list[dict]:
    """Per system, op, cell and target: the per-round ratios and their min / median / max."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for x in per_round:
        by[(x["system"], x["op"], _cell(x), x["target"])].append(x)
    out = []
    for xs in by.values():
        xs.sort(key=lambda x: x["round"])
        first = xs[0]
        entry = {k: first[k] for k in ("system", "name", "path", "op", *CELL_KEYS, "target", "kind")}
        entry["rounds"] = [x["ratio"] for x in xs]
        entry.update(spread(x["ratio"] for x in xs))
        out.append(entry)
    return out


def metadata_summary(meta_rows: list[dict]) -> list[dict]:
    """Per metadata op, client count and batch: keys/s, calls/s and latency over the rounds."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for m in meta_rows:
        by[(m["op"], m["clients"], m["batch"])].append(m)
    return [{"op": op, "clients": nc, "batch": b, "rounds": [m["keys_per_s"] for m in ms],
             **{k: spread(m[k] for m in ms) for k in ("keys_per_s", "calls_per_s", "p50_ms", "p99_ms")}}
            for (op, nc, b), ms in by.items()]
