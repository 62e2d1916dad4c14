"""What the completions and chat endpoints share: the served model's names and limits,
tokenizing a prompt and checking it against the context window, building SamplingParams from a
request, the SSE framing, and running a handler until the client goes away."""
from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from tidal.frontend import AsyncLLM
from tidal.frontend.entrypoints.openai.errors import APIError, ErrorResponse, from_exception
from tidal.frontend.entrypoints.openai.limits import RequestSizeLimits
from tidal.frontend.entrypoints.openai.protocol import (
    PromptLogprob,
    PromptLogprobs,
    SamplingFields,
    StreamHeader,
    UsageInfo,
)
from tidal.frontend import LONG_TEXT_CHARS, check_prompt_chars, prompt_char_limit
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams
from tidal.protocol.structured_outputs import CONSTRAINTS, StructuredOutputsParams

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class SSEResponse(StreamingResponse):
    """An event stream, sent straight to the server's `send` (Starlette's StreamingResponse runs
    it in an anyio task group per response). The body generator yields bytes, each one or more
    whole `data: ...\n\n` events ready at once, so each is one write; the piece ending in
    `data: [DONE]` ends the body in that same write. A watcher task cancels the stream when the
    client disconnects, and the generator is closed as soon as the response ends (not when it is
    garbage-collected), which aborts its requests now."""

    media_type = "text/event-stream"

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            if chunk.endswith(DONE):  # the last event: finish the body in the same write
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(_wait_disconnect_receive(receive))
        try:
            await asyncio.wait((stream, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not stream.done():  # the client left, or this task was cancelled (shutdown)
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if not stream.cancelled() and (exc := stream.exception()) is not None and not isinstance(exc, OSError):
            raise exc


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(prefix: str, request: Request, req: SamplingFields) -> tuple[str, str]:
    """(the id the response reports, the base of its engine request ids). As vLLM's: the
    `X-Request-Id` header, else the body's `request_id`, else a random one, after `prefix-`.
    A caller's id need not be unique, so the engine's ids then get a random suffix."""
    given = request.headers.get("x-request-id") or req.request_id
    if not given:
        rid = new_id(prefix)
        return rid, rid
    rid = f"{prefix}-{given}"
    return rid, f"{rid}-{uuid.uuid4().hex[:12]}"


def check_request(req: SamplingFields) -> None:
    """vLLM's request validators that no SamplingParams field covers: 400 naming the field."""
    if req.stream and req.prompt_logprobs:  # 0 asks for none, as vLLM allows
        raise APIError("`prompt_logprobs` are not available when `stream=True`.",
                       HTTPStatus.BAD_REQUEST, "prompt_logprobs")
    if req.stream_options is not None and req.stream_options.given and not req.stream:
        raise APIError("Stream options can only be defined when `stream=True`.",
                       HTTPStatus.BAD_REQUEST, "stream_options")
    if req.use_beam_search:
        raise APIError("use_beam_search is not supported by tidal's server (LLM.beam_search offers it offline)",
                       HTTPStatus.BAD_REQUEST, "use_beam_search")
    if req.logits_processors:
        raise APIError("The `logits_processors` argument is not supported by this server.",
                       HTTPStatus.BAD_REQUEST, "logits_processors")
    if req.cache_salt is not None and not req.cache_salt:
        raise APIError("Parameter 'cache_salt' must be a non-empty string if provided.",
                       HTTPStatus.BAD_REQUEST, "cache_salt")


@dataclass(frozen=True)
class ChatOptions:
    """tidal serve's flags for chat and streams (vLLM's names: --response-role,
    --chat-template-content-format, --default-chat-template-kwargs, --enable-force-include-usage)."""

    response_role: str = "assistant"
    content_format: str = "auto"  # auto and string: text parts joined; openai: a list of text parts
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False  # every request's logprob tokens as "token_id:N"
    trust_request_chat_template: bool = False  # a request may bring its own chat template


class ServingContext:
    """The engine and what every endpoint reads about the model it serves."""

    def __init__(self, engine: AsyncLLM, served_names: Sequence[str], chat_template: str | None,
                 options: ChatOptions | None = None, limits: RequestSizeLimits | None = None) -> None:
        self.engine = engine
        self.options = options or ChatOptions()
        self.limits = limits or RequestSizeLimits()
        self.tokenizer: Any = engine.tokenizer
        self.served_names = list(served_names)
        self.model_path: str = engine.config.model
        self.max_model_len: int = engine.model_config.max_model_len
        self.vocab_size: int = engine.info.vocab_size
        self.chat_template = chat_template
        # prompt_char_limit, at start-up (a pass over the vocabulary: not on the loop per request)
        self.char_limit = prompt_char_limit(self.tokenizer, self.max_model_len) if self.tokenizer is not None else 0
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tidal-render")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def model_name(self, requested: str | None) -> str:
        """The name to report; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.served_names[0]
        if requested in self.served_names:
            return requested
        raise APIError(f"The model `{requested}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    def tokens_as_ids(self, req: SamplingFields) -> bool:
        """Logprob tokens as "token_id:N": the request's choice, else the server's flag."""
        if req.return_tokens_as_token_ids is not None:
            return req.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids

    @staticmethod
    def engine_prompt(text: str | None, ids: list[int], req: SamplingFields) -> dict[str, Any]:
        """The prompt for AsyncLLM.generate: text (kept for RequestOutput.prompt), ids, and the
        request's prefix-cache salt."""
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        return prompt

    def needs_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError("this endpoint needs a tokenizer (the server runs with skip_tokenizer_init)")
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool, truncate: int | None = None,
                     param: str | None = "prompt") -> list[int]:
        """Token ids of a prompt's text. Long texts are tokenized in a worker thread (with the
        GIL released: see LONG_TEXT_CHARS). A prompt (`param` names its field) that cannot fit
        is a 400 before any of that, unless a valid `truncate` (truncate_prompt_tokens) asks
        for its end; param=None: any length (/tokenize counts tokens of what may not fit)."""
        tok = self.needs_tokenizer()
        if len(text) <= LONG_TEXT_CHARS:
            return list(tok.encode(text, add_special_tokens=add_special_tokens))
        if param is not None and truncate_length(truncate, self.max_model_len) is None:
            try:
                check_prompt_chars(len(text), self.char_limit, self.max_model_len)
            except ValueError as e:
                raise APIError(str(e), HTTPStatus.BAD_REQUEST, param) from None
        return await asyncio.to_thread(tok.encode, text, add_special_tokens=add_special_tokens)

    async def in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in the server's own small pool (chat templates): not behind long
        tokenizations in asyncio's default pool, and not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int | None:
        """max_tokens for the engine: as asked, or what the context window leaves (None);
        400 with vLLM's message when prompt + max_tokens does not fit."""
        max_len = self.max_model_len
        if prompt_len >= max_len:  # no room for one token: vLLM's words
            raise APIError(f"This model's maximum context length is {max_len} tokens. However, your request "
                           f"has {prompt_len} input tokens. Please reduce the length of the input messages.",
                           HTTPStatus.BAD_REQUEST)
        if max_tokens is None:
            return max_tokens
        if prompt_len + max_tokens > max_len:
            raise APIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                f"maximum context length is {max_len} tokens and your request has {prompt_len} input "
                f"tokens ({max_tokens} > {max_len} - {prompt_len}).", HTTPStatus.BAD_REQUEST, "max_tokens")
        return max_tokens


