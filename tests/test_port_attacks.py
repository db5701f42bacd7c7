"""Every attack against every stream port, on real processes: the matrix an operator's
attacker runs. Ports: the master's RPC port, a store node's data port (TCP, Unix and,
with the ``ucx`` extra, the UCX rendezvous port) and its disk tier's read port (TCP and
Unix). Attacks: no secret, a wrong secret, a role
credential of another cluster, a silent flood at the connection cap, a half-sent frame
after authenticating, and (TCP ports) TLS against plain text and plain text against TLS.
Each is refused with a typed error or a close within its deadline, and an honest peer is
served on the same port afterwards. (The zmq control port: tests/test_auth.py.)"""
from __future__ import annotations

import importlib.util
import socket
import time

import pytest

from kvpool.cli.cluster import LocalCluster
from kvpool.protocol import auth, transport
from kvpool.protocol.auth import Security, write_credential_file
from kvpool.protocol.config import load_config
from kvpool.protocol.dataplane import DataRequest, frame, recv_reply
from kvpool.protocol.errors import AuthFailed, NodeUnavailable
from tests.test_auth import WRONG, _closed, _descs, certs  # noqa: F401 - certs: a fixture

CAP = 16
FRAME_S = 2.0
UCX = importlib.util.find_spec("ucxx") is not None  # the ucx extra (.ci/setup --test installs it)


def _cfg(tmp, **security):
    return load_config(None, {"storenodes": [{"name": "node-0", "memory": "64MiB", "disk_dir": str(tmp / "disk"),
                                              "disk_capacity": "64MiB", "ucx": UCX}],
                              "master": {"replicas": 1},
                              "security": {"max_conns": CAP, "frame_timeout": f"{FRAME_S}s", **security}},
                       environ={})


@pytest.fixture(scope="module")
def lc(tmp_path_factory):
    c = LocalCluster(_cfg(tmp_path_factory.mktemp("attacks")), secure=True)
    c.__enter__()
    try:
        yield c
    finally:
        c.stop()


def _ports(lc) -> dict[str, tuple[str, bytes]]:
    """Port name -> (address, handshake purpose)."""
    d = _descs(lc)[0]
    assert d.disk_addr and d.disk_path
    return {"master": (lc.master_addr, auth.RPC), "data-tcp": (d.data_addr, auth.DATA),
            "data-unix": (d.shm_path, auth.DATA), "disk-tcp": (d.disk_addr, auth.DATA),
            "disk-unix": (d.disk_path, auth.DATA), "data-ucx": (d.ucx_addr, auth.DATA)}


PORTS = ("master", "data-tcp", "data-unix", "disk-tcp", "disk-unix") + (("data-ucx",) if UCX else ())
TCP = ("master", "data-tcp", "disk-tcp")


def _honest(lc, port: str) -> None:
    addr, purpose = _ports(lc)[port]
    s = transport.connect(addr, 10.0, lc.security, purpose)
    try:
        if purpose == auth.DATA:  # a request answered, not only a handshake
            s.settimeout(10)
            s.sendall(frame(DataRequest("ping", "")))
            assert recv_reply(s).ok
    finally:
        s.close()


def _raw(addr: str) -> socket.socket:
    if addr.startswith("ucx://"):  # its rendezvous socket, where the handshake runs
        host, port = addr[len("ucx://"):].rsplit(":", 1)
        s = socket.create_connection((host, int(port)), 5.0)
    else:
        s = transport.connect(addr, 5.0)  # no TLS, no handshake
    s.settimeout(auth.HANDSHAKE_S + FRAME_S + 10)
    return s


@pytest.mark.parametrize("port", PORTS)
def test_no_secret_is_answered_and_closed(lc, port):
    addr, _ = _ports(lc)[port]
    s = _raw(addr)
    try:
        s.sendall(b"\x10\x00\x00\x00" + b"x" * 60)  # a request without any handshake
        assert _closed(s)
    finally:
        s.close()
    _honest(lc, port)


@pytest.mark.parametrize("port", PORTS)
def test_wrong_secret_and_foreign_credential_are_refused(lc, port, tmp_path):
    addr, purpose = _ports(lc)[port]
    foreign = Security.load(write_credential_file(tmp_path / "c", b"f" * 32, "client"))
    for sec in (WRONG, foreign):
        t0 = time.monotonic()
        with pytest.raises(AuthFailed) as e:
            transport.connect(addr, 10.0, sec, purpose).close()
        assert e.value.fields["cause"] == "wrong_secret"
        assert time.monotonic() - t0 < auth.HANDSHAKE_S  # refused at the proof, not at a deadline
    _honest(lc, port)


@pytest.mark.parametrize("port", PORTS)
def test_a_silent_flood_at_the_cap_leaves_honest_peers_served(lc, port):
    addr, _ = _ports(lc)[port]
    flood = [_raw(addr) for _ in range(CAP + 4)]
    try:
        for _ in range(3):
            _honest(lc, port)  # takes the place of the oldest silent handshake
    finally:
        for s in flood:
            s.close()


@pytest.mark.parametrize("port", PORTS)
def test_a_half_sent_frame_is_closed_at_the_frame_deadline(lc, port):
    addr, purpose = _ports(lc)[port]
    s = transport.connect(addr, 10.0, lc.security, purpose)
    try:
        s.settimeout(FRAME_S + 20)
        s.sendall(b"\x40\x00")  # half of a frame's length, then nothing
        t0 = time.monotonic()
        assert _closed(s)
        assert time.monotonic() - t0 >= FRAME_S * 0.5  # closed by the frame deadline, not at once
    finally:
        s.close()
    _honest(lc, port)


def test_tls_and_plain_text_mismatches_are_named_on_every_tcp_port(certs, tmp_path):  # noqa: F811
    server_tls = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server.pem"),
                  "tls_ca": str(certs / "ca.pem")}
    with LocalCluster(_cfg(tmp_path / "plain"), secure=True) as plain, \
            LocalCluster(_cfg(tmp_path / "tls", **server_tls), secure=True) as tls:
        tls_client = Security(plain.security.secret, tls_ca=str(certs / "ca.pem"))
        plain_client = Security(tls.security.secret)
        for port in TCP:
            addr, purpose = _ports(plain)[port]
            t0 = time.monotonic()
            with pytest.raises(AuthFailed) as e:  # TLS against a plain-text port
                transport.connect(addr, 10.0, tls_client, purpose).close()
            assert e.value.fields["cause"] in ("tls_mismatch", "closed"), (port, e.value)
            addr, purpose = _ports(tls)[port]
            with pytest.raises((AuthFailed, NodeUnavailable)):  # plain text against a TLS port
                transport.connect(addr, 10.0, plain_client, purpose).close()
            assert time.monotonic() - t0 < 2 * auth.HANDSHAKE_S + 2, port  # named, not waited out
            _honest(plain, port)
            _honest(tls, port)
