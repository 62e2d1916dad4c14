"""`tidal serve` with the tiny Qwen3 model, through the official `openai` client on real sockets:
completions and chat, streamed and not, n=2, logprobs, seeds, results equal to LLM.generate's,
64 concurrent streams, and /metrics counting exactly the tokens served."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server_utils import CHAT_TEMPLATE, Server, http_get, post_json, wait_for

MAX_MODEL_LEN = 512
ENGINE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "512", "--max-num-seqs", "64"]
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = str(tmp_path_factory.mktemp("tpl") / "chat.jinja")
    with open(template, "w") as f:
        f.write(CHAT_TEMPLATE)
    srv = Server(tiny_model_dir, [*ENGINE_FLAGS, "--chat-template", template,
                                  "--served-model-name", "tiny", "tiny-alias"], tidal_cache_dir)
    yield srv
    srv.stop()


def test_completion_equals_offline_llm_generate(server: Server, tiny_model_dir: str) -> None:
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    res = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
    with LLM(model=tiny_model_dir, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64) as llm:
        ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    choice = res.choices[0]
    assert res.object == "text_completion" and res.model == "tiny" and res.id.startswith("cmpl-")
    assert choice.text == ref.outputs[0].text and choice.finish_reason == "length"
    assert res.usage.completion_tokens == 12 and res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.total_tokens == res.usage.prompt_tokens + 12


def test_completion_streamed_equals_unstreamed(server: Server) -> None:
    client = server.client()
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in text_chunks)


def test_completion_prompt_forms_and_n(server: Server) -> None:
    client = server.client()
    ids = post_json(server.url + "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    hello_ids = post_json(server.url + "/tokenize", {"prompt": "Hello"})[1]["tokens"]
    by_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], max_tokens=4, n=2, seed=7,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 16 and batch.usage.prompt_tokens == len(ids) + len(hello_ids)
    token_lists = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in token_lists.choices] == [by_text.choices[0].text] * 2


def test_n2_streamed_has_each_index_and_finish(server: Server) -> None:
    chunks = list(server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, n=2, seed=3, stream=True, extra_body={"ignore_eos": True}))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}
    for index in (0, 1):
        last = [c for c in chunks if c.choices[0].index == index][-1]
        assert last.choices[0].finish_reason == "length"


def test_seed_reproducibility(server: Server) -> None:
    client = server.client()

    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_completion_logprobs_and_echo(server: Server) -> None:
    client = server.client()
    res = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # (token texts need not join to the text: a byte-level token may hold part of a character)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3 and max(top.values()) >= chosen - 1e-5
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                       echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + res.choices[0].text
    elp = echoed.choices[0].logprobs
    assert elp.token_logprobs[0] is None and elp.tokens[-5:] == lp.tokens


def test_echo_with_max_tokens_0_scores_the_prompt(server: Server, tiny_model_dir: str) -> None:
    """OpenAI's prompt scoring (lm-eval-harness's loglikelihood requests): echo, max_tokens 0,
    logprobs; the reply is the prompt alone, its logprobs transformers' on the same checkpoint."""
    from engine_utils import hf_log_softmax

    ids = [5, 17, 99, 3, 250, 41]
    client = server.client()
    res = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = res.choices[0]
    assert choice.finish_reason == "length" and res.usage.completion_tokens == 0
    assert res.usage.prompt_tokens == len(ids) and len(choice.logprobs.tokens) == len(ids)
    ref = hf_log_softmax(tiny_model_dir, ids)
    assert choice.logprobs.token_logprobs[0] is None
    for p, got in enumerate(choice.logprobs.token_logprobs[1:]):
        assert got == pytest.approx(ref[p, ids[p + 1]].item(), abs=1e-4)
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    streamed_lps = [lp for c in chunks if c.choices for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed_lps == choice.logprobs.token_logprobs


def test_chat_unstreamed_and_streamed_agree(server: Server) -> None:
    client = server.client()
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_n2_and_logprobs(server: Server) -> None:
    res = server.client().chat.completions.create(
        model="tiny-alias", messages=MESSAGES, max_completion_tokens=6, n=2, seed=11, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    assert res.model == "tiny-alias" and [c.index for c in res.choices] == [0, 1]
    for choice in res.choices:
        content = choice.logprobs.content
        assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
        assert all(t.logprob <= 0 and isinstance(t.bytes, list) for t in content)
    assert res.usage.completion_tokens == 12


def test_models_version_tokenize_detokenize(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    status, body = http_get(server.url + "/version")
    assert status == 200 and b"version" in body
    status, tok = post_json(server.url + "/tokenize", {"prompt": PROMPT})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    status, detok = post_json(server.url + "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and PROMPT in detok["prompt"]
    status, chat_tok = post_json(server.url + "/tokenize", {"messages": MESSAGES})
    assert status == 200 and chat_tok["count"] > tok["count"]


def test_64_concurrent_streams_complete_exactly(server: Server) -> None:
    async def one(client: Any, i: int) -> tuple[int, int, int]:
        want = 4 + i % 13
        stream = await client.completions.create(
            model="tiny", prompt=f"{PROMPT} {i}", max_tokens=want, logprobs=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        counted, usage = 0, None
        async for chunk in stream:
            if chunk.choices:
                counted += len(chunk.choices[0].logprobs.tokens)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return want, counted, usage  # type: ignore[return-value]

    async def main() -> list[tuple[int, int, int]]:
        async with server.async_client() as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 300)

    results = asyncio.run(main())
    assert len(results) == 64
    for want, counted, usage in results:
        assert counted == usage == want


def test_metrics_count_exactly_the_tokens_served(server: Server) -> None:
    client = server.client()
    before = server.metrics()
    served_prompt = served_gen = 0
    for stream in (False, True):
        kwargs: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
        res = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, stream=stream,
                                        extra_body={"ignore_eos": True}, **kwargs)
        usage = [c for c in res][-1].usage if stream else res.usage
        served_prompt += usage.prompt_tokens
        served_gen += usage.completion_tokens
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                          extra_body={"ignore_eos": True})
    served_prompt += chat.usage.prompt_tokens
    served_gen += chat.usage.completion_tokens
    after = server.metrics()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == served_gen
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == served_prompt
    assert after["vllm:num_requests_running"] == 0
    for name in ("num_requests_waiting", "kv_cache_usage_perc", "request_success_total",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"):
        assert "vllm:" + name in after, name


@pytest.mark.skipif(not os.path.exists("/usr/bin/curl"), reason="no curl")
def test_curl_stream_is_openai_sse(server: Server) -> None:
    import subprocess

    out = subprocess.run(["curl", "-sN", server.url + "/v1/completions", "-H", "Content-Type: application/json",
                          "-d", '{"prompt": "Hi", "max_tokens": 2, "stream": true}'],
                         capture_output=True, timeout=60, check=True).stdout
    events = out.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b'data: {"id":"cmpl-') for e in events[:-2])


def test_a_prompt_too_long_to_fit_is_refused_untokenized(server: Server, tiny_model_dir: str) -> None:
    """A text past what max_model_len tokens could hold is a 400 at once (tokenizing megabytes
    took seconds); with truncate_prompt_tokens its end is served."""
    from transformers import AutoTokenizer

    text = "ab " * 100_000
    assert len(AutoTokenizer.from_pretrained(tiny_model_dir)(text)["input_ids"]) > MAX_MODEL_LEN  # the reference
    status, body = post_json(server.url + "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert f"prompt of {len(text)} characters is too long for max_model_len {MAX_MODEL_LEN}" in body["error"]["message"]
    status, body = post_json(server.url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": text}]})
    assert status == 400 and body["error"]["param"] == "messages"
    res = server.client().completions.create(model="tiny", prompt=text, max_tokens=2,
                                             extra_body={"truncate_prompt_tokens": 8})
    assert res.usage.prompt_tokens == 8 and res.usage.completion_tokens == 2
    # A truncation out of range is named as such, before the text is tokenized.
    status, body = post_json(server.url + "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 2,
                                                              "truncate_prompt_tokens": 10**9})
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens"
    # /tokenize counts the tokens of any text: whether it fits is what it is asked for.
    status, body = post_json(server.url + "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False})
    assert status == 200 and body["count"] == len(AutoTokenizer.from_pretrained(tiny_model_dir).encode(
        text, add_special_tokens=False)) and body["max_model_len"] == MAX_MODEL_LEN


def test_bench_client_reads_what_the_openai_client_reads(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/sse_client.py (bench_serving's client): exact usage and one timing per content
    chunk (the server merges the deltas of a reader that falls behind, so the count is at most
    one per token, not equal to the official client's); an error status is reported, not read
    as a stream; and its parser gives the same events whatever the read boundaries."""
    import random
    from urllib.parse import urlsplit

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
    from sse_client import Request, SSEParser, send

    prompt = [5, 6, 7, 8, 9]
    url = urlsplit(server.url)
    ok = asyncio.run(send(url.hostname, url.port, "/v1/completions", b"", "tiny", Request(prompt, 9), 0.0, 60))
    assert ok.success and ok.output_tokens == 9 and ok.error == ""
    assert 1 <= len(ok.itl) + 1 <= 9 and 0 < ok.ttft <= ok.latency
    bad = asyncio.run(send(url.hostname, url.port, "/v1/completions", b"", "tiny",
                           Request(prompt, MAX_MODEL_LEN * 2), 0.0, 60))
    assert not bad.success and bad.error.startswith("HTTP 400")

    events = [b'{"n":%d}' % i for i in range(5)] + [b"[DONE]"]
    body = b"".join(b"data: " + e + b"\n\n" for e in events)
    pieces = [body[:7], body[7:30], body[30:]]  # chunk boundaries that cut events apart
    raw = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n")
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(raw)), 6))
        parser, got = SSEParser(), []
        for a, b in zip([0, *cuts], [*cuts, len(raw)]):
            got += parser.feed(raw[a:b])
        assert got == events and parser.done and parser.status == 200


def test_chat_renders_off_the_event_loop(tiny_model_dir: str) -> None:
    """The template renders in a worker thread (jinja2 is Python: 100,000 messages took seconds,
    and the first render loads transformers' tokenizer), into the same text as on the loop."""
    import threading
    from types import SimpleNamespace

    from tidal.frontend.entrypoints.openai.serving_context import ServingContext
    from tidal.frontend.entrypoints.openai.serving_chat import render_chat
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    threads: list[threading.Thread] = []
    render = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: threads.append(threading.current_thread()) or render(*a, **k)
    engine = SimpleNamespace(tokenizer=tok, config=SimpleNamespace(model=tiny_model_dir),
                             model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
                             info=SimpleNamespace(vocab_size=len(tok)))
    ctx = ServingContext(engine, ["tiny"], CHAT_TEMPLATE)  # type: ignore[arg-type]
    text = asyncio.run(render_chat(ctx, MESSAGES, add_generation_prompt=True, continue_final_message=False,
                                   kwargs=None))
    assert threads and threads[0].name.startswith("tidal-render")  # its own pool, not the loop's thread
    assert text == render(MESSAGES, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)


FUZZ_VALUES: list[Any] = [None, -1, 0, 1, 3, 255, 2**31, 2**63, 1e308, -0.5, 0.5, 2.0, "", "x", [], [1], [-1], [600],
                          ["a", "b"], [[1, 2]], {}, {"a": 1}, {"1": 5.0}, True, "\U0001F600", "<|im_start|>"]


def test_random_request_bodies_never_break_the_server(server: Server) -> None:
    """Seeded random values in every request field (completions, chat, tokenize; streamed and
    not): each answer is a 200 (a stream ending in [DONE]) or an OpenAI-shaped 4xx, never a 5xx
    or silence, and afterwards the server is healthy, idle, and serves a plain request."""
    import json
    import random

    import msgspec

    from tests.server_utils import http_request
    from tidal.frontend.entrypoints.openai import protocol as P

    rng = random.Random(0)
    kinds = [("/v1/completions", P.CompletionRequest, {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
             ("/v1/chat/completions", P.ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}),
             ("/tokenize", P.TokenizeRequest, {"prompt": "hi"})]
    for _ in range(200):
        path, cls, base = rng.choice(kinds)
        body = dict(base)
        for name in rng.sample([f.encode_name for f in msgspec.structs.fields(cls)], rng.randint(1, 3)):
            body[name] = rng.choice(FUZZ_VALUES)
        stream = path != "/tokenize" and body.get("stream") is not True and rng.random() < 0.5
        if stream:
            body["stream"] = True
        status, raw = http_request("POST", server.url + path, json.dumps(body).encode(), timeout=60)
        where = f"{path} {json.dumps(body)[:200]} -> {status} {raw[:200]!r}"
        assert status == 200 or 400 <= status < 500, where
        if status != 200:
            assert set(json.loads(raw)["error"]) >= {"message", "type", "param", "code"}, where
        elif body.get("stream") is True:
            assert raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw, where
    assert http_get(server.url + "/health")[0] == 200
    wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 0, 30, "the core to be idle")
    assert server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=3).usage.completion_tokens > 0
