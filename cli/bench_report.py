"""Rendering of a ``kvpool bench`` report: rich tables for people, Markdown for documents.

The report (``--json`` prints it as is) holds ``config``, ``machine`` (CPUs, load averages),
``systems``, ``plan`` (the order of every round's steps), ``skipped`` (cells, systems and
peers left out, with why), ``rounds`` (every phase, ceiling and metadata measurement of every
round), and their summaries over the rounds: ``results`` (per system, op and cell),
``ceilings``, ``ratios`` (kvpool ÷ peer, ÷ other setting, system ÷ ceiling) and
``metadata``. Each summary holds ``min``, ``median`` and ``max``.
"""
from __future__ import annotations

_FAMILY_ORDER = {"kvpool": 0, "mooncake": 1, "redis": 2}
_CEILING_NAMES = {"memcpy": "memcpy", "tcp": "raw TCP stream", "unix": "raw Unix stream", "ucx": "raw UCX stream",
                  "tcp_rr_get": "raw TCP get-shaped req→reply", "tcp_rr_put": "raw TCP put-shaped req→reply"}


def fmt_size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def _mmm(s: dict, fmt: str = "{:.2f}") -> str:
    """``median (min–max)``."""
    if not s.get("n"):
        return "–"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def _cell_sort(r: dict) -> tuple:
    return (r["op"] != "put", r["size"], r["batch"], r["clients"], r["replicas"], r["path"],
            _FAMILY_ORDER.get(r.get("family", "kvpool"), 3), r["name"])


def _shown_results(report: dict) -> list[dict]:
    """Reported systems (a group, not its members) in table order."""
    return sorted((r for r in report["results"] if r["group"] == r["system"]), key=_cell_sort)


def _flags(r: dict) -> str:
    bad = [f"{r[k]} {k.replace('_', ' ')}" for k in ("errors", "misses", "stale", "corrupt", "not_fresh") if r.get(k)]
    return "; ".join(bad) + (f" ({r['first_error']})" if r.get("first_error") else "") if bad else ""


def _variants(r: dict) -> str:
    vs = [x.get("variant") for x in r["rounds"] if x.get("variant")]
    if not vs:
        return ""
    counts = {v: vs.count(v) for v in dict.fromkeys(vs)}
    return "best: " + ", ".join(f"{v} ×{n}" for v, n in counts.items())


def _title(report: dict) -> str:
    c, m = report["config"], report["machine"]
    la = m.get("loadavg_start", (0, 0, 0))
    return (f"{c['rounds']} rounds, systems interleaved; {c.get('load_procs', 0)} load processes; "
            f"load average {la[0]:.1f} at the start on {m['cpus']} CPUs")


def _shown_ratios(report: dict, all_ratios: bool) -> list[dict]:
    """kvpool's ratios (and, with ``all_ratios``, the peers' ratios to the ceilings) in table order."""
    xs = [x for x in report["ratios"] if all_ratios or x["system"] in _kvpool_ids(report)]
    return sorted(xs, key=lambda x: (*_cell_sort({**x, "family": "kvpool"}), x["kind"], x["target"]))


def _kvpool_ids(report: dict) -> set[str]:
    return {s["id"] for s in report.get("systems", []) if s["family"] == "kvpool"}


def _left_out(s: dict) -> str:
    return f"{s.get('system') or s.get('cell') or s.get('ceiling')}: {s['why']}"


