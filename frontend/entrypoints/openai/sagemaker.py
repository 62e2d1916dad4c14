"""POST /invocations, SageMaker's inference route (vLLM's vllm/entrypoints/sagemaker/api_router.py):
the body goes to the first endpoint whose request type it validates as, in vLLM's order for a
generative model: a chat completions request (it has `messages`), then a completions request
(it has a non-empty `prompt`, vLLM's CompletionRequest validator). The response is that
endpoint's, headers, streams, server load and errors included. A body that is neither is a
400: "Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest',
'CompletionRequest']"; a body that is not JSON, a 400 "JSON decode error: ..." with Python's
json message, as vLLM's. (GET and POST /ping, SageMaker's health probe, are api_server's.)

vLLM decides by pydantic validation, which also runs its field checks: a chat body that fails
one (say `top_logprobs` without `logprobs`) falls through to the next type there and ends in
the error above; here a body is dispatched on its types and the endpoint's check answers it.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, request_decoder

Handler = Callable[[Any, Request], Awaitable[Response]]
INVOCATION_TYPES = ("ChatCompletionRequest", "CompletionRequest")  # vLLM's names, in its order
NO_HANDLER = f"Cannot find suitable handler for request. Expected one of: {list(INVOCATION_TYPES)}"


def _prompt_given(req: CompletionRequest) -> bool:
    return req.prompt is not None and req.prompt != "" and req.prompt != []


class Invocations:
    """Decodes an /invocations body and hands it to the chat or completions handler."""

    def __init__(self, chat: Handler, completions: Handler) -> None:
        self.chat, self.completions = chat, completions
        self._chat_decoder = request_decoder(ChatCompletionRequest)
        self._completion_decoder = request_decoder(CompletionRequest)

    async def __call__(self, body: bytes, request: Request) -> Response:
        try:
            chat_req = self._chat_decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            chat_req = None
        if chat_req is not None:
            return await self.chat(chat_req, request)
        try:
            req = self._completion_decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            req = None
        if req is not None and _prompt_given(req):
            return await self.completions(req, request)
        try:
            json.loads(body)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError: Python's words, as vLLM's
            raise APIError(f"JSON decode error: {e}", HTTPStatus.BAD_REQUEST) from None
        raise APIError(NO_HANDLER, HTTPStatus.BAD_REQUEST)
