"""etcd credentials (``etcd.username``/``password``/``password_file``, TLS ``etcd.ca``/
``cert``/``key``) against a real etcd with auth enabled or serving TLS, and the advertised
address rules of ``--advertise``."""
from __future__ import annotations

import asyncio

import pytest

from kvpool.cli.cluster import Child, find_etcd, free_port
from kvpool.protocol import errors as E
from kvpool.protocol import transport
from kvpool.protocol.config import load_config
from kvpool.protocol.etcd import Etcd, EtcdAuth, read_key_sync

from tests.conftest import wait_for


def _etcd(tmp_path, scheme: str = "http", tls: list[str] = ()) -> tuple[Child, str]:
    port, peer = free_port(), free_port()
    url = f"{scheme}://127.0.0.1:{port}"
    child = Child("etcd", [find_etcd(), "--name", "e", "--data-dir", str(tmp_path / "data"),
                           "--listen-client-urls", url, "--advertise-client-urls", url,
                           "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                           "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                           "--initial-cluster", f"e=http://127.0.0.1:{peer}", *tls], str(tmp_path))
    return child, f"http://127.0.0.1:{port}"


def _answers(ep: str, auth: EtcdAuth) -> bool:
    try:
        read_key_sync(ep, "/kvpool/ping", 1.0, auth)
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


async def _enable_auth(ep: str, password: str) -> None:
    from aetcd import rpc

    async with Etcd(ep) as e:
        stub = rpc.AuthStub(e.client.channel)
        await stub.UserAdd(rpc.AuthUserAddRequest(name="root", password=password))
        await stub.RoleAdd(rpc.AuthRoleAddRequest(name="root"))
        await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        await stub.AuthEnable(rpc.AuthEnableRequest())


def test_user_and_password_against_an_etcd_with_auth_enabled(tmp_path):
    etcd, ep = _etcd(tmp_path)
    try:
        wait_for(lambda: _answers(ep, EtcdAuth()), 30, 0.1, what="etcd up")
        asyncio.run(_enable_auth(ep, "s3cret-pw"))
        (tmp_path / "pw").write_text("s3cret-pw\n")
        cfg = load_config(None, {"etcd": {"endpoint": ep, "username": "root", "password_file": str(tmp_path / "pw")}},
                          environ={})
        auth = EtcdAuth.from_config(cfg.etcd)
        assert (auth.username, auth.password) == ("root", "s3cret-pw")

        async def roundtrip(a: EtcdAuth) -> bytes | None:
            async with Etcd(ep, 2.0, a) as e:
                await e.put("/kvpool/auth-test", b"v")
                return await e.get("/kvpool/auth-test")

        assert asyncio.run(roundtrip(auth)) == b"v"
        with pytest.raises(E.AuthFailed, match="refused this process's credentials"):
            asyncio.run(roundtrip(EtcdAuth("root", "wrong")))
        with pytest.raises(E.AuthFailed):  # no credentials at all: refused, not "unreachable"
            asyncio.run(roundtrip(EtcdAuth()))
    finally:
        etcd.stop()


def test_tls_to_an_etcd_serving_https(tmp_path):
    import trustme  # the test extra installs it (pyproject [test])
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    client = ca.issue_cert("kvpool-client")
    client.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    client.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    etcd, ep = _etcd(tmp_path, "https", ["--cert-file", str(tmp_path / "server.pem"), "--key-file",
                                         str(tmp_path / "server.key"), "--client-cert-auth",
                                         "--trusted-ca-file", str(tmp_path / "ca.pem")])
    try:
        cfg = load_config(None, {"etcd": {"endpoint": ep, "ca": str(tmp_path / "ca.pem"),
                                          "cert": str(tmp_path / "client.pem"), "key": str(tmp_path / "client.key")}},
                          environ={})
        auth = EtcdAuth.from_config(cfg.etcd)
        wait_for(lambda: _answers(ep, auth), 30, 0.1, what="etcd over TLS")

        async def roundtrip() -> bytes | None:
            async with Etcd(ep, 2.0, auth) as e:
                await e.put("/kvpool/tls-test", b"t")
                return await e.get("/kvpool/tls-test")

        assert asyncio.run(roundtrip()) == b"t"
        assert not _answers(ep, EtcdAuth())  # plain text to a TLS port: no answer
    finally:
        etcd.stop()


def test_etcd_credentials_config_errors(tmp_path):
    for over, key in [({"username": "u"}, "etcd.username"), ({"password": "p"}, "etcd.username"),
                      ({"username": "u", "password": "p", "password_file": "f"}, "etcd.password"),
                      ({"cert": "c"}, "etcd.cert"), ({"cert": "c", "key": "k"}, "etcd.ca")]:
        with pytest.raises(E.ConfigError) as ei:
            load_config(None, {"etcd": over}, environ={})
        assert ei.value.fields["key"] == key, (over, ei.value)
    cfg = load_config(None, {"etcd": {"username": "u", "password_file": str(tmp_path / "none")}}, environ={})
    with pytest.raises(E.ConfigError, match="etcd.password_file: cannot read"):
        EtcdAuth.from_config(cfg.etcd)


def test_advertised_addresses():
    assert transport.advertise_host("10.1.2.3", None, "k") == "10.1.2.3"
    assert transport.advertise_host("0.0.0.0", "node1.example", "k") == "node1.example"
    primary = transport.primary_address()
    if primary is None:  # no default route here: a wildcard bind needs --advertise
        with pytest.raises(E.ConfigError, match="--advertise"):
            transport.advertise_host("0.0.0.0", None, "master.advertise")
    else:
        assert transport.advertise_host("0.0.0.0", None, "k") == primary
    for bad in ("0.0.0.0", "::", "tcp://10.0.0.1", "10.0.0.1:7000/x", ""):
        with pytest.raises(E.ConfigError) as ei:
            load_config(None, {"master": {"advertise": bad}}, environ={})
        assert ei.value.fields["key"] == "master.advertise"
    with pytest.raises(E.ConfigError) as ei:
        load_config(None, {"storenodes": [{"name": "a", "control_port": 70000}]}, environ={})
    assert ei.value.fields["key"] == "storenodes[0].control_port"
    cfg = load_config(None, {"storenodes": [{"name": "a", "advertise": "10.0.0.5", "control_port": 7501,
                                             "ucx_port": 7502}]}, environ={})
    assert (cfg.storenodes[0].advertise, cfg.storenodes[0].control_port) == ("10.0.0.5", 7501)
