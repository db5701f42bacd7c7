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
    s = socket.create_connection((host, int(port)), timeout=timeout)
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
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
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


def register(scheme: str, connect: Callable[[str, float], Any], listen: Callable[[str], Any]) -> None:
    """Register a transport for ``scheme`` (called by lazily imported plugin modules)."""
    _CONNECT[scheme] = connect
    _LISTEN[scheme] = listen


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


def connect(addr: str, timeout: float) -> Any:
    """Open a stream to ``addr``; raises NodeUnavailable when nothing answers there."""
    scheme, rest = split_addr(addr)
    _load(scheme)
    try:
        return _CONNECT[scheme](rest, timeout)
    except OSError as e:
        raise NodeUnavailable(f"cannot reach store node at {addr}: {e}; check `kvpool status`",
                              addr=addr) from None


def listen(addr: str) -> Any:
    scheme, rest = split_addr(addr)
    _load(scheme)
    return _LISTEN[scheme](rest)


def default_host_id() -> str:
    """Host identity for same-host detection: hostname plus this boot's id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "0"
    return f"{socket.gethostname()}-{boot}"
