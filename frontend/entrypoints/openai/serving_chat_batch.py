"""POST /v1/chat/completions/batch (vLLM's vllm/entrypoints/openai/chat_completion/batch_serving.py
and BatchChatCompletionRequest in its protocol.py): `messages` is a list of conversations, each
a list of messages; every conversation is one engine request, all run together, and the reply
is one chat.completion whose choice `index` i answers conversation i, with the usage summed.

As vLLM's:
- the other fields are a chat request's, applied to every conversation, but only those vLLM's
  batch request has (BATCH_FIELDS); others (`stream`, `tools`, `stream_options`, `ignore_eos`,
  `prompt_logprobs`, ...) are ignored, and fields set to null take their defaults;
- `n` must be 1, `use_beam_search` false, `tool_choice` "none" (or null);
- a choice's `finish_reason` is "stop" where the engine gave none, `echo` prepends the last
  message when its role is the reply's, `return_token_ids` gives each choice its `token_ids`;
- no streaming, no prompt_logprobs or prompt_token_ids at the response's level, and no
  usage.prompt_tokens_details.
"""
from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from tidal.frontend.entrypoints.openai.disconnect import until_disconnect
from tidal.frontend.entrypoints.openai.engine_streams import final_output, gather_all
from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.protocol import (
    request_decoder,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    UsageInfo,
)
from tidal.frontend.entrypoints.openai.request_params import request_ids
from tidal.frontend.entrypoints.openai.serving_chat import ChatHandler
from tidal.frontend.entrypoints.openai.serving_context import ServingContext
from tidal.protocol.outputs import RequestOutput

_encode = msgspec.json.encode
# vLLM's BatchChatCompletionRequest fields, `messages` aside (those tidal's chat request lacks,
# e.g. best_of or early_stopping, are ignored as they are everywhere in this server).
BATCH_FIELDS = frozenset({
    "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "logprob_token_ids", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "temperature",
    "top_p", "user", "tool_choice", "include_reasoning", "best_of", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "watermarking", "length_penalty", "early_stopping", "structured_outputs",
    "request_id", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "priority", "cache_salt", "include_stop_str_in_output",
    "guided_decoding_backend", "echo", "return_tokens_as_token_ids", "return_token_ids"})
BAD_MESSAGES = "`messages` must be a non-empty list of conversations, each a non-empty list of messages"


def check_batch(body: Any) -> list[list[Any]]:
    """vLLM's check_batch_mode and field checks: the conversations, or a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", HTTPStatus.BAD_REQUEST)
    if body.get("use_beam_search"):
        raise APIError("Batch chat completions do not support beam search. Please set `use_beam_search` to False.",
                       HTTPStatus.BAD_REQUEST, "use_beam_search")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise APIError("Batch chat completions do not support `n > 1`. Please set `n` to 1.",
                       HTTPStatus.BAD_REQUEST, "n")
    if body.get("tool_choice") not in (None, "none"):
        raise APIError('Batch chat completions do not support tool calling: `tool_choice` must be "none".',
                       HTTPStatus.BAD_REQUEST, "tool_choice")
    conversations = body.get("messages")
    if (not isinstance(conversations, list) or not conversations
            or not all(isinstance(c, list) and c for c in conversations)):
        raise APIError(BAD_MESSAGES, HTTPStatus.BAD_REQUEST, "messages")
    return conversations


class BatchChatHandler:
    def __init__(self, ctx: ServingContext, chat: ChatHandler) -> None:
        self.ctx, self.chat = ctx, chat
        self._decoder = request_decoder(ChatCompletionRequest)

    def single_requests(self, body: bytes) -> list[ChatCompletionRequest]:
        """One chat request per conversation (vLLM's to_chat_completion_request: the batch's
        fields less the nulls, and the conversation), each decoded as /v1/chat/completions
        decodes its body."""
        data = msgspec.json.decode(body)
        conversations = check_batch(data)
        shared = {k: v for k, v in data.items() if k in BATCH_FIELDS and v is not None}
        return [self._decoder.decode(_encode({**shared, "messages": conv})) for conv in conversations]

    async def __call__(self, body: bytes, request: Request) -> Response:
        ctx, chat = self.ctx, self.chat
        reqs = self.single_requests(body)
        model = ctx.model_name(reqs[0].model)
        if len(reqs) > ctx.limits.max_prompts:
            raise APIError(f"at most {ctx.limits.max_prompts} conversations per request "
                           f"(TIDAL_MAX_COMPLETION_PROMPTS), got {len(reqs)}", HTTPStatus.BAD_REQUEST, "messages")
        inputs = [await chat.engine_inputs(req) for req in reqs]  # every conversation checked first
        rid, engine_rid = request_ids("chatcmpl", request, reqs[0], ctx.request_ids)
        gens = [ctx.engine.generate(ctx.engine_prompt(text, ids, req), params, f"{engine_rid}-{i}",
                                    priority=req.priority)
                for i, (req, (text, ids, params)) in enumerate(zip(reqs, inputs))]
        finals = await until_disconnect(request, gather_all([final_output(g) for g in gens]))
        return Response(_encode(self._response(reqs, rid, model, finals)), media_type="application/json")

    def _response(self, reqs: list[ChatCompletionRequest], rid: str, model: str,
                  finals: list[RequestOutput]) -> ChatCompletionResponse:
        chat, choices, usage = self.chat, [], UsageInfo()
        for i, (req, final) in enumerate(zip(reqs, finals)):
            usage.prompt_tokens += len(final.prompt_token_ids)
            role = chat.role(req)
            echoed = chat.echoed(req, role)
            for o in final.outputs:
                usage.completion_tokens += len(o.token_ids)
                logprobs = chat.logprobs(req, o.token_ids, o.logprobs)
                choices.append(ChatChoice(i, ChatMessage(role, echoed + o.text), logprobs, o.finish_reason or "stop",
                                          o.stop_reason, o.token_ids if req.return_token_ids else None))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return ChatCompletionResponse(id=rid, created=int(time.time()), model=model, choices=choices, usage=usage)
