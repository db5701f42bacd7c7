"""The ``kvpool`` typer app: cluster processes (up, master, storenode), objects (put, get,
ls, rm, pin, unpin), admin (status, evict, drain), the P/D proxy, demo and bench."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer
from typer import rich_utils
from rich.markup import escape
from rich.table import Table

from kvpool.cli.config_flags import config_flags
from kvpool.cli.common import (ClusterOpt, ConfigOpt, EtcdOpt, JsonOpt, LogLevelOpt, MasterOpt, build_config,
                               claim_record, connect, console, fail, local_metrics, process_config, release_record, write_record)
from kvpool.protocol import errors as E
from kvpool.protocol import messages as M
from kvpool.protocol.config import MasterConfig, ProxyConfig, SecurityConfig, StoreNodeConfig
from kvpool.protocol.units import format_bytes, parse_duration, parse_size

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="kvpool: a distributed KV-cache store for LLM inference.")
# help renders at least HELP_WIDTH columns wide (piped output is taken as 80): narrower, rich cuts
# the long generated flag names; a narrower terminal wraps the lines instead
HELP_WIDTH = 120
if rich_utils.MAX_WIDTH is None:
    rich_utils.MAX_WIDTH = max(shutil.get_terminal_size((HELP_WIDTH, 24)).columns, HELP_WIDTH)


def _run(fn):
    try:
        return fn()
    except E.KVPoolError as e:
        fail(e)
    except (OSError, ValueError) as e:  # files, sizes, sockets: one line, not a traceback
        fail(E.InvalidRequest(f"{type(e).__name__}: {e}"))


# ---- processes ------------------------------------------------------------------------------

@app.command()
def up(config: ConfigOpt = None, cluster: ClusterOpt = None, etcd: EtcdOpt = None) -> None:
    """Run the configured cluster (etcd child if no endpoint, master, store nodes) until Ctrl-C."""
    from kvpool.cli.cluster import LocalCluster

    def go() -> None:
        cfg = build_config(config, cluster, etcd)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: stop.set())
        f = claim_record(cfg.cluster)
        try:
            with console.status("starting etcd, master and store nodes..."):
                lc = LocalCluster(cfg, metrics=True, secure=True)
                if lc.owns_run_dir:  # named from the start: a kill -9 while starting leaves nothing behind
                    write_record(f, {"run_dir": lc.run_dir})
                lc.__enter__()
        except BaseException:
            release_record(f)
            raise
        try:
            write_record(f, {"master": lc.master_addr, "etcd": lc.etcd_endpoint,
                             "run_dir": lc.run_dir if lc.owns_run_dir else "", "metrics": lc.metrics_urls,
                             "secret_file": lc.security.secret_file or ""})
            console.print(f"[green]cluster {cfg.cluster!r} up[/]: etcd {lc.etcd_endpoint}, master {lc.master_addr}, "
                          f"{len(lc.nodes)} store nodes. Ctrl-C to stop.", soft_wrap=True)
            console.print("metrics (/metrics, /healthz, /readyz): " + ", ".join(
                f"{name} {url}" for name, url in lc.metrics_urls.items()), soft_wrap=True, highlight=False)
            if lc.secret_file:
                console.print(f"cluster secret: {lc.secret_file} (kvpool commands find it; other clients: export "
                              f"KVPOOL_SECRET_FILE={lc.secret_file})", soft_wrap=True, highlight=False)
            sys.stdout.flush()  # visible at once when piped to a log
            try:
                reported: set[str] = set()
                while not stop.is_set():
                    stop.wait(0.5)
                    for c in [*lc.nodes.values(), *lc.masters] + ([lc.etcd] if lc.etcd else []):
                        if not c.alive() and c.name not in reported:
                            reported.add(c.name)
                            console.print(f"[yellow]{c.name} exited (code {c.proc.returncode}); the rest keeps "
                                          f"running. Its log: {c.log_path}[/]", soft_wrap=True)
                            sys.stdout.flush()
            except KeyboardInterrupt:
                pass
        finally:
            release_record(f)
            with console.status("stopping..."):
                lc.__exit__(None, None, None)
            console.print("cluster stopped")

    _run(go)


_SecretFile = Annotated[Optional[str], typer.Option(
    help="File holding the cluster secret (config security.secret_file; env KVPOOL_SECRET_FILE or KVPOOL_SECRET)")]


@app.command()
@config_flags(master=MasterConfig, security=SecurityConfig)
def master(config: ConfigOpt = None, etcd: EtcdOpt = None, cluster: ClusterOpt = None, log_level: LogLevelOpt = None,
           overrides: dict | None = None) -> None:
    """Run one master (several may run; one leads through etcd election). Settings: the `master` and `security`
    sections of --config (defaults: protocol/config.py MasterConfig, SecurityConfig), each flag overriding its
    key."""
    from kvpool.master.server import main as run_master
    from kvpool.master.server_settings import MasterServerSettings

    def go() -> None:
        run_master(MasterServerSettings.from_config(process_config(config, cluster, etcd, log_level, overrides)))

    _run(go)


@app.command()
@config_flags(storenode=StoreNodeConfig, security=SecurityConfig)
def storenode(config: ConfigOpt = None, etcd: EtcdOpt = None, cluster: ClusterOpt = None,
              log_level: LogLevelOpt = None,
              node_ttl: Annotated[Optional[str], typer.Option(help="TTL of this node's etcd registration (config master.node_ttl: one TTL for the cluster)")] = None,
              run_dir: Annotated[Optional[str], typer.Option(help="Directory for the node's Unix socket")] = None,
              overrides: dict | None = None) -> None:
    """Run one store node with a segment of --memory bytes (shared memory, or GPU memory with --device cuda:N).
    Settings: its `storenodes` entry in --config (defaults: protocol/config.py StoreNodeConfig) and the
    `security` section, each flag overriding its key."""
    from kvpool.storenode.server import NodeSettings, main as run_node

    flags = overrides.pop("storenode", {})

    def go() -> None:
        common = {"master": {"node_ttl": node_ttl}} if node_ttl is not None else {}
        common.update(overrides)
        cfg = process_config(config, cluster, etcd, log_level, common, logs=False)
        entry = cfg.storenode(flags.get("name")) if config is not None else StoreNodeConfig(name=flags.get("name"))
        cfg = process_config(config, cluster, etcd, log_level,
                             {**common, "storenodes": [{**msgspec.structs.asdict(entry), **flags}]})
        node = cfg.storenodes[0]
        if node.device != "cpu":
            from kvpool.storenode.device_segment import check_device

            node = msgspec.structs.replace(node, device=check_device(node.device, node.memory))
        run_node(NodeSettings.from_config(cfg, node, run_dir))

    _run(go)


# ---- objects --------------------------------------------------------------------------------

@app.command()
def credential(role: Annotated[str, typer.Option(help="client (engines: put, get, hand-offs) or operator "
                                                      "(also settings, evictions, forced removals, drains)")],
               output: Annotated[Path, typer.Option("-o", "--output", help="File to write (mode 0600)")],
               secret_file: _SecretFile = None, cluster: ClusterOpt = None) -> None:
    """Derive a role credential from the cluster secret (--secret-file, the environment, else the secret of
    the local cluster `kvpool up` runs): give engines a `client` credential instead of the secret (their
    processes then cannot change settings, evict by selector or drain nodes)."""
    from kvpool.cli.common import recorded_secret_file
    from kvpool.protocol.auth import Security, write_credential_file

    def go() -> None:
        sec = Security.load(secret_file)
        if sec.secret is None and (recorded := recorded_secret_file(cluster)):
            sec = Security.load(recorded)
        if sec.secret is None or sec.role != "cluster":
            raise E.ConfigError("kvpool credential needs the cluster secret itself: --secret-file, "
                              "KVPOOL_SECRET_FILE, KVPOOL_SECRET, or a local cluster started by `kvpool up`",
                              key="security.secret_file")
        console.print(f"{role} credential: {write_credential_file(output, sec.secret, role)} (give it as the "
                      "process's --secret-file or KVPOOL_SECRET_FILE)", soft_wrap=True, highlight=False)

    _run(go)


@app.command()
def put(key: str, file: Path, config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None,
        cluster: ClusterOpt = None, replicas: Annotated[Optional[int], typer.Option()] = None) -> None:
    """Store FILE's bytes under KEY (an existing key is a no-op success)."""
    def go() -> None:
        if not file.is_file():
            raise E.InvalidRequest(f"{file} is not a readable file")
        data = file.read_bytes()
        with connect(config, master, etcd, cluster) as c:
            r = c.put_batch_results([key], [data], replicas=replicas)[0]
        if r.error is not None:
            raise r.error
        if r.short:
            console.print(f"stored {key} ({format_bytes(len(data))}) on [yellow]{r.replicas} of {r.replicas_wanted} "
                          "replicas[/]: fewer live store nodes could take it; the master adds the missing "
                          "replicas when nodes allow (`kvpool status` shows under-replicated objects)", soft_wrap=True)
        elif r.stored:
            console.print(f"stored {key} ({format_bytes(len(data))}) on {r.replicas} "
                          f"replica{'s' if r.replicas != 1 else ''}")
        else:
            console.print(f"{key} was already stored; kept the existing bytes (keys are content addresses: "
                          "`kvpool rm` it first to replace it)")

    _run(go)


