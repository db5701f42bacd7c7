"""The ``kvpool`` typer app: cluster processes (up, master, storenode), objects (put, get,
ls, rm, pin, unpin), admin (status, evict, drain), the P/D proxy, demo and bench."""
from __future__ import annotations

import json
import re
import signal
import sys
import threading
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer
from rich.markup import escape
from rich.table import Table

from kvpool.cli.common import (ClusterOpt, ConfigOpt, EtcdOpt, JsonOpt, MasterOpt, build_config, claim_record, connect,
                        console, fail, release_record, write_record)
from kvpool.protocol import errors as E
from kvpool.protocol import messages as M
from kvpool.protocol.config import MasterConfig
from kvpool.protocol.units import format_bytes, parse_duration, parse_size

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="kvpool: a distributed KV-cache store for LLM inference.")


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
                lc = LocalCluster(cfg)
                if lc.owns_run_dir:  # named from the start: a kill -9 while starting leaves nothing behind
                    write_record(f, {"run_dir": lc.run_dir})
                lc.__enter__()
        except BaseException:
            release_record(f)
            raise
        try:
            write_record(f, {"master": lc.master_addr, "etcd": lc.etcd_endpoint,
                             "run_dir": lc.run_dir if lc.owns_run_dir else ""})
            console.print(f"[green]cluster {cfg.cluster!r} up[/]: etcd {lc.etcd_endpoint}, master {lc.master_addr}, "
                          f"{len(lc.nodes)} store nodes. Ctrl-C to stop.", soft_wrap=True)
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


_MASTER = MasterConfig()  # defaults of the flags below that the config also has


@app.command()
def master(etcd: Annotated[str, typer.Option(help="etcd endpoint http://host:port, several comma-separated")],
           cluster: Annotated[str, typer.Option()] = "default",
           host: Annotated[str, typer.Option()] = "127.0.0.1",
           rpc_port: Annotated[int, typer.Option(help="0 = any free port")] = 0,
           metrics_port: Annotated[Optional[int], typer.Option(help="Serve Prometheus /metrics here")] = None,
           replicas: Annotated[int, typer.Option()] = 1,
           lease_ttl: Annotated[str, typer.Option()] = "5s",
           put_timeout: Annotated[str, typer.Option()] = "30s",
           quarantine: Annotated[str, typer.Option()] = "5s",
           node_ttl: Annotated[str, typer.Option()] = "3s",
           high_watermark: Annotated[float, typer.Option()] = 0.90,
           low_watermark: Annotated[float, typer.Option()] = 0.80,
           max_handoff_ttl: Annotated[str, typer.Option(help="Longest hold a hand-off may ask for")] = "24h",
           membership_poll: Annotated[str, typer.Option()] = "250ms",
           etcd_compaction_interval: Annotated[str, typer.Option(help="How often the leader compacts etcd's "
                                               "history (0 = never)")] = str(_MASTER.etcd_compaction_interval),
           etcd_compaction_retention: Annotated[int, typer.Option(
               help="Revisions of history that compaction keeps")] = _MASTER.etcd_compaction_retention,
           repair_rate: Annotated[float, typer.Option(help="Re-replication copies started per second "
                                                           "(average)")] = _MASTER.repair_rate,
           repair_in_flight: Annotated[int, typer.Option(help="Re-replication copies in flight at "
                                                              "most")] = _MASTER.repair_in_flight) -> None:
    """Run one master (several may run; one leads through etcd election)."""
    from kvpool.master.server import MasterServerSettings, main as run_master
    from kvpool.master.state import MasterSettings
    from kvpool.protocol.etcd import parse_endpoints

    def go() -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise E.ConfigError("need 0 < --low-watermark <= --high-watermark <= 1", key="watermark")
        st = MasterSettings(replicas, parse_duration(lease_ttl, key="lease_ttl"),
                            parse_duration(put_timeout, key="put_timeout"),
                            parse_duration(quarantine, key="quarantine"), high_watermark, low_watermark,
                            parse_duration(max_handoff_ttl, key="max_handoff_ttl"),
                            suspect_s=parse_duration(node_ttl, key="node_ttl"))
        st.check()  # the first leader records these as the cluster's settings: same bounds as `settings --set`
        parse_endpoints(etcd, key="--etcd")
        if etcd_compaction_retention < 0:
            raise E.ConfigError(f"--etcd-compaction-retention {etcd_compaction_retention}: a number of revisions "
                                ">= 0", key="etcd_compaction_retention")
        MasterConfig(repair_rate=repair_rate, repair_in_flight=repair_in_flight).check_repair("--")
        st = msgspec.structs.replace(st, repair_rate=repair_rate, repair_in_flight=repair_in_flight)
        run_master(MasterServerSettings(etcd, cluster, host, rpc_port, metrics_port,
                                        parse_duration(membership_poll, key="membership_poll"),
                                        parse_duration(node_ttl, key="node_ttl"), st,
                                        parse_duration(etcd_compaction_interval, key="etcd_compaction_interval"),
                                        etcd_compaction_retention))

    _run(go)


