"""vLLM's server (frontend) flags beyond the basic ones: CORS, TLS, a Unix socket, X-Request-Id
headers, extra ASGI middleware, access-log filtering, a logging config, and the vLLM flags tidal
accepts without acting on them or refuses (vllm/entrypoints/openai/cli_args.py, FrontendArgs).

Every vLLM server flag has a defined outcome here: implemented, accepted as a no-op (a value
other than vLLM's default logs why it changes nothing), or refused at start-up with a message
naming the feature (exit 1, before the engine loads). Some are only declared here and acted on
where their feature is: --enable-prompt-tokens-details (usage_details.py),
--enable-server-load-tracking (server_load.py), --enable-tokenizer-info-endpoint (tokenizer_info.py).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import os
import ssl
import stat
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tidal.utils.logging_utils import apply_logging_config, load_logging_config

logger = logging.getLogger(__name__)

# vLLM flags that change nothing in tidal: flag -> (vLLM's default, why); another value is
# accepted and logged once.
NOOP_FLAGS: dict[str, tuple[Any, str]] = {
    "disable_fastapi_docs": (False, "tidal's server has no OpenAPI docs pages"),
    "enable_offline_docs": (False, "tidal's server has no OpenAPI docs pages"),
    "h11_max_incomplete_event_size": (4194304, "tidal's server parses HTTP with httptools, not h11"),
    "h11_max_header_count": (256, "tidal's server parses HTTP with httptools, not h11"),
    "max_log_len": (None, "tidal's request log (--enable-log-requests) prints request ids, never prompts"),
    "disable_frontend_multiprocessing": (False, "tidal's server and its engine client are one process; the "
                                                "engine core is always a process of its own"),
}
# vLLM flags for features tidal does not have: flag -> the feature; any value but vLLM's default
# (unset, False, or "" for --tool-parser-plugin) is refused.
REFUSED_FLAGS: dict[str, str] = {
    "lora_modules": "LoRA adapters",
    "tool_parser_plugin": "tool parser plugins (the built-in parsers are --tool-call-parser's choices)",
    "tool_server": "built-in tool servers (the Responses API's MCP/demo tools)",
    "enable_log_outputs": "logging generated outputs",
    "tokens_only": "the tokens-only endpoint set",
    "enable_ssl_refresh": "reloading TLS certificates while running",
}
_STORE_TRUE = frozenset({"enable_log_outputs", "tokens_only",
                         "enable_ssl_refresh", "disable_fastapi_docs", "enable_offline_docs",
                         "disable_frontend_multiprocessing"})
_INT_FLAGS = frozenset({"h11_max_incomplete_event_size", "h11_max_header_count", "max_log_len"})


def json_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's CORS flags: '["https://a.example"]')."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {value!r} ({e.msg})") from None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {value!r} ({e.msg})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def add_server_flags(group: argparse._ArgumentGroup) -> None:
    """The flags this module implements, then the accepted-only and refused ones."""
    group.add_argument("--uds", default=None, help="serve on this Unix domain socket (--host/--port are then unused)")
    group.add_argument("--allowed-origins", type=json_list, default=None,
                       help="CORS: origins whose browser pages may call the API, a JSON list ('[\"*\"]' for any). "
                            "Default: none (vLLM's is any): a server on loopback would otherwise answer every "
                            "web page its user opens")
    group.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS: allowed methods (JSON list)")
    group.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS: allowed headers (JSON list)")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key file")
    group.add_argument("--ssl-certfile", default=None, help="... and this certificate file")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    group.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                       help="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)")
    group.add_argument("--ssl-ciphers", default=None, help="TLS 1.2 cipher suites (OpenSSL list format)")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="answer with an X-Request-Id header (the request's own, else a new id)")
    group.add_argument("--middleware", action="append", default=[],
                       help="import path of an ASGI middleware class, or of an HTTP middleware function "
                            "`async def f(request, call_next)`; repeatable")
    group.add_argument("--disable-access-log-for-endpoints", default=None,
                       help="comma-separated paths kept out of the access log, e.g. /health,/metrics")
    group.add_argument("--log-config-file", default=None,
                       help="a JSON logging.config dict for the server's and its engine processes' loggers "
                            "(uvicorn's too)")
    group.add_argument("--response-role", default="assistant", help="the role of chat replies")
    group.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default="auto",
                       help="message content as the template sees it: a string (string; auto too, where "
                            "vLLM inspects the template), or OpenAI's list of {'type': 'text', 'text': ...} "
                            "parts (openai)")
    group.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                       help="chat template kwargs for every request (a JSON object; a request's own win)")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="end every stream with a usage chunk, as if stream_options.include_usage were set")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprob tokens as 'token_id:N' strings (a request's return_tokens_as_token_ids wins)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a chat request bring its own `chat_template` (else such a request is a 400)")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage.prompt_tokens_details.cached_tokens: the prompt tokens served from the "
                            "prefix cache (chat and completions, streamed and not)")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="count the generation requests in flight, reported by GET /load")
    group.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve GET /tokenizer_info, the tokenizer's configuration (its chat template too)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto": the model decides whether to call tools, and '
                            "--tool-call-parser reads its calls from the reply (required with it)")
    group.add_argument("--tool-call-parser", default=None,
                       help="the format the model writes tool calls in: hermes (Qwen, Hermes: <tool_call>{...}"
                            "</tool_call>), llama3_json, mistral, pythonic")
    group.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help='with tool_choice "none" the chat template gets no tools (else it lists them)')
    for name in [*NOOP_FLAGS, *REFUSED_FLAGS]:
        flag = "--" + name.replace("_", "-")
        if name in _STORE_TRUE:
            group.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
        elif name == "lora_modules":
            group.add_argument(flag, nargs="+", default=None, help=argparse.SUPPRESS)
        elif name in _INT_FLAGS:
            group.add_argument(flag, type=int, default=NOOP_FLAGS[name][0], help=argparse.SUPPRESS)
        else:
            group.add_argument(flag, default=None, help=argparse.SUPPRESS)


# apply_chat_template's own parameters: template kwargs named so would collide with them.
_TEMPLATE_PARAMS = frozenset({"conversation", "chat_template", "add_generation_prompt", "continue_final_message",
                              "tokenize", "tools", "documents", "padding", "truncation", "max_length",
                              "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_server_flags(args: argparse.Namespace) -> None:
    """Everything about these flags that can fail, before the engine starts: ValueError for a
    refused flag that was set, a half TLS setting, a --middleware that does not import, a
    --log-config-file that does not load or template kwargs that name apply_chat_template's
    own parameters, an empty --api-key (an unset shell variable: it would serve without a key);
    one warning per no-op flag set to other than vLLM's default."""
    if getattr(args, "api_key", None) is not None and not all(args.api_key):
        raise ValueError("--api-key: an empty key (is the variable that should hold it unset?)")
    for name, feature in REFUSED_FLAGS.items():
        if getattr(args, name, None) not in (None, False, ""):
            raise ValueError(f"--{name.replace('_', '-')}: tidal does not support {feature}")
    for name, (default, why) in NOOP_FLAGS.items():
        if getattr(args, name, default) != default:
            logger.warning("--%s changes nothing here: %s", name.replace("_", "-"), why)
    check_parser_flags(args)
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    if args.ssl_cert_reqs not in (int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)):
        raise ValueError(f"--ssl-cert-reqs {args.ssl_cert_reqs}: expected 0 (none), 1 (optional) or 2 (required)")
    if args.ssl_cert_reqs != int(ssl.CERT_NONE) and args.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs asks for client certificates: --ssl-ca-certs must name the CAs to check")
    if clash := sorted(_TEMPLATE_PARAMS & set(args.default_chat_template_kwargs or {})):
        raise ValueError(f"--default-chat-template-kwargs: {clash} are apply_chat_template's own parameters")
    for path in args.middleware:
        middleware_of(path)
    log_config(args)


