"""Byte-stream transports for the data plane, chosen by URI scheme.

``tcp://host:port`` and ``unix:///path`` (``unix://@name``: Linux abstract namespace) are built in; other schemes (``ucx://``) are
registered lazily by module path, so optional dependencies are imported only when
selected (the registry idea of dask's ``distributed/comm/registry.py``). All transports
give a blocking, stream-oriented socket-like object with ``sendall``, ``sendmsg``,
``recv_into`` and ``close``; timeouts are in seconds.
"""
from __future__ import annotations

import importlib
import os
import socket
from typing import Any, Callable

from kvpool.protocol.errors import ConfigError, NodeUnavailable

_LAZY: dict[str, str] = {"ucx": "kvpool.protocol.ucx_transport"}
_CONNECT: dict[str, Callable[[str, float], Any]] = {}
_LISTEN: dict[str, Callable[[str], Any]] = {}
_UPGRADE: dict[str, Callable[[Any, float], Any]] = {}  # scheme -> what a set-up socket becomes (register)

SOCK_BUF = 4 << 20


def split_addr(addr: str) -> tuple[str, str]:
    if "://" not in addr:
        raise ConfigError(f"address {addr!r} has no scheme; use tcp://host:port or unix:///path", key="addr")
    scheme, rest = addr.split("://", 1)
    return scheme, rest


def _tune(s: socket.socket) -> socket.socket:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass
    return s


def _tcp_connect(rest: str, timeout: float) -> socket.socket:
    host, port = rest.rsplit(":", 1)
    s = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _tune(s)


def _unix_path(rest: str) -> str:
    """``@name`` is Linux's abstract namespace (no file; gone when its listener closes)."""
    return "\0" + rest[1:] if rest.startswith("@") else rest


def _unix_connect(rest: str, timeout: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(_unix_path(rest))
    except OSError:
        s.close()
        raise
    return _tune(s)


def _tcp_listen(rest: str) -> socket.socket:
    host, port = rest.rsplit(":", 1)
    host = host.strip("[]")  # an IPv6 host is written in brackets
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, int(port)))
    s.listen(128)
    return _tune(s)


def _unix_listen(rest: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if rest.startswith("@"):
        s.bind(_unix_path(rest))
    else:
        try:
            os.unlink(rest)
        except FileNotFoundError:
            pass
        s.bind(rest)
        os.chmod(rest, 0o600)
    s.listen(128)
    return _tune(s)


_CONNECT.update(tcp=_tcp_connect, unix=_unix_connect)
_LISTEN.update(tcp=_tcp_listen, unix=_unix_listen)


def register(scheme: str, connect: Callable[[str, float], Any], listen: Callable[[str], Any],
             upgrade: Callable[[Any, float], Any] | None = None) -> None:
    """Register a transport for ``scheme`` (called by lazily imported plugin modules).
    ``upgrade(sock, timeout)``: for a transport whose ``connect`` returns a socket to set
    up first (secured like any stream socket), the stream that socket then becomes."""
    _CONNECT[scheme] = connect
    _LISTEN[scheme] = listen
    if upgrade is not None:
        _UPGRADE[scheme] = upgrade


def _load(scheme: str) -> None:
    if scheme in _CONNECT:
        return
    mod = _LAZY.get(scheme)
    if mod is None:
        raise ConfigError(f"unknown transport {scheme!r}; accepted: tcp, unix, {', '.join(_LAZY)}", key="transport")
    try:
        importlib.import_module(mod)
    except ImportError as e:
        raise ConfigError(f"transport {scheme!r} needs an optional dependency ({e}); "
                          f"install it with `pip install kvpool[{scheme}]`", key="transport") from None


def connect(addr: str, timeout: float, security=None, purpose: bytes = b"data") -> Any:
    """Open a stream to ``addr``; raises NodeUnavailable when nothing answers there.
    With ``security`` (a :class:`~protocol.auth.Security`), the stream is secured before
    it is returned: TLS on ``tcp://`` when configured, then the cluster-secret handshake
    for ``purpose`` (``b"rpc"``, ``b"data"``); AuthFailed names a refused handshake."""
    scheme, rest = split_addr(addr)
    _load(scheme)
    try:
        s = _CONNECT[scheme](rest, timeout)
        if security is not None and (security.secret is not None or security.tls):
            from kvpool.protocol.auth import secure_client

            s = secure_client(s, scheme, rest.rsplit(":", 1)[0].strip("[]"), security, purpose, addr)
        up = _UPGRADE.get(scheme)
        if up is not None:
            try:
                s = up(s, timeout)
            except BaseException:
                s.close()
                raise
        return s
    except OSError as e:
        raise NodeUnavailable(f"cannot reach store node at {addr}: {e}; check `kvpool status`",
                              addr=addr) from None


def listen(addr: str) -> Any:
    scheme, rest = split_addr(addr)
    _load(scheme)
    return _LISTEN[scheme](rest)


def primary_address() -> str | None:
    """This machine's primary IPv4 address: the source address of its default route (no
    packet is sent), or None when it has no route off the host."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route lookup matters
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def advertise_host(bind: str, advertise: str | None, key: str) -> str:
    """The host published for a server bound to ``bind``: ``advertise`` when given, else
    ``bind``; a wildcard ``bind`` (``0.0.0.0``, ``::``) without ``advertise`` publishes
    :func:`primary_address`. Raises ConfigError naming ``key`` (e.g. ``master.advertise``)
    when a wildcard bind has no primary address to publish."""
    from kvpool.protocol.config import WILDCARD_HOSTS, check_advertise

    if advertise is not None:
        return check_advertise(advertise, key)
    if bind.strip("[]") not in WILDCARD_HOSTS:
        return bind.strip("[]")
    addr = primary_address()
    if addr is None:
        raise ConfigError(f"bound to {bind or 'every interface'} but this host has no default route to take an "
                          f"address from; pass --advertise HOST (config {key}) with the address other hosts "
                          "reach it at", key=key)
    return addr


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def default_host_id() -> str:
    """Host identity for same-host detection: hostname plus this boot's id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "0"
    return f"{socket.gethostname()}-{boot}"
