"""Cluster secret, peer authentication and TLS for every kvpool socket.

**The secret.** One shared secret per cluster, read from a file (``--secret-file``, config
``security.secret_file``, env ``KVPOOL_SECRET_FILE``) or the environment (``KVPOOL_SECRET``).
Without one, sockets are open (the behaviour of a trusted network); ``kvpool up`` and
``kvpool demo`` make a random one for their embedded cluster. Keys for each use are derived
from it with HMAC-SHA256 (:meth:`Security.derive`), so the secret itself never travels.

**Roles.** The cluster secret is the root credential: masters and store nodes hold it
(they derive write-grant and control-channel keys from it). Engines and operators can be
given a *role credential* instead, derived from it and unable to derive anything else
(``kvpool credential --role client|operator``, a file ``kvpool-credential ROLE HEX``)::

    credential(role) = HMAC-SHA256(secret, "kvpool/role/" + role)

A ``client`` may put, get, look up, hand off, pin and remove its objects; an ``operator``
may also change settings, evict by selector, force removals and drain nodes. The master
refuses the rest with :class:`~protocol.errors.Forbidden`. Holders of the secret itself
act in role ``cluster`` (everything).

**Stream sockets** (master RPC, store-node data; TCP, Unix, UCX): with a secret, every
connection opens with a mutual challenge-response before any request is read::

    client → server   MAGIC ver nc role            (4 + 1 + 32 + 1 bytes)
    server → client   MAGIC ver ns proof_s         (4 + 1 + 32 + 32 bytes)
    client → server   proof_c                      (32 bytes)
    server → client   status                       (1 byte: 0 accepted, 1 refused)

``proof_s = HMAC(k, "server" || purpose || nc || ns)``, ``proof_c = HMAC(k, "client" ||
purpose || nc || ns)`` with ``k = HMAC(credential(role), "kvpool/auth")`` (for role
``cluster``, ``HMAC(secret, "kvpool/auth")``) and ``purpose`` the port's kind and the role
(``rpc/client``, ``data/cluster``), so a proof for one port or role is worthless on
another and nonces make every proof single-use. The server, holding the secret, derives
the key of the role the peer names; the role is the connection's from then on. The server
reads at most 70 bytes from an unauthenticated peer and closes it after
:data:`HANDSHAKE_S`. ``MAGIC`` read as a frame length exceeds
every frame bound, so a client without a secret is answered, in its own framing, with
:class:`~protocol.errors.AuthFailed` instead of being misread.

**TLS** (``security.tls_cert``/``tls_key``: the server's chain and key; ``tls_ca``: the CA
that clients verify servers with and, with ``tls_client_certs``, servers verify clients
with) wraps TCP sockets before the handshake. Unix sockets and shared memory stay
plaintext but are authenticated; the segment's memfd is passed only after the handshake.

**The zmq control channel** (master DEALER → node ROUTER) uses CURVE with key pairs
derived from the secret: the node's ZAP handler admits only the master's derived public
key, so a peer without the secret cannot complete the CURVE handshake (and the traffic is
encrypted). See :func:`curve_server` / :func:`curve_client_keys`.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvpool.protocol.errors import AuthFailed, ConfigError, NodeUnavailable, Overloaded

SECRET_ENV = "KVPOOL_SECRET"
SECRET_FILE_ENV = "KVPOOL_SECRET_FILE"
MIN_SECRET = 16  # bytes
MAGIC = b"KVPA"
VERSION = 2  # 2: the hello names the peer's role
REFUSED = b"\xff"  # in place of the version: the server refuses the connection (see refusal)
NONCE = 32
HELLO_LEN = 4 + 1 + NONCE + 1  # client's first message
CHALLENGE_LEN = 4 + 1 + NONCE + 32  # server's answer
PROOF_LEN = 32
HANDSHAKE_S = 5.0  # seconds an unauthenticated peer may take (TLS and challenge-response together)
RPC, DATA = b"rpc", b"data"
ROLES = ("cluster", "client", "operator")  # the role byte of the hello is an index into this
CREDENTIAL_TAG = "kvpool-credential"


def role_credential(secret: bytes, role: str) -> bytes:
    """The 32-byte credential of ``role`` (one of :data:`ROLES` but ``cluster``), derived
    from the cluster secret with HMAC-SHA256 (key ``secret``, message ``kvpool/role/ROLE``)."""
    return hmac.new(secret, b"kvpool/role/" + role.encode(), hashlib.sha256).digest()


def write_credential_file(path: str | os.PathLike, secret: bytes, role: str) -> str:
    """Write ``role``'s credential (:func:`role_credential`) to ``path`` (mode 0600), as
    ``kvpool-credential ROLE HEX``; the path. Raises ConfigError for an unknown role."""
    if role not in ROLES[1:]:
        raise ConfigError(f"unknown role {role!r}; roles: {', '.join(ROLES[1:])}", key="role")
    return _write_private(path, f"{CREDENTIAL_TAG} {role} {role_credential(secret, role).hex()}\n")


def _parse_credential(raw: bytes, where: str, key: str) -> tuple[bytes, str]:
    """``(secret or credential, role)`` from a secret file's or variable's bytes."""
    if not raw.startswith(CREDENTIAL_TAG[:11].encode()):  # "kvpool-cred": a near miss of the tag is no secret
        return raw, "cluster"
    parts = raw.decode(errors="replace").split()
    try:
        if len(parts) != 3 or parts[0] != CREDENTIAL_TAG or parts[1] not in ROLES[1:]:
            raise ValueError
        cred = bytes.fromhex(parts[2])
        if len(cred) != 32:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{where} holds a malformed role credential; expected `{CREDENTIAL_TAG} ROLE HEX` as "
                          "`kvpool credential --role ROLE` writes it", key=key) from None
    return cred, parts[1]


def _read_secret(path: str) -> bytes:
    file = Path(path).expanduser()
    try:
        raw = file.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"security.secret_file {path!r} cannot be read ({e.strerror or e}); point it at a file "
                          "holding the cluster secret", key="security.secret_file") from None
    with contextlib.suppress(OSError):
        mode = file.stat().st_mode
        if mode & 0o077:
            logging.getLogger("kvpool").warning("security.secret_file %r is readable by others (mode %o): anyone "
                                                "who reads it acts with its role; `chmod 600` it", path, mode & 0o777)
    if len(raw) < MIN_SECRET:
        raise ConfigError(f"the cluster secret in {path!r} is {len(raw)} bytes; use at least {MIN_SECRET} "
                          "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > FILE`)",
                          key="security.secret_file")
    return raw


def write_secret_file(path: str | os.PathLike) -> str:
    """Write a fresh random secret (64 hex characters) to ``path`` with mode 0600; the path."""
    return _write_private(path, secrets.token_hex(32) + "\n")


def _write_private(path: str | os.PathLike, text: str) -> str:
    """Write ``text`` to ``path`` readable by its owner only (0600, also when it existed); the path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return str(path)


