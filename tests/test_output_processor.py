"""OutputProcessor driven by hand-made EngineCoreOutputs: output kinds, the DELTA-merging
collector, n > 1 fan-out, stop strings and stop tokens, logprobs, abort and errors."""
from __future__ import annotations

import asyncio
import functools
import operator
import random
import time
from typing import Any

import numpy as np
import pytest

from tidal.frontend.output_collector import RequestOutputCollector
from tidal.frontend.output_processor import OutputProcessor
from tidal.protocol import EngineGenerateError, RequestOutput
from tidal.protocol.messages import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsArrays,
)
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams

try:
    from test_detokenizer import train_tokenizer
except ImportError:  # tests/ made a package
    from tests.test_detokenizer import train_tokenizer  # type: ignore[no-redef]

CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
TEXT = "Hello wörld! 日本語 😀 def main(): return 42 and more text after that."
PROMPT = [10, 11, 12]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer()


def req(rid: str, **kw: Any) -> EngineCoreRequest:
    return EngineCoreRequest(rid, PROMPT, SamplingParams(**kw), eos_token_id=0)


def feed(op: OutputProcessor, rid: str, ids: list[int], last: FinishReason | None = FinishReason.LENGTH,
         stop_reason: int | str | None = None) -> tuple[list[Any], list[str]]:
    """One EngineCoreOutput per token; the last one finished with `last`."""
    outs, aborts = [], []
    for i, t in enumerate(ids):
        fin = last if i == len(ids) - 1 else None
        r = op.process_outputs([EngineCoreOutput(rid, [t], finish_reason=fin,
                                                 stop_reason=stop_reason if fin is not None else None)])
        outs += r.request_outputs
        aborts += r.reqs_to_abort
    return outs, aborts


@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_output_kinds(tokenizer: Any, kind: RequestOutputKind) -> None:
    op = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT)
    op.add_request(req("r1", output_kind=kind), "the prompt")
    outs, aborts = feed(op, "r1", ids)
    assert not aborts and not op.has_unfinished_requests()
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert all(o.request_id == "r1" and o.prompt == "the prompt" and o.prompt_token_ids == PROMPT for o in outs)
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length" and final.stop_reason is None
    if kind == FINAL:
        assert len(outs) == 1
    else:
        assert len(outs) == len(ids)
        assert all(o.outputs[0].finish_reason is None for o in outs[:-1])
    if kind == DELTA:
        assert "".join(o.outputs[0].text for o in outs) == TEXT
        assert sum((o.outputs[0].token_ids for o in outs), []) == ids
    else:
        assert final.text == TEXT and final.token_ids == ids
    if kind == CUM:  # earlier outputs are snapshots, not views of later state
        assert outs[2].outputs[0].token_ids == ids[:3]
        assert TEXT.startswith(outs[5].outputs[0].text)
    # The id is reusable right away.
    op.add_request(req("r1"), None)
    assert op.get_num_unfinished_requests() == 1


