"""POST /v1/completions (vLLM's serving_completion.py): prompts as a string, a list of strings,
token ids or a list of token-id lists; `echo`; integer `logprobs`; streamed or not.

Choice `index` is `prompt index * n + completion index`, as in vLLM and OpenAI.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from http import HTTPStatus

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from tidal.frontend import keep_last, plain_token_ids
from tidal.frontend.entrypoints.openai.disconnect import until_disconnect
from tidal.frontend.entrypoints.openai.engine_streams import final_output, gather_all, merged, primed
from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.logprobs import LogprobsBuilder, concat, prompt_logprobs_out
from tidal.frontend.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamChoiceIds,
    UsageInfo,
)
from tidal.frontend.entrypoints.openai.request_params import check_request, request_ids, sampling_params
from tidal.frontend.entrypoints.openai.serving_context import ServingContext
from tidal.frontend.entrypoints.openai.sse import SSEResponse, event_stream
from tidal.frontend.entrypoints.openai.usage_details import CachedTokens, DetailsFraming, cached_details
from tidal.protocol.outputs import CompletionOutput, RequestOutput

_encode = msgspec.json.encode
Prompt = tuple[str | None, list[int]]  # (text, token ids)


def _num_prompts(p: object) -> int:
    """Prompts in a completions `prompt`: a list of strings or of token-id lists is several;
    a string or one token-id list is one."""
    if isinstance(p, list) and p and not isinstance(p[0], int):
        return len(p)
    return 1


async def completion_prompts(ctx: ServingContext, req: CompletionRequest, keep: int | None) -> list[Prompt]:
    """The request's prompts, tokenized and truncated to their last `keep` tokens if given
    (text kept for echo and RequestOutput.prompt)."""
    p = req.prompt
    if p is None or p == "" or p == []:
        raise APIError("Either prompt or prompt_embeds must be provided and non-empty.",
                       HTTPStatus.BAD_REQUEST, "prompt")
    if isinstance(p, str):
        return [(p, await ctx.encode(p, req.add_special_tokens, keep))]
    if (ids := plain_token_ids(p)) is not None:
        return [(None, keep_last(ids, keep))]
    prompts: list[Prompt] = []
    for item in p:
        if isinstance(item, str):
            prompts.append((item, await ctx.encode(item, req.add_special_tokens, keep)))
        elif isinstance(item, list) and (ids := plain_token_ids(item)) is not None:
            prompts.append((None, keep_last(ids, keep)))
        else:
            raise APIError("prompt must be a string, a list of strings, a list of token ids or a list "
                           "of token-id lists", HTTPStatus.BAD_REQUEST, "prompt")
    return prompts


def _logprob_params(req: CompletionRequest) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) for the engine: echo with logprobs wants the prompt's too."""
    prompt_lps = req.prompt_logprobs
    if prompt_lps is None and req.echo and req.logprobs is not None:
        prompt_lps = req.logprobs
    return req.logprobs, prompt_lps


class CompletionsHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, req: CompletionRequest, request: Request) -> Response:
        ctx = self.ctx
        model = ctx.model_name(req.model)
        if req.suffix:
            raise APIError("suffix is not supported", HTTPStatus.BAD_REQUEST, "suffix")
        check_request(req)
        ctx.limits.check(_num_prompts(req.prompt), req, ctx.vocab_size)
        prompts = await completion_prompts(ctx, req, ctx.truncation(req))
        logprobs, prompt_lps = _logprob_params(req)
        rid, engine_rid = request_ids("cmpl", request, req, ctx.request_ids)
        gens = []
        for i, (text, ids) in enumerate(prompts):
            # echo with max_tokens 0 (OpenAI's, used to score a prompt): the engine makes one
            # token, which the reply leaves out (_echo_only).
            max_tokens = ctx.resolve_max_tokens(len(ids), 1 if _echo_only(req) else req.max_tokens)
            params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_lps)
            gens.append(ctx.engine.generate(ctx.engine_prompt(text, ids, req), params,
                                            f"{engine_rid}-{i}", priority=req.priority))
        if req.stream:
            streams = await until_disconnect(request, gather_all([primed(g) for g in gens]))
            return SSEResponse(self._stream(req, rid, model, streams))
        finals = await until_disconnect(request, gather_all([final_output(g) for g in gens]))
        return Response(_encode(self._response(req, rid, model, finals)), media_type="application/json")

    # --------------------------------------------------------------------- whole
    def _response(self, req: CompletionRequest, rid: str, model: str,
                  finals: list[RequestOutput]) -> CompletionResponse:
        builder = LogprobsBuilder(self.ctx.tokenizer, req.logprobs or 0, self.ctx.tokens_as_ids(req))
        choices, usage = [], UsageInfo()
        for i, final in enumerate(finals):
            usage.prompt_tokens += len(final.prompt_token_ids)
            for o in final.outputs:
                o = _without_generation(o) if _echo_only(req) else o
                usage.completion_tokens += len(o.token_ids)
                choices.append(self._choice(req, builder, i * req.n + o.index, final, o))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        usage.prompt_tokens_details = cached_details(self.ctx.options.prompt_tokens_details,
                                                     sum(final.num_cached_tokens for final in finals))
        return CompletionResponse(id=rid, created=int(time.time()), model=model, choices=choices, usage=usage)

    def _choice(self, req: CompletionRequest, builder: LogprobsBuilder, index: int, final: RequestOutput,
                o: CompletionOutput) -> CompletionChoice:
        text, logprobs = o.text, None
        # With return_token_ids the ids carry the prompt, and echo adds no text (vLLM's way).
        prompt_text = self._prompt_text(final) if req.echo and not req.return_token_ids else ""
        if req.logprobs is not None:
            logprobs = builder.build(o.token_ids, o.logprobs or [], len(prompt_text))
            if req.echo and final.prompt_logprobs is not None:
                head = builder.build(final.prompt_token_ids, final.prompt_logprobs, 0)
                logprobs = concat(head, logprobs)
        ids = req.return_token_ids
        return CompletionChoice(index, prompt_text + text, logprobs, o.finish_reason, o.stop_reason,
                                prompt_logprobs_out(final) if req.prompt_logprobs is not None else None,
                                final.prompt_token_ids if ids else None, o.token_ids if ids else None)

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.ctx.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    # ------------------------------------------------------------------- streamed
    def _stream(self, req: CompletionRequest, rid: str, model: str,
                streams: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]) -> AsyncIterator[bytes]:
        options = self.ctx.options
        framing = DetailsFraming("text_completion", rid, model, req, options.force_include_usage)
        builder = LogprobsBuilder(self.ctx.tokenizer, req.logprobs or 0, self.ctx.tokens_as_ids(req))
        offsets: dict[int, int] = {}  # choice index -> characters streamed (logprobs text_offset)
        choice_tokens: dict[int, int] = {}  # choice index -> tokens streamed (continuous usage)
        seen_prompts: set[int] = set()
        usage = UsageInfo()
        cached = CachedTokens(options.prompt_tokens_details)
        left = len(streams)  # prompts not finished yet

        def events(item: tuple[int, RequestOutput]) -> tuple[list[bytes], bool]:
            nonlocal left
            i, out = item
            cached.see(i, out.num_cached_tokens, usage)
            parts = []
            for o in out.outputs:
                o = _without_generation(o) if _echo_only(req) else o
                index = i * req.n + o.index
                usage.completion_tokens += len(o.token_ids)
                if i not in seen_prompts:
                    seen_prompts.add(i)
                    usage.prompt_tokens += len(out.prompt_token_ids)
                first = index not in offsets  # this choice's first chunk
                if first:
                    offsets[index] = 0
                choice_tokens[index] = n = choice_tokens.get(index, 0) + len(o.token_ids)
                parts.append(framing.chunk(self._chunk(req, builder, index, out, o, offsets, first),
                                           len(out.prompt_token_ids), n))
            if out.finished:
                left -= 1
            return parts, not left  # the last prompt's end: its events go with the stream's tail

        return event_stream(merged(streams), events, framing, usage)

    def _chunk(self, req: CompletionRequest, builder: LogprobsBuilder, index: int, out: RequestOutput,
               o: CompletionOutput, offsets: dict[int, int], first: bool) -> CompletionStreamChoice:
        """One choice's chunk; `first`: the choice's first, which echoes the prompt (its ids
        instead of its text with return_token_ids, as vLLM)."""
        text, logprobs = o.text, None
        offset = offsets[index]
        echo = first and bool(req.echo)
        if echo and not req.return_token_ids:
            text = self._prompt_text(out) + text
        if req.logprobs is not None:
            logprobs = builder.build(o.token_ids, o.logprobs or [], offset + (len(text) - len(o.text)))
            if echo and out.prompt_logprobs is not None:
                logprobs = concat(builder.build(out.prompt_token_ids, out.prompt_logprobs, offset), logprobs)
        offsets[index] = offset + len(text)
        if req.return_token_ids:
            return CompletionStreamChoiceIds(index, text, logprobs, o.finish_reason, o.stop_reason, o.token_ids,
                                             out.prompt_token_ids if first else None)
        return CompletionStreamChoice(index, text, logprobs, o.finish_reason, o.stop_reason)


def _echo_only(req: CompletionRequest) -> bool:
    return bool(req.echo) and req.max_tokens == 0


def _without_generation(o: CompletionOutput) -> CompletionOutput:
    """An echo-only choice: the prompt (added by the echo) and nothing generated; it stopped
    at its max_tokens, 0."""
    return dataclasses.replace(o, text="", token_ids=[], cumulative_logprob=None,
                               logprobs=None if o.logprobs is None else [], finish_reason="length", stop_reason=None)

