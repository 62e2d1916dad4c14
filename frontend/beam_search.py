"""Beam search on top of the engine, as vLLM's `LLM.beam_search` does it.

Each step sends every live beam (prompt + tokens so far) to the engine as its own one-token
request with `logprobs=2 * beam_width`; each returned candidate extends its beam by one token
(cumulative logprob += the candidate's logprob). Per prompt, candidates ending in EOS (unless
`ignore_eos`) are finished; the best `beam_width` of the others, by length-penalised score,
stay live. After `max_tokens` steps (or once no beam is live) the finished and live beams are
ranked by the same score and the best `beam_width` returned, text decoded.

Invariants:
- A prompt never has more than `beam_width` live beams; finished beams are never pruned
  before the final ranking (vLLM's behaviour).
- A beam that fills the context window (`max_model_len`, when given) finishes with "length"
  instead of being sent: the engine could not extend it.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tidal.protocol.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    create_sort_beams_key_function,
)
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generate_fn(prompts as {"prompt_token_ids": [...]}, params) -> one finished output per prompt,
# in order (`LLM.generate` with the progress bar off).
GenerateFn = Callable[[list[dict[str, Any]], SamplingParams], list[RequestOutput]]
BeamPrompt = str | list[int] | dict[str, Any]


class BeamSearchInstance:
    """The beams of one prompt: `beams` live, `completed` finished."""

    def __init__(self, prompt: dict[str, Any]) -> None:
        self.beams: list[BeamSearchSequence] = [
            BeamSearchSequence(orig_prompt=prompt, tokens=list(prompt["prompt_token_ids"]), logprobs=[])]
        self.completed: list[BeamSearchSequence] = []


def beam_search(generate_fn: GenerateFn, tokenizer: Any, prompts: BeamPrompt | Sequence[BeamPrompt],
                params: BeamSearchParams, eos_token_id: int | None, *, lora_request: None = None,
                use_tqdm: bool = False, concurrency_limit: int | None = None,
                max_model_len: int | None = None) -> list[BeamSearchOutput]:
    """vLLM's `LLM.beam_search(prompts, params, lora_request, use_tqdm, concurrency_limit)`:
    one BeamSearchOutput per prompt, in order. Prompts: text, token ids, or vLLM's
    {"prompt": ...} / {"prompt_token_ids": ...}. `concurrency_limit` prompts are searched at a
    time (None: all at once)."""
    if lora_request is not None:
        raise ValueError("lora_request is not supported: tidal has no LoRA")
    instances = [BeamSearchInstance(p) for p in _token_prompts(tokenizer, prompts)]
    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}.")
    if use_tqdm and concurrency_limit is not None:
        logger.warning("Progress bar is not supported when using concurrency_limit. Disabling progress bar.")
        use_tqdm = False
    limit = concurrency_limit or max(len(instances), 1)
    # 2 * beam_width candidates per beam, as transformers and vLLM.
    step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature)
    for start in range(0, len(instances), limit):
        batch = instances[start : start + limit]
        for _ in _steps(params.max_tokens, use_tqdm):
            if not _step(generate_fn, batch, params, step_params, eos_token_id, max_model_len):
                break
    return [_finish(inst, params, eos_token_id, tokenizer) for inst in instances]


def _token_prompts(tokenizer: Any, prompts: BeamPrompt | Sequence[BeamPrompt]) -> list[dict[str, Any]]:
    """Each prompt as {"prompt_token_ids": [...]} (and its "prompt" text, if it had one)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                             and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]  # type: ignore[list-item]
    out: list[dict[str, Any]] = []
    for p in prompts:  # type: ignore[union-attr]
        if isinstance(p, str):
            p = {"prompt": p}
        elif isinstance(p, list):
            p = {"prompt_token_ids": p}
        if not isinstance(p, dict) or not ({"prompt", "prompt_token_ids"} & set(p)):
            raise ValueError(f"a beam search prompt is a str, a list of token ids, {{'prompt': str}} or "
                             f"{{'prompt_token_ids': list[int]}}; got {p!r}")
        if "prompt_token_ids" not in p:
            if tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids instead")
            p = {**p, "prompt_token_ids": list(tokenizer.encode(p["prompt"]))}
        out.append(p)
    return out


def _steps(max_tokens: int, use_tqdm: bool) -> Iterable[int]:
    if not use_tqdm:
        return range(max_tokens)
    from tqdm.auto import tqdm

    logger.warning("The progress bar shows the upper bound on token steps and may finish early due to "
                   "stopping conditions. It does not reflect instance-level progress.")
    return tqdm(range(max_tokens), desc="Beam search", unit="token", unit_scale=False)


def _step(generate_fn: GenerateFn, batch: list[BeamSearchInstance], params: BeamSearchParams,
          step_params: SamplingParams, eos_token_id: int | None, max_model_len: int | None) -> bool:
    """Extend every live beam of `batch` by one token; False if none was live."""
    for inst in batch:  # beams that fill the context window cannot grow: they end here
        full = [b for b in inst.beams if max_model_len is not None and len(b.tokens) >= max_model_len]
        for beam in full:
            beam.finish_reason = "length"
        inst.completed += full
        inst.beams = [b for b in inst.beams if b.finish_reason is None]
    live = [beam for inst in batch for beam in inst.beams]
    if not live:
        return False
    outputs = generate_fn([{"prompt_token_ids": b.tokens} for b in live], step_params)
    ends = list(itertools.accumulate(len(inst.beams) for inst in batch))
    sort_key = create_sort_beams_key_function(eos_token_id, params.length_penalty)
    for inst, start, end in zip(batch, [0] + ends[:-1], ends):
        candidates: list[BeamSearchSequence] = []
        for beam, out in zip(live[start:end], outputs[start:end], strict=True):
            candidates += _extend(beam, out, inst, params, eos_token_id)
        inst.beams = sorted(candidates, key=sort_key, reverse=True)[: params.beam_width]
    return True


def _extend(beam: BeamSearchSequence, out: RequestOutput, inst: BeamSearchInstance,
            params: BeamSearchParams, eos_token_id: int | None) -> list[BeamSearchSequence]:
    """`beam` extended by each candidate of its step; those ending in EOS go to
    `inst.completed`, the others are returned. No logprobs: the request ended without a
    token (vLLM drops the beam)."""
    logprobs = out.outputs[0].logprobs if out.outputs else None
    if not logprobs:
        return []
    step_logprobs = logprobs[0]
    extended: list[BeamSearchSequence] = []
    for token_id, lp in step_logprobs.items():
        new = BeamSearchSequence(orig_prompt=beam.orig_prompt, tokens=beam.tokens + [token_id],
                                 logprobs=beam.logprobs + [step_logprobs], cum_logprob=beam.cum_logprob + lp.logprob)
        if token_id == eos_token_id and not params.ignore_eos:
            new.finish_reason = "stop"
            inst.completed.append(new)
        else:
            extended.append(new)
    return extended


def _finish(inst: BeamSearchInstance, params: BeamSearchParams, eos_token_id: int | None,
            tokenizer: Any) -> BeamSearchOutput:
    """The best `beam_width` of the finished and live beams, text decoded (prompt included)."""
    for beam in inst.beams:
        beam.finish_reason = "length"
    sort_key = create_sort_beams_key_function(eos_token_id, params.length_penalty)
    best = sorted(inst.completed + inst.beams, key=sort_key, reverse=True)[: params.beam_width]
    for beam in best:
        beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
    return BeamSearchOutput(sequences=best)
