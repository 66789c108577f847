"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): routes, errors, limits, API key.

Errors use OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``: invalid
parameters, malformed JSON, prompts that cannot fit and bad LoRA adapter directories -> 400;
unknown model (or LoRA adapter to unload) -> 404; a missing or wrong key when ``--api-key`` is
set -> 401; a body over ``max_request_bytes`` -> 413; a request the engine failed -> 500; a
dead engine -> 503. 5xx bodies never carry internal exception text (it goes to the server
log).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import hitchllm
from hitchllm.engine.async_engine import EngineDeadError, RequestFailedError
from hitchllm.engine.engine_client import EngineClient
from hitchllm.entrypoints.openai.metrics import MetricsSource
from hitchllm.entrypoints.openai.models import (
    APIError,
    LoadLoRAAdapterRequest,
    ServedModels,
    UnloadLoRAAdapterRequest,
)
from hitchllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from hitchllm.entrypoints.openai.serving import OpenAIServing
from hitchllm.entrypoints.openai.streaming import sse
from hitchllm.entrypoints.openai.tokenization import (
    DetokenizeRequest,
    OpenAITokenization,
    parse_tokenize_request,
)

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}
_INTERNAL_ERROR = "internal server error (details are in the server log)"
# How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class ServerLimits:
    """Limits that keep one request from overloading the server."""

    # Largest ``n`` (sequences per prompt) a request may ask for.
    max_n: int = 128
    # Largest request body, in bytes.
    max_request_bytes: int = 4 * 2**20


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in OpenAI's JSON shape."""
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": _ERROR_TYPES.get(status, HTTPStatus(status).phrase),
        "param": param, "code": status,
    }})


class BodySizeLimit:
    """ASGI middleware: answer 413 to a request body over ``max_bytes``, whether announced
    by Content-Length or streamed in chunks, before the body is buffered."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large()(scope, receive, send)
        received = 0

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # FastAPI passes HTTPExceptions raised while reading the body through.
                raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return (f"the request body is larger than {self.max_bytes} bytes; send less, or start "
                "the server with a larger --max-request-bytes")

    def _too_large(self) -> JSONResponse:
        return error_response(413, self._message())


class APIKeyCheck:
    """ASGI middleware: /v1 routes need ``Authorization: Bearer <api_key>``. It reads the
    ASGI path, which routing uses (``request.url`` is rebuilt from the Host header)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or invalid API key: send "
                                               "'Authorization: Bearer <key>'")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _invalid_text_field(value: Any, path: str = "") -> str | None:
    """The first field holding a string that is not valid Unicode (a lone surrogate from a
    JSON escape like "\\ud800"), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            if (found := _invalid_text_field(item, f"{path}.{key}" if path else str(key))):
                return found
    elif isinstance(value, list):
        if all(type(item) is int for item in value):  # token ids: nothing to check, and
            return None  # a prompt of thousands should not cost a call per token
        for i, item in enumerate(value):
            if (found := _invalid_text_field(item, f"{path}[{i}]")):
                return found
    return None


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; cancel it (which aborts its engine requests) if the client leaves.
    Returns None when the client is gone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def build_app(
    engine: EngineClient,
    served_model_names: list[str],
    tokenizer: Any,
    metrics: MetricsSource,
    api_key: str | None = None,
    chat_template: str | None = None,
    limits: ServerLimits | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The FastAPI application serving ``engine`` (one in-process engine, or data-parallel
    replicas) under ``served_model_names`` (the first is
    the name reported back) and each of its LoRA adapters under the adapter's name;
    ``allow_runtime_lora_updating`` opens ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter``."""
    limits = limits or ServerLimits()
    app = FastAPI(title="hitchllm", version=hitchllm.__version__)
    served = ServedModels(engine, served_model_names, allow_runtime_lora_updating)
    serving = OpenAIServing(engine, served_model_names[0], tokenizer, chat_template)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)

    if api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.error("request failed", exc_info=exc)
        return error_response(500, _INTERNAL_ERROR)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, param=".".join(loc) or None)

    async def respond(
        request: Request, req: CompletionRequest | ChatCompletionRequest, handler: Any
    ) -> Response:
        lora_request = served.lora_request(req.model)  # 404 for an unknown model
        if bad := req.unsupported():
            return error_response(400, f"not supported by this server: {', '.join(bad)}",
                                  param=bad[0])
        if (field := _invalid_text_field(req.model_dump())) is not None:
            return error_response(400, f"{field}: the text is not valid Unicode (a lone "
                                       "surrogate escape?)", param=field)
        if req.n > limits.max_n:
            return error_response(400, f"n must be at most {limits.max_n} on this server, got "
                                       f"{req.n}", param="n")
        try:
            result = await _unless_disconnected(request, handler(req, lora_request))
        except ValueError as exc:
            # Parameter errors start with the field's name ("top_p must be in (0, 1]...").
            words = str(exc).split()
            param = words[0] if words and words[0] in type(req).model_fields else None
            return error_response(400, str(exc), param=param)
        except RequestFailedError as exc:
            return error_response(500, str(exc))
        except EngineDeadError as exc:
            return error_response(503, str(exc))
        if result is None:  # the client left; its requests were aborted
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(_guarded(result), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Response:
        return await respond(request, req, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
        return await respond(request, req, serving.chat)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": served.cards()}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await served.load(req))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await served.unload(req))

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop runs (every replica's, with data parallelism); 503 with
        the reason once one has stopped."""
        if (reason := engine.dead_reason) is not None:
            return error_response(503, reason)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hitchllm.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        # Off the event loop: with data parallelism this asks every replica for its numbers.
        text = await asyncio.to_thread(metrics.render)
        return Response(text, media_type="text/plain; version=0.0.4")

    # ---- vLLM's extra routes: one model's card, and the server's tokenizer ----

    tokenization = OpenAITokenization(serving, engine.max_model_len)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return JSONResponse(served.card(model_id))

    async def tokenizer_route(model_name: str | None, handler: Any, req: Any) -> Response:
        if model_name is not None:
            served.lora_request(model_name)  # 404 for an unknown model; adapters share the
            # base model's tokenizer
        try:
            return JSONResponse(await serving.in_tokenizer_thread(handler, req))
        except ValueError as exc:
            return error_response(400, str(exc))

    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> Response:
        try:
            req = parse_tokenize_request(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc
        return await tokenizer_route(req.model, tokenization.tokenize, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        return await tokenizer_route(req.model, tokenization.detokenize, req)

    return app


async def _guarded(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Stream ``chunks``; a failure mid-stream becomes a final error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except (RequestFailedError, EngineDeadError) as exc:
        code = 503 if isinstance(exc, EngineDeadError) else 500
        yield sse({"error": {"message": str(exc), "type": _ERROR_TYPES[code], "code": code}})
    except Exception as exc:
        logger.error("streaming a response failed", exc_info=exc)
        yield sse({"error": {"message": _INTERNAL_ERROR, "type": _ERROR_TYPES[500],
                             "code": 500}})
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
