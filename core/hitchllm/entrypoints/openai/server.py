"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): routes, errors, API key.

Errors use OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``: invalid
parameters, malformed JSON and prompts that cannot fit -> 400; unknown model -> 404; a missing
or wrong key when ``--api-key`` is set -> 401.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import hitchllm
from hitchllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from hitchllm.entrypoints.openai.metrics import ServerMetrics
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
                500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in OpenAI's JSON shape."""
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": _ERROR_TYPES.get(status, HTTPStatus(status).phrase),
        "param": param, "code": status,
    }})


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: list[str],
    tokenizer: Any,
    metrics: ServerMetrics,
    api_key: str | None = None,
    chat_template: str | None = None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``served_model_names`` (the first is
    the name reported back)."""
    app = FastAPI(title="hitchllm", version=hitchllm.__version__)
    serving = OpenAIServing(engine, served_model_names[0], tokenizer, chat_template)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Any) -> Response:
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(401, "missing or invalid API key: send "
                                           "'Authorization: Bearer <key>'")
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, param=".".join(loc) or None)

    def check_model(name: str) -> JSONResponse | None:
        if name not in served_model_names:
            return error_response(
                404, f"The model `{name}` does not exist. Available: "
                     f"{', '.join(served_model_names)}", param="model")
        return None

    async def respond(req: CompletionRequest | ChatCompletionRequest, handler: Any) -> Response:
        if (err := check_model(req.model)) is not None:
            return err
        if bad := req.unsupported():
            return error_response(400, f"not supported by this server: {', '.join(bad)}",
                                  param=bad[0])
        try:
            result = await handler(req)
        except ValueError as exc:
            # Parameter errors start with the field's name ("top_p must be in (0, 1]...").
            words = str(exc).split()
            param = words[0] if words and words[0] in type(req).model_fields else None
            return error_response(400, str(exc), param=param)
        except EngineDeadError as exc:
            return error_response(503, str(exc))
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(_guarded(result), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Response:
        return await respond(req, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        return await respond(req, serving.chat)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "hitchllm",
                "max_model_len": engine.engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in served_model_names]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hitchllm.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    # ---- vLLM's extra routes: one model's card, and the server's tokenizer ----

    tokenization = OpenAITokenization(serving, engine.engine.max_model_len)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if (err := check_model(model_id)) is not None:
            return err
        return JSONResponse(model_card(model_id))

    async def tokenizer_route(model_name: str | None, handler: Any, req: Any) -> Response:
        if model_name is not None and (err := check_model(model_name)) is not None:
            return err
        try:
            return JSONResponse(handler(req))
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


async def _guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Stream ``chunks``; an engine failure mid-stream becomes a final error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except (ValueError, EngineDeadError) as exc:
        yield sse({"error": {"message": str(exc), "type": "InternalServerError", "code": 500}})
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
