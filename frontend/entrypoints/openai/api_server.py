"""The OpenAI-compatible HTTP server behind `tidal serve` (vLLM's api_server.py): the app, its
routes, the API key and body-size guards, and the server's life cycle.

Stack, and why: Starlette on uvicorn, with uvloop as the event loop and httptools as the HTTP
parser (uvicorn's fastest pairing, both C-backed). Starlette is the ASGI toolkit FastAPI is
built on; FastAPI's additions are pydantic validation and OpenAPI docs, and this server decodes
requests with msgspec into the same kind of typed Structs it encodes responses from (one schema
library, several times faster than pydantic + json.dumps on the per-token path), so Starlette's
routing, exception handlers, lifespan and `StreamingResponse` (which watches for the client's
disconnect while streaming) are all it needs. uvicorn does the graceful shutdown: it stops
accepting, waits up to `timeout_graceful_shutdown` for in-flight requests, then cancels them
(cancelling a request's generate() stream aborts it in the core) and runs the lifespan exit,
which shuts the engine down (graceful_server.py: the requests still running at the timeout are
aborted first, so their streams end cleanly). Metrics are prometheus_client's text exposition.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from http import HTTPStatus
from typing import Any

import msgspec
import prometheus_client
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from tidal import __version__
from tidal.frontend import AsyncEngineArgs, AsyncLLM
from tidal.frontend.entrypoints.openai.cli_args import api_keys, load_chat_template
from tidal.frontend.entrypoints.openai.disconnect import ClientGone
from tidal.frontend.entrypoints.openai.errors import APIError, from_exception
from tidal.frontend.entrypoints.openai.graceful_server import ABORT_GRACE_S, GracefulServer
from tidal.frontend.entrypoints.openai.http_guard import guarded_protocol
from tidal.frontend.entrypoints.openai.limits import RequestSizeLimits
from tidal.frontend.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    request_decoder,
)
from tidal.frontend.entrypoints.openai.server_flags import (
    RootPathOnce,
    add_app_middleware,
    apply_log_config,
    check_server_flags,
    filter_access_log,
    remove_uds,
    uvicorn_kwargs,
)
from tidal.frontend.entrypoints.openai.orca_metrics import with_orca_header
from tidal.frontend.entrypoints.openai.sagemaker import Invocations
from tidal.frontend.entrypoints.openai.server_load import ServerLoad
from tidal.frontend.entrypoints.openai.serving_chat import ChatHandler, render_chat
from tidal.frontend.entrypoints.openai.serving_chat_batch import BatchChatHandler
from tidal.frontend.entrypoints.openai.serving_completions import CompletionsHandler
from tidal.frontend.entrypoints.openai.serving_responses import ResponsesHandler
from tidal.frontend.entrypoints.anthropic.serving_messages import MessagesHandler, error_response as anthropic_error_response
from tidal.frontend.entrypoints.openai.serving_context import ChatOptions, ServingContext
from tidal.frontend.entrypoints.openai.tokenizer_info import TokenizerInfoRoute
from tidal.frontend import lower_thread_priority
from tidal.protocol import envs
from tidal.protocol.errors import EngineDeadError
from tidal.utils.openmp import omp_wait_is_tidals

logger = logging.getLogger(__name__)

# No API key needed: probes, scrapers and load balancers' load polls.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/load"})
_LOG_POLL_MIN_S = 0.05  # the stats task never wakes more often than this
_JSON = "application/json"


def json_response(obj: msgspec.Struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type=_JSON)


def error_response(e: APIError) -> Response:
    return Response(e.encode(), status_code=int(e.status), media_type=_JSON, headers=e.headers or None)


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` (the scheme in any case, as RFC 9110 has it) or Anthropic's
    `x-api-key: KEY` (what its clients send) on every path but OPEN_PATHS; KEY is any of the
    server's keys, each compared in constant time. A refusal under /v1/messages is in
    Anthropic's error shape, so its clients raise their AuthenticationError."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str]) -> None:
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        if not keys or not all(keys):
            raise ValueError("an API key must be a non-empty string")
        # Digests are compared, so neither a key's length nor which key matched shows in the time.
        self.app, self.digests = app, [hashlib.sha256(k.encode()).digest() for k in keys]

    def _matches(self, token: bytes) -> bool:
        got = hashlib.sha256(token.strip()).digest()
        ok = False
        for digest in self.digests:  # every key compared
            ok |= hmac.compare_digest(got, digest)
        return ok

    def _authorized(self, header: bytes, api_key: bytes | None = None) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and self._matches(token):
            return True
        return api_key is not None and self._matches(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        api_key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
        if path in OPEN_PATHS or self._authorized(got, api_key):
            return await self.app(scope, receive, send)
        err = APIError("Unauthorized: a missing or wrong API key (send 'Authorization: Bearer KEY' or "
                       "'x-api-key: KEY')", HTTPStatus.UNAUTHORIZED)
        anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
        await (anthropic_error_response(err) if anthropic else error_response(err))(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 once it is known to exceed `limit` (by Content-Length, or while read)."""
    declared = request.headers.get("content-length")
    too_large = APIError(f"Request body exceeds the limit of {limit} bytes (--max-request-body-bytes)",
                         HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            parts.clear()
            release_memory()
            raise too_large
        parts.append(chunk)
    if size >= TRIM_AFTER_BYTES:
        release_memory()  # the transport's buffers for a large body are freed by now
    return b"".join(parts)


# After a body this large, freed heap is handed back to the OS: glibc keeps it otherwise
# (620 MB stayed resident after rejected 64 MiB bodies until malloc_trim).
TRIM_AFTER_BYTES = 8 << 20


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on a libc without it (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_memory() -> None:
    """Return free heap pages to the OS where the libc can (a no-op elsewhere)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


Handler = Callable[[Any, Request], Awaitable[Response]]


def json_endpoint(handler: Handler, request_type: type, limit: int) -> Callable[[Request], Awaitable[Response]]:
    """A POST route: body (size-checked) -> typed request (`bytes`: the body itself, for a
    handler that decodes it) -> handler; every failure an APIError."""
    decode: Callable[[bytes], Any] = (
        (lambda b: b) if request_type is bytes else request_decoder(request_type).decode)

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(decode(await read_body(request, limit)), request)
        except (ClientGone, ClientDisconnect):  # mid-body too (e.g. closed by --request-read-timeout)
            return Response(status_code=499)  # nobody reads it: the client went away
        except Exception as e:
            raise from_exception(e) from None

    return endpoint


class Routes:
    """The GET routes and the small POST ones (tokenize, detokenize)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def health(self, request: Request) -> Response:
        try:
            await self.ctx.engine.check_health()
        except EngineDeadError as e:
            return error_response(from_exception(e))
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        m = self.ctx.engine.metrics
        body = prometheus_client.generate_latest(m.registry) if m is not None else b""
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    async def version(self, request: Request) -> Response:
        return json_response(VersionResponse(__version__))

    async def models(self, request: Request) -> Response:
        ctx = self.ctx
        return json_response(ModelList(data=[
            ModelCard(id=name, created=_started_at(), root=ctx.model_path, max_model_len=ctx.max_model_len)
            for name in ctx.served_names]))

    async def tokenize(self, req: TokenizeRequest, request: Request) -> Response:
        ctx = self.ctx
        ctx.model_name(req.model)
        tok = ctx.needs_tokenizer()
        if req.messages is not None:
            text = await render_chat(ctx, req.messages, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, kwargs=req.chat_template_kwargs)
            special = bool(req.add_special_tokens)
        elif req.prompt is not None:
            text, special = req.prompt, req.add_special_tokens is not False
        else:
            raise APIError("/tokenize needs 'prompt' or 'messages'", HTTPStatus.BAD_REQUEST, "prompt")
        ids = await ctx.encode(text, special, param=None)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response(TokenizeResponse(len(ids), ctx.max_model_len, ids, strs))

    async def detokenize(self, req: DetokenizeRequest, request: Request) -> Response:
        ctx = self.ctx
        ctx.model_name(req.model)
        tok = ctx.needs_tokenizer()
        vocab = len(tok)
        if bad := [t for t in req.tokens if not 0 <= t < vocab]:
            raise APIError(f"token ids {bad[:8]} are out of the vocabulary range [0, {vocab})",
                           HTTPStatus.BAD_REQUEST, "tokens")
        return json_response(DetokenizeResponse(tok.decode(req.tokens)))


_START = [0]


def _started_at() -> int:
    """When this server started (the `created` of its model cards)."""
    if not _START[0]:
        _START[0] = int(time.time())
    return _START[0]


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = HTTPStatus(exc.status_code)
    message = f"{status.phrase}: {request.method} {request.url.path}"
    return error_response(APIError(message, status))


async def _api_error(request: Request, exc: Exception) -> Response:
    return error_response(exc if isinstance(exc, APIError) else from_exception(exc))


async def _log_stats(engine: AsyncLLM) -> None:
    """vLLM's periodic stats line (INFO while busy, DEBUG when idle), with stats on. The output
    handler logs it when a core message comes after the interval is up; this task logs it when
    none comes (an idle engine). Both ask `maybe_log`, so whichever comes first logs and the
    other waits for the next interval: a forced log here used to follow the handler's by
    milliseconds, a second line over an empty interval."""
    while (metrics := engine.metrics) is not None:
        await asyncio.sleep(max(_LOG_POLL_MIN_S, metrics.seconds_until_log()))
        try:
            metrics.maybe_log()
        except Exception as e:
            logger.debug("stats log failed: %s", e)


def build_app(ctx: ServingContext, *, api_key: str | Sequence[str] | None = None, max_body_bytes: int = 32 << 20,
              flags: Any = None) -> Starlette:
    """The app; `flags` (tidal serve's parsed arguments) adds the middleware server_flags
    implements (outside the API key check, so CORS preflights need no key), server load tracking
    and the /tokenizer_info route."""
    routes = Routes(ctx)
    load = ServerLoad(bool(getattr(flags, "enable_server_load_tracking", False)))
    chat_handler = ChatHandler(ctx)
    # The generation handlers: ORCA load reports on whole responses, counted in the server load.
    completions = load.tracked(with_orca_header(CompletionsHandler(ctx), ctx.engine))
    chat = load.tracked(with_orca_header(chat_handler, ctx.engine))
    batch_chat = load.tracked(BatchChatHandler(ctx, chat_handler))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        _started_at()
        stats = asyncio.create_task(_log_stats(ctx.engine))
        try:
            yield
        finally:
            stats.cancel()
            ctx.engine.shutdown()  # aborts what is left, stops the core and its workers

    app = Starlette(routes=[
        Route("/health", routes.health, methods=["GET"]),
        Route("/ping", routes.health, methods=["GET", "POST"]),  # vLLM's (SageMaker's) health probe
        Route("/metrics", routes.metrics, methods=["GET"]),
        Route("/version", routes.version, methods=["GET"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/completions", json_endpoint(completions, CompletionRequest, max_body_bytes), methods=["POST"]),
        Route("/v1/chat/completions", json_endpoint(chat, ChatCompletionRequest, max_body_bytes),
              methods=["POST"]),
        Route("/v1/chat/completions/batch", json_endpoint(batch_chat, bytes, max_body_bytes), methods=["POST"]),
        *ResponsesHandler(chat_handler).routes(json_endpoint, load, max_body_bytes),  # /v1/responses
        *MessagesHandler(chat_handler).routes(json_endpoint, load, max_body_bytes),  # /v1/messages (Anthropic)
        Route("/invocations", json_endpoint(Invocations(chat, completions), bytes, max_body_bytes),
              methods=["POST"]),  # SageMaker's
        Route("/load", load.endpoint, methods=["GET"]),
        Route("/tokenize", json_endpoint(routes.tokenize, TokenizeRequest, max_body_bytes), methods=["POST"]),
        Route("/detokenize", json_endpoint(routes.detokenize, DetokenizeRequest, max_body_bytes),
              methods=["POST"]),
        *([Route("/tokenizer_info", TokenizerInfoRoute(ctx).endpoint, methods=["GET"])]
          if getattr(flags, "enable_tokenizer_info_endpoint", False) else []),
    ], exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _api_error},
        lifespan=lifespan)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if flags is not None:
        add_app_middleware(app, flags)
    return app


def engine_args_from(args: Any) -> AsyncEngineArgs:
    """The engine args of `tidal serve`'s flags, the model resolved (the positional, --model, or
    the embedded default model)."""
    model = args.model or args.model_flag
    if model is None:
        from tidal.frontend.entrypoints.make_model import ensure_default_model

        model = ensure_default_model()
        logger.warning("no model given, so this serves tidal's embedded default model (%s); its "
                       "weights are random: its text is gibberish", model)
    return AsyncEngineArgs.from_cli_args(args).replace(model=model)


def served_names(engine_args: AsyncEngineArgs) -> list[str]:
    names = engine_args.served_model_name
    if isinstance(names, str):
        names = [names]
    return list(names) if names else [engine_args.model]


def yield_to_cpu_engine(engine: AsyncLLM, increment: int) -> int | None:
    """TIDAL_SERVER_NICE (see frontend/priority.py): the event loop's thread runs `increment`
    nicer than an engine that computes on this host's CPUs, one this server started itself
    (a headless core's host and device are its own business). Unless asked for by name, not
    when the user chose OpenMP's wait behaviour: compute threads that spin longer than tidal's
    leave the loop no idle core to run on. Returns the loop's new nice value, if it changed."""
    if engine.config.core_address is not None or engine.info.device != "cpu":
        return None
    if not envs.is_set("TIDAL_SERVER_NICE") and not omp_wait_is_tidals():
        logger.info("the event loop keeps its priority: OMP_WAIT_POLICY or GOMP_SPINCOUNT is set "
                    "(set TIDAL_SERVER_NICE to lower it anyway)")
        return None
    try:
        nice = lower_thread_priority(increment)
    except OSError as e:  # e.g. a sandbox that forbids setpriority: serve at the same priority
        logger.warning("could not lower the event loop's priority (TIDAL_SERVER_NICE): %s", e)
        return None
    if nice is not None:
        logger.info("the event loop runs at nice %d, nicer than its CPU engine (TIDAL_SERVER_NICE=%d)",
                    nice, increment)
    return nice


async def run_server(args: Any) -> None:
    """Start the engine, serve until SIGINT/SIGTERM, shut everything down."""
    check_server_flags(args)
    nice_increment = envs.TIDAL_SERVER_NICE  # a bad value fails here, before the engine starts
    limits = RequestSizeLimits.from_env()
    template = load_chat_template(args.chat_template)
    server_kwargs = uvicorn_kwargs(args)
    # httptools with read and write time bounds (http_guard.py): slow clients hurt only themselves.
    http = guarded_protocol(args.request_read_timeout, args.response_write_timeout)
    apply_log_config(args)  # before the engine starts its processes: they inherit it
    engine_args = engine_args_from(args)
    engine = AsyncLLM.from_engine_args(engine_args)
    ctx: ServingContext | None = None
    try:
        yield_to_cpu_engine(engine, nice_increment)
        ctx = ServingContext(engine, served_names(engine_args), template, ChatOptions(
            args.response_role, args.chat_template_content_format, args.default_chat_template_kwargs or {},
            args.enable_force_include_usage, args.return_tokens_as_token_ids, args.trust_request_chat_template,
            args.enable_prompt_tokens_details, args.enable_auto_tool_choice, args.tool_call_parser,
            args.exclude_tools_when_tool_choice_none, getattr(args, "reasoning_parser", None) or None),
            limits)
        keys = api_keys(args.api_key)
        app = build_app(ctx, api_key=keys, max_body_bytes=args.max_request_body_bytes, flags=args)
        if args.root_path:
            app = RootPathOnce(app, args.root_path)
        config = uvicorn.Config(app, http=http, lifespan="on", log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log,
                                timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S,
                                root_path=args.root_path or "",
                                **server_kwargs)
        filter_access_log(args)
        where = f"unix:{args.uds}" if args.uds else (
            f"{'https' if args.ssl_keyfile else 'http'}://{args.host}:{args.port}")
        logger.info("tidal serve: %s as %s on %s", engine_args.model, ctx.served_names[0], where)
        await GracefulServer(config, engine, args.shutdown_timeout).serve()
    finally:
        if ctx is not None:
            ctx.close()
        engine.shutdown()
        remove_uds(args)
