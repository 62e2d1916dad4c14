"""Front-end input processing (vLLM V1's processor.py): tokenize, validate, seed.

Every problem with a request raises `ValueError` here, before anything is queued.
"""
from __future__ import annotations

import json
import math
import operator
import os
import random
import time
from typing import Any

import msgspec
from tidal.frontend.detokenizer import rust_backend
from tidal.frontend.prompt_tokens import PromptEncoder, keep_last, off_loop_if_long, truncation_length
from tidal.frontend.request_ids import check_request_id
from tidal.frontend.tokenizer import LONG_TEXT_CHARS, rust_encode
from tidal.protocol.messages import EngineCoreRequest
from tidal.protocol.request_rules import RequestLimits, check_priority, check_request
from tidal.protocol.sampling_params import SamplingParams

# Drawn seeds stay below 2**63 with room for the n > 1 children's seed + i (and then some).
_SEED_LIMIT = (1 << 63) - (1 << 32)


def _generation_config_eos(tokenizer: Any) -> list[int]:
    """eos_token_id(s) from generation_config.json beside the tokenizer, if there is one."""
    path = getattr(tokenizer, "name_or_path", None)
    if not path or not os.path.isdir(path):
        return []
    try:
        with open(os.path.join(path, "generation_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [e for e in eos if isinstance(e, int)]
    return []


class InputProcessor:
    def __init__(self, tokenizer: Any | None, *, max_model_len: int, vocab_size: int,
                 max_logprobs: int, eos_token_id: int | list[int] | None = None,
                 scheduling_policy: str = "fcfs", seed: int | None = None) -> None:
        """`eos_token_id` overrides the tokenizer's/generation_config's (a list: the first is the
        EOS, the others become stop token ids, as vLLM does with generation_config). `seed`, the
        engine's: the seeds drawn for unseeded requests follow from it, so the same requests in
        the same order sample the same tokens run after run (vLLM's seed=0 promise); None: a
        fresh draw each run."""
        self.tokenizer = tokenizer
        self._seeds = random.Random(seed)
        self.limits = RequestLimits(max_model_len, vocab_size, max_logprobs, scheduling_policy)
        if eos_token_id is None:
            eos_ids = _generation_config_eos(tokenizer) if tokenizer is not None else []
            tok_eos = getattr(tokenizer, "eos_token_id", None)
            if isinstance(tok_eos, int):
                eos_ids = [tok_eos] + [e for e in eos_ids if e != tok_eos]
        else:
            eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self.extra_eos_token_ids: list[int] = eos_ids[1:]
        # Text prompts are tokenized, size-checked and truncated as the server does its own.
        self.encoder = None if tokenizer is None else PromptEncoder(tokenizer, max_model_len)

    # ------------------------------------------------------------------ prompts
    def _parse_prompt(self, prompt: str | dict) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if not isinstance(prompt, dict):
            raise ValueError(
                f"prompt must be a str, {{'prompt': str}} or {{'prompt_token_ids': list[int]}}, "
                f"got {type(prompt).__name__}")
        unknown = sorted(set(prompt) - _PROMPT_KEYS - _MULTIMODAL_KEYS)
        if unknown:
            raise ValueError(f"unknown prompt key(s) {unknown}; expected 'prompt', 'prompt_token_ids' "
                             "or 'cache_salt'")
        given = sorted(k for k in _MULTIMODAL_KEYS if prompt.get(k) is not None)
        if given:
            raise ValueError(f"prompt key(s) {given}: tidal serves text-only models (leave them out or None)")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"'prompt' must be a str, got {type(text).__name__}")
        if "prompt_token_ids" not in prompt:
            if text is None:
                raise ValueError("the prompt dict needs 'prompt' or 'prompt_token_ids'")
            return text, None
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"'prompt_token_ids' must be a list of ints, got {type(ids).__name__}")
        plain = plain_token_ids(ids)
        if plain is not None:
            return text, plain
        clean: list[int] = []
        for t in ids:  # numpy integers are fine; bools, floats, strings are not
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise ValueError(f"'prompt_token_ids' must hold ints, got {t!r}")
            clean.append(operator.index(t))
        return text, clean

    def _tokenize(self, text: str, keep: int | None) -> list[int]:
        """Token ids of a text prompt, the last `keep` if given (PromptEncoder.encode: one that
        cannot fit is refused first, untokenized, unless it is to be truncated)."""
        if self.encoder is None:  # vLLM's words first (its tests match on them)
            raise ValueError("You cannot pass text prompts when `skip_tokenizer_init=True` "
                             "(no tokenizer was loaded: pass prompt_token_ids instead)")
        return self.encoder.encode(text, keep=keep)

    def _encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens (BOS and the like)."""
        backend = rust_backend(self.tokenizer)
        if backend is not None:
            return list(rust_encode(backend, text, add_special_tokens=False))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word as written (stripped of leading spaces),
        and again after a space where that makes a different token sequence of the same length
        (a word inside text, for tokenizers that fold the space into the word's first token)."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer (skip_tokenizer_init is set): "
                             "use logit_bias or allowed_token_ids with token ids instead")
        sequences: list[list[int]] = []
        for word in bad_words:
            plain = self._encode_plain(word.lstrip())
            if not plain:
                raise ValueError("bad_words entries must tokenize to at least one token.")
            sequences.append(plain)
            spaced = self._encode_plain(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return sequences

    # ------------------------------------------------------------------ process
    def process(self, request_id: str, prompt: str | dict, params: SamplingParams,
                arrival_time: float | None = None, priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        """Validated `EngineCoreRequest` (sampling params cloned, never mutated) and the prompt
        text (None for a token-id prompt). n > 1 stays in the params (OutputProcessor.add_request
        fans it out). The request rules are `check_request`'s, the core's too."""
        check_request_id(request_id)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._parse_prompt(prompt)
        salt = _cache_salt(prompt)
        # The clone re-runs SamplingParams' checks: params changed after construction (structs
        # are mutable) are caught here too, before anything is registered or sent. The
        # front-end's own changes then go into this private copy, checked by check_request.
        params = params.clone()
        keep = truncation_length(params.truncate_prompt_tokens, self.limits.max_model_len)
        ids = self._tokenize(text, keep) if ids is None else keep_last(ids, keep)  # type: ignore[arg-type]
        for name, value in self._changes(params).items():
            setattr(params, name, value)
        problem = check_request(ids, params, self.limits, self.eos_token_id, priority)
        if problem is not None:
            raise ValueError(_in_vllm_words(ids, self.limits, priority, problem))
        request = EngineCoreRequest(request_id, ids, params, self.eos_token_id,
                                    time.time() if arrival_time is None else _arrival_time(arrival_time), priority,
                                    cache_salt=salt)
        return request, text

    def _draw_seed(self, params: SamplingParams) -> int:
        """A seed for an unseeded request, with room for its n > 1 children's seed + i within
        int64 (the core's seed type)."""
        return self._seeds.randrange(min(_SEED_LIMIT, (1 << 63) - params.n))

    def _changes(self, params: SamplingParams) -> dict[str, Any]:
        """What the front-end sets in a request's params: the bad words' token ids (always, so a
        caller's own value never travels), a drawn seed, the extra EOS ids as stop ids."""
        # extra_args stay with the caller's params: the wire to the core carries typed fields only.
        changes: dict[str, Any] = {"extra_args": None} if params.extra_args is not None else {}
        if params.bad_words:
            changes["_bad_words_token_ids"] = self._bad_words_token_ids(params.bad_words)
        elif params.bad_words_token_ids is not None:
            changes["_bad_words_token_ids"] = None
        if params.seed is None:
            changes["seed"] = self._draw_seed(params)
        if self.extra_eos_token_ids and not params.ignore_eos:
            stop_ids = list(params.stop_token_ids or ())
            extra = [t for t in self.extra_eos_token_ids if t not in stop_ids]
            if extra:
                changes["stop_token_ids"] = stop_ids + extra
        return changes

    async def process_async(self, request_id: str, prompt: str | dict, params: SamplingParams,
                            arrival_time: float | None = None,
                            priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        """`process`, tokenizing long prompts (or many bad words) in a worker thread so the event
        loop keeps serving."""
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else None)
        chars = len(text) if isinstance(text, str) else 0
        if isinstance(params, SamplingParams) and params.bad_words:
            chars += sum(map(len, params.bad_words))
        if chars > LONG_TEXT_CHARS and isinstance(params, SamplingParams) and params.seed is None:
            # Drawn here, in arrival order: in the thread it would be in finishing order.
            params = params.clone(seed=self._draw_seed(params))
        return await off_loop_if_long(chars, self.process, request_id, prompt, params, arrival_time, priority)


def _in_vllm_words(ids: list[int], limits: RequestLimits, priority: int, problem: str) -> str:
    """`check_request`'s `problem` with vLLM's sentence for it first when it is about the prompt
    (its InputProcessor's, which vLLM's tests and users' code match on), tidal's after it."""
    if check_priority(priority, limits.scheduling_policy) is not None:
        return problem  # checked first there; its words are vLLM's already
    n, most = len(ids), limits.max_model_len
    if n == 0:
        words = "The decoder prompt cannot be empty"
    elif n > most:
        words = (f"The decoder prompt (length {n}) is longer than the maximum model length of {most}. "
                 "Make sure that `max_model_len` is no smaller than the number of text tokens.")
    elif n == most:
        words = (f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) "
                 f"is longer than the maximum model length of {most}. Make sure that `max_model_len` is no "
                 "smaller than the number of text tokens (prompt + requested output tokens).")
    else:
        lo, hi = min(ids), max(ids)
        if 0 <= lo and hi < limits.vocab_size:
            return problem
        words = f"Token id {lo if lo < 0 else hi} is out of vocabulary"
    return f"{words} ({problem})"


def _arrival_time(value: object) -> float:
    """A caller's `arrival_time` (vLLM's: seconds since the epoch, as time.time()): a finite
    number, else ValueError. Anything else would reach the latency stats of every step it is
    in, where a non-number raises in the output handler."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ValueError(f"arrival_time must be a finite number of seconds since the epoch (time.time()), "
                     f"got {value!r}")


def plain_token_ids(value: object) -> list[int] | None:
    """`value` (a list or tuple) as a new list when it holds plain ints only (no bools, floats,
    strings or numpy ints), else None. One C pass (msgspec, ~4 us for 256 ids): a Python loop
    over a prompt's ids cost ~15-30 us of each request's front-end CPU, checked up to 3 times."""
    try:
        return msgspec.convert(value, list[int], strict=True)
    except msgspec.ValidationError:
        return None


_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
# vLLM's multimodal prompt keys: accepted when None (code that always sets them), else refused.
_MULTIMODAL_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"})


def _cache_salt(prompt: str | dict) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's key): a non-empty str, or absent."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"'cache_salt' must be a non-empty str, got {salt!r}")
    return salt
