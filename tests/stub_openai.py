"""A stand-in OpenAI server for ``kvpool proxy`` tests of the default tier (the vLLM tier
runs real vLLM servers): ``python tests/stub_openai.py PORT`` serves ``/health``,
``/v1/models`` and ``/v1/completions`` on 127.0.0.1. A prefill request (``max_tokens: 1``,
no ``kv_transfer_params``) is answered with ``kv_transfer_params``; a decode request with a
completion naming the ``kv_transfer_params`` it carried. A body with ``stub_delay_s`` is
answered that many seconds late (a request that holds the proxy's slot)."""
from __future__ import annotations

import asyncio
import sys

from aiohttp import web


async def completions(request: web.Request) -> web.Response:
    body = await request.json()
    await asyncio.sleep(float(body.get("stub_delay_s", 0)))
    if body.get("max_tokens") == 1 and "kv_transfer_params" not in body:
        return web.json_response({"choices": [{"text": "p"}], "kv_transfer_params": {"stub": True}})
    return web.json_response({"choices": [{"text": "decoded"}], "usage": {"prompt_tokens": 1},
                              "had_params": "kv_transfer_params" in body})


async def health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def models(_request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "stub"}]})


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