@app.command()
def storenode(etcd: Annotated[str, typer.Option(help="etcd endpoint http://host:port, several comma-separated")],
              cluster: Annotated[str, typer.Option()] = "default",
              name: Annotated[Optional[str], typer.Option(help="Node id (default: random)")] = None,
              memory: Annotated[str, typer.Option(help="Segment size, e.g. 2GiB")] = "1GiB",
              host: Annotated[str, typer.Option()] = "127.0.0.1",
              data_port: Annotated[int, typer.Option()] = 0,
              host_id: Annotated[Optional[str], typer.Option(help="Override host identity")] = None,
              node_ttl: Annotated[str, typer.Option()] = "3s",
              run_dir: Annotated[Optional[str], typer.Option()] = None,
              device: Annotated[str, typer.Option(
                  help="cpu (shared memory) or cuda:N (device memory, served through pinned staging)")] = "cpu",
              ucx: Annotated[bool, typer.Option(
                  help="Also serve data on ucx:// (needs the ucx extra: pip install kvpool\\[ucx])")] = False) -> None:
    """Run one store node with a segment of --memory bytes (shared memory, or GPU memory with --device cuda:N)."""
    from kvpool.protocol.etcd import parse_endpoints
    from kvpool.storenode.server import NodeSettings, main as run_node

    def go() -> None:
        parse_endpoints(etcd, key="--etcd")
        if parse_size(memory, key="memory") < (1 << 20):
            raise E.ConfigError(f"--memory {memory}: a segment needs at least 1MiB", key="memory")
        if name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise E.ConfigError(f"--name {name!r}: use letters, digits, '_', '.', '-'", key="name")
        dev = device
        if device != "cpu":
            from kvpool.storenode.device_segment import check_device

            dev = check_device(device, parse_size(memory, key="memory"))  # "cuda" -> "cuda:0"
        run_node(NodeSettings(etcd, cluster, name, parse_size(memory, key="memory"), host, data_port, host_id,
                              parse_duration(node_ttl, key="node_ttl"), run_dir, dev, ucx))

    _run(go)


