"""Authentication and TLS on every socket (protocol/auth.py), on real processes.

A cluster with a secret refuses peers without it, or with another one, on the master's RPC
port, the store nodes' data ports and their zmq control ports; a refused peer gets a typed
AuthFailed naming the cause, and nothing of the cluster's data changes. TLS round trips use
certificates made by ``trustme``."""
from __future__ import annotations

import asyncio
import socket
import ssl
import time

import msgspec
import pytest
import zmq

from tests.conftest import wait_for
from kvpool.cli.cluster import LocalCluster
from kvpool.connector.client import KVPoolClient
from kvpool.protocol import auth, transport
from kvpool.protocol import messages as M
from kvpool.protocol.auth import Security
from kvpool.protocol.config import load_config
from kvpool.protocol.dataplane import DataReply, DataRequest, frame, recv_reply
from kvpool.protocol.errors import AuthFailed, NodeUnavailable
from kvpool.protocol.etcd import Etcd, Keys

WRONG = Security(secret=b"not-the-cluster-secret-at-all-0123")


def _cfg(security: dict | None = None, **over):
    tree = {"storenodes": [{"name": f"node-{i}", "memory": "64MiB"} for i in range(2)], **over}
    if security:
        tree["security"] = security
    return load_config(None, tree, environ={})


@pytest.fixture(scope="module")
def secure():
    lc = LocalCluster(_cfg(), secure=True)
    lc.__enter__()
    try:
        assert lc.secret_file and lc.security.secret
        yield lc
    finally:
        lc.stop()


def _closed(s: socket.socket) -> bool:
    """The server closed ``s`` (EOF after what it sent, at most 64 KiB; or a reset for bytes
    it did not read)."""
    try:
        for _ in range(64):
            if s.recv(1024) == b"":
                return True
        return False
    except ConnectionResetError:
        return True


def _descs(lc: LocalCluster) -> list[M.NodeDesc]:
    async def go():
        async with Etcd(lc.etcd_endpoint) as e:
            return [msgspec.msgpack.decode(v, type=M.NodeDesc)
                    for v in (await e.get_prefix(Keys(lc.cfg.cluster).nodes)).values()]
    return asyncio.run(go())


def test_secret_file_is_private_and_grant_keys_are_not_published(secure):
    import os
    import stat

    assert stat.S_IMODE(os.stat(secure.secret_file).st_mode) == 0o600
    descs = _descs(secure)
    assert len(descs) == 2 and all(d.grant_key == b"" for d in descs)


def test_master_rpc_refuses_missing_and_wrong_secret(secure):
    with secure.client() as c:
        c.put("k", b"v" * 100)
    t0 = time.monotonic()
    with pytest.raises(AuthFailed) as e:
        with KVPoolClient(secure.master_addr, security=Security(), rpc_timeout_s=5) as c:
            c.get("k")
    assert e.value.fields["cause"] == "missing_secret"
    with pytest.raises(AuthFailed) as e:
        with KVPoolClient(secure.master_addr, security=WRONG, rpc_timeout_s=5) as c:
            c.get("k")
    assert e.value.fields["cause"] == "wrong_secret"
    assert time.monotonic() - t0 < 5  # refused at once, not after the RPC timeout
    with secure.client() as c:
        assert c.get("k") == b"v" * 100


def test_open_master_is_named_by_a_client_with_a_secret(make_cluster):
    lc = make_cluster(nodes=1, memory="32MiB")
    with pytest.raises(AuthFailed) as e:
        with KVPoolClient(lc.master_addr, security=WRONG, rpc_timeout_s=5) as c:
            c.stats()
    assert e.value.fields["cause"] == "server_without_secret"


def test_data_port_refuses_missing_and_wrong_secret(secure):
    for d in _descs(secure):
        for addr in (d.data_addr, d.shm_path):
            s = transport.connect(addr, 5.0)  # no handshake: a plain request is answered with the error
            try:
                s.sendall(frame(DataRequest("ping", "")))
                s.settimeout(5)
                rep: DataReply = recv_reply(s)
                assert not rep.ok and rep.error.code == "auth_failed"
                assert _closed(s)
            finally:
                s.close()
            with pytest.raises(AuthFailed) as e:
                transport.connect(addr, 5.0, WRONG)
            assert e.value.fields["cause"] == "wrong_secret"
            good = transport.connect(addr, 5.0, secure.security)
            good.sendall(frame(DataRequest("ping", "")))
            assert recv_reply(good).ok
            good.close()


def test_shared_memory_map_needs_the_secret(secure):
    d = _descs(secure)[0]
    s = transport.connect(d.shm_path, 5.0)
    try:
        s.sendall(frame(DataRequest("map", d.incarnation)))
        s.settimeout(5)
        msg, fds, _, _ = socket.recv_fds(s, 1 << 16, 1)
        assert fds == [] and b"auth_failed" in msg
    finally:
        s.close()


