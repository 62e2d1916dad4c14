"""The rules the library and the OpenAI server used to write twice, now written once: each is
pinned here from both entry points (InputProcessor / LLM.chat, and the server's ServingContext
and handlers), so the two cannot drift apart again. No engine runs: the server's side is its
ServingContext over a stand-in engine (as test_server_api's render test does)."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from tidal.frontend import (
    ChatTemplateError,
    LLM,
    RequestIds,
    keep_last,
    render_chat as library_render_chat,
    truncation_length,
)
from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tidal.frontend.entrypoints.openai.request_params import request_ids
from tidal.frontend.entrypoints.openai.serving_chat import render_chat as server_render_chat
from tidal.frontend.entrypoints.openai.serving_context import ServingContext
from tidal.frontend.input_processor import InputProcessor
from tidal.frontend.request_ids import check_request_id
from tidal.frontend.tokenizer import LONG_TEXT_CHARS
from tidal.protocol.sampling_params import SamplingParams

# The same tokenizer and InputProcessor as test_input_processor's (pytest fixtures by import).
try:
    from test_input_processor import MAX_LEN, ip, tokenizer  # noqa: F401
except ImportError:  # tests/ made a package
    from tests.test_input_processor import MAX_LEN, ip, tokenizer  # type: ignore[no-redef]  # noqa: F401

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]


@pytest.fixture
def ctx(tokenizer: Any) -> Iterator[ServingContext]:
    engine = SimpleNamespace(tokenizer=tokenizer, config=SimpleNamespace(model="m"),
                             model_config=SimpleNamespace(max_model_len=MAX_LEN),
                             info=SimpleNamespace(vocab_size=len(tokenizer)))
    context = ServingContext(engine, ["m"], None)  # type: ignore[arg-type]
    yield context
    context.close()


# ------------------------------------------------------------------ truncate_prompt_tokens
def test_truncation_length_is_vllms_rule() -> None:
    assert truncation_length(None, MAX_LEN) is None
    assert truncation_length(-1, MAX_LEN) == MAX_LEN
    assert truncation_length(1, MAX_LEN) == 1 and truncation_length(MAX_LEN, MAX_LEN) == MAX_LEN
    with pytest.raises(ValueError, match=rf"^truncate_prompt_tokens value \({MAX_LEN + 1}\) is greater than "
                                         rf"max_model_len \({MAX_LEN}\)\. Please, select a smaller truncation size\.$"):
        truncation_length(MAX_LEN + 1, MAX_LEN)
    for bad in (0, -2):  # SamplingParams' words, for a value it would refuse
        with pytest.raises(ValueError, match=rf"^truncate_prompt_tokens must be an integer >= 1 or -1, got {bad}$"):
            truncation_length(bad, MAX_LEN)
    assert keep_last([1, 2, 3], None) == [1, 2, 3] and keep_last([1, 2, 3], 2) == [2, 3]
    assert keep_last([1, 2, 3], 5) == [1, 2, 3]


def test_truncation_is_one_rule_in_both_entry_points(ip: InputProcessor, ctx: ServingContext,
                                                     tokenizer: Any) -> None:
    """The same bound and message from LLM/AsyncLLM (ValueError) and the server (a 400 naming
    the field); the same last tokens kept of a text prompt."""
    too_many = MAX_LEN + 1
    with pytest.raises(ValueError) as lib:
        ip.process("r", "hello", SamplingParams(truncate_prompt_tokens=too_many))
    with pytest.raises(APIError) as srv:
        ctx.truncation(CompletionRequest(prompt="hello", truncate_prompt_tokens=too_many))
    assert str(lib.value) == srv.value.message and srv.value.param == "truncate_prompt_tokens"
    assert ctx.truncation(CompletionRequest(truncate_prompt_tokens=-1)) == MAX_LEN
    text = "Hello, 世界 😀 and more words"
    lib_ids = ip.process("r", text, SamplingParams(truncate_prompt_tokens=4))[0].prompt_token_ids
    srv_ids = asyncio.run(ctx.encode(text, True, ctx.truncation(CompletionRequest(truncate_prompt_tokens=4))))
    assert lib_ids == srv_ids == tokenizer(text).input_ids[-4:]


# ------------------------------------------------------------------ long texts
def test_long_text_rule_is_one_in_both_entry_points(ip: InputProcessor, ctx: ServingContext,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A text that cannot fit: the same message, untokenized, from both; one that may fit is
    tokenized off the event loop's thread by both, a short one on it."""
    huge = "ab " * 20000
    with pytest.raises(ValueError) as lib:
        ip.process("r", huge, SamplingParams())
    with pytest.raises(APIError) as srv:
        asyncio.run(ctx.encode(huge, True))
    assert str(lib.value) == srv.value.message and "characters is too long for max_model_len" in srv.value.message
    assert srv.value.param == "prompt"

    threads: list[str] = []
    for encoder in (ip.encoder, ctx.encoder):
        assert encoder is not None
        tokenize = encoder.tokenize
        monkeypatch.setattr(encoder, "tokenize", lambda t, special=True, f=tokenize: (
            threads.append(threading.current_thread().name), f(t, special))[1])
    long_text = "x" * (LONG_TEXT_CHARS + 1)  # long, but few enough tokens to be measured, not refused

    async def both(text: str) -> None:
        await ip.process_async("r", text, SamplingParams(truncate_prompt_tokens=8))
        await ctx.encode(text, True, 8)

    asyncio.run(both(long_text))
    assert len(threads) == 2 and threading.main_thread().name not in threads
    threads.clear()
    asyncio.run(both("short"))
    assert threads == [threading.main_thread().name] * 2