# ---- objects --------------------------------------------------------------------------------

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
            extra = (r.kind, ",".join(r.nodes), f"{r.age_s:.0f}s", f"{r.idle_s:.0f}s ago",
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


# ---- admin ----------------------------------------------------------------------------------

@app.command()
def status(json_: JsonOpt = False, config: ConfigOpt = None, master: MasterOpt = None, etcd: EtcdOpt = None,
           cluster: ClusterOpt = None) -> None:
    """Cluster table: leader, nodes (address, host, device, capacity, used, objects, alive), totals."""
    def go() -> None:
        with connect(config, master, etcd, cluster) as c:
            st = c.stats()
        if json_:
            print(msgspec.json.encode(st).decode())
            return
        console.print(f"cluster [bold]{st.cluster}[/]  leader [bold]{st.leader}[/]")
        t = Table("node", "address", "host", "device", "capacity", "used", "use %", "objects", "alive")
        for n in st.nodes:
            pct = 100 * n.used / n.capacity if n.capacity else 0
            mark = "[red]" if pct > 100 * st.high_watermark else ""
            t.add_row(n.node_id + (" (draining)" if n.draining else ""), n.data_addr, n.host_id, n.device,
                      format_bytes(n.capacity), format_bytes(n.used), f"{mark}{pct:.1f}",
                      str(n.objects), "yes" if n.alive else "no")
        t.add_row("[bold]total", "", "", "", format_bytes(st.capacity), format_bytes(st.used),
                  f"{100 * st.used / st.capacity if st.capacity else 0:.1f}", str(st.objects), "")
        console.print(t)
        for nid, wire in sorted(st.refused.items()):
            console.print(f"[red]store node {nid} is not used: it speaks kvpool wire version {wire}, this "
                          f"cluster's master {M.WIRE_VERSION}; install this release there and restart it")
        for nid, why in sorted(st.joining.items()):
            console.print(f"[yellow]store node {escape(nid)} is not taken in yet (nothing is placed there): "
                          f"{escape(why)}", highlight=False)
        ev = {k: v for k, v in st.counters.items() if k.startswith("evictions_")}
        console.print(f"watermarks high {st.high_watermark:.2f} / low {st.low_watermark:.2f}; pending puts "
                      f"{st.pending}; held {format_bytes(st.held_bytes)}; under-replicated {st.under_replicated}")
        console.print("evictions: " + (", ".join(f"{k[10:]} {v}" for k, v in sorted(ev.items())) or "none"))
        rs, rd = st.counters.get("repairs_started", 0), st.counters.get("repairs_done", 0)
        if rs or st.under_replicated:
            failed = st.counters.get("repairs_failed", 0)
            console.print(f"repair: {rd}/{rs} copies done, {st.repairs_in_flight} in flight"
                          + (f", {failed} failed (retried)" if failed else "")
                          + f", {st.under_replicated} object(s) under-replicated")

    _run(go)


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
def evict(key: Annotated[Optional[str], typer.Option()] = None,
          prefix: Annotated[Optional[str], typer.Option()] = None,
          model: Annotated[Optional[str], typer.Option()] = None,
          node: Annotated[Optional[str], typer.Option()] = None,
          older_than: Annotated[Optional[str], typer.Option(help="e.g. 10m")] = None,
          all_: Annotated[bool, typer.Option("--all")] = False,
          dry_run: Annotated[bool, typer.Option("--dry-run")] = False,
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
        console.print(f"{verb} {rep.removed} object(s) / {format_bytes(rep.removed_bytes)}; skipped "
                      f"{rep.skipped_leased + rep.skipped_pinned + rep.skipped_held}: leased {rep.skipped_leased}, "
                      f"pinned {rep.skipped_pinned}, held {rep.skipped_held}")

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
def proxy(prefill: Annotated[list[str], typer.Option(
              "--prefill", help="Prefill (kv_producer) vLLM server URL, e.g. http://127.0.0.1:8100; repeatable")],
          decode: Annotated[list[str], typer.Option(
              "--decode", help="Decode (kv_consumer) vLLM server URL; repeatable")],
          host: Annotated[str, typer.Option()] = "127.0.0.1",
          port: Annotated[int, typer.Option(help="0 = any free port")] = 8000,
          health_interval: Annotated[str, typer.Option(help="Between health checks of every server")] = "2s",
          timeout: Annotated[str, typer.Option(help="Deadline of one backend request, a whole stream included")
                             ] = "300s",
          master: Annotated[Optional[str], typer.Option(
              "--master", help="kvpool master tcp://host:port: release the hand-offs no decode server took")] = None,
          etcd: Annotated[Optional[str], typer.Option(
              "--etcd", help="kvpool etcd http://host:port (instead of --master)")] = None,
          cluster: Annotated[str, typer.Option(help="Cluster name, with --etcd")] = "default") -> None:
    """OpenAI-compatible front for prefill/decode vLLM pools: prefill with max_tokens=1, then decode with its
    kv_transfer_params (README: router contract). Serves /v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics until Ctrl-C."""
    from kvpool.cli.proxy import ProxySettings, run_proxy

    def go() -> None:
        run_proxy(ProxySettings(list(prefill), list(decode), host, port,
                                parse_duration(health_interval, key="health_interval"),
                                parse_duration(timeout, key="timeout"), master, etcd, cluster))

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
            lc = LocalCluster(cfg)
            lc.__enter__()
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


@app.command()
def bench(sizes: Annotated[str, typer.Option(help="Object sizes, comma separated")] = "64KiB,1MiB,4MiB",
          clients: Annotated[str, typer.Option(help="Concurrent client processes, comma separated")] = "1",
          batches: Annotated[str, typer.Option(help="Objects per batch call, comma separated")] = "1",
          replicas: Annotated[str, typer.Option(help="Replica counts, comma separated")] = "1",
          total: Annotated[str, typer.Option(help="Bytes moved per cell")] = "256MiB",
          transport: Annotated[str, typer.Option(
              help="Data paths, comma separated: auto (shared memory on the same host), tcp, unix")] = "auto",
          metadata: Annotated[bool, typer.Option(help="Also measure master metadata ops/s")] = False,
          baseline: Annotated[Optional[str], typer.Option(help="Peer to run the same workload against: redis")] = None,
          repeat: Annotated[int, typer.Option(help="Repeats per cell (best kept)")] = 1,
          streams: Annotated[int, typer.Option(help="Network connections per store node per batch (1-16)")] = 1,
          json_: JsonOpt = False, config: ConfigOpt = None) -> None:
    """Throughput and latency of put/get beside the memcpy and raw-socket ceilings."""
    from kvpool.cli.bench import render_bench, run_bench

    def go() -> None:
        if baseline not in (None, "redis"):
            raise E.ConfigError(f"--baseline {baseline!r}; accepted: redis", key="baseline")
        if not 1 <= streams <= 16:
            raise E.ConfigError(f"--streams {streams}; accepted: 1 to 16", key="streams")
        if repeat < 1:
            raise E.ConfigError(f"--repeat {repeat}; at least 1 run per cell", key="repeat")
        cfg = build_config(config)
        rep = run_bench(cfg, [parse_size(s.strip()) for s in sizes.split(",")],
                        [int(c) for c in clients.split(",")], parse_size(total), transport, metadata,
                        progress=not json_, batches=[int(b) for b in batches.split(",")],
                        replicas=[int(r) for r in replicas.split(",")], baseline=baseline, repeat=repeat,
                        streams=streams)
        if json_:
            print(json.dumps(rep, indent=2))
        else:
            render_bench(rep)

    _run(go)


def main() -> None:
    app()