def truncate_length(keep: int | None, max_model_len: int) -> int | None:
    """The tokens truncate_prompt_tokens keeps (-1: max_model_len; None: no truncation); 400
    for a value outside -1 and [1, max_model_len]."""
    if keep is None:
        return None
    if keep == -1:
        return max_model_len
    if keep < 1 or keep > max_model_len:
        raise APIError(f"truncate_prompt_tokens must be -1 or in [1, max_model_len={max_model_len}], "
                       f"got {keep}", HTTPStatus.BAD_REQUEST, "truncate_prompt_tokens")
    return keep


def truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens as vLLM: the last `keep` tokens (-1: max_model_len)."""
    length = truncate_length(keep, max_model_len)
    return ids if length is None else ids[-length:]


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams (ValueError, i.e. 400, for a value out of range);
    DELTA output when streamed, else FINAL_ONLY."""
    return SamplingParams.from_optional(
        n=req.n, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, temperature=req.temperature, top_p=req.top_p,
        top_k=0 if req.top_k is None else req.top_k, min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, bad_words=req.bad_words,
        include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
        max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
        structured_outputs=structured_outputs(req))


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint from `structured_outputs` and `response_format` (as vLLM: both
    may be given only if they name one constraint together; ValueError, i.e. 400, otherwise)."""
    so, rf = req.structured_outputs, req.response_format
    fields: dict[str, Any] = {} if so is None else msgspec.structs.asdict(so)
    if rf is not None and rf.type == "json_object":
        fields["json_object"] = True
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema.schema",
                           HTTPStatus.BAD_REQUEST, "response_format")
        fields["json"] = rf.json_schema.json_schema
    elif rf is not None and rf.type == "structural_tag":
        tag = ({"type": "structural_tag", "format": rf.format} if rf.format is not None
               else {"structures": rf.structures or [], "triggers": rf.triggers or []})
        fields["structural_tag"] = json.dumps(tag)
    if all(fields.get(name) is None for name in CONSTRAINTS):
        return None  # no constraint (options alone, or response_format "text")
    return StructuredOutputsParams(**fields)


def include_usage(req: SamplingFields, ctx: ServingContext) -> bool:
    return ctx.options.force_include_usage or (req.stream_options is not None and req.stream_options.usage)


def continuous_usage(req: SamplingFields) -> bool:
    """stream_options.continuous_usage_stats: usage in every chunk (callers check that usage is
    included: by include_usage, or forced by --enable-force-include-usage, as vLLM)."""
    return req.stream_options is not None and req.stream_options.continuous


def usage_tail(prompt_tokens: int, completion_tokens: int) -> bytes:
    """A chunk's tail carrying the usage so far (continuous_usage_stats)."""
    usage = UsageInfo(prompt_tokens, prompt_tokens + completion_tokens, completion_tokens)
    return b'],"usage":' + _encode(usage) + b"}\n\n"