@app.command()
def get(key: str, output: Annotated[Optional[Path], typer.Option("-o", "--output")] = None,
        config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None, cluster: ClusterOpt = None) -> None:
    """Fetch KEY to stdout or -o FILE. Exits 3 when the key is not stored."""
    def go() -> None:
        with connect(config, master, etcd, cluster) as c:
            data = c.get(key)
        if data is None:
            raise E.NotFound(f"key {key!r} is not stored; see `kvpool ls`")
        if output is None:
            sys.stdout.buffer.write(data)
        else:
            output.write_bytes(data)
            console.print(f"wrote {format_bytes(len(data))} to {output}")

    _run(go)


class SortBy(str, Enum):
    key = "key"
    size = "size"
    age = "age"
    access = "access"


@app.command("ls")
def ls_(prefix: Annotated[str, typer.Option("--prefix", "-p")] = "",
        long: Annotated[bool, typer.Option("--long", "-l")] = False,
        sort: Annotated[SortBy, typer.Option()] = SortBy.key,
        limit: Annotated[int, typer.Option()] = 10000,
        json_: JsonOpt = False, config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None,
        cluster: ClusterOpt = None) -> None:
    """List stored objects (key, size, layout kind, replicas, age, state)."""
    def go() -> None:
        with connect(config, master, etcd, cluster) as c:
            rows = c.ls(prefix, limit)
        keyf = {"key": lambda r: r.key, "size": lambda r: -r.size, "age": lambda r: -r.age_s,
                "access": lambda r: r.idle_s}[sort.value]  # ages: the master's monotonic clock
        rows = sorted(rows, key=keyf)
        if json_:
            print(msgspec.json.encode(rows).decode())
            return
        t = Table("key", "size", *(("kind", "replicas", "age", "last access", "state") if long else ()))
        for r in rows:
            state = ",".join(s for s in (("leased" if r.leased else ""), (f"pin:{r.pin}" if r.pin else ""),
                                         ("held" if r.held else "")) if s) or "-"
            where = [f"{n}:{t}" if t == "disk" else n for n, t in zip(r.nodes, r.tiers)] if r.tiers else r.nodes
            extra = (r.kind, ",".join(where), f"{r.age_s:.0f}s", f"{r.idle_s:.0f}s ago",
                     state) if long else ()
            t.add_row(r.key, format_bytes(r.size), *extra)
        console.print(t)
        console.print(f"{len(rows)} object(s)")

    _run(go)