def test_unknown_ids_ignored(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    r = op.process_outputs([EngineCoreOutput("nope", [5], finish_reason=FinishReason.ABORT)])
    assert r.request_outputs == [] and r.reqs_to_abort == []


async def test_collector_delta_merges_when_consumer_lags(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT)
    q = RequestOutputCollector(DELTA)
    op.add_request(req("r", output_kind=DELTA, logprobs=1), None, queue=q)
    rng = random.Random(0)
    got: list[RequestOutput] = []
    i = 0
    while i < len(ids):  # bursts of outputs between reads
        for _ in range(rng.randrange(1, 6)):
            if i < len(ids):
                fin = FinishReason.LENGTH if i == len(ids) - 1 else None
                op.process_outputs([EngineCoreOutput("r", [ids[i]], new_logprobs=_lp([ids[i]]), finish_reason=fin)])
                i += 1
        assert isinstance(q.output, RequestOutput)  # never more than one pending item
        got.append(await q.get())
    assert q.get_nowait() is None
    assert "".join(o.outputs[0].text for o in got) == TEXT
    assert sum((o.outputs[0].token_ids for o in got), []) == ids
    lps = sum((o.outputs[0].logprobs for o in got), [])
    assert [next(iter(d)) for d in lps] == ids
    assert [o.finished for o in got] == [False] * (len(got) - 1) + [True]
    assert got[-1].outputs[0].finish_reason == "length"


async def test_collector_cumulative_replaces_and_exception_wins() -> None:
    q = RequestOutputCollector(CUM)
    from tidal.protocol import CompletionOutput

    def ro(text: str) -> RequestOutput:
        return RequestOutput("r", None, [1], None, [CompletionOutput(0, text, [1], None, None)], False)

    q.put(ro("a"))
    q.put(ro("ab"))
    assert (await q.get()).outputs[0].text == "ab"
    waiter = asyncio.ensure_future(q.get())
    await asyncio.sleep(0)
    q.put(ro("abc"))
    assert (await asyncio.wait_for(waiter, 1)).outputs[0].text == "abc"
    waiter = asyncio.ensure_future(q.get())  # a cancelled get() leaves the collector usable
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    q.put(ro("x"))
    assert q.get_nowait().outputs[0].text == "x"  # type: ignore[union-attr]
    q.put(ro("x"))
    q.put(EngineGenerateError("boom"))
    q.put(ro("y"))
    with pytest.raises(EngineGenerateError, match="boom"):
        await q.get()


def _lp(ids: list[int], k: int = 2) -> LogprobsArrays:
    n = len(ids)
    tok = np.array([[t] + [(t + j) % 50 for j in range(1, k + 1)] for t in ids], dtype=np.int32)
    lps = np.full((n, k + 1), -1.0, dtype=np.float32)
    lps[:, 0] = -0.5
    return LogprobsArrays(tok, lps, np.full(n, 3, dtype=np.int32))


def test_logprobs_and_prompt_logprobs(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    op.add_request(req("r", logprobs=2, prompt_logprobs=2, output_kind=DELTA), None)
    # Chunked prefill: prompt logprobs of positions 1..2 arrive over two steps.
    r1 = op.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=_lp([11]))])
    assert r1.request_outputs == []
    r2 = op.process_outputs([EngineCoreOutput("r", [20], new_logprobs=_lp([20]), new_prompt_logprobs=_lp([12]))])
    out = r2.request_outputs[0]
    plp = out.prompt_logprobs
    assert plp[0] is None and [next(iter(d)) for d in plp[1:]] == [11, 12]
    row = out.outputs[0].logprobs[0]
    assert list(row) == [20, 21, 22]
    assert row[20].rank == 3 and row[21].rank == 1 and row[22].rank == 2
    assert row[20].logprob == pytest.approx(-0.5) and row[20].decoded_token == tokenizer.decode([20])
    assert out.outputs[0].cumulative_logprob == pytest.approx(-0.5)
    r3 = op.process_outputs([EngineCoreOutput("r", [30], new_logprobs=_lp([30]), finish_reason=FinishReason.LENGTH)])
    out = r3.request_outputs[0]
    assert out.prompt_logprobs is None  # DELTA: sent once
    assert out.outputs[0].cumulative_logprob == pytest.approx(-1.0) and len(out.outputs[0].logprobs) == 1
    # No logprobs requested: None.
    op.add_request(req("s", output_kind=FINAL), None)
    out = op.process_outputs([EngineCoreOutput("s", [5], finish_reason=FinishReason.LENGTH)]).request_outputs[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None and out.prompt_logprobs is None


def test_final_only_logprobs_cumulative(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    op.add_request(req("r", logprobs=1, output_kind=FINAL), None)
    for t in (5, 6, 7):
        r = op.process_outputs([EngineCoreOutput("r", [t], new_logprobs=_lp([t], 1),
                                                 finish_reason=FinishReason.LENGTH if t == 7 else None)])
    c = r.request_outputs[0].outputs[0]
    assert [next(iter(d)) for d in c.logprobs] == [5, 6, 7] and c.cumulative_logprob == pytest.approx(-1.5)


@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_parent_fan_out(tokenizer: Any, kind: RequestOutputKind) -> None:
    params = SamplingParams(n=3, seed=100, output_kind=kind, max_tokens=5)
    op = OutputProcessor(tokenizer)
    q = RequestOutputCollector(kind)
    children = op.add_request(EngineCoreRequest("p", PROMPT, params, 0, priority=4), "prompt", q)
    assert all(c.priority == 4 for c in children)  # each child is scheduled at the parent's priority
    assert children[2].request_id == "2_p" and children[2].sampling_params == params.clone(n=1, seed=102)
    assert params.n == 3 and params.seed == 100  # parent params untouched
    for i, child in enumerate(children):
        assert child.request_id == f"{i}_p" and child.sampling_params.seed == 100 + i
        assert child.sampling_params.n == 1 and child.prompt_token_ids == PROMPT
    ids = tokenizer.encode("abc def ghi")
    seen: list[RequestOutput] = []
    for step, t in enumerate(ids):  # children interleave; child 1 finishes first
        outs = [EngineCoreOutput(f"{i}_p", [t + i], finish_reason=FinishReason.LENGTH
                                 if step == len(ids) - 1 - (i == 1) else None) for i in (2, 0, 1)
                if not (i == 1 and step == len(ids) - 1)]
        assert op.process_outputs(outs).request_outputs == []
        if (o := q.get_nowait()) is not None:
            seen.append(o)
    assert not op.has_unfinished_requests() and not op.parent_requests
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    assert all(o.request_id == "p" for o in seen)
    final = seen[-1]
    if kind == FINAL:
        assert len(seen) == 1
        assert [c.index for c in final.outputs] == [0, 1, 2]
        assert final.outputs[1].token_ids == [t + 1 for t in ids[:-1]]
        assert final.outputs[0].token_ids == ids and all(c.finish_reason == "length" for c in final.outputs)
    elif kind == DELTA:  # each poll merged every child's progress
        for idx in range(3):
            toks = sum((c.token_ids for o in seen for c in o.outputs if c.index == idx), [])
            assert toks == [t + idx for t in (ids[:-1] if idx == 1 else ids)]
    else:  # the latest snapshot of each child is complete
        latest = {c.index: c for o in seen for c in o.outputs}
        for idx in range(3):
            assert latest[idx].token_ids == [t + idx for t in (ids[:-1] if idx == 1 else ids)]
            assert latest[idx].finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", [DELTA, CUM, FINAL])
def test_stop_string_across_tokens(tokenizer: Any, include: bool, kind: RequestOutputKind) -> None:
    text = "alpha beta STOPPING gamma delta"
    ids = []
    for piece in ["alpha", " beta", " ST", "OP", "PING", " gamma", " delta"]:  # stop spans tokens
        ids += tokenizer.encode(piece)
    op = OutputProcessor(tokenizer)
    op.add_request(req("r", output_kind=kind, stop=["STOPP", "zzzzzzzzzzz"],
                       include_stop_str_in_output=include), None)
    outs, aborts = feed(op, "r", ids, last=None)
    assert aborts == ["r"] and not op.has_unfinished_requests()
    expected = text[:text.index("STOPP") + (5 if include else 0)]
    last = outs[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == "STOPP" and outs[-1].finished
    assert sum(o.finished for o in outs) == 1
    if kind == DELTA:
        streamed = ""
        for o in outs:
            streamed += o.outputs[0].text
            if not include:
                assert "STOPP" not in streamed
        assert streamed == expected
    else:
        assert last.text == expected
    # The core's outputs still in flight, then its ABORT, are dropped; then the id is reusable.
    op.add_request(req("r", output_kind=DELTA), None)
    assert op.process_outputs([EngineCoreOutput("r", [5]),
                               EngineCoreOutput("r", finish_reason=FinishReason.ABORT)]).request_outputs == []
    outs, _ = feed(op, "r", tokenizer.encode("new"))
    assert "".join(o.outputs[0].text for o in outs) == "new"


def test_stop_string_held_back_then_flushed(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    op.add_request(req("r", output_kind=DELTA, stop=["xyz!"]), None)
    ids = tokenizer.encode("hello xy")
    outs, aborts = feed(op, "r", ids, last=FinishReason.LENGTH)
    assert not aborts
    before_last = tokenizer.decode(ids[:-1])
    assert "".join(o.outputs[0].text for o in outs[:-1]) == before_last[:-3]  # len("xyz!") - 1 held
    assert "".join(o.outputs[0].text for o in outs) == "hello xy"


def test_stop_string_respects_min_tokens(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    ids = tokenizer.encode("a b c d a b c d")
    op.add_request(req("r", stop=["a"], min_tokens=2, output_kind=FINAL), None)
    outs, _ = feed(op, "r", ids)
    assert outs[-1].outputs[0].text == "a b c d " and outs[-1].outputs[0].stop_reason == "a"


def test_stop_string_inside_min_tokens_text_ignored(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    ids = [tokenizer.encode(c)[0] for c in "abcab"]
    op.add_request(req("r", stop=["ab", "zzzz"], min_tokens=2, output_kind=DELTA), None)
    outs, aborts = feed(op, "r", ids, last=None)
    # "ab" ended within the first 2 tokens: not a stop; the second "ab" is.
    assert aborts == ["r"] and "".join(o.outputs[0].text for o in outs) == "abc"


def test_earliest_of_several_stop_strings(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    op.add_request(req("r", stop=["lo wor", "hel"], output_kind=FINAL), None)
    outs, _ = feed(op, "r", tokenizer.encode("say hello world"), last=None)
    assert outs[-1].outputs[0].text == "say " and outs[-1].outputs[0].stop_reason == "hel"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_passthrough(tokenizer: Any, include: bool) -> None:
    op = OutputProcessor(tokenizer)
    ids = tokenizer.encode("one two")
    stop_id = tokenizer.encode(" three")[0]
    op.add_request(req("r", stop_token_ids=[stop_id], include_stop_str_in_output=include), None)
    outs, aborts = feed(op, "r", ids + [stop_id], last=FinishReason.STOP, stop_reason=stop_id)
    c = outs[-1].outputs[0]
    assert not aborts and c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.token_ids == ids + [stop_id]
    assert c.text == "one two" + (tokenizer.decode([stop_id]) if include else "")
    # EOS: stop_reason None, EOS text never shown.
    op.add_request(req("e", skip_special_tokens=False), None)
    outs, _ = feed(op, "e", ids + [0], last=FinishReason.STOP)
    assert outs[-1].outputs[0].stop_reason is None and outs[-1].outputs[0].text == "one two"


@pytest.mark.parametrize("kind", [DELTA, CUM, FINAL])
async def test_abort_ends_stream_once(tokenizer: Any, kind: RequestOutputKind) -> None:
    op = OutputProcessor(tokenizer)
    q = RequestOutputCollector(kind)
    ids = tokenizer.encode("partial output")
    op.add_request(req("r", output_kind=kind, stop=["never-seen"]), None, queue=q)
    feed(op, "r", ids[:3], last=None)
    streamed = ""
    if kind != FINAL:
        streamed = (await q.get()).outputs[0].text
    res = op.finish_request_aborted(["r"])
    assert res.reqs_to_abort == ["r"] and res.request_outputs == []
    out = await q.get()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    full = out.outputs[0].text if kind != DELTA else streamed + out.outputs[0].text
    assert full == tokenizer.decode(ids[:3])  # held-back text flushed at the end
    # The core's ABORT (and a late token) for it: ignored, nothing more in the queue.
    op.process_outputs([EngineCoreOutput("r", [7]), EngineCoreOutput("r", finish_reason=FinishReason.ABORT)])
    assert q.get_nowait() is None and not op.has_unfinished_requests()
    assert op.finish_request_aborted(["r"]).reqs_to_abort == []


def test_abort_parent_and_silent_abort(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, seed=1, output_kind=FINAL)
    assert [c.request_id for c in op.add_request(EngineCoreRequest("p", PROMPT, params), None)] == ["0_p", "1_p"]
    op.process_outputs([EngineCoreOutput("0_p", [5], finish_reason=FinishReason.LENGTH),
                        EngineCoreOutput("1_p", [6])])
    res = op.finish_request_aborted(["p"])  # sync case: returned
    assert res.reqs_to_abort == ["1_p"]
    (out,) = res.request_outputs
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length", "abort"]
    assert not op.parent_requests and not op.has_unfinished_requests()
    op.add_request(req("s"), None)
    assert op.abort_requests(["s", "missing"]) == ["s"] and not op.has_unfinished_requests()


async def test_errors(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    q = RequestOutputCollector(DELTA)
    op.add_request(req("a"), None, queue=q)
    op.add_request(req("b"), None)
    res = op.process_outputs([EngineCoreOutput("a", finish_reason=FinishReason.ERROR, error="bad a"),
                              EngineCoreOutput("b", finish_reason=FinishReason.ERROR, error="bad b")])
    with pytest.raises(EngineGenerateError, match="bad a"):
        await q.get()
    (exc,) = res.request_outputs
    assert isinstance(exc, EngineGenerateError) and "bad b" in str(exc) and exc.request_id == "b"
    assert not op.has_unfinished_requests()
    # Engine death reaches every queue.
    q1, q2 = RequestOutputCollector(), RequestOutputCollector()
    op.add_request(req("c"), None, queue=q1)
    op.add_request(req("d"), None, queue=q2)
    op.propagate_error(RuntimeError("dead"))
    for q_ in (q1, q2):
        with pytest.raises(RuntimeError, match="dead"):
            q_.get_nowait()


def test_detokenize_false(tokenizer: Any) -> None:
    op = OutputProcessor(tokenizer)
    op.add_request(req("r", detokenize=False, logprobs=0, output_kind=FINAL), None)
    outs, _ = feed(op, "r", [5, 6])
    c = outs[0].outputs[0]
    assert c.text == "" and c.token_ids == [5, 6]


def test_metrics_only_with_stats(tokenizer: Any) -> None:
    queued, scheduled, preempted = (int(e) for e in (EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED,
                                                     EngineCoreEventType.PREEMPTED))
    op = OutputProcessor(tokenizer, log_stats=True)
    request = EngineCoreRequest("r", PROMPT, SamplingParams(output_kind=CUM), 0, time.time())
    op.add_request(request, None)
    t = time.monotonic()
    outs = op.process_outputs([EngineCoreOutput("r", [5], events=[(queued, t), (scheduled, t + 1)])]).request_outputs
    outs += op.process_outputs([EngineCoreOutput("r", [6], events=[(preempted, t + 2), (scheduled, t + 3)])]
                               ).request_outputs
    outs += op.process_outputs([EngineCoreOutput("r", [7], finish_reason=FinishReason.LENGTH)]).request_outputs
    first, last = outs[0].metrics, outs[-1].metrics
    assert first is not None and last is not None and first is not last  # snapshots
    assert (first.num_generation_tokens, last.num_generation_tokens) == (1, 3)
    assert (last.arrival_time, last.queued_ts, last.scheduled_ts) == (request.arrival_time, t, t + 1)
    assert t <= last.first_token_ts == first.first_token_ts <= last.last_token_ts <= time.monotonic()
    assert 0 <= last.first_token_latency < 5
    op = OutputProcessor(tokenizer)  # stats off: no metrics
    op.add_request(req("s"), None)
    (out,) = op.process_outputs([EngineCoreOutput("s", [5], finish_reason=FinishReason.LENGTH,
                                                  events=[(queued, t)])]).request_outputs
    assert out.metrics is None


def _python_tokenizer() -> Any:
    """A pure-Python tokenizer (no Rust backend, as a trust_remote_code model may bring) over a
    10-word vocabulary: it raises KeyError for an id past it, as a padded model vocabulary has."""
    from transformers import PreTrainedTokenizer

    class WordTokenizer(PreTrainedTokenizer):
        def __init__(self, **kwargs: Any) -> None:
            self.words = {f"w{i}": i for i in range(10)}
            self.by_id = {i: w for w, i in self.words.items()}
            super().__init__(eos_token="w0", **kwargs)

        @property
        def vocab_size(self) -> int:
            return len(self.words)

        def get_vocab(self) -> dict[str, int]:
            return dict(self.words)

        def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
            return text.split()

        def _convert_token_to_id(self, token: str) -> int:
            return self.words[token]

        def _convert_id_to_token(self, index: int) -> str:
            return self.by_id[index]

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return " ".join(tokens)

    return WordTokenizer()


def test_a_request_whose_output_cannot_be_processed_fails_alone() -> None:
    """Request "a" samples an id its tokenizer cannot decode: "a" ends with the error and goes to
    the core's abort list, the other requests of the same messages stream on to their end, and
    the core's final word on "a" (its abort) is swallowed."""
    op = OutputProcessor(_python_tokenizer())
    for rid in ("a", "b"):
        op.add_request(EngineCoreRequest(rid, [1, 2], SamplingParams(output_kind=CUM), 0), None)
    r = op.process_outputs([EngineCoreOutput("a", [50]), EngineCoreOutput("b", [3])])
    (err, b1) = r.request_outputs
    assert isinstance(err, EngineGenerateError) and "KeyError" in str(err) and err.request_id == "a"
    assert r.reqs_to_abort == ["a"] and b1.outputs[0].text == " w3"
    r = op.process_outputs([EngineCoreOutput("a", [], finish_reason=FinishReason.ABORT),
                            EngineCoreOutput("b", [4], finish_reason=FinishReason.LENGTH)])
    (b2,) = r.request_outputs
    assert b2.finished and b2.outputs[0].text == " w3 w4" and not r.reqs_to_abort
    assert op.get_num_unfinished_requests() == 0 and not op._awaiting_final


# ------------------------------------------------------------------ logprobs containers and text


def _run_logprobs(tokenizer: Any, kind: RequestOutputKind, flat: bool, prompt: list[int], ids: list[int]
                  ) -> tuple[list[RequestOutput], Any, Any]:
    """One request fed token by token (its prompt logprobs with the first token); returns its
    outputs and the whole sample / prompt logprobs as the user would assemble them."""
    op = OutputProcessor(tokenizer)
    params = SamplingParams(logprobs=2, prompt_logprobs=1, output_kind=kind, flat_logprobs=flat)
    op.add_request(EngineCoreRequest("r", prompt, params, eos_token_id=0), None)
    outs = []
    for i, t in enumerate(ids):
        outs += op.process_outputs([EngineCoreOutput(
            "r", [t], new_logprobs=_lp([t]), new_prompt_logprobs=_lp(prompt[1:], 1) if i == 0 else None,
            finish_reason=FinishReason.LENGTH if i == len(ids) - 1 else None)]).request_outputs
    if kind == DELTA:
        sample = [row for o in outs for row in o.outputs[0].logprobs]
        prompt_lp = [row for o in outs if o.prompt_logprobs is not None for row in o.prompt_logprobs]
    else:
        sample, prompt_lp = list(outs[-1].outputs[0].logprobs), list(outs[-1].prompt_logprobs)
    return outs, sample, prompt_lp


@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_flat_logprobs_equal_nested(tokenizer: Any, kind: RequestOutputKind) -> None:
    from tidal.protocol.outputs import FlatLogprobs

    ids = [20, 21, 20, 33]
    flat_outs, flat_sample, flat_prompt = _run_logprobs(tokenizer, kind, True, PROMPT, ids)
    nested_outs, sample, prompt_lp = _run_logprobs(tokenizer, kind, False, PROMPT, ids)
    assert all(isinstance(o.outputs[0].logprobs, FlatLogprobs) for o in flat_outs)
    assert all(isinstance(o.outputs[0].logprobs, list) for o in nested_outs)
    assert flat_sample == sample and len(sample) == len(ids)
    assert flat_outs[-1].outputs[0].logprobs == nested_outs[-1].outputs[0].logprobs
    # Prompt logprobs: position 0 is None in the nested form, an empty position in the flat one.
    assert prompt_lp[0] is None and flat_prompt[0] == {} and flat_prompt[1:] == prompt_lp[1:]
    assert len(prompt_lp) == len(PROMPT)
    flat = flat_outs[-1].outputs[0].logprobs
    if kind != DELTA:
        assert len(flat.token_ids) == sum(len(d) for d in sample)  # flat lists, no dicts stored
        assert flat[1:3] == sample[1:3] and isinstance(flat[1:3], FlatLogprobs)


@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_prompt_logprobs_first_entry_none(tokenizer: Any, kind: RequestOutputKind) -> None:
    outs, _, _ = _run_logprobs(tokenizer, kind, False, PROMPT, [20, 21])
    first = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    assert first[0] is None and all(isinstance(d, dict) for d in first[1:])


def _split_char_text(tokenizer: Any) -> tuple[str, list[int]]:
    """A text with a character split across byte-level tokens (its pieces decode to U+FFFD)."""
    for text in ("日本語のテキスト😀", "😀🎉👍", "中文文本测试", "ünïcödé 🎉"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if any(tokenizer.decode([t]).endswith("\ufffd") for t in ids):
            return text, ids
    raise AssertionError("the tokenizer splits no character across tokens")


def test_decoded_token_completes_split_characters(tokenizer: Any) -> None:
    text, ids = _split_char_text(tokenizer)
    prompt = [10] + ids  # prompt logprobs score ids too
    outs, sample, prompt_lp = _run_logprobs(tokenizer, CUM, False, prompt, ids)
    for rows in (sample, prompt_lp[1:]):
        chosen = [row[t].decoded_token for row, t in zip(rows, ids)]
        assert not any(c.endswith("\ufffd") for c in chosen), chosen
        assert "".join(chosen) == text  # each piece carries what it completes, "" what it begins
    # Top-k alternatives are decoded in the same context, never ending in U+FFFD either.
    assert not any(lp.decoded_token.endswith("\ufffd") for row in sample for lp in row.values())
    assert outs[-1].outputs[0].text == text


def test_outputs_keep_unknown_kwargs() -> None:
    from tidal.protocol import CompletionOutput

    c = CompletionOutput(0, "x", [1], None, None, finish_reason="stop", some_new_field=[1, 2])
    r = RequestOutput("r", "p", [1], None, [c], True, kv_transfer_params={"a": 1}, encoder_prompt=None)
    assert c.some_new_field == [1, 2] and c.finish_reason == "stop" and c.finished()
    assert r.kv_transfer_params == {"a": 1} and r.encoder_prompt is None and r.outputs == [c]
    with pytest.raises(TypeError):
        RequestOutput("r")  # required arguments stay required


def _sizes(outs: list[Any]) -> list[int]:
    return [len(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_stream_interval(tokenizer: Any, kind: RequestOutputKind) -> None:
    """vLLM's stream_interval: the first token goes out alone, then one output per 3 tokens, and
    the last (with the remainder); DELTA outputs then carry the tokens, text and logprobs held
    back, so they join to what interval 1 gives; the final output is the same either way."""
    ids = tokenizer.encode(TEXT)[:8]
    results = {}
    for interval in (1, 3):
        op = OutputProcessor(tokenizer, stream_interval=interval)
        op.add_request(req("r", logprobs=1, output_kind=kind), None)
        outs = []
        for i, t in enumerate(ids):
            outs += op.process_outputs([EngineCoreOutput(
                "r", [t], new_logprobs=_lp([t]),
                finish_reason=FinishReason.LENGTH if i == len(ids) - 1 else None)]).request_outputs
        results[interval] = outs
    expect = {CUM: ([1, 2, 3, 4, 5, 6, 7, 8], [1, 4, 7, 8]), DELTA: ([1] * 8, [1, 3, 3, 1]), FINAL: ([8], [8])}[kind]
    assert (_sizes(results[1]), _sizes(results[3])) == expect
    one, three = results[1], results[3]
    assert [o.finished for o in three] == [False] * (len(three) - 1) + [True]
    if kind == DELTA:
        for field in ("text", "token_ids", "logprobs"):
            joined = [functools.reduce(operator.add, (getattr(o.outputs[0], field) for o in outs))
                      for outs in (one, three)]
            assert joined[0] == joined[1], field
        assert len(joined[1]) == len(ids)
        assert three[-1].outputs[0].cumulative_logprob == pytest.approx(one[-1].outputs[0].cumulative_logprob)
    else:
        assert three[-1].outputs[0] == one[-1].outputs[0]


def test_stream_interval_held_tokens_reach_abort_and_stop(tokenizer: Any) -> None:
    """Tokens held back by stream_interval go out with a user abort's final output, and with
    the output a stop string ends (found in held text)."""
    ids = tokenizer.encode(TEXT)
    op = OutputProcessor(tokenizer, stream_interval=10)
    op.add_request(req("a", output_kind=DELTA), None)
    sent = [o for t in ids[:4] for o in op.process_outputs([EngineCoreOutput("a", [t])]).request_outputs]
    assert _sizes(sent) == [1]
    (final,) = op.finish_request_aborted(["a"]).request_outputs
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert sent[0].outputs[0].token_ids + final.outputs[0].token_ids == ids[:4]
    assert sent[0].outputs[0].text + final.outputs[0].text == tokenizer.decode(ids[:4])
    op.add_request(req("s", output_kind=DELTA, stop=["main"]), None)
    outs, aborts = feed(op, "s", ids, last=None)
    assert aborts == ["s"] and outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    text = "".join(o.outputs[0].text for o in outs)
    assert text == TEXT[:TEXT.index("main")]


def test_stream_interval_is_an_engine_arg() -> None:
    from tidal.frontend.engine_args import EngineArgs
    from tidal.protocol import EngineConfig

    assert EngineArgs(model="m", stream_interval=4).create_engine_config().stream_interval == 4
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        EngineConfig(model="m", stream_interval=0)
