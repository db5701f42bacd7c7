"""The server connection set-up (protocol/session.py) on real socket pairs: the secret
handshake over a plain non-blocking socket, TLS over memory BIOs with requests pipelined
behind the proof, a TLS client on a plaintext port, a wrong secret, and a silent peer on
a blocking stream that meets its deadline."""
from __future__ import annotations

import select
import socket
import ssl
import threading
import time

import pytest

from kvpool.protocol import auth
from kvpool.protocol.admission import not_tls
from kvpool.protocol.auth import Security
from kvpool.protocol.errors import AuthFailed
from kvpool.protocol.session import WANT_READ, BIOStream, ServerSession
from tests.test_auth import WRONG, certs  # noqa: F401 - certs: a fixture

SECRET = Security(secret=b"s" * 32)


def _server_hs(sec: Security = SECRET) -> auth.ServerHandshake:
    return auth.ServerHandshake(sec.auth_keys(), auth.DATA, lambda err, head: b"NO")


def _drive(session: ServerSession, sock: socket.socket, wait_s: float = 10.0):
    """Step ``session`` until it is set up; what it returns then."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        got = session.step()
        if not isinstance(got, int):
            return got
        r, w = ([sock], []) if got == WANT_READ else ([], [sock])
        select.select(r, w, [], 0.5)
    raise AssertionError("the session did not finish")


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_the_secret_handshake_on_a_plain_socket_sets_the_role():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(10)
    client = Security(secret=SECRET.secret)
    t, out = _in_thread(lambda: (auth.client_handshake(b, client, auth.DATA, "test"), b.sendall(b"req"))[1])
    s = ServerSession(a, False, _server_hs())
    assert _drive(s, a) == b""  # read no further than the proof
    t.join(10)
    assert out == [None] and s.done and s.role == "cluster"
    assert a.recv(16) == b"req"  # what the peer sent after it is still in the socket


def test_tls_over_memory_bios_then_requests_pipelined_behind_the_proof(certs):  # noqa: F811
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(str(certs / "server.pem"))
    cctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(10)

    def client():
        tb = cctx.wrap_socket(b, server_hostname="localhost")
        auth.client_handshake(tb, Security(secret=SECRET.secret), auth.DATA, "test")
        tb.sendall(b"pipelined")
        return tb.recv(5)

    t, out = _in_thread(client)
    stream = BIOStream(a, sctx)
    s = ServerSession(stream, True, _server_hs())
    got = _drive(s, a)
    end = time.monotonic() + 10
    while b"pipelined" not in got and time.monotonic() < end:
        select.select([a], [], [], 0.5)
        try:
            data = a.recv(4096)
        except BlockingIOError:
            data = b""
        got += stream.decrypt(data)
    assert got == b"pipelined"
    stream.encrypt(b"reply")
    stream.flush()
    t.join(10)
    assert out == [b"reply"] and not stream.pending


def test_a_tls_client_on_a_plaintext_port_is_told_so():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.sendall(b"\x16\x03\x01\x02\x00" + b"\x00" * 40)  # a ClientHello's record header
    s = ServerSession(a, False, _server_hs(), not_tls("test server"))
    with pytest.raises(AuthFailed) as e:
        _drive(s, a)
    assert e.value.fields["cause"] == "tls"
    b.settimeout(5)
    assert b"does not serve TLS" in b.recv(1000)


def test_first_bytes_without_a_secret_are_handed_back():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.sendall(b"\x10\x00\x00\x00request")
    s = ServerSession(a, False, None, not_tls("test server"))
    assert _drive(s, a) == b"\x10\x00\x00\x00request" and s.done


def test_a_wrong_secret_fails_both_sides():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(10)

    def client():
        try:
            auth.client_handshake(b, WRONG, auth.DATA, "test")
        finally:
            b.close()  # the client sees the server's proof fail and hangs up

    t, out = _in_thread(client)
    s = ServerSession(a, False, _server_hs())
    with pytest.raises(AuthFailed) as e:
        _drive(s, a)
    assert e.value.fields["cause"] == "closed"
    t.join(10)
    assert isinstance(out[0], AuthFailed) and out[0].fields["cause"] == "wrong_secret"


def test_a_silent_peer_on_a_blocking_stream_meets_the_deadline():
    a, b = socket.socketpair()
    s = ServerSession(a, False, _server_hs())
    t0 = time.monotonic()
    with pytest.raises(AuthFailed) as e:
        s.finish(time.monotonic() + 0.3)
    assert e.value.fields["cause"] == "timeout" and time.monotonic() - t0 < 5
    b.close()
