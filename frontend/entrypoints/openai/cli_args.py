"""`tidal serve`'s own flags, with vLLM's names (vllm/entrypoints/openai/cli_args.py); the
engine flags come from AsyncEngineArgs."""
from __future__ import annotations

import argparse
import os

from tidal.frontend import AsyncEngineArgs
from tidal.frontend.entrypoints.openai.server_flags import add_server_flags

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
API_KEY_ENV = "TIDAL_API_KEY"


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF model dir or hub name (default: the embedded random model)")
    parser.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    group = parser.add_argument_group("server arguments")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default loopback; 0.0.0.0 serves every interface)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", nargs="+", default=None,
                       help=f"require 'Authorization: Bearer KEY', KEY any of these (also ${API_KEY_ENV}); "
                            "/health, /ping and /metrics stay open")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template file (or the template itself) overriding the tokenizer's")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="larger request bodies get 413 (default 32 MiB)")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="on SIGTERM, seconds in-flight requests may run before they are aborted")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    group.add_argument("--disable-uvicorn-access-log", action="store_true")
    group.add_argument("--root-path", default=None, help="ASGI root_path behind a path-routing proxy")
    add_server_flags(group)
    AsyncEngineArgs.add_cli_args(parser, exclude=frozenset({"model"}))
    return parser


def load_chat_template(value: str | None) -> str | None:
    """The template text: a file's contents, or `value` itself when it is a template (vLLM
    accepts both); a path that does not exist is an error at startup."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file (and not a template)")
