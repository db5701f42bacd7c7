"""Admission of connections to a server port: the cap, handshake deadlines, refusals.

Every kvpool server port (the master's RPC port, a store node's data ports over TCP and
Unix) admits connections by the same rules, kept here once:

* at most ``max_conns`` connections are held. One accepted at the cap takes the place of
  the oldest connection still in its handshake (that one is closed: ``handshake_evicted``),
  so peers that open connections and stay silent cannot lock honest clients out for the
  handshake deadline; with none in a handshake it is refused (``max_conns``) with
  :func:`overloaded`, written by :func:`refuse` in what the peer reads first;
* a connection must finish TLS and the cluster-secret handshake (:mod:`protocol.auth`)
  within ``handshake_s`` (:data:`protocol.auth.HANDSHAKE_S`) of its accept
  (``handshake_timeout``);
* a plaintext port answers a connection that opens with a TLS record in plain text
  (:func:`not_tls`) and closes it, so the client's TLS handshake fails at once (``tls``).

:class:`Admission` is the state (no sockets: each server's loop does the I/O and asks it);
``refusals`` counts closed connections by reason (:data:`REASONS`), which the servers export.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from kvpool.protocol import auth
from kvpool.protocol.errors import KVPoolError, Overloaded

TLS_RECORD = b"\x16\x03"  # how a TLS ClientHello starts: a handshake record of version 3.x (RFC 8446 §5.1)
REASONS = ("max_conns", "auth", "tls", "handshake_timeout", "handshake_evicted", "frame_timeout")

C = TypeVar("C", bound=Hashable)


class Admission(Generic[C]):
    """The cap and the handshake deadlines of one server's connections ``C`` (any hashable
    handle). Not thread-safe: one thread (the server's loop or selector) owns it."""

    def __init__(self, max_conns: int, handshake_s: float = auth.HANDSHAKE_S) -> None:
        self.max_conns = max_conns
        self.handshake_s = handshake_s
        self._handshaking: dict[C, float] = {}  # deadline (monotonic seconds), in accept order
        self.refusals: dict[str, int] = dict.fromkeys(REASONS, 0)

    def handshaking(self) -> int:
        """How many connections are in their handshake."""
        return len(self._handshaking)

    def admit(self, held: int) -> tuple[bool, C | None]:
        """A connection was accepted while ``held`` were held: ``(admitted, victim)``. At the
        cap the oldest connection in its handshake is the victim (close it; it is forgotten
        here), and with none the new one is refused (counted)."""
        if held < self.max_conns:
            return True, None
        victim = next(iter(self._handshaking), None)
        if victim is None:
            self.refusals["max_conns"] += 1
            return False, None
        del self._handshaking[victim]
        self.refusals["handshake_evicted"] += 1
        return True, victim

    def start(self, conn: C, now: float) -> None:
        """``conn`` begins its handshake at ``now`` (it must finish by ``now + handshake_s``)."""
        self._handshaking[conn] = now + self.handshake_s

    def done(self, conn: C) -> None:
        """``conn`` finished its handshake, or was closed."""
        self._handshaking.pop(conn, None)

    def deadline(self, conn: C) -> float | None:
        """When ``conn``'s handshake must be done (None: not in one)."""
        return self._handshaking.get(conn)

    def expired(self, now: float) -> list[C]:
        """Connections whose handshake deadline passed (forgotten here, counted): close them."""
        out = []
        for conn, deadline in self._handshaking.items():  # deadlines grow in accept order
            if deadline > now:
                break
            out.append(conn)
        for conn in out:
            del self._handshaking[conn]
        self.refusals["handshake_timeout"] += len(out)
        return out


def overloaded(server: str, max_conns: int) -> Overloaded:
    """The error a connection refused at the cap is told; ``server`` names the port's owner."""
    return Overloaded(f"{server} holds its maximum of {max_conns} connections (security.max_conns); retry "
                      "later, or raise it", max_conns=max_conns)


def refuse(sock, err: KVPoolError, *, secret: bool, tls: bool, framed: Callable[[KVPoolError], bytes]) -> None:
    """Tell a refused peer ``err`` in what it reads first, then close ``sock``: the secret
    handshake's refusal on a port with a secret, else ``framed(err)`` (an error reply in
    the port's framing); nothing under TLS (no session to say it in)."""
    if not tls:
        msg = auth.refusal(err.message) if secret else framed(err)
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(msg)  # a fresh connection's socket buffer holds these bytes
    with contextlib.suppress(OSError):
        sock.close()


def not_tls(server: str) -> bytes:
    """What a plaintext port sends a client that opened with TLS, before closing."""
    return (f"kvpool {server}: this port does not serve TLS; give the {server} security.tls_cert and "
            "security.tls_key, or connect without security.tls_ca\n").encode()
