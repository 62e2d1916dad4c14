"""`tidal serve`'s own flags, with vLLM's names (vllm/entrypoints/openai/cli_args.py); the
engine flags come from AsyncEngineArgs."""
from __future__ import annotations

import argparse
import logging
import os

from tidal.frontend import AsyncEngineArgs
from tidal.frontend.entrypoints.openai.http_guard import DEFAULT_READ_TIMEOUT_S, DEFAULT_WRITE_TIMEOUT_S
from tidal.frontend.entrypoints.openai.server_flags import add_server_flags
from tidal.protocol import envs

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
API_KEY_ENVS = ("VLLM_API_KEY", "TIDAL_API_KEY")  # read in this order when --api-key is not given


def api_keys(flag_keys: list[str] | None) -> list[str] | None:
    """The keys `tidal serve` requires: --api-key's, else $VLLM_API_KEY (vLLM's name, so a
    deployment keyed the vLLM way is keyed here too), else $TIDAL_API_KEY; None: no key. Logs
    which one is in force (never the key)."""
    if flag_keys:
        logger.info("API key required: from --api-key (%d key(s))", len(flag_keys))
        return flag_keys
    for name in API_KEY_ENVS:
        key = getattr(envs, name)
        if key:
            others = [n for n in API_KEY_ENVS if n != name and getattr(envs, n)]
            logger.info("API key required: from $%s%s", name, f" (${others[0]} ignored)" if others else "")
            return [key]
    return None


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF model dir or hub name (default: the embedded random model)")
    parser.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    group = parser.add_argument_group("server arguments")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default loopback; 0.0.0.0 serves every interface)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", nargs="+", default=None,
                       help="require 'Authorization: Bearer KEY', KEY any of these (else $VLLM_API_KEY, else "
                            "$TIDAL_API_KEY); "
                            "/health, /ping and /metrics stay open")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template file (or the template itself) overriding the tokenizer's")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="larger request bodies get 413 (default 32 MiB)")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="on SIGTERM, seconds in-flight requests may run before they are aborted")
    group.add_argument("--request-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                       help="seconds a client has to send a request's headers (from its first byte, or from "
                            "connecting), and the longest pause within its body; else 408 and the connection "
                            "is closed (slow or stalled senders). 0: no bound")
    group.add_argument("--response-write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT_S,
                       help="seconds a response may wait on a client that reads nothing (its socket and the "
                            "server's send buffer full); then the connection is dropped and its request "
                            "aborted in the engine. 0: no bound")
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
