"""The FastAPI app: routes, error replies, authentication and the request-size limit.

``build_app(engine, config)`` wires one ``LLMEngine`` into an app; the engine loop thread
starts and stops with the app's lifespan (so with uvicorn's startup and shutdown, Ctrl-C
included). Everything the app holds is reachable as ``app.state.ridge`` (a ``ServerState``).

Every error reply, whatever raised it, is OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``:

=====  ==========================================================================
400    malformed JSON; bad values (sampling ranges, empty prompt, context length)
401    missing or wrong API key (``/v1`` routes, when the server has a key)
404    unknown model name, or unknown route
413    request body over ``max_request_bytes``
422    schema errors: a field of the wrong type, a missing field, an unknown field
503    the engine is not running
=====  ==========================================================================
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ridge import __version__
from ridge.engine.client import EngineClient
from ridge.server.async_engine import AsyncEngine, EngineDeadError
from ridge.server.metrics import STATE_SOURCES, ServerMetrics, StateSource
from ridge.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from ridge.server.serving import CLIENT_CLOSED, ClientGone, OpenAIServing, ServerConfig

logger = logging.getLogger("ridge.server")

# How long /metrics waits for the engine thread to read its state (it answers between steps).
STATE_READ_TIMEOUT_S = 5.0


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine
    metrics: ServerMetrics
    serving: OpenAIServing


def build_app(
    engine: EngineClient, config: ServerConfig, state_sources: tuple[StateSource, ...] = STATE_SOURCES
) -> FastAPI:
    """An OpenAI-compatible app serving ``engine``. ``state_sources``: see ``ridge.server.metrics``."""
    if config.kv_info is None and engine.kv_info() is not None:  # read before the engine loop starts
        config = dataclasses.replace(config, kv_info=engine.kv_info())
    metrics = ServerMetrics(config.served_model_names[0], state_sources)
    async_engine = AsyncEngine(engine, observer=metrics)
    serving = OpenAIServing(async_engine, config)
    state = ServerState(config, async_engine, metrics, serving)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            serving.close()

    app = FastAPI(title="ridge", version=__version__, lifespan=lifespan)
    app.state.ridge = state
    # The last added runs first: the key is checked before the body is read.
    app.add_middleware(_JsonBody)
    app.add_middleware(_BodyLimit, limit=config.max_request_bytes, on_error=metrics.record_http_error)
    app.add_middleware(_ApiKey, api_key=config.api_key, on_error=metrics.record_http_error)
    _add_error_handlers(app, metrics)
    _add_routes(app, state)
    return app


# -- routes ------------------------------------------------------------------------------------


def _errors(*statuses: int) -> dict:
    """OpenAPI ``responses`` for these error statuses: all are OpenAI's error object (the fuzz
    test checks every reply against this schema, and that none is a 5xx)."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


ERROR_DESCRIPTIONS = {
    400: "malformed JSON or a bad value",
    401: "a missing or wrong API key",
    404: "an unknown model or route",
    413: "a body over the size limit",
    422: "a field of the wrong type, a missing or an unknown field",
    503: "the engine is not running",
}
V1_ERRORS = (401, 422)
GENERATION_ERRORS = _errors(400, 404, 413, 503, *V1_ERRORS)


# One server-sent event as a client parses it (the OpenAPI specification's generic schema for
# text/event-stream, which schema checkers such as schemathesis validate each event against):
# here data holds a JSON chunk, or [DONE] last
SSE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0},
    },
}