def check_parser_flags(args: argparse.Namespace) -> None:
    """The tool and reasoning parser flags, in vLLM's words: --enable-auto-tool-choice needs
    --tool-call-parser, and a parser name must be one the server has (the message lists them)."""
    from tidal.frontend.entrypoints.openai.chat_tools import reasoning_parser_class, tool_parser_class

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser:
        tool_parser_class(args.tool_call_parser)
    if getattr(args, "reasoning_parser", None):  # an engine arg (vLLM's), read by the chat routes
        reasoning_parser_class(args.reasoning_parser)


class RequestIdHeaderMiddleware:
    """X-Request-Id on every HTTP response: the request's own header, else a new uuid4 hex."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def middleware_of(path: str) -> tuple[type, dict[str, Any]]:
    """(middleware class, its options) for `--middleware path` ("package.module.Name": an ASGI
    middleware class, or an `async def f(request, call_next)`); ValueError naming the path."""
    module_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # noqa: BLE001 - whatever importing it raised (SyntaxError too), named

        raise ValueError(f"--middleware {path!r}: cannot import it ({type(e).__name__}: {e})") from None
    if inspect.isclass(obj):
        return obj, {}
    if inspect.iscoroutinefunction(obj):
        return BaseHTTPMiddleware, {"dispatch": obj}
    raise ValueError(f"--middleware {path!r}: expected an ASGI middleware class or an async function")


def add_app_middleware(app: Starlette, args: argparse.Namespace) -> None:
    """The user's middleware, then request ids, then CORS, each around the app built so far (so
    all of them sit outside the API key check, and CORS outermost: a preflight is answered before
    anything else, and every response, a 401 too, carries the CORS and request id headers)."""
    for path in args.middleware:
        cls, options = middleware_of(path)
        app.add_middleware(cls, **options)
    if args.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if args.allowed_origins is not None:
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)


class RootPathOnce:
    """--root-path for both kinds of proxy (as vLLM serves): uvicorn puts the root path in
    front of every request path, which suits a proxy that strips the prefix (`/v1/...` arrives,
    `/llm/v1/...` is routed), but one that forwards it (or a client calling the prefixed URL
    directly) then got `/llm/llm/v1/...`, a 404. The doubled prefix is cut to one, so
    `/llm/v1/...` and `/v1/...` are both served."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app, self.root = app, root_path.rstrip("/")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        doubled = self.root + self.root
        if self.root and scope["type"] in ("http", "websocket"):
            path = scope["path"]
            if path == doubled or path.startswith(doubled + "/"):
                scope = dict(scope, path=path[len(self.root):])
                raw = scope.get("raw_path")
                if isinstance(raw, bytes) and raw.startswith(doubled.encode()):
                    scope["raw_path"] = raw[len(self.root):]
        await self.app(scope, receive, send)