@dataclass(frozen=True)
class Security:
    """What a process needs to authenticate its sockets. ``secret``: the cluster secret
    (None: open sockets); ``secret_file``: where it came from (passed on to child
    processes); ``tls_cert``/``tls_key``/``tls_ca``: PEM paths; ``tls_client_certs``:
    servers ask clients for certificates signed by ``tls_ca``, and clients present
    ``tls_cert``/``tls_key``."""

    secret: bytes | None = None
    secret_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_client_certs: bool = False
    role: str = "cluster"  # what ``secret`` is: the cluster secret, or a role's credential

    @classmethod
    def load(cls, secret_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
             tls_ca: str | None = None, tls_client_certs: bool = False,
             environ: dict[str, str] | None = None) -> "Security":
        """From explicit values, else the environment (``KVPOOL_SECRET_FILE``,
        ``KVPOOL_SECRET``). Raises ConfigError for an unreadable or short secret, or a TLS
        key without its certificate."""
        env = os.environ if environ is None else environ
        secret, role = None, "cluster"
        secret_file = secret_file or env.get(SECRET_FILE_ENV) or None
        if secret_file:
            secret, role = _parse_credential(_read_secret(secret_file), repr(secret_file), "security.secret_file")
        elif env.get(SECRET_ENV):
            secret, role = _parse_credential(env[SECRET_ENV].strip().encode(), SECRET_ENV, SECRET_ENV)
            if len(secret) < MIN_SECRET:
                raise ConfigError(f"{SECRET_ENV} is {len(secret)} bytes; use at least {MIN_SECRET}", key=SECRET_ENV)
        if bool(tls_cert) != bool(tls_key):
            raise ConfigError("security.tls_cert and security.tls_key go together (the certificate chain and its "
                              "private key)", key="security.tls_cert")
        if tls_client_certs and not tls_ca:
            raise ConfigError("security.tls_client_certs needs security.tls_ca (the CA client certificates are "
                              "checked against)", key="security.tls_client_certs")
        return cls(secret, secret_file, tls_cert, tls_key, tls_ca, tls_client_certs, role)

    @classmethod
    def from_config(cls, sec, environ: dict[str, str] | None = None) -> "Security":
        """From a :class:`~protocol.config.SecurityConfig`."""
        return cls.load(sec.secret_file, sec.tls_cert, sec.tls_key, sec.tls_ca, sec.tls_client_certs, environ)

    @classmethod
    def for_server(cls, sec, what: str) -> "Security":
        """A master's or store node's security from its
        :class:`~protocol.config.SecurityConfig`: it must hold the cluster secret, or be
        started with ``security.insecure`` (then it warns, loudly, that it is open). Raises
        ConfigError otherwise, or for a role credential."""
        security = cls.from_config(sec)
        if security.secret is None:
            if not sec.insecure:
                raise ConfigError(f"{what} has no cluster secret, so every socket would be open to anyone who "
                                  "reaches it; give it --secret-file (security.secret_file, KVPOOL_SECRET_FILE), "
                                  "or --insecure (security.insecure) on a trusted network",
                                  key="security.secret_file")
            logging.getLogger("kvpool").warning(
                "%s runs WITHOUT a cluster secret (--insecure): any peer that reaches its ports may read, write "
                "and evict every object and change the cluster's settings", what)
        else:
            security.need_cluster_secret(what)
        return security

    def need_cluster_secret(self, what: str = "this process") -> None:
        """Raise ConfigError unless this is the cluster secret itself (not a role credential):
        serving, write grants and the control channel's keys derive from it."""
        if self.role != "cluster":
            raise ConfigError(f"{what} holds a {self.role} credential; masters and store nodes need the "
                              "cluster secret itself (security.secret_file)", key="security.secret_file")

    @property
    def tls(self) -> bool:
        """TCP sockets use TLS (a CA to verify servers with, or a server certificate)."""
        return bool(self.tls_ca or self.tls_cert)

    def argv(self) -> list[str]:
        """The flags that give a child process the same security (the secret by file only)."""
        out = ["--secret-file", self.secret_file] if self.secret_file else []
        for flag, v in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if v:
                out += [flag, v]
        return out + (["--tls-client-certs"] if self.tls_client_certs else [])

    def derive(self, purpose: str) -> bytes:
        """32-byte key for ``purpose``: HMAC-SHA256(secret, "kvpool/" + purpose). Raises
        ConfigError when this process holds a role credential, not the cluster secret."""
        assert self.secret is not None
        self.need_cluster_secret()
        return hmac.new(self.secret, b"kvpool/" + purpose.encode(), hashlib.sha256).digest()

    def auth_key(self, role: str | None = None) -> bytes:
        """The handshake key of ``role`` (default: this process's own): a holder of the
        cluster secret derives any role's; a role credential only its own."""
        assert self.secret is not None
        role = role or self.role
        if role == self.role:
            base = self.secret
        elif self.role == "cluster":
            base = role_credential(self.secret, role)
        else:
            raise ConfigError(f"a {self.role} credential cannot act as {role}", key="security.secret_file")
        return hmac.new(base, b"kvpool/auth", hashlib.sha256).digest()

    def auth_keys(self) -> dict[str, bytes]:
        """A server's handshake keys, one per role it admits (all, with the cluster secret)."""
        self.need_cluster_secret()
        return {r: self.auth_key(r) for r in ROLES}

    def grant_key(self, incarnation: str) -> bytes:
        """A store node incarnation's write-grant key, derived from the secret (so it is never
        published: the master derives the same key from the incarnation in the descriptor)."""
        return self.derive("grant/" + incarnation)

    # ---- TLS ------------------------------------------------------------------------------

    def server_context(self) -> ssl.SSLContext | None:
        """The servers' TLS context (None without ``tls_cert``)."""
        if not self.tls_cert:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.tls_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(ctx, self.tls_cert, self.tls_key)
        ctx.verify_mode = ssl.CERT_REQUIRED if self.tls_client_certs else ssl.CERT_NONE
        return ctx

    def client_context(self) -> ssl.SSLContext | None:
        """The clients' TLS context, verifying the server against ``tls_ca`` (None when TLS is off)."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.tls_client_certs and self.tls_cert:
            _load_chain(ctx, self.tls_cert, self.tls_key)
        return ctx


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str | None) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"security.tls_cert/tls_key {cert!r}, {key!r} cannot be loaded: {e}",
                          key="security.tls_cert") from None


OPEN = Security()


def resolve(security: "Security | None") -> "Security":
    """``security``, or (None) what the environment gives (:meth:`Security.load`)."""
    return security if security is not None else Security.load()


def proof(key: bytes, role: bytes, purpose: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(key, role + b"|" + purpose + b"|" + nc + ns, hashlib.sha256).digest()


# ---- the challenge-response, server side (pure: bytes in, bytes out) ---------------------------------

class ServerHandshake:
    """The server's half of the handshake as a state machine: :meth:`feed` the peer's bytes,
    send what it returns. :attr:`done` once the peer proved the secret; :attr:`error` (an
    AuthFailed) once it failed: send the returned bytes, then close. ``reject(err, head)``
    encodes an error in the port's own framing, for a peer that sent no handshake
    (``head``: its first bytes, e.g. to answer with its request id)."""

    __slots__ = ("keys", "purpose", "reject", "buf", "nc", "ns", "done", "error", "role", "key")

    def __init__(self, keys: dict[str, bytes], purpose: bytes,
                 reject: Callable[[AuthFailed, bytes], bytes]) -> None:
        self.keys = keys  # role -> handshake key (:meth:`Security.auth_keys`)
        self.purpose, self.reject = purpose, reject
        self.buf = b""
        self.nc = self.ns = self.key = b""
        self.done = False
        self.error: AuthFailed | None = None
        self.role = ""  # the peer's role, once it named one

    def want(self) -> int:
        """Bytes to read before the next step (never more than the handshake holds)."""
        return (HELLO_LEN if not self.ns else PROOF_LEN) - len(self.buf)

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """``(bytes to send, bytes past the handshake)``. Bytes past it are the peer's first
        requests (a client may pipeline them after its proof)."""
        if self.done or self.error is not None:
            return b"", data
        self.buf += data
        if not self.ns:
            if len(self.buf) >= 5 and self.buf[:4] == MAGIC and self.buf[4] != VERSION:
                self.error = AuthFailed(f"the peer speaks handshake version {self.buf[4]}, this server {VERSION}: "
                                        "run one kvpool version across the cluster", cause="version")
                self.buf = b""
                return b"\x01", b""
            if len(self.buf) >= 4 and self.buf[:4] != MAGIC:
                self.error = AuthFailed("this server requires the cluster secret and the peer sent none; set "
                                        f"{SECRET_FILE_ENV} or {SECRET_ENV} (for kvpool processes also --secret-file or security.secret_file in --config) to the cluster's "
                                        "secret", cause="missing_secret")
                head, self.buf = self.buf[:64], b""
                return self.reject(self.error, head), b""
            if len(self.buf) < HELLO_LEN:
                return b"", b""
            self.nc, r, self.buf = self.buf[5:HELLO_LEN - 1], self.buf[HELLO_LEN - 1], self.buf[HELLO_LEN:]
            role = ROLES[r] if r < len(ROLES) else f"#{r}"
            if role not in self.keys:
                self.error = AuthFailed(f"the peer names role {role}, which this server does not admit",
                                        cause="unknown_role")
                return b"\x01", b""
            self.role, self.key, self.purpose = role, self.keys[role], self.purpose + b"/" + role.encode()
            self.ns = secrets.token_bytes(NONCE)
            out = MAGIC + bytes([VERSION]) + self.ns + proof(self.key, b"server", self.purpose, self.nc, self.ns)
            more, rest = self.feed(b"") if self.buf else (b"", b"")
            return out + more, rest
        if len(self.buf) < PROOF_LEN:
            return b"", b""
        got, rest = self.buf[:PROOF_LEN], self.buf[PROOF_LEN:]
        self.buf = b""
        if not hmac.compare_digest(got, proof(self.key, b"client", self.purpose, self.nc, self.ns)):
            self.error = AuthFailed(f"wrong cluster secret or {self.role} credential: the peer's proof does not "
                                    "match", cause="wrong_secret")
            return b"\x01", b""
        self.done = True
        return b"\x00", rest


def client_handshake(sock, security: Security, purpose: bytes, where: str) -> None:
    """The client's half on a blocking socket (its timeout applies). Raises AuthFailed
    naming the cause: the server has no secret or another one, or refused ours;
    NodeUnavailable (retryable) when it does not answer within the timeout."""
    key = security.auth_key()
    purpose = purpose + b"/" + security.role.encode()
    nc = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + bytes([VERSION]) + nc + bytes([ROLES.index(security.role)]))
    got = _recv_exact(sock, 5, where)
    if got == MAGIC + REFUSED:
        raise Overloaded(f"{where} refused the connection: {_recv_rest(sock)}", addr=where)
    if got == MAGIC + bytes([VERSION]):
        got += _recv_exact(sock, CHALLENGE_LEN - 5, where)
    if got[:5] != MAGIC + bytes([VERSION]):
        raise AuthFailed(f"{where} did not answer the cluster-secret handshake: it runs without a secret (or is "
                         "not a kvpool server of this version); give it the same --secret-file",
                         cause="server_without_secret", addr=where)
    ns, ps = got[5:5 + NONCE], got[5 + NONCE:]
    if not hmac.compare_digest(ps, proof(key, b"server", purpose, nc, ns)):
        raise AuthFailed(f"{where} does not know this cluster's secret (wrong secret on one side); check that "
                         "every process reads the same secret file", cause="wrong_secret", addr=where)
    sock.sendall(proof(key, b"client", purpose, nc, ns))
    status = _recv_exact(sock, 1, where)
    if status != b"\x00":
        raise AuthFailed(f"{where} refused this client's proof: wrong cluster secret; check that every process "
                         "reads the same secret file", cause="wrong_secret", addr=where)


def refusal(message: str) -> bytes:
    """What a server with a secret sends a connection it will not serve (over its
    connection cap) before closing it: ``MAGIC 0xff message`` (UTF-8, at most 1000 bytes)."""
    return MAGIC + REFUSED + message.encode()[:1000]


def _recv_rest(sock) -> str:
    buf = b""
    with _suppress():
        while len(buf) < 1000:
            part = sock.recv(1000 - len(buf))
            if not part:
                break
            buf += part
    return buf.decode(errors="replace")


def _recv_exact(sock, n: int, where: str) -> bytes:
    buf = b""
    while len(buf) < n:
        try:
            part = sock.recv(n - len(buf))
        except (socket.timeout, TimeoutError):
            # a server too busy to answer in time is not refusing us: retryable, as a dropped connection
            raise NodeUnavailable(f"{where} did not answer the cluster-secret handshake in time (overloaded, "
                                  "or not a kvpool server)", addr=where) from None
        if not part:
            raise AuthFailed(f"{where} closed the connection during the cluster-secret handshake (it may use "
                             "TLS, or another secret)", cause="closed", addr=where)
        buf += part
    return buf


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


# ---- clients: secure a freshly connected stream ------------------------------------------------------

def secure_client(sock, scheme: str, host: str, security: Security, purpose: bytes, where: str):
    """TLS (TCP only, when configured), then the challenge-response (with a secret). Returns
    the stream to use (an ``ssl.SSLSocket`` under TLS). Raises AuthFailed when retrying
    cannot help (``cause``: ``tls_verify``, the server's certificate does not verify;
    ``tls_mismatch``, the server answered the TLS handshake with something that is not the
    TLS expected, e.g. it serves plain text; or a handshake cause), NodeUnavailable when
    the TLS connection broke (reset, EOF); closes ``sock`` on failure."""
    try:
        if scheme == "tcp" and security.tls:
            ctx = security.client_context()
            try:
                sock = ctx.wrap_socket(sock, server_hostname=host)
            except ssl.SSLCertVerificationError as e:
                raise AuthFailed(f"TLS: the certificate of {where} does not verify against security.tls_ca: "
                                 f"{e.verify_message}", cause="tls_verify", addr=where) from None
            except OSError as e:  # SSLError is one: a protocol error is a mismatch, a broken stream is not
                if isinstance(e, ssl.SSLError) and not isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
                    raise AuthFailed(f"TLS handshake with {where} failed ({e.reason or e}): it does not serve "
                                     "TLS, or not one this client accepts; give every process the same "
                                     "security.tls_* settings", cause="tls_mismatch", addr=where) from None
                raise NodeUnavailable(f"TLS handshake with {where} failed: {e}; does it serve TLS "
                                      "(security.tls_cert)?", addr=where) from None
        if security.secret is not None:
            try:
                client_handshake(sock, security, purpose, where)
            except (ConnectionError, ssl.SSLError) as e:
                raise AuthFailed(f"{where} dropped the connection during the cluster-secret handshake ({e}); it "
                                 "may require TLS (security.tls_ca) or a client certificate", cause="closed",
                                 addr=where) from None
        return sock
    except BaseException:
        with _suppress():
            sock.close()
        raise


# ---- the zmq control channel: CURVE with derived keys ----------------------------------------------

def _curve_pair(security: Security, role: str) -> tuple[bytes, bytes]:
    import zmq
    from zmq.utils import z85

    sk = z85.encode(security.derive("curve/" + role))
    return zmq.curve_public(sk), sk


def curve_server(sock, security: Security) -> None:
    """Make zmq ``sock`` a CURVE server with the derived node key pair (needs a ZAP handler
    admitting :func:`curve_client_public` to refuse other clients; see storenode)."""
    pk, sk = _curve_pair(security, "node")
    sock.curve_secretkey, sock.curve_publickey, sock.curve_server = sk, pk, True


def curve_client_keys(security: Security) -> tuple[bytes, bytes, bytes]:
    """``(server public, client public, client secret)``: the z85 keys of a CURVE client
    (the master) of the nodes' control sockets."""
    return _curve_pair(security, "node")[0], *_curve_pair(security, "master")


def curve_client_public(security: Security) -> bytes:
    """The z85 public key a CURVE client must present (the master's)."""
    return _curve_pair(security, "master")[0]