@app.command()
def rm(key: str, force: Annotated[bool, typer.Option(help="Remove even if leased or pinned")] = False,
       config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None, cluster: ClusterOpt = None) -> None:
    """Remove KEY (HasLease/Pinned unless --force)."""
    def go() -> None:
        with connect(config, master, etcd, cluster) as c:
            c.remove(key, force)
        console.print(f"removed {key}")

    _run(go)


@app.command()
def pin(key: str, ttl: Annotated[Optional[str], typer.Option(help="Soft pin for this long, e.g. 30m")] = None,
        config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None, cluster: ClusterOpt = None) -> None:
    """Hard-pin KEY (never evicted) or, with --ttl, soft-pin it (evicted last)."""
    def go() -> None:
        with connect(config, master, etcd, cluster) as c:
            c.pin(key, None if ttl is None else parse_duration(ttl, key="ttl"))
        console.print(f"pinned {key}" + (f" (soft, {ttl})" if ttl else " (hard)"))

    _run(go)


@app.command()
def unpin(key: str, config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None,
          cluster: ClusterOpt = None) -> None:
    """Remove KEY's pin."""
    def go() -> None:
        with connect(config, master, etcd, cluster) as c:
            c.unpin(key)
        console.print(f"unpinned {key}")

    _run(go)