# ------------------------------------------------------------------ chat templates
def test_chat_rendering_is_one_in_llm_chat_and_the_server(ctx: ServingContext, tokenizer: Any) -> None:
    """LLM.chat and /v1/chat/completions render the same text through the library's render_chat
    (content parts joined, or kept as parts with the "openai" format); a failing template is a
    ChatTemplateError (a ValueError, as vLLM) to LLM.chat and the same words in a 400 from the server."""
    sent: list[Any] = []
    fake = SimpleNamespace(get_tokenizer=lambda: tokenizer,
                           generate=lambda prompts, *a, **k: sent.extend(prompts) or [])
    LLM.chat(fake, MESSAGES, chat_template=TEMPLATE)  # type: ignore[arg-type]
    ctx.chat_template = TEMPLATE  # --chat-template
    served = asyncio.run(server_render_chat(ctx, MESSAGES, add_generation_prompt=True, continue_final_message=False,
                                            kwargs=None))
    assert sent[0]["prompt"] == served == "<user>hi\nthere<assistant>"
    assert sent[0]["prompt_token_ids"] == tokenizer.encode(served, add_special_tokens=False)
    parts = library_render_chat(tokenizer, MESSAGES, "{{ messages[0]['content'] | length }}", content_format="openai")
    assert parts == "2"

    failing = "{{ raise_exception('no system prompt') }}"
    with pytest.raises(ChatTemplateError) as lib:
        LLM.chat(fake, MESSAGES, chat_template=failing)  # type: ignore[arg-type]
    ctx.chat_template = failing
    with pytest.raises(APIError) as srv:
        asyncio.run(server_render_chat(ctx, MESSAGES, add_generation_prompt=True, continue_final_message=False,
                                       kwargs=None))
    assert isinstance(lib.value, ValueError) and str(lib.value) == srv.value.message
    assert "no system prompt" in srv.value.message and srv.value.param == "messages"
    with pytest.raises(ValueError, match="cannot both be true") as lib_both:
        LLM.chat(fake, MESSAGES, chat_template=TEMPLATE, continue_final_message=True)  # type: ignore[arg-type]
    with pytest.raises(APIError) as srv_both:
        asyncio.run(server_render_chat(ctx, MESSAGES, add_generation_prompt=True, continue_final_message=True,
                                       kwargs=None))
    assert str(lib_both.value) == srv_both.value.message and srv_both.value.param == "continue_final_message"


# ------------------------------------------------------------------ request ids
def test_one_request_id_check_and_scheme(ip: InputProcessor, ctx: ServingContext) -> None:
    for bad in ("", None, 5):
        with pytest.raises(ValueError, match="request_id must be a non-empty str"):
            check_request_id(bad)
        with pytest.raises(ValueError, match="request_id must be a non-empty str"):
            ip.process(bad, "hi", SamplingParams())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="request_id must be a non-empty str"):
            RequestIds().unique(bad)
    ids = RequestIds()
    a, b = ids.unique("x#1"), ids.unique("x#1")
    assert a != b and RequestIds.external(a) == RequestIds.external(b) == "x#1"  # the caller's '#' kept

    def http(headers: dict[str, str]) -> Request:
        return Request({"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})

    rid, engine_rid = request_ids("cmpl", http({"x-request-id": "trace"}), CompletionRequest(request_id="body"),
                                  ctx.request_ids)
    assert rid == "cmpl-trace" and RequestIds.external(engine_rid) == rid  # the library's scheme
    assert request_ids("cmpl", http({}), CompletionRequest(request_id="body"), ctx.request_ids)[0] == "cmpl-body"
    rid, engine_rid = request_ids("chatcmpl", http({}), ChatCompletionRequest(messages=MESSAGES), ctx.request_ids)
    assert rid.startswith("chatcmpl-") and len(rid) > len("chatcmpl-") and RequestIds.external(engine_rid) == rid