class _SkipPaths(logging.Filter):
    """Drops uvicorn access-log records of the given paths. Their args are (client, method,
    path with query, HTTP version, status), the path including any --root-path prefix."""

    def __init__(self, paths: set[str], root_path: str) -> None:
        super().__init__()
        self.paths, self.root_path = paths, root_path

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) >= 3 else None
        if not isinstance(path, str):
            return True
        path = path.split("?", 1)[0]
        if self.root_path and path.startswith(self.root_path):
            path = path[len(self.root_path):] or "/"
        return path not in self.paths


def log_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """--log-config-file's dict (ValueError naming the flag when it does not load)."""
    if args.log_config_file is None:
        return None
    try:
        return load_logging_config(args.log_config_file)
    except ValueError as e:
        raise ValueError(f"--log-config-file: {e}") from None


def apply_log_config(args: argparse.Namespace) -> None:
    """--log-config-file for this process and, through TIDAL_LOGGING_CONFIG_PATH, the engine
    processes it starts (before they start). uvicorn is then told to leave logging alone."""
    config = log_config(args)
    if config is not None:
        os.environ["TIDAL_LOGGING_CONFIG_PATH"] = os.path.abspath(args.log_config_file)
        apply_logging_config(config)


def filter_access_log(args: argparse.Namespace) -> None:
    """--disable-access-log-for-endpoints; after uvicorn.Config, which (re)configures logging."""
    if args.disable_access_log_for_endpoints:
        paths = {p.strip() for p in args.disable_access_log_for_endpoints.split(",") if p.strip()}
        logging.getLogger("uvicorn.access").addFilter(_SkipPaths(paths, (args.root_path or "").rstrip("/")))


def remove_uds(args: argparse.Namespace) -> None:
    """The --uds socket file, once the server has stopped (uvicorn leaves it behind)."""
    path = args.uds
    try:
        if path and stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass  # already gone, or not ours to remove


def uvicorn_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The socket, TLS and logging settings of uvicorn.Config."""
    out: dict[str, Any] = {"uds": args.uds} if args.uds else {"host": args.host, "port": args.port}
    if getattr(args, "listen_fd", None) is not None:  # one of --api-server-count's servers (api_servers.py)
        out = {"fd": args.listen_fd}
    if args.log_config_file is not None:
        out["log_config"] = None  # apply_log_config has set it up
    if args.ssl_keyfile is not None:
        out.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                   ssl_cert_reqs=args.ssl_cert_reqs)
        if args.ssl_ciphers:
            out["ssl_ciphers"] = args.ssl_ciphers
    return out