@app.command()
def story(key: str, limit: Annotated[int, typer.Option(help="Newest entries shown at most")] = 100,
          json_: JsonOpt = False, config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None,
          cluster: ClusterOpt = None) -> None:
    """What the leading master recorded about KEY, oldest first: stored (on which nodes), replicas lost and
    repaired, demoted, promoted, pinned, evicted and why, removed. The log is bounded and kept by the leader
    only (a new leader starts it empty)."""
    def go() -> None:
        with connect(config, master, etcd, cluster) as c:
            rows = c.story(key, limit)
        if json_:
            print(msgspec.json.encode(rows).decode())
            return
        if not rows:
            console.print(f"the master has no story of {key!r} (never seen by this leader, or gone from its "
                          "bounded log)", soft_wrap=True, highlight=False)
            return
        t = Table("time (UTC)", "event", "detail", title=f"story of {key}")
        for r in rows:
            t.add_row(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.t)) + f".{int(r.t % 1 * 1000):03d}",
                      r.event, escape(r.detail))
        console.print(t)

    _run(go)


# ---- admin ----------------------------------------------------------------------------------

@app.command()
def status(json_: JsonOpt = False, config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None,
           cluster: ClusterOpt = None) -> None:
    """Cluster table: leader, nodes (address, host, device, capacity, used, objects, alive), totals; for the
    cluster of a local `kvpool up`, its processes' metrics URLs."""
    def go() -> None:
        with connect(config, master, etcd, cluster) as c:
            st = c.stats()
        urls = local_metrics(config, master, etcd, cluster)
        if json_:
            print(msgspec.json.encode({**msgspec.to_builtins(st), **({"metrics": urls} if urls else {})}).decode())
            return
        console.print(f"cluster [bold]{st.cluster}[/]  leader [bold]{st.leader}[/]")
        if urls:
            console.print("metrics (/metrics, /healthz, /readyz): " + ", ".join(f"{k} {v}" for k, v in urls.items()),
                          soft_wrap=True, highlight=False)
        disk = st.disk_capacity > 0
        t = Table("node", "address", "host", "device", "capacity", "used", "use %", "objects",
                  *(("disk", "disk used", "disk %", "disk objects") if disk else ()), "alive")
        for n in st.nodes:
            pct = 100 * n.used / n.capacity if n.capacity else 0
            mark = "[red]" if pct > 100 * st.high_watermark else ""
            cols = ((format_bytes(n.disk_capacity), format_bytes(n.disk_used),
                     f"{100 * n.disk_used / n.disk_capacity:.1f}", str(n.disk_objects)) if n.disk_capacity
                    else ("-", "-", "-", "-")) if disk else ()
            t.add_row(n.node_id + (" (draining)" if n.draining else ""), n.data_addr, n.host_id, n.device,
                      format_bytes(n.capacity), format_bytes(n.used), f"{mark}{pct:.1f}",
                      str(n.objects), *cols, "yes" if n.alive else "no")
        mem_objects = st.objects - st.disk_objects if disk else st.objects
        t.add_row("[bold]total", "", "", "", format_bytes(st.capacity), format_bytes(st.used),
                  f"{100 * st.used / st.capacity if st.capacity else 0:.1f}", str(mem_objects),
                  *((format_bytes(st.disk_capacity), format_bytes(st.disk_used),
                     f"{100 * st.disk_used / st.disk_capacity:.1f}", str(st.disk_objects)) if disk else ()), "")
        console.print(t)
        if disk:
            console.print(_tier_line(st), soft_wrap=True, highlight=False)
        for nid, wire in sorted(st.refused.items()):
            console.print(f"[red]store node {nid} is not used: it speaks kvpool wire version {wire}, this "
                          f"cluster's master {M.WIRE_VERSION}; install this release there and restart it")
        for nid, why in sorted(st.joining.items()):
            console.print(f"[yellow]store node {escape(nid)} is not taken in yet (nothing is placed there): "
                          f"{escape(why)}", highlight=False)
        ev = {k: v for k, v in st.counters.items() if k.startswith("evictions_")}
        console.print(f"watermarks high {st.high_watermark:.2f} / low {st.low_watermark:.2f}; pending puts "
                      f"{st.pending}; reserved for writers {format_bytes(st.reserved_bytes)}; held "
                      f"{format_bytes(st.held_bytes)}; under-replicated {st.under_replicated}")
        console.print("evictions: " + (", ".join(f"{k[10:]} {v}" for k, v in sorted(ev.items())) or "none"))
        rs, rd = st.counters.get("repairs_started", 0), st.counters.get("repairs_done", 0)
        if rs or st.under_replicated:
            failed = st.counters.get("repairs_failed", 0)
            console.print(f"repair: {rd}/{rs} copies done, {st.repairs_in_flight} in flight"
                          + (f", {failed} failed (retried)" if failed else "")
                          + f", {st.under_replicated} object(s) under-replicated")

    _run(go)


