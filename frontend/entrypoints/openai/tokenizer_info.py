"""GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint; TokenizerInfo in
vllm/entrypoints/serve/tokenize/serving.py): the tokenizer's configuration, as its
tokenizer_config.json has it. vLLM's fields: transformers' `init_kwargs` less the file paths
(`vocab_file`, `merges_file`), each AddedToken as its text (added_tokens_decoder's values, the
special tokens), `tokenizer_class` (the tokenizer's class name) and, when the server was started
with --chat-template, that template as `chat_template`. Without the flag the route does not
exist (404), as in vLLM.

tidal's front-end may serve a lean tokenizer (frontend/tokenizer.py) in front of transformers'
one: the configuration is the transformers tokenizer's (loaded on first use, in the render pool).
"""
from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from tidal.frontend.entrypoints.openai.serving_context import ServingContext


def transformers_tokenizer(tok: Any) -> Any:
    """The transformers tokenizer behind `tok` (itself when it is one)."""
    full = getattr(type(tok), "_full_tokenizer", None)  # LeanTokenizer's, which loads it once
    return full(tok) if full is not None else tok


def _serializable(obj: Any) -> Any:
    """vLLM's _make_json_serializable: an AddedToken (anything with `content`) as its text."""
    if hasattr(obj, "content"):
        return obj.content
    if isinstance(obj, dict):
        return {k: _serializable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_serializable(v) for v in obj]
    return obj


def tokenizer_info(tok: Any, chat_template: str | None) -> dict[str, Any]:
    """The /tokenizer_info body of transformers tokenizer `tok` (server template: `chat_template`)."""
    config = dict(getattr(tok, "init_kwargs", None) or {})
    config.pop("vocab_file", None)
    config.pop("merges_file", None)
    config = _serializable(config)
    config["tokenizer_class"] = type(tok).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


class TokenizerInfoRoute:
    """The endpoint; the body is made once (the configuration does not change while serving)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self._body: bytes | None = None

    def _make(self) -> bytes:
        tok = transformers_tokenizer(self.ctx.needs_tokenizer())
        # repr for what JSON has no form of (vLLM's pydantic would fail on it instead)
        return msgspec.json.encode(tokenizer_info(tok, self.ctx.chat_template), enc_hook=repr)

    async def endpoint(self, request: Request) -> Response:
        if self._body is None:
            self._body = await self.ctx.in_thread(self._make)
        return Response(self._body, media_type="application/json")
