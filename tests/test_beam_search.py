"""Beam search (vLLM's `LLM.beam_search` on top of the engine) against a straightforward
reference beam search over transformers' float32 log-softmax of the same tiny model: token
sequences equal, cumulative logprobs close, with and without EOS, with length penalties, at the
context window, several prompts at once and in slices (concurrency_limit)."""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from engine_utils import hf_log_softmax, model_path
from tidal.frontend import LLM
from tidal.frontend.beam_search import beam_search
from tidal.protocol.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    get_beam_search_score,
)

NAME = "tiny"
MAX_MODEL_LEN = 48
PROMPTS = [[5, 6, 7, 8], [40, 41, 300, 17, 9, 250]]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model=model_path(NAME), dtype="float32", device="cpu", multiprocessing=False,
             max_model_len=MAX_MODEL_LEN, num_kv_blocks=64) as engine:
        yield engine


# ------------------------------------------------------------------ the reference


@functools.cache
def next_logprobs(tokens: tuple[int, ...]) -> torch.Tensor:
    """transformers' log-softmax of the next token after `tokens` (beams share prefixes)."""
    return hf_log_softmax(NAME, list(tokens))[-1]


@dataclass
class RefBeam:
    tokens: list[int]  # prompt + generated, as vLLM's BeamSearchSequence
    cum_logprob: float
    finish_reason: str = "length"


def reference(prompt: list[int], params: BeamSearchParams, eos: int | None,
              max_model_len: int = MAX_MODEL_LEN) -> tuple[list[RefBeam], float]:
    """Beam search as vLLM specifies it, straight from transformers' logits. Returns the best
    beams and the smallest relative score margin at any cut (kept vs dropped, returned vs not):
    one far above float noise (logprobs ~1e-6 apart, over |cum_logprob| > 1) means the
    comparison cannot hinge on it."""
    k = params.beam_width

    def score(b: RefBeam) -> float:
        n = len(b.tokens) - (1 if b.tokens[-1] == eos else 0)
        return b.cum_logprob / n**params.length_penalty

    def margin(a: RefBeam, b: RefBeam) -> float:
        return (score(a) - score(b)) / max(abs(score(a)), abs(score(b)))

    live, done, margins = [RefBeam(list(prompt), 0.0)], [], []
    for _ in range(params.max_tokens):
        done += [b for b in live if len(b.tokens) >= max_model_len]
        live = [b for b in live if len(b.tokens) < max_model_len]
        if not live:
            break
        cands = []
        for b in live:
            top = next_logprobs(tuple(b.tokens)).topk(2 * k)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                new = RefBeam(b.tokens + [t], b.cum_logprob + lp)
                if t == eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    done.append(new)
                else:
                    cands.append(new)
        cands.sort(key=score, reverse=True)
        if len(cands) > k:
            margins.append(margin(cands[k - 1], cands[k]))
        live = cands[:k]
    final = sorted(done + live, key=score, reverse=True)
    if len(final) > k:
        margins.append(margin(final[k - 1], final[k]))
    return final[:k], min(margins, default=float("inf"))


def run(llm: LLM, prompts: list, params: BeamSearchParams, eos: int | None, **kw: object) -> list[BeamSearchOutput]:
    return beam_search(functools.partial(llm.generate, use_tqdm=False), llm.get_tokenizer(), prompts, params,
                       eos, max_model_len=MAX_MODEL_LEN, **kw)


def assert_matches(got: BeamSearchOutput, prompt: list[int], params: BeamSearchParams, eos: int | None) -> None:
    ref, margin = reference(prompt, params, eos)
    assert margin > 1e-5, f"reference stands on a near-tie ({margin:.2g}): pick another prompt"
    assert [s.tokens for s in got.sequences] == [b.tokens for b in ref]
    assert [s.finish_reason for s in got.sequences] == [b.finish_reason for b in ref]
    for s, b in zip(got.sequences, ref):
        assert s.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-4)
        assert len(s.logprobs) == len(s.tokens) - len(prompt)
        assert sum(step[t].logprob for step, t in zip(s.logprobs, s.tokens[len(prompt):])) == pytest.approx(
            s.cum_logprob, abs=1e-9)


def _eos_mid_search(prompt: list[int], params: BeamSearchParams) -> int:
    """A token the best EOS-free beam picks at its 3rd step: as EOS, beams finish mid-search."""
    best, _ = reference(prompt, params, None)
    return best[0].tokens[len(prompt) + 2]


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("beam_width", [1, 3])
def test_without_eos_matches_reference(llm: LLM, beam_width: int) -> None:
    params = BeamSearchParams(beam_width=beam_width, max_tokens=6)
    outs = run(llm, PROMPTS, params, None)
    assert len(outs) == 2 and all(len(o.sequences) == beam_width for o in outs)
    for out, prompt in zip(outs, PROMPTS):
        assert_matches(out, prompt, params, None)
        assert all(s.finish_reason == "length" and len(s.tokens) == len(prompt) + 6 for s in out.sequences)
        # text: the whole sequence decoded, prompt included (vLLM's)
        assert out.sequences[0].text == llm.get_tokenizer().decode(out.sequences[0].tokens)