def _tier_line(st: M.ClusterStats) -> str:
    """One line on the disk tiers' moves: demotions and promotions (done, in flight, failed,
    given up) with their mean latency on the nodes, and disk evictions."""
    c = st.counters
    dem = sum(n.demotions for n in st.nodes)
    pro = sum(n.promotions for n in st.nodes)
    dem_s = sum(n.demotion_s for n in st.nodes)
    pro_s = sum(n.promotion_s for n in st.nodes)
    moving = sum(n.tier_moves for n in st.nodes)
    mean = lambda s, n: f" (mean latency {1000 * s / n:.1f} ms)" if n else ""  # noqa: E731
    return (f"tiers: {dem} demotions to disk{mean(dem_s, dem)} ({format_bytes(c.get('demoted_bytes', 0))}), "
            f"{pro} promotions to memory{mean(pro_s, pro)} ({format_bytes(c.get('promoted_bytes', 0))}), "
            f"{moving} in flight, {c.get('demotions_failed', 0) + c.get('promotions_failed', 0)} failed, "
            f"{c.get('demotions_aborted', 0)} demotions given up (read meanwhile); "
            f"disk evictions {c.get('evictions_disk', 0)}")


# config-file names (seconds fields without their ``_s``) -> ClusterSettings fields
_SETTING_NAMES = {f.removesuffix("_s"): f for f in M.ClusterSettings.__struct_fields__}


