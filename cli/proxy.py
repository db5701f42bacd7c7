"""``kvpool proxy``: an OpenAI-compatible HTTP front for pools of prefill (``kv_producer``)
and decode (``kv_consumer``) vLLM servers, following the router contract in docs/vllm.md.

Each ``POST /v1/completions`` or ``/v1/chat/completions`` is sent first to a healthy
prefill server with ``max_tokens: 1`` (chat: also ``max_completion_tokens: 1``) and
``stream: false``; the ``kv_transfer_params`` of its answer are added to the original body,
which goes to a healthy decode server, whose answer (JSON, or SSE with ``stream: true``)
is passed back. ``X-Request-Id`` (the client's, or a new one) is sent to both servers and
returned. Failures:

* prefill server unreachable or 5xx: retried once on another prefill server, then 502
  naming the servers tried; its 4xx answers are returned as they are;
* decode server unreachable, 5xx, or silent before its first byte: tried on every other
  healthy decode server with the same ``kv_transfer_params``, then 502, and the hand-off is
  released (with ``--master``/``--etcd``; else it expires at its deadline); a 4xx answer is
  returned as it is (the hand-off released too);
* decode failure after the stream began: the stream ends with an SSE error event
  (``data: {"error": ...}`` then ``data: [DONE]``);
* prefill answer without ``kv_transfer_params``: decode computes the whole prompt and the
  ``kvpool_proxy_handoff_failures_total`` metric counts it;
* a body that is not a JSON object with ``model`` and ``prompt`` / ``messages``: 400,
  nothing forwarded. With no healthy server of a role: 503.

``GET /health`` (200 when a prefill and a decode server are healthy, else 503 with the
reason), ``GET /v1/models`` (from a decode server) and ``GET /metrics`` (Prometheus text,
the proxy's own registry) complete the API. Every backend call has a deadline.

No client, however slow or numerous, takes the proxy from the others: connections are
capped with the oldest silent ones evicted first (:mod:`kvpool.cli.proxy_guard`), request
heads and bodies have deadlines that do not reset per byte, a body announced over
:data:`MAX_BODY_BYTES` is refused with 413 before it is read, and bodies are charged to
:data:`BODY_BUDGET_BYTES` by the bytes actually received (:meth:`Proxy._read_body`).
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import re
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import http_exceptions, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpool.cli.proxy_guard import ConnectionGuard
from kvpool.cli.proxy_pool import BACKEND_ERRORS, Backend, Pool, describe, health_loop
from kvpool.protocol.config import ProxyConfig
from kvpool.protocol.errors import ConfigError, KVPoolError

log = logging.getLogger("kvpool.proxy")

MAX_BODY_BYTES = 32 << 20  # largest request body accepted (long prompts, inline images)
BODY_BUDGET_BYTES = 128 << 20  # request bodies being received and handled at once (parsed JSON takes ~8x)
_OFF_LOOP_BYTES = 256 << 10  # bodies this large are parsed and serialized on a worker thread
MAX_CONNECTIONS = 4096  # open client connections; one more evicts the oldest silent one, else gets 503
MAX_SILENT_PER_PEER = 1024  # connections of one peer address that sent no request yet; one more closes its oldest
HEAD_TIMEOUT_S = 10.0  # a client's request head (line and headers) must arrive within this
KEEPALIVE_S = 75.0  # aiohttp's idle keep-alive time between requests on one connection
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # visible ASCII, as a header value can carry it
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DONE = b"data: [DONE]\n\n"
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")  # metric labels: no client-made ones
# what reading a request body raises when its client hung up or broke the body's framing
_CLIENT_GONE = (ConnectionError, aiohttp.ClientPayloadError, http_exceptions.HttpProcessingError)


@dataclass(frozen=True)
class ProxySettings:
    """``kvpool proxy`` options, resolved from the ``proxy`` section of the config tree
    (:class:`~kvpool.protocol.config.ProxyConfig` states each default; build with
    :meth:`from_config`). Durations in seconds: ``health_interval_s`` between
    health-check rounds, ``timeout_s`` the deadline of one backend request (a whole
    stream included), ``read_timeout_s`` the deadline for a client to send its whole
    request body (then 408). ``max_in_flight``: generate requests served at once; more get
    503 ``overloaded`` at once instead of queueing without bound. ``api_key``: clients must
    send ``Authorization: Bearer <api_key>`` on ``/v1/*`` (401 otherwise; ``/health`` and
    ``/metrics`` stay open for probes and scrapers); ``backend_api_key``: what the proxy
    sends to the vLLM servers (their ``--api-key``); without it a client's own
    ``Authorization`` is passed on, unless it was the proxy's key. A proxy bound to an
    address other than loopback needs ``api_key``, or ``allow_no_api_key`` (then it warns
    at start). ``master`` / ``etcd`` + ``cluster``: the kvpool cluster, used only to release
    the hand-off of a request no decode server took (optional)."""

    prefill: list[str]
    decode: list[str]
    host: str
    port: int
    health_interval_s: float
    timeout_s: float
    master: str | None
    etcd: str | None
    cluster: str
    read_timeout_s: float
    max_in_flight: int
    api_key: str | None = None
    backend_api_key: str | None = None
    connect_timeout_s: float = 10.0
    allow_no_api_key: bool = False

    @classmethod
    def from_config(cls, p: ProxyConfig, etcd: str | None = None, cluster: str = "default") -> "ProxySettings":
        """Settings from the config tree's ``proxy`` section; the API keys are read from
        ``api_key_file`` / ``backend_api_key_file``, else ``KVPOOL_PROXY_API_KEY`` /
        ``KVPOOL_BACKEND_API_KEY``. Raises ConfigError for an unreadable key file."""
        return cls(list(p.prefill), list(p.decode), p.host, p.port, p.health_interval,
                   p.timeout, p.master, etcd, cluster, p.read_timeout,
                   p.max_in_flight, _key(p.api_key_file, "KVPOOL_PROXY_API_KEY", "proxy.api_key_file"),
                   _key(p.backend_api_key_file, "KVPOOL_BACKEND_API_KEY", "proxy.backend_api_key_file"),
                   allow_no_api_key=p.allow_no_api_key)

    def check(self) -> None:
        """Raise ConfigError naming the bad option."""
        if not 0 < self.health_interval_s < float("inf"):
            raise ConfigError("--health-interval must be > 0", key="health_interval")
        if not 0 < self.timeout_s < float("inf"):
            raise ConfigError("--timeout must be > 0", key="timeout")
        if not 0 < self.read_timeout_s < float("inf"):
            raise ConfigError("--read-timeout must be > 0", key="read_timeout")
        if self.max_in_flight < 1:
            raise ConfigError("--max-in-flight must be >= 1", key="max_in_flight")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: use 0 (any free port) to 65535", key="port")
        if not self.api_key and not self.allow_no_api_key and not loopback(self.host):
            raise ConfigError(f"the proxy would serve {self.host} without an API key, so anyone who reaches it could "
                              "use the model servers behind it: give it a key with --api-key-file (config "
                              "proxy.api_key_file, or KVPOOL_PROXY_API_KEY), bind 127.0.0.1, or pass "
                              "--allow-no-api-key (proxy.allow_no_api_key) to serve it open anyway",
                              key="api_key_file")


def loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this host's loopback only: ``127.0.0.0/8``,
    ``::1`` or ``localhost``. A wildcard (``0.0.0.0``, ``::``) or any other name is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _key(path: str | None, env: str, key: str) -> str | None:
    """An API key: the first line of ``path``, else the environment variable ``env``."""
    if path:
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise ConfigError(f"{key}: cannot read {path} ({e.strerror})", key=key) from None
        if not text:
            raise ConfigError(f"{key}: {path} is empty", key=key)
        return text
    return os.environ.get(env) or None


class ProxyMetrics:
    """The proxy's Prometheus metrics, in a registry of their own (``registry``).

    ``kvpool_proxy_requests_total{endpoint, outcome}``: ok, bad_request (400/408/413, nothing
    forwarded), unauthorized (401), no_backend and overloaded (503), rejected (a server's 4xx passed on), prefill_failed /
    decode_failed (502), stream_error (the stream ended with an error event), client_gone,
    failed (/v1/models). Latency histograms in seconds: ``kvpool_proxy_prefill_seconds``,
    ``kvpool_proxy_decode_ttfb_seconds`` (until the decode server's first byte),
    ``kvpool_proxy_decode_seconds`` (until its last). ``kvpool_proxy_handoff_failures_total
    {reason}``, ``kvpool_proxy_connections_refused_total{reason}`` (max_conns, head_timeout,
    evicted, peer_waiting: :mod:`kvpool.cli.proxy_guard`), ``kvpool_proxy_retries_total{role}``,
    ``kvpool_proxy_backend_healthy{role, server}`` (1 or 0)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvpool_proxy_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prefill_seconds = Histogram("kvpool_proxy_prefill_seconds", "Prefill request latency (seconds)",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_ttfb_seconds = Histogram(
            "kvpool_proxy_decode_ttfb_seconds", "Decode request: seconds until its first byte",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_seconds = Histogram("kvpool_proxy_decode_seconds", "Decode request: seconds until its end",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.handoff_failures = Counter(
            "kvpool_proxy_handoff_failures", "Hand-offs that did not happen: no_params (prefill answer without "
            "kv_transfer_params), producer_error (its params carry an error), decode_failed (no decode server took "
            "it)", ["reason"], registry=r)
        self.retries = Counter("kvpool_proxy_retries", "Requests retried on another server", ["role"], registry=r)
        self.refused = Counter("kvpool_proxy_connections_refused", "Client connections closed by the proxy: "
                               "max_conns (over its connection cap, all busy), head_timeout (request head too "
                               "slow), evicted (silent, closed for a newer one at the cap), peer_waiting (its "
                               "peer's share of silent connections was full)",
                               ["reason"], registry=r)
        self.healthy = Gauge("kvpool_proxy_backend_healthy", "1 when the server passes its health check",
                             ["role", "server"], registry=r)

    def set_health(self, b: Backend) -> None:
        self.healthy.labels(b.role, b.url).set(1 if b.healthy else 0)


class _Answer(Exception):
    """Ends a request early with ``response``; ``outcome`` labels the request metric."""

    def __init__(self, response: web.StreamResponse, outcome: str) -> None:
        super().__init__(outcome)
        self.response, self.outcome = response, outcome


def error_response(status: int, message: str, kind: str, **extra) -> web.Response:
    """An OpenAI-style JSON error: ``{"error": {"message", "type", "code", ...extra}}``."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status, **extra}},
                             status=status)


def _finite(text: str) -> float:
    """``json.loads`` hook: a number too large for a float (``1e400``) would become
    ``inf`` and be sent on as ``Infinity``, which is not JSON."""
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:32]} is out of range")
    return v


def _not_json(name: str):
    """``json.loads`` hook: NaN and Infinity are Python's extension, not JSON; a server
    would read them differently (or fail later), so they are refused here."""
    raise ValueError(f"{name} is not JSON")


def _sse_error(message: str) -> bytes:
    return b"data: " + json.dumps({"error": {"message": message, "type": "BadGateway", "code": 502}}).encode() \
        + b"\n\n" + _DONE


class Proxy:
    """The proxy's state (pools, HTTP session, metrics, optional kvpool client) and its
    request handlers. :meth:`app` builds the aiohttp application."""

    def __init__(self, s: ProxySettings) -> None:
        s.check()
        self.s = s
        self.metrics = ProxyMetrics()
        self.prefill = Pool("prefill", s.prefill, self.metrics.set_health)
        self.decode = Pool("decode", s.decode, self.metrics.set_health)
        self.timeout = aiohttp.ClientTimeout(total=s.timeout_s, sock_connect=min(s.connect_timeout_s, s.timeout_s))
        self.health_timeout_s = min(max(s.health_interval_s, 1.0), 10.0)
        self.session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task | None = None
        self._kv = None  # AsyncKVPoolClient, when --master/--etcd is given
        self.in_flight = 0  # generate requests being served (event-loop thread only)
        self.body_bytes = 0  # request body bytes received and in hand (read or being handled)
        self.guard = None  # ConnectionGuard, set by serve()

    # ---- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application; its startup opens the session and starts the checks."""
        a = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._request_id])
        a.router.add_post("/v1/completions", lambda r: self._generate(r, "/v1/completions"))
        a.router.add_post("/v1/chat/completions", lambda r: self._generate(r, "/v1/chat/completions"))
        a.router.add_get("/v1/models", self._models)
        a.router.add_get("/health", self._health_handler)
        a.router.add_get("/metrics", self._metrics_handler)
        a.on_startup.append(self._start)
        a.on_cleanup.append(self._stop)
        return a

    async def _start(self, _app: web.Application) -> None:
        if self.s.master or self.s.etcd:
            from kvpool.connector.aclient import AsyncKVPoolClient

            # its calls run on executor threads beside the event loop: they sleep, not spin, for replies
            self._kv = AsyncKVPoolClient(self.s.master, etcd=self.s.etcd, cluster=self.s.cluster, rpc_timeout_s=5.0,
                                         spin_wait_s=0.0)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        self._health = asyncio.create_task(health_loop(self.session, [self.prefill, self.decode],
                                                       self.s.health_interval_s, self.health_timeout_s))

    async def _stop(self, _app: web.Application) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        if self._kv is not None:
            await self._kv.close()

    @web.middleware
    async def _request_id(self, request: web.Request, handler) -> web.StreamResponse:
        """Honour or make the request id; put it on every response that is not streaming yet."""
        if self.guard is not None:
            self.guard.seen(request.transport)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        if self.s.api_key and request.path.startswith("/v1/") and not self._authorized(request):
            resp = error_response(401, "missing or wrong API key: send Authorization: Bearer <key> (the proxy's "
                                  "--api-key-file / KVPOOL_PROXY_API_KEY)", "authentication_error")
            self.metrics.requests.labels(request.path if request.path in _ENDPOINTS else "other",
                                         "unauthorized").inc()
            rid = uuid.uuid4().hex
        elif not _REQUEST_ID.fullmatch(rid):
            resp: web.StreamResponse = error_response(400, "X-Request-Id must be 1 to 256 visible ASCII characters",
                                                      "invalid_request_error")
            rid = uuid.uuid4().hex
        else:
            request["request_id"] = rid
            try:
                resp = await handler(request)
            except web.HTTPException as e:  # unknown path, wrong method, body too large
                resp = error_response(e.status, e.reason, "invalid_request_error")
        if not resp.prepared:
            resp.headers["X-Request-Id"] = rid
        if self.guard is not None:
            self.guard.idle(request.transport)  # the next request head is due within the keep-alive time
        return resp

    def _authorized(self, request: web.Request) -> bool:
        got = request.headers.get("Authorization", "")
        want = f"Bearer {self.s.api_key}"
        return hmac.compare_digest(got.encode("utf-8", "surrogateescape"), want.encode())

    # ---- the generate path ----------------------------------------------------------------

    async def _generate(self, request: web.Request, path: str) -> web.StreamResponse:
        """One generate request: its body is read (bounded, see :meth:`_read_body`) before it
        takes one of the ``max_in_flight`` slots, so a slow sender holds a connection and the
        bytes it really sent, nothing else."""
        chat = path == "/v1/chat/completions"
        held = [0]  # body bytes in hand, charged to self.body_bytes
        try:
            try:
                body = await self._parse(await self._read_body(request, held), chat)
                if self.in_flight >= self.s.max_in_flight:
                    raise _Answer(error_response(503, f"the proxy is serving {self.in_flight} requests "
                                                 "(--max-in-flight); retry later", "overloaded"), "overloaded")
                self.in_flight += 1
                try:
                    resp, outcome = await self._generate_one(request, path, body, chat)
                finally:
                    self.in_flight -= 1
            except _Answer as a:
                resp, outcome = a.response, a.outcome
        finally:
            self.body_bytes -= held[0]
        self.metrics.requests.labels(path, outcome).inc()
        return resp

    async def _generate_one(self, request: web.Request, path: str, body: dict,
                            chat: bool) -> tuple[web.StreamResponse, str]:
        for pool in (self.prefill, self.decode):
            if not pool.healthy():
                raise _Answer(error_response(503, pool.reason(), "service_unavailable"), "no_backend")
        params = await self._run_prefill(request, path, body, chat)
        return await self._run_decode(request, path, body, params)

    async def _read_body(self, request: web.Request, held: list[int]) -> bytes:
        """The request body, read as it arrives and charged to :attr:`body_bytes` by the bytes
        actually received (``held[0]``: what this request holds). Raises _Answer (its
        connection then closes, the rest of the body unread): 413 at once for a length
        announced over :data:`MAX_BODY_BYTES`, or when that many bytes arrived; 503 when the
        announced length, or the bytes received, would pass :data:`BODY_BUDGET_BYTES` with
        the other requests' bodies in hand; 408 when the whole body has not arrived within
        ``read_timeout_s`` of the request head (one deadline, however the bytes trickle)."""
        def refuse(status: int, message: str, kind: str, outcome: str = "bad_request") -> _Answer:
            resp = error_response(status, message, kind)
            resp.force_close()  # the unread rest of the body must not be taken for a request
            return _Answer(resp, outcome)

        announced = request.content_length
        if announced is not None and announced > MAX_BODY_BYTES:
            raise refuse(413, f"request body of {announced} bytes is over {MAX_BODY_BYTES >> 20} MiB",
                         "invalid_request_error")
        if announced is not None and self.body_bytes + announced > BODY_BUDGET_BYTES:
            raise refuse(503, f"the proxy holds {self.body_bytes >> 20} MiB of request bodies "
                         f"({BODY_BUDGET_BYTES >> 20} MiB at most); retry later", "overloaded", "overloaded")
        parts: list[bytes] = []

        async def read() -> None:
            while chunk := await request.content.readany():
                n = len(chunk)
                if held[0] + n > MAX_BODY_BYTES:
                    raise refuse(413, f"request body over {MAX_BODY_BYTES >> 20} MiB", "invalid_request_error")
                if self.body_bytes + n > BODY_BUDGET_BYTES:
                    raise refuse(503, f"the proxy holds {self.body_bytes >> 20} MiB of request bodies "
                                 f"({BODY_BUDGET_BYTES >> 20} MiB at most); retry later", "overloaded",
                                 "overloaded")
                self.body_bytes += n
                held[0] += n
                parts.append(chunk)

        try:
            await asyncio.wait_for(read(), self.s.read_timeout_s)
        except asyncio.TimeoutError:
            raise refuse(408, f"request body not received within {self.s.read_timeout_s:g} s",
                         "invalid_request_error") from None
        except _CLIENT_GONE as e:  # the client hung up or broke the body's framing: nobody to answer
            log.debug("request %s: client gone while sending its body (%s)", request["request_id"], describe(e))
            raise refuse(400, "request body incomplete", "invalid_request_error", "client_gone") from None
        raw = b"".join(parts)
        request["body_len"] = len(raw)
        return raw

    async def _parse(self, raw: bytes, chat: bool) -> dict:
        """The request body as a dict; raises _Answer(400) for what no server could take."""
        def bad(msg: str) -> _Answer:
            return _Answer(error_response(400, msg, "invalid_request_error"), "bad_request")

        try:
            if len(raw) < _OFF_LOOP_BYTES:
                body = json.loads(raw, parse_constant=_not_json, parse_float=_finite)
            else:
                body = await asyncio.to_thread(json.loads, raw, parse_constant=_not_json, parse_float=_finite)
        except (ValueError, UnicodeDecodeError):
            raise bad("request body is not JSON") from None
        except RecursionError:  # nesting deeper than the JSON decoder's recursion limit
            raise bad("request body nests too deeply") from None
        if not isinstance(body, dict):
            raise bad("request body must be a JSON object")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise bad('missing "model": the model name (see GET /v1/models)')
        if chat and not (isinstance(body.get("messages"), list) and body["messages"]):
            raise bad('missing "messages": a non-empty list of chat messages')
        if not chat and not (isinstance(body.get("prompt"), (str, list)) and body["prompt"]):
            raise bad('missing "prompt": a string, a list of strings, or token ids')
        if not isinstance(body.get("stream", False), bool):
            raise bad('"stream" must be true or false')
        return body

    async def _dumps(self, obj: dict, request: web.Request) -> bytes:
        """``obj`` as JSON bytes; a large one is serialized on a worker thread so that the
        event loop keeps serving other clients."""
        if request.get("body_len", 0) < _OFF_LOOP_BYTES:
            return json.dumps(obj).encode()
        return await asyncio.to_thread(lambda: json.dumps(obj).encode())

    def _json_headers(self, request: web.Request) -> dict[str, str]:
        return {**self._headers(request), "Content-Type": "application/json"}

    def _headers(self, request: web.Request) -> dict[str, str]:
        h = {"X-Request-Id": request["request_id"]}
        if self.s.backend_api_key:  # servers started with --api-key
            h["Authorization"] = f"Bearer {self.s.backend_api_key}"
        elif "Authorization" in request.headers and not self.s.api_key:
            h["Authorization"] = request.headers["Authorization"]
        return h

    async def _run_prefill(self, request: web.Request, path: str, body: dict, chat: bool) -> dict | None:
        """Prefill on one server (one retry on another); its ``kv_transfer_params`` or
        None. Raises _Answer: 502 when no server answered, its own answer for a 4xx."""
        pbody = {k: v for k, v in body.items() if k not in ("kv_transfer_params", "stream_options", "min_tokens")}
        pbody.update(max_tokens=1, stream=False)
        if chat:
            pbody["max_completion_tokens"] = 1
        pdata = await self._dumps(pbody, request)
        tried: list[Backend] = []
        errors: list[str] = []
        while len(tried) < 2 and (b := self.prefill.pick(tried)) is not None:
            if tried:
                self.metrics.retries.labels("prefill").inc()
            tried.append(b)
            t0 = time.monotonic()
            try:
                with self.prefill.busy(b):
                    async with self.session.post(b.url + path, data=pdata, headers=self._json_headers(request),
                                                 timeout=self.timeout) as r:
                        data = await r.read()
            except BACKEND_ERRORS as e:
                errors.append(f"{b.url}: {describe(e, self.s.timeout_s)}")
                if isinstance(e, aiohttp.ClientConnectionError):
                    self.prefill.mark(b, False, describe(e))
                continue
            if r.status >= 500:
                errors.append(f"{b.url}: HTTP {r.status} {data[:200].decode(errors='replace')}")
                continue
            if r.status != 200:  # the request's own fault: the client sees the server's answer
                raise _Answer(web.Response(body=data, status=r.status, content_type=r.content_type),
                              "rejected")
            try:
                params = json.loads(data).get("kv_transfer_params")
            except (ValueError, AttributeError, RecursionError):
                errors.append(f"{b.url}: HTTP 200 but the body is not a JSON object")
                continue
            self.metrics.prefill_seconds.observe(time.monotonic() - t0)
            if not isinstance(params, dict):
                self.metrics.handoff_failures.labels("no_params").inc()
                log.warning("request %s: prefill server %s sent no kv_transfer_params (is it a kv_producer?); "
                            "the decode server computes the whole prompt", request["request_id"], b.url)
                return None
            if isinstance(params.get("kvpool"), dict) and params["kvpool"].get("error"):
                self.metrics.handoff_failures.labels("producer_error").inc()
            return params
        why = "; ".join(errors) or self.prefill.reason()
        raise _Answer(error_response(502, f"prefill failed: {why}", "bad_gateway",
                                     servers_tried=[b.url for b in tried]), "prefill_failed")

    async def _run_decode(self, request: web.Request, path: str, body: dict,
                          params: dict | None) -> tuple[web.StreamResponse, str]:
        """Send the original body (plus ``params``) to a decode server, trying each healthy
        one until one sends its first byte; return the client's response and outcome."""
        dbody = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if params is not None:
            dbody["kv_transfer_params"] = params
        stream = bool(body.get("stream"))
        ddata = await self._dumps(dbody, request)
        tried: list[Backend] = []
        errors: list[str] = []
        while (b := self.decode.pick(tried)) is not None:
            if tried:
                self.metrics.retries.labels("decode").inc()
            tried.append(b)
            t0 = time.monotonic()
            with self.decode.busy(b):
                try:
                    r = await self.session.post(b.url + path, data=ddata, headers=self._json_headers(request),
                                                timeout=self.timeout)
                except BACKEND_ERRORS as e:
                    errors.append(f"{b.url}: {describe(e, self.s.timeout_s)}")
                    if isinstance(e, aiohttp.ClientConnectionError):
                        self.decode.mark(b, False, describe(e))
                    continue
                try:
                    try:
                        first = await (r.content.readany() if stream and r.status == 200 else r.read())
                    except BACKEND_ERRORS as e:
                        errors.append(f"{b.url}: {describe(e, self.s.timeout_s)} before its first byte")
                        continue
                    if r.status >= 500 or (r.status == 200 and not first):
                        errors.append(f"{b.url}: HTTP {r.status} {first[:200].decode(errors='replace')}".rstrip())
                        continue
                    self.metrics.decode_ttfb_seconds.observe(time.monotonic() - t0)
                    if r.status != 200:  # the request's fault: no server will take it
                        await self._release(request, params)
                        return web.Response(body=first, status=r.status, content_type=r.content_type), "rejected"
                    if not stream:
                        self.metrics.decode_seconds.observe(time.monotonic() - t0)
                        return web.Response(body=first, content_type=r.content_type), "ok"
                    return await self._relay(request, r, first, b, t0)
                finally:
                    if r.content.at_eof():
                        r.release()  # keep the connection
                    else:
                        r.close()  # unread rest (client gone, failure): closing aborts the server's request
        released = await self._release(request, params)
        why = "; ".join(errors) or self.decode.reason()
        if released is not None:
            self.metrics.handoff_failures.labels("decode_failed").inc()
        return error_response(502, f"decode failed: {why}", "bad_gateway", servers_tried=[b.url for b in tried],
                              handoff=_handoff_id(params), handoff_released=released), "decode_failed"

    async def _relay(self, request: web.Request, r: aiohttp.ClientResponse, first: bytes, b: Backend,
                     t0: float) -> tuple[web.StreamResponse, str]:
        """Pass the decode server's SSE stream through; a failure ends it with an error event."""
        resp = web.StreamResponse(headers={"Content-Type": r.headers.get("Content-Type", "text/event-stream"),
                                           "Cache-Control": "no-cache", "X-Request-Id": request["request_id"]})
        await resp.prepare(request)
        chunk, tail, failure = first, b"", None
        while chunk:
            try:  # a client that stops reading gets the same deadline as a server
                await asyncio.wait_for(resp.write(chunk), self.s.timeout_s)
            except (ConnectionResetError, asyncio.TimeoutError):  # closing ours aborts the server's request
                return resp, "client_gone"
            tail = (tail + chunk)[-len(_DONE):]
            try:
                chunk = await r.content.readany()
            except BACKEND_ERRORS as e:
                failure = describe(e, self.s.timeout_s)
                break
        if failure is None and tail != _DONE:
            failure = "the stream ended before data: [DONE]"
        self.metrics.decode_seconds.observe(time.monotonic() - t0)
        if failure is not None:
            log.warning("request %s: decode server %s failed mid-stream: %s", request["request_id"], b.url, failure)
        end = b"" if failure is None else ((b"" if tail.endswith(b"\n\n") else b"\n\n")
                                            + _sse_error(f"decode server {b.url} failed mid-stream: {failure}"))
        try:
            await asyncio.wait_for(resp.write_eof(end), self.s.timeout_s)
        except (ConnectionResetError, asyncio.TimeoutError):
            return resp, "client_gone"
        return resp, "ok" if failure is None else "stream_error"

    async def _release(self, request: web.Request, params: dict | None) -> bool | None:
        """Release the hand-off in ``params`` that no decode server took. True: released;
        False: not (no --master/--etcd, or kvpool failed: it expires at its deadline); None:
        there is none."""
        hid = _handoff_id(params)
        if hid is None:
            return None
        if self._kv is None:
            log.warning("request %s: hand-off %s was not taken; it expires at its deadline (give --master or "
                        "--etcd to release it at once)", request["request_id"], hid)
            return False
        try:
            await asyncio.wait_for(self._kv.handoff_release(hid), 15.0)
            log.info("request %s: released hand-off %s", request["request_id"], hid)
            return True
        except (KVPoolError, asyncio.TimeoutError) as e:
            log.warning("request %s: releasing hand-off %s failed (%s); it expires at its deadline",
                        request["request_id"], hid, describe(e, 15.0))
            return False

    # ---- other endpoints -------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        """GET /v1/models from a healthy decode server (the next one if it fails)."""
        tried: list[Backend] = []
        errors: list[str] = []
        while (b := self.decode.pick(tried)) is not None:
            tried.append(b)
            try:
                async with self.session.get(b.url + "/v1/models", headers=self._headers(request),
                                            timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as r:
                    data = await r.read()
                if r.status == 200:
                    self.metrics.requests.labels("/v1/models", "ok").inc()
                    return web.Response(body=data, content_type=r.content_type)
                errors.append(f"{b.url}: HTTP {r.status}")
            except BACKEND_ERRORS as e:
                errors.append(f"{b.url}: {describe(e, self.health_timeout_s)}")
        self.metrics.requests.labels("/v1/models", "failed" if tried else "no_backend").inc()
        if not tried:
            return error_response(503, self.decode.reason(), "service_unavailable")
        return error_response(502, "models: " + "; ".join(errors), "bad_gateway", servers_tried=[b.url for b in tried])

    async def _health_handler(self, _request: web.Request) -> web.Response:
        """200 when a prefill and a decode server are healthy, else 503 with the reason."""
        down = [p.reason() for p in (self.prefill, self.decode) if not p.healthy()]
        doc = {"status": "unavailable" if down else "ok", **({"reason": "; ".join(down)} if down else {}),
               "prefill": [b.as_dict() for b in self.prefill.backends],
               "decode": [b.as_dict() for b in self.decode.backends]}
        return web.json_response(doc, status=503 if down else 200)

    async def _metrics_handler(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _handoff_id(params: dict | None) -> str | None:
    kv = params.get("kvpool") if isinstance(params, dict) else None
    hid = kv.get("handoff_id") if isinstance(kv, dict) else None
    return str(hid) if hid else None


def make_app(s: ProxySettings) -> web.Application:
    """The proxy's aiohttp application for ``s`` (raises ConfigError for bad settings)."""
    return Proxy(s).app()


async def _listen(runner: web.AppRunner, proxy: Proxy, host: str, port: int):
    """Listen with aiohttp's server behind a :class:`ConnectionGuard`; returns the asyncio
    server and the guard's sweeper task."""
    guard = proxy.guard = ConnectionGuard(runner.server, MAX_CONNECTIONS, HEAD_TIMEOUT_S, KEEPALIVE_S,
                                          proxy.metrics.refused, MAX_SILENT_PER_PEER)
    server = await asyncio.get_running_loop().create_server(guard.factory, host, port, reuse_address=True,
                                                            backlog=1024)
    return server, asyncio.create_task(guard.sweep())


async def serve(s: ProxySettings, stop: asyncio.Event | None = None,
                on_ready=None) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when it is None). ``on_ready(url)``
    runs once the socket listens (``url`` has the real port when ``s.port`` is 0).
    Raises ConfigError for bad settings, OSError when the address is taken."""
    proxy = Proxy(s)
    runner = web.AppRunner(proxy.app(), access_log=None, handle_signals=False, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    server = sweeper = None
    try:
        server, sweeper = await _listen(runner, proxy, s.host, s.port)
        url = f"http://{s.host}:{server.sockets[0].getsockname()[1]}"
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        (on_ready or (lambda u: None))(url)
        await stop.wait()
    finally:
        if sweeper is not None:
            sweeper.cancel()
        if server is not None:
            server.close()
        await runner.cleanup()


def run_proxy(s: ProxySettings) -> None:
    """``kvpool proxy``: serve until SIGINT/SIGTERM, logging through the process's one log
    setup (:func:`protocol.logs.setup_logging`, stderr; set up here when nobody did)."""
    if not logging.getLogger().handlers:
        from kvpool.protocol.logs import setup_logging

        setup_logging("info")

    s.check()  # ConfigError before anything is logged or bound
    if not s.api_key and not loopback(s.host):
        log.warning("kvpool proxy: serving %s WITHOUT AN API KEY (--allow-no-api-key): anyone who reaches this port "
                    "can use the model servers behind it; give it --api-key-file unless a gateway in front "
                    "authenticates clients", s.host)

    def ready(url: str) -> None:
        log.info("kvpool proxy on %s: prefill %s, decode %s%s", url, ", ".join(s.prefill), ", ".join(s.decode),
                 "" if (s.master or s.etcd) else " (no --master/--etcd: failed hand-offs expire at their deadline)")

    asyncio.run(serve(s, on_ready=ready))