def _ctrl(d: M.NodeDesc, keys: tuple[bytes, bytes, bytes] | None):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(d.ctrl_addr)
    return sock


def _ask_list(sock, wait_s: float, term: int = 0):
    sock.send(M.encode(M.NodeList(term=term)))
    if sock.poll(int(wait_s * 1000)):
        return msgspec.msgpack.decode(sock.recv(), type=M.Reply)
    return None


def test_control_port_refuses_missing_and_wrong_secret(secure):
    with secure.client() as c:
        for i in range(5):
            c.put(f"ctl-{i}", bytes([i]) * 4096)
    fake_pk, fake_sk = zmq.curve_keypair()
    spk = auth.curve_client_keys(secure.security)[0]
    for d in _descs(secure):
        good = _ctrl(d, auth.curve_client_keys(secure.security))
        rep = _ask_list(good, 5.0)
        assert rep is not None  # the master's derived keys get in
        term = rep.error.fields.get("term", 0) if rep.error is not None else 0  # the leader's, as the node knows it
        rep = _ask_list(good, 5.0, term)
        assert rep is not None and rep.error is None
        rows = msgspec.msgpack.decode(rep.result)[1]
        extents = [(r[1], r[3]) for r in rows]  # (offset, gen) of every committed extent
        good.close()
        for keys in (None, auth.curve_client_keys(WRONG), (spk, fake_pk, fake_sk)):
            bad = _ctrl(d, keys)
            for _ in range(50):  # a flood of frees of every extent
                bad.send(M.encode(M.NodeFree(extents, term=term)), zmq.NOBLOCK)
            assert _ask_list(bad, 1.0, term) is None  # nothing gets through, not even an answer
            bad.close()
    with secure.client() as c:
        for i in range(5):
            assert c.get(f"ctl-{i}") == bytes([i]) * 4096


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    import trustme

    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(d / "server.pem"))
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other = trustme.CA()
    other.cert_pem.write_to_path(str(d / "other-ca.pem"))
    client = ca.issue_cert("kvpool-client")
    client.private_key_and_cert_chain_pem.write_to_path(str(d / "client.pem"))
    return d


def test_tls_round_trip(certs):
    sec = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server.pem"), "tls_ca": str(certs / "ca.pem")}
    lc = LocalCluster(_cfg(sec), secure=True)
    with lc:
        assert lc.security.tls and lc.security.secret
        # another host id: data moves over TCP (the RPC's Hello goes over TLS, then to the Unix alias)
        with lc.client(host_id="elsewhere", transport="tcp") as c:
            c.put("tls", b"t" * 300_000)
            assert c.get("tls") == b"t" * 300_000
            streams = list(c.data.conns.thread_streams().values())
            assert streams and all(isinstance(st.sock, ssl.SSLSocket) for st in streams)
        d = _descs(lc)[0]
        with pytest.raises(AuthFailed) as e:  # a CA that did not sign the server's certificate
            transport.connect(d.data_addr, 5.0, Security(lc.security.secret, tls_ca=str(certs / "other-ca.pem")))
        assert e.value.fields["cause"] == "tls_verify"
        with pytest.raises(AuthFailed):  # plaintext against TLS: refused, the cluster keeps serving
            transport.connect(d.data_addr, 5.0, Security(lc.security.secret))
        with pytest.raises((AuthFailed, NodeUnavailable)):
            with KVPoolClient(lc.master_addr, host_id="elsewhere", transport="tcp", rpc_timeout_s=3,
                              security=Security(lc.security.secret)) as c:
                c.stats()
        with lc.client(host_id="elsewhere", transport="tcp") as c:
            assert c.get("tls") == b"t" * 300_000


def test_a_tls_client_of_a_plaintext_master_is_told_so(certs, make_cluster):
    """The master answers a TLS handshake on its plaintext port in plain text and closes:
    the client raises AuthFailed(tls_mismatch) at once instead of retrying to its deadline
    (a Timeout after 120 s here); plaintext clients are served as before."""
    lc = make_cluster(nodes=1, memory="32MiB")
    tls = Security(tls_ca=str(certs / "ca.pem"))
    with pytest.raises(AuthFailed) as e:
        with KVPoolClient(lc.master_addr, security=tls, rpc_timeout_s=120) as c:
            c.stats()
    assert e.value.fields["cause"] == "tls_mismatch" and "does not serve TLS" in e.value.message
    with lc.client() as c:
        assert c.put("plain", b"p" * 100) is True and c.get("plain") == b"p" * 100