def stream_framing(obj: str, request_id: str, model: str, with_usage: bool) -> tuple[bytes, bytes]:
    """(prefix, suffix) around a chunk's encoded choice: `data: {"id":...,"choices":[` and
    `]}` (`],"usage":null}` when the stream ends with a usage chunk, as OpenAI's)."""
    header = _encode(StreamHeader(request_id, obj, int(time.time()), model))
    prefix = b"data: " + header[:-1] + b',"choices":['
    return prefix, (b'],"usage":null}\n\n' if with_usage else b"]}\n\n")


def sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def sse_error(e: BaseException) -> bytes:
    """An error after the stream started: one `data: {"error": ...}` event (vLLM's way)."""
    error: ErrorResponse = from_exception(e).to_response()
    return sse(error)


def prompt_logprobs_out(out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt position, token id -> {logprob, rank, decoded_token}."""
    if out.prompt_logprobs is None:
        return None
    return [None if not pos else {t: PromptLogprob(max(lp.logprob, -9999.0), lp.rank, lp.decoded_token)
                                  for t, lp in pos.items()}
            for pos in out.prompt_logprobs]


async def _wait_disconnect_receive(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _wait_disconnect(request: Request) -> None:
    await _wait_disconnect_receive(request.receive)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone once the client disconnects first: then `work` is
    cancelled, which closes its generate() streams and so aborts the requests in the core."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down: end the work with it
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise ClientGone()


async def primed(gen: AsyncIterator[RequestOutput]) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
    """The first output and the stream: a request the engine refuses raises here (ValueError
    before anything is queued), so it is answered with a 400 status, not inside a 200 stream."""
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        raise APIError("the engine returned no output", HTTPStatus.INTERNAL_SERVER_ERROR) from None
    return first, gen


async def gather_all(works: Sequence[Awaitable[T]]) -> list[T]:
    """All results; on the first failure the others are cancelled (their requests aborted)."""
    if len(works) == 1:
        return [await works[0]]
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def final_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The one output of a FINAL_ONLY stream."""
    final = None
    async for out in gen:
        final = out
    if final is None:
        raise APIError("the engine returned no output", HTTPStatus.INTERNAL_SERVER_ERROR)
    return final


async def merged(streams: Sequence[tuple[RequestOutput, AsyncIterator[RequestOutput]]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several primed streams as they come; one stream (the usual
    case) is passed through without tasks. Closing this closes (aborts) every stream."""
    if len(streams) == 1:
        first, gen = streams[0]
        try:
            yield 0, first
            async for out in gen:
                yield 0, out
        finally:
            await gen.aclose()  # aborts the request if the client left mid-stream
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            queue.put_nowait((i, first))
            async for out in gen:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, f, g)) for i, (f, g) in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