@pytest.mark.parametrize("length_penalty", [1.0, 0.3, 2.5])
def test_eos_and_length_penalty_match_reference(llm: LLM, length_penalty: float) -> None:
    prompt = PROMPTS[0]
    params = BeamSearchParams(beam_width=3, max_tokens=7, length_penalty=length_penalty)
    eos = _eos_mid_search(prompt, BeamSearchParams(beam_width=3, max_tokens=7))
    (out,) = run(llm, [prompt], params, eos)
    assert_matches(out, prompt, params, eos)
    finished = [s for s in out.sequences if s.finish_reason == "stop"]
    assert all(s.tokens[-1] == eos and eos not in s.tokens[len(prompt):-1] for s in finished)
    if length_penalty == 1.0:
        assert finished, "EOS never won a place: the test does not exercise it"
    # ignore_eos: EOS is a token like any other and every beam runs to max_tokens
    params_ign = BeamSearchParams(beam_width=3, max_tokens=7, length_penalty=length_penalty, ignore_eos=True)
    (out,) = run(llm, [prompt], params_ign, eos)
    assert_matches(out, prompt, params_ign, eos)
    assert all(len(s.tokens) == len(prompt) + 7 for s in out.sequences)


def test_length_penalty_reorders_finished_beams(llm: LLM) -> None:
    """The same search ranks its finished beams differently under different penalties (short
    EOS beams against longer ones), each time as the reference does."""
    prompt = PROMPTS[0]
    eos = _eos_mid_search(prompt, BeamSearchParams(beam_width=3, max_tokens=7))
    orders = {}
    for lp in (0.0, 1.0, 3.0):
        params = BeamSearchParams(beam_width=3, max_tokens=7, length_penalty=lp)
        (out,) = run(llm, [prompt], params, eos)
        assert_matches(out, prompt, params, eos)
        orders[lp] = [tuple(s.tokens) for s in out.sequences]
    assert len(set(map(tuple, orders.values()))) > 1


def test_context_window_ends_beams_with_length(llm: LLM) -> None:
    prompt = list(range(10, 10 + MAX_MODEL_LEN - 3))  # room for 3 tokens
    params = BeamSearchParams(beam_width=2, max_tokens=10)
    (out,) = run(llm, [prompt], params, None)
    assert_matches(out, prompt, params, None)
    assert all(len(s.tokens) == MAX_MODEL_LEN and s.finish_reason == "length" for s in out.sequences)


def test_prompt_forms_and_concurrency_limit(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    text = "hello world"
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    prompts = [text, {"prompt": text}, {"prompt_token_ids": PROMPTS[1]}, PROMPTS[0]]
    all_at_once = run(llm, prompts, params, None)
    one_by_one = run(llm, prompts, params, None, concurrency_limit=1)
    as_tokens = run(llm, [tok.encode(text)], params, None)
    key = [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in all_at_once]
    assert key == [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in one_by_one]
    assert key[0] == key[1] == [(s.tokens, s.cum_logprob) for s in as_tokens[0].sequences]
    assert all_at_once[0].sequences[0].orig_prompt["prompt"] == text
    assert_matches(all_at_once[3], PROMPTS[0], params, None)
    (single,) = run(llm, PROMPTS[0], params, None)  # one prompt of token ids, unwrapped
    assert [s.tokens for s in single.sequences] == [s.tokens for s in all_at_once[3].sequences]


def test_params_and_score() -> None:
    p = BeamSearchParams(beam_width=4, max_tokens=16)
    assert (p.ignore_eos, p.temperature, p.length_penalty, p.include_stop_str_in_output) == (False, 0.0, 1.0, False)
    with pytest.raises(AttributeError):
        p.beam_width = 2  # type: ignore[misc]
    for bad in ({"beam_width": 0, "max_tokens": 1}, {"beam_width": 1, "max_tokens": 0},
                {"beam_width": 1, "max_tokens": 1, "temperature": -1.0}):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)  # type: ignore[arg-type]
    # score: cum / len ** penalty, a final EOS not counted (vLLM's, after transformers)
    assert get_beam_search_score([1, 2, 3, 9], -8.0, eos_token_id=9, length_penalty=1.0) == -8.0 / 3
    assert get_beam_search_score([1, 2, 3, 9], -8.0, eos_token_id=7, length_penalty=2.0) == -8.0 / 16
    assert BeamSearchSequence(orig_prompt={}, tokens=[1], logprobs=[]).cum_logprob == 0.0


def test_lora_request_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="LoRA"):
        run(llm, PROMPTS, BeamSearchParams(beam_width=1, max_tokens=1), None, lora_request=object())


def test_llm_beam_search_method_uses_the_engines_eos(llm: LLM) -> None:
    """`LLM.beam_search` (vLLM's entry point) is the function above with the engine's own EOS."""
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    got = llm.beam_search(PROMPTS, params)
    want = run(llm, PROMPTS, params, llm.input_processor.eos_token_id)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in want]
    for out, prompt in zip(got, PROMPTS):
        assert_matches(out, prompt, params, llm.input_processor.eos_token_id)
