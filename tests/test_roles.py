"""Roles (protocol/auth.py, "Roles"): engines hold a ``client`` credential derived from the
cluster secret, operators an ``operator`` one; the master refuses a client's operator
requests with Forbidden, on real processes. Masters and store nodes need the secret
itself, and refuse to start without one unless told ``--insecure``."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.cli.cluster import LocalCluster
from kvpool.connector.client import KVPoolClient
from kvpool.protocol import auth
from kvpool.protocol import messages as M
from kvpool.protocol.auth import Security, role_credential, write_credential_file
from kvpool.protocol.config import load_config
from kvpool.protocol.errors import AuthFailed, ConfigError, Forbidden


def _cfg():
    return load_config(None, {"storenodes": [{"name": f"node-{i}", "memory": "64MiB"} for i in range(2)]},
                       environ={})


@pytest.fixture(scope="module")
def secure():
    lc = LocalCluster(_cfg(), secure=True)
    lc.__enter__()
    try:
        yield lc
    finally:
        lc.stop()


def _as(lc: LocalCluster, tmp_path, role: str) -> KVPoolClient:
    path = write_credential_file(tmp_path / f"{role}.cred", lc.security.secret, role)
    sec = Security.load(path)
    assert sec.role == role and sec.secret == role_credential(lc.security.secret, role)
    return KVPoolClient(lc.master_addr, security=sec, rpc_timeout_s=10)


def test_a_client_credential_puts_and_gets_but_cannot_administer(secure, tmp_path):
    with _as(secure, tmp_path, "client") as c:
        data = os.urandom(300_000)
        assert c.put("roles/a", data) and c.get("roles/a") == data  # master and store-node data ports
        assert c.stats().objects >= 1 and c.config().lease_ttl_s > 0  # reads are allowed
        c.pin("roles/a")
        c.unpin("roles/a")
        for what, call in (("settings", lambda: c.set_config(lease_ttl_s=5)),
                           ("evict", lambda: c.evict(M.EvictSelector(all=True))),
                           ("drain", lambda: c.drain("node-0")),
                           ("forced remove", lambda: c.remove("roles/a", force=True))):
            with pytest.raises(Forbidden, match="operator credential"):
                call()
        assert c.get("roles/a") == data, "a refused request changed nothing"
        c.remove("roles/a")  # its own objects, unforced
        assert c.get("roles/a") is None


def test_a_client_credentials_corruption_reports_cannot_destroy_pinned_objects(secure, tmp_path):
    with _as(secure, tmp_path, "client") as c:
        keys = [f"roles/pinned-{i}" for i in range(5)]
        for k in keys:
            assert c.put(k, k.encode() * 100, replicas=1)
            c.pin(k)
        for _ in range(10):  # a flood of well-formed reports naming every replica
            for info in c.lookup(keys):
                for r in info.replicas:
                    c.rpc.call(M.ReportCorrupt(info.key, r.node_id, r.gen, r.incarnation))
        assert [c.get(k) for k in keys] == [k.encode() * 100 for k in keys]
        assert c.stats().counters.get("corrupt_reports_kept", 0) >= 50
        for k in keys:
            c.unpin(k)
            c.remove(k)


def test_an_operator_credential_administers(secure, tmp_path):
    with _as(secure, tmp_path, "operator") as c:
        before = c.config().lease_ttl_s
        assert c.set_config(lease_ttl_s=before + 1).lease_ttl_s == before + 1
        c.set_config(lease_ttl_s=before)
        assert c.put("roles/op", b"x" * 1000)
        assert c.evict(M.EvictSelector(key="roles/op"), force=True).removed == 1


def test_a_credential_of_another_cluster_or_role_is_refused(secure, tmp_path):
    other = os.urandom(32).hex().encode()
    path = write_credential_file(tmp_path / "other.cred", other, "client")
    with pytest.raises(AuthFailed):
        with KVPoolClient(secure.master_addr, security=Security.load(path), rpc_timeout_s=5) as c:
            c.exists("x")


def test_handshake_names_the_role_and_checks_its_key():
    root = Security(secret=b"s" * 32)
    client = Security(secret=role_credential(root.secret, "client"), role="client")
    keys = root.auth_keys()
    assert client.auth_key() == keys["client"] != keys["operator"] != keys["cluster"]
    with pytest.raises(ConfigError, match="client credential"):
        client.derive("grant/x")  # a role credential derives no grant or control-channel key
    with pytest.raises(ConfigError):
        client.auth_keys()  # nor can it serve
    hs = auth.ServerHandshake(keys, auth.RPC, lambda e, head: b"NO")
    hello = auth.MAGIC + bytes([auth.VERSION]) + b"n" * auth.NONCE + bytes([auth.ROLES.index("client")])
    out, _ = hs.feed(hello)
    assert hs.role == "client" and out[:5] == auth.MAGIC + bytes([auth.VERSION])
    hs2 = auth.ServerHandshake(keys, auth.RPC, lambda e, head: b"NO")
    hs2.feed(auth.MAGIC + bytes([auth.VERSION]) + b"n" * auth.NONCE + bytes([9]))
    assert hs2.error is not None and hs2.error.fields["cause"] == "unknown_role"
    hs3 = auth.ServerHandshake(keys, auth.RPC, lambda e, head: b"NO")
    hs3.feed(auth.MAGIC + bytes([1]) + b"n" * auth.NONCE)
    assert hs3.error is not None and hs3.error.fields["cause"] == "version"


def test_malformed_credential_files_are_named(tmp_path):
    bad = tmp_path / "bad"
    bad.write_text("kvpool-credential client nothex\n")
    with pytest.raises(ConfigError, match="malformed role credential"):
        Security.load(str(bad))
    with pytest.raises(ConfigError, match="unknown role"):
        write_credential_file(tmp_path / "x", b"s" * 32, "root")
    good = write_credential_file(tmp_path / "c.cred", b"s" * 32, "client")
    text = open(good).read()
    for typo in ("kvpool-credentialXX", "kvpool-credentia"):  # a near miss of the tag is not taken for a secret
        bad.write_text(text.replace("kvpool-credential", typo))
        with pytest.raises(ConfigError, match="malformed role credential"):
            Security.load(str(bad))


def test_a_secret_file_others_can_read_is_warned_about(tmp_path, caplog):
    import logging

    path = write_credential_file(tmp_path / "c.cred", b"s" * 32, "client")
    with caplog.at_level(logging.WARNING, logger="kvpool"):
        Security.load(path)
    assert "readable by others" not in caplog.text
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="kvpool"):
        Security.load(path)
    assert "readable by others" in caplog.text and "chmod 600" in caplog.text


def test_servers_refuse_to_start_open_without_insecure(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    for what in ("master", "storenode"):
        r = subprocess.run([sys.executable, "-m", "kvpool.cli", what, "--etcd", "http://127.0.0.1:1"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "--insecure" in r.stderr + r.stdout, (what, r.stderr[-2000:])
    cred = write_credential_file(tmp_path / "c.cred", b"s" * 32, "client")
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "master", "--etcd", "http://127.0.0.1:1",
                        "--secret-file", cred], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "cluster secret itself" in r.stderr + r.stdout, r.stderr[-2000:]