def _parse_setting(item: str) -> tuple[str, float]:
    """``KEY=VALUE`` (config-file names, e.g. ``lease_ttl=10s``) → (ClusterSettings field, value)."""
    name, sep, raw = item.partition("=")
    name = name.strip().replace("-", "_")
    field = _SETTING_NAMES.get(name) or (name if name in _SETTING_NAMES.values() else None)
    if not sep or field is None:
        raise E.ConfigError(f"--set {item!r}: use KEY=VALUE with KEY one of {', '.join(_SETTING_NAMES)}",
                            key="set")
    if field.endswith("_s"):
        return field, parse_duration(raw.strip(), key=name)
    try:
        return field, float(raw)
    except ValueError:
        raise E.ConfigError(f"--set {item!r}: {raw!r} is not a number", key=name) from None


@app.command()
def settings(set_: Annotated[Optional[list[str]], typer.Option(
                 "--set", help="KEY=VALUE, repeatable: replicas, lease_ttl, put_timeout, quarantine, "
                               "high_watermark, low_watermark, max_handoff_ttl")] = None,
             json_: JsonOpt = False, config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None,
             cluster: ClusterOpt = None) -> None:
    """Cluster-wide settings (kept in etcd, applied by every leader); --set changes them."""
    def go() -> None:
        changes = dict(_parse_setting(item) for item in set_ or [])
        with connect(config, master, etcd, cluster) as c:
            cs = c.set_config(**changes) if changes else c.config()
            nodes = sum(not n.draining for n in c.stats().nodes) if "replicas" in changes else 0
        if json_:
            print(msgspec.json.encode(cs).decode())
            return
        if cs.replicas > nodes and "replicas" in changes:
            console.print(f"[yellow]warning: replicas={cs.replicas} but {nodes} store node(s) take new objects (up, "
                          f"not draining): new objects get {nodes} replica(s) until more nodes join or are undrained "
                          "(status counts them as under-replicated); start nodes with `kvpool storenode`[/yellow]")
        t = Table("setting", "value", title="cluster settings (etcd: config)" + (" — updated" if changes else ""))
        for name, field in _SETTING_NAMES.items():
            v = getattr(cs, field)
            t.add_row(name, f"{v:g}s" if field.endswith("_s") else f"{v:g}")
        console.print(t)

    _run(go)


@app.command()
def evict(key: Annotated[Optional[str], typer.Option(help="One object")] = None,
          prefix: Annotated[Optional[str], typer.Option(help="Objects whose key starts with this")] = None,
          model: Annotated[Optional[str], typer.Option(help="Objects a model's engines stored (key <ns>/<model>/...)")
                           ] = None,
          node: Annotated[Optional[str], typer.Option(help="Objects with a replica on this store node")] = None,
          older_than: Annotated[Optional[str], typer.Option(help="Objects not read for this long, e.g. 10m")] = None,
          all_: Annotated[bool, typer.Option("--all", help="Every object")] = False,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would go; remove nothing")] = False,
          force: Annotated[bool, typer.Option(help="Include leased, pinned and held objects")] = False,
          json_: JsonOpt = False, config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None,
          cluster: ClusterOpt = None) -> None:
    """Evict objects by one selector; prints what was removed and what was skipped and why."""
    from kvpool.protocol.messages import EvictSelector

    def go() -> None:
        sel = EvictSelector(key, prefix, model, node,
                            None if older_than is None else parse_duration(older_than, key="older-than"), all_)
        with connect(config, master, etcd, cluster) as c:
            rep = c.evict(sel, dry_run, force)
        if json_:
            print(msgspec.json.encode(rep).decode())
            return
        verb = "would remove" if rep.dry_run else "removed"
        skipped = rep.skipped_leased + rep.skipped_pinned + rep.skipped_held
        console.print(f"{verb} {rep.removed} object(s) / {format_bytes(rep.removed_bytes)}; skipped "
                      f"{skipped}: leased {rep.skipped_leased}, pinned {rep.skipped_pinned}, held {rep.skipped_held}")
        if key is not None and skipped and not rep.removed:  # the one object asked for stayed
            why = "pinned" if rep.skipped_pinned else "leased by a reader" if rep.skipped_leased else \
                "held by an open hand-off"
            fix = f"`kvpool unpin {key}` first, or" if rep.skipped_pinned else "wait, or"
            raise (E.Pinned if rep.skipped_pinned else E.HasLease)(
                f"{key!r} was not evicted: it is {why}; {fix} evict it with --force", key=key)
        if skipped and not force:
            console.print("(--force includes leased, pinned and held objects)", highlight=False)

    _run(go)