def test_tls_client_certificates(certs):
    sec = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server.pem"),
           "tls_ca": str(certs / "ca.pem"), "tls_client_certs": True}
    lc = LocalCluster(_cfg(sec), secure=True)
    with lc:
        d = _descs(lc)[0]
        client_sec = Security(lc.security.secret, tls_cert=str(certs / "client.pem"), tls_key=str(certs / "client.pem"),
                              tls_ca=str(certs / "ca.pem"), tls_client_certs=True)
        s = transport.connect(d.data_addr, 5.0, client_sec)
        s.close()
        no_cert = Security(lc.security.secret, tls_ca=str(certs / "ca.pem"))
        with pytest.raises((AuthFailed, NodeUnavailable)):
            s = transport.connect(d.data_addr, 5.0, no_cert)
            s.sendall(frame(DataRequest("ping", "")))
            s.settimeout(5)
            if s.recv(1) == b"":
                raise NodeUnavailable("closed")
        with KVPoolClient(lc.master_addr, host_id="elsewhere", transport="tcp", security=client_sec) as c:
            c.put("mtls", b"m" * 1000)
            assert c.get("mtls") == b"m" * 1000


def test_config_errors_name_the_key(tmp_path):
    from kvpool.protocol.errors import ConfigError

    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="at least 16"):
        Security.load(secret_file=str(short))
    with pytest.raises(ConfigError, match="cannot be read"):
        Security.load(secret_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="tls_key"):
        Security.load(tls_cert="x.pem", environ={})
    env = {auth.SECRET_ENV: "s" * 20}
    assert Security.load(environ=env).secret == b"s" * 20


def test_handshake_state_machine_is_bounded():
    """Pure: whatever an unauthenticated peer sends, the server keeps at most one step."""
    hs = auth.ServerHandshake({"cluster": b"k" * 32}, auth.RPC, lambda e, head: b"NO")
    out, rest = hs.feed(b"GET / HTTP/1.1\r\n" + b"x" * 100000)
    assert out == b"NO" and hs.error is not None and hs.error.fields["cause"] == "missing_secret"
    assert hs.buf == b""  # nothing of it is kept
    hs = auth.ServerHandshake({"cluster": b"k" * 32}, auth.RPC, lambda e, head: b"NO")
    out, _ = hs.feed(auth.MAGIC + bytes([auth.VERSION]) + b"n" * 32 + b"\x00")  # role cluster
    assert out[:5] == auth.MAGIC + bytes([auth.VERSION]) and len(out) == auth.CHALLENGE_LEN
    out, _ = hs.feed(b"p" * 32)
    assert out == b"\x01" and hs.error.fields["cause"] == "wrong_secret"


def test_unauthenticated_idle_connections_are_closed(secure):
    d = _descs(secure)[0]
    host, port = secure.master_addr[len("tcp://"):].rsplit(":", 1)
    dh, dp = d.data_addr[len("tcp://"):].rsplit(":", 1)
    socks = [socket.create_connection((host, int(port))) for _ in range(20)]
    socks += [socket.create_connection((dh, int(dp))) for _ in range(20)]
    t0 = time.monotonic()
    for s in socks:
        s.settimeout(auth.HANDSHAKE_S + 10)
        assert _closed(s)  # by the server's handshake deadline
        s.close()
    assert time.monotonic() - t0 < auth.HANDSHAKE_S + 10
    with secure.client() as c:
        wait_for(lambda: c.stats() is not None, 5)


def test_a_master_of_another_secret_is_told_the_node_refused_its_key(secure):
    from kvpool.master.joins import fetch_table

    ctx = zmq.Context()
    spk, pk, sk = auth.curve_client_keys(WRONG)
    ctx.setsockopt(zmq.CURVE_SERVERKEY, spk)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, pk)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, sk)
    try:
        d = _descs(secure)[0]
        t0 = time.monotonic()
        with pytest.raises(AuthFailed, match="refused the master's control-channel key"):
            fetch_table(ctx, d, 30.0)
        assert time.monotonic() - t0 < 25  # named at the failed handshake, not at the deadline
    finally:
        ctx.term()


def test_a_server_too_busy_to_answer_the_handshake_is_retryable_not_refused():
    """Pure: a server that accepts and does not answer in time (a master whose request loop is
    busy) gives NodeUnavailable, which callers retry, not AuthFailed, which they do not."""
    a, b = socket.socketpair()
    try:
        a.settimeout(0.3)
        with pytest.raises(NodeUnavailable, match="did not answer the cluster-secret handshake in time"):
            auth.client_handshake(a, Security(secret=b"s" * 32), auth.RPC, "busy-master")
    finally:
        a.close()
        b.close()