def render_bench(report: dict, console=None, all_ratios: bool = False) -> None:
    """Rich tables: ceilings, per-system results, ratios (kvpool's; ``all_ratios``: the
    peers' to the ceilings too), metadata ops, what was left out."""
    from rich.console import Console
    from rich.markup import escape as e
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)  # a pipe or file: do not squeeze the tables to 80 columns
    console.print(_title(report))
    t = Table(title="ceilings (GB/s per round: median (min–max))")
    for col in ("ceiling", "object size", "GB/s"):
        t.add_column(col, justify="left" if col == "ceiling" else "right")
    for c in sorted(report["ceilings"], key=lambda c: (c["name"], c["size"])):
        t.add_row(_CEILING_NAMES.get(c["name"], c["name"]), fmt_size(c["size"]) if c["size"] else "", _mmm(c["gbps"]))
    console.print(t)
    t = Table(title="put / get (per round: median (min–max))")
    for col in ("op", "size", "batch", "clients", "replicas", "system", "path", "GB/s", "objects/s", "p50 ms",
                "p99 ms", "notes"):
        t.add_column(col, justify="left" if col in ("op", "system", "path", "notes") else "right")
    for r in _shown_results(report):
        note = _flags(r)
        t.add_row(r["op"], fmt_size(r["size"]), str(r["batch"]), str(r["clients"]), str(r["replicas"]), e(r["name"]),
                  r["path"], _mmm(r["gbps"]), _mmm(r["objects_per_s"], "{:,.0f}"), _mmm(r["p50_ms"], "{:.3f}"),
                  _mmm(r["p99_ms"], "{:.3f}"), f"[red]{e(note)}[/]" if note else e(_variants(r)))
    console.print(t)
    t = Table(title="ratios within a round (median (min–max) over the rounds)")
    for col in ("op", "size", "batch", "clients", "replicas", "system", "path", "÷", "ratio"):
        t.add_column(col, justify="left" if col in ("op", "system", "path", "÷") else "right")
    for x in _shown_ratios(report, all_ratios):
        t.add_row(x["op"], fmt_size(x["size"]), str(x["batch"]), str(x["clients"]), str(x["replicas"]), e(x["name"]),
                  x["path"], e(_CEILING_NAMES.get(x["target"], x["target"])), _mmm(x))
    console.print(t)
    if report.get("metadata"):
        t = Table(title="master metadata (real RPC; median (min–max) over the rounds)")
        for col in ("op", "clients", "batch", "keys/s", "calls/s", "p50 ms", "p99 ms"):
            t.add_column(col, justify="left" if col == "op" else "right")
        for r in report["metadata"]:
            t.add_row(r["op"], str(r["clients"]), str(r["batch"]), _mmm(r["keys_per_s"], "{:,.0f}"),
                      _mmm(r["calls_per_s"], "{:,.0f}"), _mmm(r["p50_ms"], "{:.3f}"), _mmm(r["p99_ms"], "{:.3f}"))
        console.print(t)
    for s in report.get("skipped", []):
        console.print(f"[yellow]left out[/]: {e(_left_out(s))}")


def render_markdown(report: dict, all_ratios: bool = False) -> str:
    """The report as Markdown tables (for benchmarks/RESULTS.md and the README): ceilings,
    per-system figures and kvpool's ratios (``all_ratios``: the peers' to the ceilings
    too), each as median (min–max) over the rounds."""
    lines = [f"{_title(report)}.", "", "| ceiling | object size | GB/s |", "|---|---:|---:|"]
    for c in sorted(report["ceilings"], key=lambda c: (c["name"], c["size"])):
        lines.append(f"| {_CEILING_NAMES.get(c['name'], c['name'])} | {fmt_size(c['size']) if c['size'] else ''} "
                     f"| {_mmm(c['gbps'])} |")
    lines += ["", "| op | size | batch | clients | replicas | system | path | GB/s | objects/s | p50 ms | p99 ms |",
              "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in _shown_results(report):
        flag = _flags(r)
        lines.append(f"| {r['op']} | {fmt_size(r['size'])} | {r['batch']} | {r['clients']} | {r['replicas']} | "
                     f"{r['name']}{' ⚠ ' + flag if flag else ''} | {r['path']} | {_mmm(r['gbps'])} | "
                     f"{_mmm(r['objects_per_s'], '{:,.0f}')} | {_mmm(r['p50_ms'], '{:.3f}')} | "
                     f"{_mmm(r['p99_ms'], '{:.3f}')} |")
    lines += ["", "| op | size | batch | clients | replicas | system | path | ÷ | ratio |",
              "|---|---:|---:|---:|---:|---|---|---|---:|"]
    for x in _shown_ratios(report, all_ratios):
        lines.append(f"| {x['op']} | {fmt_size(x['size'])} | {x['batch']} | {x['clients']} | {x['replicas']} | "
                     f"{x['name']} | {x['path']} | {_CEILING_NAMES.get(x['target'], x['target'])} | {_mmm(x)} |")
    if report.get("metadata"):
        lines += ["", "| metadata op | clients | batch | keys/s | calls/s | p50 ms | p99 ms |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in report["metadata"]:
            lines.append(f"| {r['op']} | {r['clients']} | {r['batch']} | {_mmm(r['keys_per_s'], '{:,.0f}')} | "
                         f"{_mmm(r['calls_per_s'], '{:,.0f}')} | {_mmm(r['p50_ms'], '{:.3f}')} | "
                         f"{_mmm(r['p99_ms'], '{:.3f}')} |")
    if report.get("skipped"):
        lines += ["", "Left out:", *(f"- {_left_out(s)}" for s in report["skipped"])]
    return "\n".join(lines) + "\n"
