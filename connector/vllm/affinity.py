"""CPUs for the connector's worker threads beside a CPU engine's OpenMP team.

A vLLM CPU worker binds its OpenMP team to a CPU list (``VLLM_CPU_OMP_THREADS_BIND``,
``auto`` by default) and keeps the CPUs outside it for the scheduler process and, with a
``kv_transfer_config``, for a KV connector (``vllm/utils/ompmultiprocessing.py``). The
list reaches the worker process as ``OMP_PLACES`` with ``OMP_PROC_BIND``, or as
``GOMP_CPU_AFFINITY`` (libgomp preloaded) or ``KMP_AFFINITY``'s ``proclist`` (Intel
OpenMP preloaded). The OpenMP runtime binds the process's first thread when it loads,
and a new thread starts with the CPU mask of the thread that creates it: left alone, the
connector's load, save and gather threads (and the client threads they start) would run
on the forward pass's CPUs only, with a preloaded OpenMP on its single CPU, while the
CPUs vLLM reserved stay idle. vLLM's NIXL connector moves its transfer work onto the
reserved CPUs; :func:`io_cpus` names them for kvpool's threads (on the team's NUMA
nodes, off its cores' hyperthread siblings and other local ranks' teams, inside the
engine's own CPU mask) and :func:`pin_thread` moves a thread there.

:func:`io_cpus` is pure; :func:`host_topology` reads the host, :func:`pin_thread` makes
the one system call.
"""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_ITEM = re.compile(r"^(\d+)(?:-(\d+)|:(\d+)(?::(\d+))?)?$")


def parse_cpus(text: str) -> set[int] | None:
    """CPU ids named by an OpenMP CPU list: ids and ranges (``0,2-4 7``, GOMP and KMP
    syntax) or places (``{0,1},{2:4}``, ``{start:length[:stride]}``, OpenMP 4.0's
    ``OMP_PLACES`` syntax; ``!`` exclusions and abstract names such as ``cores`` are not
    resolved: None). None for an empty or malformed list."""
    cpus: set[int] = set()
    for item in re.split(r"[,\s]+", text.replace("{", " ").replace("}", " ").strip()):
        m = _ITEM.match(item)
        if m is None:
            return None
        a = int(m.group(1))
        if m.group(2) is not None:
            cpus.update(range(a, int(m.group(2)) + 1))
        elif m.group(3) is not None:
            stride = int(m.group(4) or 1)
            cpus.update(a + i * stride for i in range(int(m.group(3))))
        else:
            cpus.add(a)
    return cpus or None


def omp_cpus(environ: Mapping[str, str]) -> set[int] | None:
    """The CPUs the process's OpenMP team is bound to, from the variables vLLM sets for
    its CPU workers; None when no binding is set (or it cannot be read)."""
    kmp = environ.get("KMP_AFFINITY", "")
    m = re.search(r"proclist=\[([^\]]*)\]", kmp)
    if m and "explicit" in kmp:
        return parse_cpus(m.group(1))
    if environ.get("GOMP_CPU_AFFINITY", "").strip():
        return parse_cpus(environ["GOMP_CPU_AFFINITY"])
    bind = environ.get("OMP_PROC_BIND", "").strip().lower()
    if environ.get("OMP_PLACES", "").strip() and bind not in ("", "false"):
        return parse_cpus(environ["OMP_PLACES"])
    return None


def other_ranks_cpus(environ: Mapping[str, str]) -> set[int]:
    """Every CPU an explicit ``VLLM_CPU_OMP_THREADS_BIND`` gives to any rank's team
    (``0-3|4-7``: one list per local rank); empty for ``auto``, ``nobind`` or unset."""
    out: set[int] = set()
    for part in environ.get("VLLM_CPU_OMP_THREADS_BIND", "").split("|"):
        out |= parse_cpus(part) or set()
    return out


@dataclass(frozen=True)
class Topology:
    """What :func:`io_cpus` needs to know of the host: ``allowed``, the CPUs the engine
    process may use (its taskset/numactl/cpuset mask); ``nodes``, the CPUs of each NUMA
    node; ``siblings``, each CPU's hyperthread siblings (itself included)."""

    allowed: frozenset[int]
    nodes: tuple[frozenset[int], ...] = ()
    siblings: Mapping[int, frozenset[int]] = field(default_factory=dict)


def io_cpus(environ: Mapping[str, str], topo: Topology) -> set[int] | None:
    """CPUs for the connector's threads: the engine's allowed CPUs on the team's NUMA
    nodes that neither the team, their hyperthread siblings, nor another local rank's
    team (an explicit ``VLLM_CPU_OMP_THREADS_BIND``) use: those vLLM reserved. When none
    are left, the team's own CPUs, so that a thread is not confined to the one CPU its
    creator was bound to. None when no OpenMP binding is set: threads keep the mask they
    inherit."""
    omp = omp_cpus(environ)
    if not omp:
        return None
    near = set().union(*(n for n in topo.nodes if n & omp)) if topo.nodes else set(topo.allowed)
    busy = omp | other_ranks_cpus(environ)
    busy |= set().union(*(topo.siblings.get(c, frozenset((c,))) for c in busy))
    free = (near & topo.allowed) - busy
    return free or (omp & topo.allowed) or None


def host_topology() -> Topology | None:
    """The host as :func:`io_cpus` sees it: the parent process's CPU mask (the vLLM
    engine process that made the worker, before any OpenMP binding of the worker's
    own), the NUMA nodes and hyperthread siblings from sysfs. None when the mask cannot
    be read."""
    try:
        allowed = frozenset(os.sched_getaffinity(os.getppid()))
    except (OSError, AttributeError):
        return None
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        cpus = _read_cpus(path)
        if cpus:
            nodes.append(frozenset(cpus))
    siblings = {}
    for c in allowed:
        sib = _read_cpus(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        if sib:
            siblings[c] = frozenset(sib)
    return Topology(allowed, tuple(nodes), siblings)


def _read_cpus(path: str) -> set[int] | None:
    try:
        with open(path) as f:
            return parse_cpus(f.read())
    except OSError:
        return None


def format_cpus(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def pin_thread(cpus: set[int]) -> None:
    """Run the calling thread on ``cpus`` (a ``ThreadPoolExecutor`` initializer). Best
    effort: the kernel keeps only the CPUs the cgroup allows, and a set it allows none of
    leaves the inherited mask."""
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError, AttributeError):  # AttributeError: a platform without it
        pass
