"""Hosts simulated with Linux network namespaces, for multi-host and partition tests.

A :class:`Net` makes one namespace per host and one per *switch* namespace holding the
bridges (so nothing is added to the test machine's own namespace), joins hosts to
bridges with veth pairs, and takes everything down again in :meth:`Net.close` (deleting
a namespace deletes its links). A host may sit on several bridges (subnets); cutting one
of its links (:meth:`Net.cut`) takes that host off that subnet only, both ways, while its
other links keep working: e.g. etcd alone on its own subnet, and one master cut from it
while clients and store nodes still reach that master.

Needs root and ``ip`` (iproute2); :func:`require` skips a test when the kernel refuses
namespaces (an unprivileged container), and fails it when ``ip`` is missing (install
iproute2, see ``.ci/setup``).

    with Net("fence") as net:
        lan, back = net.bridge("lan", "10.201.0"), net.bridge("etcd", "10.201.1")
        a = net.host("a"); ip_a = net.link(a, lan); net.link(a, back)
        proc = net.popen(a, ["python", "-c", "..."])
        net.cut(a, back); ...; net.restore(a, back)
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=20)


def require() -> None:
    """Skip unless this process may create network namespaces (root, a kernel that lets
    it); fail when ``ip`` itself is missing (a setup error, not a kernel limit)."""
    if shutil.which("ip") is None:
        pytest.fail("the `ip` command (iproute2) is missing; install it (`.ci/setup --test` does)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    probe = f"kvp-probe-{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        pytest.skip(f"the kernel refuses network namespaces here: {r.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


@dataclass
class Bridge:
    name: str
    dev: str  # the bridge device in the switch namespace
    prefix: str  # first three octets of a /24, e.g. "10.201.0"
    hosts: int = 0  # addresses handed out so far (.1 upwards)


@dataclass
class Host:
    name: str
    ns: str
    links: dict[str, tuple[str, str]] = field(default_factory=dict)  # bridge -> (device in ns, address)

    def addr(self, bridge: Bridge) -> str:
        return self.links[bridge.name][1]


class Net:
    """Namespaces named ``kvp<tag><pid>-<host>``, short enough for Linux's 15-byte link
    names (veths are ``v<n>`` / ``b<n>`` with a per-Net counter). Use as a context manager
    (or call :meth:`close`): every namespace it made is deleted, every process it started
    (:meth:`popen`) is killed first."""

    def __init__(self, tag: str) -> None:
        self.base = f"kvp{tag[:4]}{os.getpid() % 100000}"
        self.switch = f"{self.base}-sw"
        self.namespaces: list[str] = []
        self.bridges: dict[str, Bridge] = {}
        self.procs: list[subprocess.Popen] = []
        self._n = 0
        self._add_ns(self.switch)

    def __enter__(self) -> "Net":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "set", "lo", "up", ns=ns)

    def bridge(self, name: str, prefix: str) -> Bridge:
        """A bridge (one /24 subnet, ``prefix.0/24``) in the switch namespace."""
        dev = f"br{len(self.bridges)}"
        _ip("link", "add", dev, "type", "bridge", ns=self.switch)
        _ip("link", "set", dev, "up", ns=self.switch)
        b = self.bridges[name] = Bridge(name, dev, prefix)
        return b

    def host(self, name: str) -> Host:
        ns = f"{self.base}-{name}"
        self._add_ns(ns)
        return Host(name, ns)

    def link(self, host: Host, bridge: Bridge) -> str:
        """Join ``host`` to ``bridge`` with a veth pair; the host's address there (``/24``)."""
        self._n += 1
        inner, outer = f"v{self._n}", f"b{self._n}"
        _ip("link", "add", inner, "netns", host.ns, "type", "veth", "peer", "name", outer, "netns", self.switch)
        _ip("link", "set", outer, "master", bridge.dev, ns=self.switch)
        _ip("link", "set", outer, "up", ns=self.switch)
        bridge.hosts += 1
        addr = f"{bridge.prefix}.{bridge.hosts}"
        _ip("addr", "add", f"{addr}/24", "dev", inner, ns=host.ns)
        _ip("link", "set", inner, "up", ns=host.ns)
        host.links[bridge.name] = (inner, addr)
        return addr

    def cut(self, host: Host, bridge: Bridge) -> None:
        """Take ``host``'s link to ``bridge`` down: no packet either way on that subnet (the
        host's route to it goes with the link, so its connections there fail)."""
        _ip("link", "set", host.links[bridge.name][0], "down", ns=host.ns)

    def restore(self, host: Host, bridge: Bridge) -> None:
        """Bring the link back (address and subnet route return with it)."""
        _ip("link", "set", host.links[bridge.name][0], "up", ns=host.ns)

    def argv(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.ns, *argv]

    def popen(self, host: Host, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in ``host``'s namespace (its own session, killed by :meth:`close`)."""
        p = subprocess.Popen(self.argv(host, argv), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self.namespaces):
            _ip("netns", "del", ns, check=False)
        self.namespaces.clear()


def own_host(hostname: str, argv: list[str], private_dirs: tuple[str, ...] = ()) -> list[str]:
    """``argv`` with its own hostname (a UTS namespace) and, for each of ``private_dirs``, a
    fresh tmpfs over that directory seen by this process alone (a mount namespace): what a
    separate machine gives, where a network namespace alone shares the hostname and every
    file (so also every Unix socket path) with the test machine. Compose with
    :meth:`Net.argv`: ``net.argv(host, own_host("h1", cmd))``."""
    script = 'echo "$0" > /proc/sys/kernel/hostname && ' + "".join(
        f'mount -t tmpfs kvp-{i} "${i + 1}" && ' for i in range(len(private_dirs))) + \
        f'shift {len(private_dirs)} && exec "$@"'
    return ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script, hostname,
            *private_dirs, *argv]