@app.command()
def drain(node: str, undo: Annotated[bool, typer.Option("--undo", help="Place on NODE again")] = False,
          config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None,
          cluster: ClusterOpt = None) -> None:
    """Stop placing on NODE and move its held/pinned objects to other nodes (--undo resumes)."""
    def go() -> None:
        with connect(config, master, etcd, cluster) as c:
            c.drain(node, undo)
        if undo:
            console.print(f"{node} takes new objects again")
        else:
            console.print(f"draining {node}: no new objects go there; its pinned/held objects are copied to "
                          "other nodes while they have room (`kvpool status` shows repair progress). "
                          f"`kvpool drain {node} --undo` resumes placement")

    _run(go)


# ---- serving ---------------------------------------------------------------------------------

@app.command()
@config_flags(proxy=ProxyConfig)
def proxy(prefill: Annotated[Optional[list[str]], typer.Option(
              "--prefill", help="Prefill (kv_producer) vLLM server URL, e.g. http://127.0.0.1:8100; repeatable")
          ] = None,
          decode: Annotated[Optional[list[str]], typer.Option(
              "--decode", help="Decode (kv_consumer) vLLM server URL; repeatable")] = None,
          etcd: Annotated[Optional[str], typer.Option(
              "--etcd", help="kvpool etcd http://host:port (instead of --master)")] = None,
          cluster: Annotated[Optional[str], typer.Option(help="Cluster name, with --etcd")] = None,
          config: ConfigOpt = None, log_level: LogLevelOpt = None, overrides: dict | None = None) -> None:
    """OpenAI-compatible front for prefill/decode vLLM pools: prefill with max_tokens=1, then decode with its
    kv_transfer_params (docs/vllm.md: router contract). Serves /v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics until Ctrl-C. Settings: the `proxy` section of --config (its `etcd.endpoint`, when set,
    is the cluster's), each flag overriding its key."""
    flags = overrides.get("proxy", {})
    flags.update({k: v for k, v in (("prefill", prefill), ("decode", decode)) if v})
    from kvpool.cli.proxy import ProxySettings, run_proxy

    def go() -> None:
        cfg = process_config(config, cluster, etcd, log_level, {"proxy": flags})
        p = cfg.proxy
        if not p.prefill or not p.decode:
            raise E.ConfigError("the proxy needs prefill and decode servers: pass --prefill URL and --decode URL "
                                "(repeatable) or set proxy.prefill / proxy.decode in --config", key="proxy.prefill")
        run_proxy(ProxySettings.from_config(p, ",".join(cfg.etcd.endpoints()) or None, cfg.cluster))

    _run(go)


# ---- demo and bench -------------------------------------------------------------------------

@app.command()
def demo(json_: JsonOpt = False, quick: Annotated[bool, typer.Option(help="A few seconds of work")] = False,
         hybrid: Annotated[bool, typer.Option(help="Also run the hybrid-attention engine")] = False,
         config: ConfigOpt = None) -> None:
    """Bring up the local cluster, run the shared-prefix demo on real text, tear down."""
    from kvpool.cli.cluster import LocalCluster
    from kvpool.cli.demo import render_demo, run_demo

    def go() -> None:
        cfg = build_config(config)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.default_int_handler)  # tear the cluster down on the way out
        with console.status("starting local cluster (etcd, master, 2 store nodes)...", spinner="dots"):
            lc = LocalCluster(cfg, secure=True)
            lc.__enter__()
        if lc.secret_file:  # the demo's engine processes inherit it (protocol/auth.py Security.load)
            os.environ["KVPOOL_SECRET_FILE"] = lc.secret_file
        try:
            report = run_demo(lc.master_addr, quick=quick, hybrid=hybrid)
        finally:
            lc.__exit__(None, None, None)
        if json_:
            print(json.dumps(report, indent=2))
        else:
            render_demo(report)
        if not report.get("all_match", True):
            sys.exit(1)

    _run(go)