def _generation_reply(model: type) -> dict:
    """A JSON body, or server-sent events when the request streams."""
    return {
        200: {"model": model, "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}},
        **GENERATION_ERRORS,
    }


def _add_routes(app: FastAPI, state: ServerState) -> None:
    serving, async_engine, metrics, config = state.serving, state.engine, state.metrics, state.config

    @app.get(
        "/health", responses={200: {"content": {"application/json": {"example": {"status": "ok"}}}}, **_errors(503)}
    )
    async def health() -> Response:
        if not async_engine.is_alive:
            raise APIError(503, f"the engine is not running ({async_engine.error or 'stopped'})")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        try:  # engine state is read at scrape time, on the engine thread, between steps
            stats = await asyncio.wait_for(async_engine.stats(), STATE_READ_TIMEOUT_S)
            samples = metrics.read_state(stats)
            metrics.publish_state(samples)
        except Exception as exc:  # engine stopped or busy: the last state read is exported
            logger.warning("metrics: could not read the engine state: %s", exc)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv/info", responses=_errors(404, 503))
    async def kv_info() -> Response:
        """Disaggregated serving: this instance's KV-transfer identity, endpoint and layout."""
        info = await _engine_call(async_engine.kv_info())
        if info is None:
            raise APIError(404, "this instance has no --kv-transfer-config")
        return JSONResponse(info)

    @app.post("/kv/connect", responses=_errors(400, 404, 503))
    async def kv_connect(raw: Request) -> Response:
        """Pair with a peer instance (the body: the peer's ``/kv/info``); ``ridge router`` asks
        both sides. 400 with one clear line when the peer is unreachable or does not match."""
        try:
            peer = json.loads(await raw.body())
        except json.JSONDecodeError as exc:
            raise APIError(400, f"Malformed JSON in the request body: {exc}", code="invalid_json") from None
        if not isinstance(peer, dict):
            raise APIError(400, "the body must be the peer's /kv/info object")
        try:
            await _engine_call(async_engine.kv_connect(peer))
        except ValueError as exc:
            raise APIError(400, str(exc), code="kv_peer_mismatch") from None
        return JSONResponse({"status": "ok", "peer": peer.get("engine_id")})

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, root=config.model_root, max_model_len=serving.max_model_len)

    @app.get("/v1/models", responses=_errors(*V1_ERRORS))
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(n) for n in config.served_model_names])

    @app.get("/v1/models/{model_id:path}", responses=_errors(404, *V1_ERRORS))
    async def get_model(model_id: str) -> ModelCard:
        if model_id not in config.served_model_names:
            raise APIError(404, f"The model {model_id!r} does not exist.", param="model", code="model_not_found")
        return model_card(model_id)

    @app.post("/v1/completions", responses=_generation_reply(CompletionResponse))
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return _reply(await _or_gone(serving.create_completion(body, raw)))

    @app.post("/v1/chat/completions", responses=_generation_reply(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return _reply(await _or_gone(serving.create_chat_completion(body, raw)))


async def _engine_call(work):
    try:
        return await work
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None


async def _or_gone(work):
    try:
        return await work
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; the access log shows it


def _reply(result) -> Response:
    if isinstance(result, Response):
        return result
    if hasattr(result, "__aiter__"):
        # no-cache / no buffering: proxies must pass tokens through as they come
        return StreamingResponse(
            result, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
    body = result.model_dump()
    if body.get("kv_transfer_params", 0) is None:  # only a producer's answer carries it
        del body["kv_transfer_params"]
    return JSONResponse(body)


# -- errors ------------------------------------------------------------------------------------


class _ErrorJSON(JSONResponse):
    """An error body in ASCII JSON: a message may quote what the client sent, lone
    surrogates included, which UTF-8 cannot carry (the reply would become a 500)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    type: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    err = APIError(status, message, param=param, code=code, type=type)
    return _ErrorJSON(err.body(), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.record_http_error(exc.status)
        return _ErrorJSON(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            metrics.record_http_error(400)
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            return _error_response(
                400,
                f"Malformed JSON in the request body: {detail.get('ctx', {}).get('error', detail.get('msg'))}",
                code="invalid_json",
            )
        metrics.record_http_error(422)
        first = errors[0] if errors else {}
        return _error_response(
            422,
            "; ".join(_describe(e) for e in errors[:5]) or "invalid request",
            param=_loc(first) or None,
            code=first.get("type"),
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.record_http_error(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        return _error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        metrics.record_http_error(500)
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return _error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _loc(error: dict) -> str:
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    return ".".join(loc)


def _describe(error: dict) -> str:
    where = _loc(error)
    if error.get("type") == "extra_forbidden":
        return f"unrecognized request argument: {where}"
    if error.get("type") == "missing" and not where:
        return "the request body is missing"
    return f"{where}: {error.get('msg')}" if where else str(error.get("msg"))


# -- middleware (pure ASGI: they must not buffer or break streaming responses) -------------------


class _ApiKey:
    """``/v1`` and ``/kv`` routes need ``Authorization: Bearer <key>`` when the server has a key."""

    def __init__(self, app: ASGIApp, api_key: str | None, on_error) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or not scope["path"].startswith(("/v1", "/kv")):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        self.on_error(401)
        message = "Missing API key: send 'Authorization: Bearer <key>'." if not given else "Incorrect API key provided."
        response = _error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class _JsonBody:
    """The ``/v1`` bodies are JSON whatever the Content-Type says: ``curl -d`` sends
    ``application/x-www-form-urlencoded``, and some clients send none (FastAPI would not
    parse either as JSON and answer 422 "Input should be a valid dictionary")."""

    JSON = b"application/json"

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = dict(scope["headers"]).get(b"content-type", b"")
            if not given.split(b";")[0].strip().lower().endswith(b"json"):
                scope = {**scope, "headers": [*headers, (b"content-type", self.JSON)]}
        await self.app(scope, receive, send)


class _BodyLimit:
    """Answers 413 for a body over ``limit`` bytes (by Content-Length, or counted as it arrives)."""

    def __init__(self, app: ASGIApp, limit: int, on_error) -> None:
        self.app = app
        self.limit = limit
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(scope, receive, send)
        # Read the body here (the app reads all of it anyway), so a chunked upload is counted too.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_error(413)
        response = _error_response(
            413, f"The request body is larger than {self.limit} bytes.", code="request_too_large"
        )
        await response(scope, receive, send)
