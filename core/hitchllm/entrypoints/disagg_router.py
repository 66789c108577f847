"""``hitchllm serve-disagg``: an OpenAI-compatible front for one prefill and one decode
instance (disaggregated serving, docs/disaggregation.md).

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to the prefill
instance (``hitchllm serve --kv-role producer``) with ``max_tokens`` 1, no streaming and
``kv_transfer_params={"do_remote_decode": true}``: it computes the prompt, saves its KV and
answers with the ``kv_transfer_params`` a consumer needs. The same request then goes to the
decode instance (``--kv-role consumer``) with those params; its answer, streamed or not, is
passed to the client unchanged. An error of either instance is the client's answer. If the
prefill answer carries no params (the prefill instance is not a producer), the decode
instance computes the prompt itself, and the router logs it. A request for several sequences
(``n`` > 1) goes to the decode instance alone: KV moves for one sequence only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

# Body fields the prefill request must not carry (it makes one token, in one response).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "max_completion_tokens")
# Request headers passed on to the instances.
_FORWARDED_HEADERS = ("authorization",)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, no stream, save the KV."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def _num_sequences(body: dict[str, Any]) -> int:
    """The sequences a request asks for. KV moves for one sequence only (engines refuse
    ``kv_transfer_params`` with ``n > 1``): a request for more goes to the decode instance
    alone, which computes its prompt."""
    counts = [body.get(key) for key in ("n", "best_of")]
    return max([c for c in counts if isinstance(c, int)] or [1])


def build_router_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    """The router's ASGI app; ``*_url`` are the instances' base URLs."""
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    clients: dict[str, aiohttp.ClientSession] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        clients["http"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s))
        try:
            yield
        finally:
            await clients["http"].close()

    app = FastAPI(title="hitchllm disaggregated router", lifespan=lifespan)

    def headers(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}

    async def route(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "the body is not JSON",
                                           "type": "invalid_request_error"}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object",
                                           "type": "invalid_request_error"}}, status_code=400)
        http = clients["http"]
        sent = headers(request)
        params = None
        if _num_sequences(body) == 1:
            async with http.post(prefill_url + path, json=prefill_body(body),
                                 headers=sent) as r:
                answer = await r.read()
                if r.status != 200:
                    return Response(answer, status_code=r.status,
                                    media_type=r.headers.get("content-type"))
            params = json.loads(answer).get("kv_transfer_params")
            if params is None:
                logger.warning("the prefill instance %s returned no kv_transfer_params (is it "
                               "started with --kv-role producer?); the decode instance "
                               "computes the prompt", prefill_url)
        decode = {**body, "kv_transfer_params": params}
        if decode["kv_transfer_params"] is None:
            del decode["kv_transfer_params"]
        upstream = await http.post(decode_url + path, json=decode, headers=sent)
        if upstream.status != 200 or not body.get("stream"):
            try:
                content = await upstream.read()
            finally:
                upstream.release()
            return Response(content, status_code=upstream.status,
                            media_type=upstream.headers.get("content-type"))

        async def relay() -> AsyncIterator[bytes]:
            try:  # a client that leaves closes the decode stream: the request is aborted
                async for chunk in upstream.content.iter_any():
                    yield chunk
            finally:
                upstream.close()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        async with clients["http"].get(decode_url + "/v1/models",
                                       headers=headers(request)) as r:
            return Response(await r.read(), status_code=r.status,
                            media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill_url, decode_url):
            try:
                async with clients["http"].get(url + "/health") as r:
                    if r.status != 200:
                        return Response(status_code=503)
            except aiohttp.ClientError:
                return Response(status_code=503)
        return Response(status_code=200)

    return app


def serve_router(prefill_url: str, decode_url: str, host: str = "127.0.0.1",
                 port: int = 8000, timeout_s: float = 600.0) -> None:
    """Serve the router until interrupted."""
    import uvicorn

    from hitchllm.logger import init_logging

    init_logging()
    app = build_router_app(prefill_url, decode_url, timeout_s)
    logger.info("routing prefill to %s, decode to %s", prefill_url, decode_url)
    uvicorn.run(app, host=host, port=port, log_level="warning")