def _csv(text: str, key: str, parse=int) -> list:
    """A comma-separated option as a list; ConfigError naming ``--key`` for a bad item."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            out.append(parse(item))
        except (ValueError, E.ConfigError) as e:
            raise E.ConfigError(f"--{key.replace('_', '-')} {item!r}: {e}", key=key) from None
    return out


@app.command()
def bench(sizes: Annotated[str, typer.Option(help="Object sizes, comma separated")] = "64KiB,1MiB,4MiB",
          clients: Annotated[str, typer.Option(help="Concurrent client processes, comma separated")] = "1",
          batches: Annotated[str, typer.Option(help="Objects per batch call, comma separated")] = "1",
          replicas: Annotated[str, typer.Option(help="Replica counts, comma separated")] = "1",
          total: Annotated[str, typer.Option(help="Bytes one phase of a cell moves")] = "256MiB",
          transport: Annotated[str, typer.Option(
              help="kvpool paths, comma separated: auto (shared memory on the same host), tcp, unix, ucx")] = "auto",
          metadata: Annotated[bool, typer.Option(help="Also measure master metadata ops/s")] = False,
          baseline: Annotated[Optional[str], typer.Option(
              help="Peers run in the same rounds, comma separated: redis, mooncake")] = None,
          rounds: Annotated[int, typer.Option(help="Rounds; each runs every cell on every system, "
                                                   "in an order that rotates")] = 5,
          streams: Annotated[int, typer.Option(help="Network connections per store node per batch (1-16)")] = 1,
          reserve: Annotated[Optional[str], typer.Option(
              help="Bytes of extents each client reserves ahead of need (0: off; default: the client's); "
                   "several, comma separated, run as separate systems")] = None,
          spin_wait: Annotated[Optional[str], typer.Option(
              help="How long each client polls for a reply before sleeping, e.g. 100us (0: off; default: "
                   "the client's); several, comma separated (0,100us), run as separate systems")] = None,
          max_batch_bytes: Annotated[Optional[str], typer.Option(
              help="Leave out batches (of more than one object) holding more bytes, e.g. 4MiB")] = None,
          load: Annotated[int, typer.Option(help="CPU-burning processes running during the rounds")] = 0,
          markdown: Annotated[bool, typer.Option(help="Print Markdown tables instead of rich ones")] = False,
          json_: JsonOpt = False, config: ConfigOpt = None) -> None:
    """kvpool's put/get beside redis, Mooncake Store and the memcpy and raw-socket ceilings,
    interleaved round by round; ratios per round, min / median / max over the rounds."""
    from kvpool.cli.bench import render_bench, render_markdown, run_bench

    def go() -> None:
        cfg = build_config(config)
        spins = None if spin_wait is None else _csv(spin_wait, "spin_wait",
                                                      lambda v: parse_duration(v, key="spin_wait"))
        reserves = None if reserve is None else _csv(reserve, "reserve", lambda v: parse_size(v, key="reserve"))
        rep = run_bench(cfg, _csv(sizes, "sizes", parse_size), _csv(clients, "clients"),
                        parse_size(total, key="total"),
                        transport, metadata, progress=not json_, batches=_csv(batches, "batches"),
                        replicas=_csv(replicas, "replicas"), baseline=baseline, rounds=rounds, streams=streams,
                        reserve=reserves, spin_wait=spins, load=load,
                        max_batch_bytes=None if max_batch_bytes is None else parse_size(max_batch_bytes,
                                                                                         key="max_batch_bytes"))
        if json_:
            print(json.dumps(rep, indent=2))
        elif markdown:
            print(render_markdown(rep), end="")
        else:
            render_bench(rep)

    _run(go)


def main() -> None:
    app()
