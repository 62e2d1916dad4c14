"""Incremental detokenization: token ids in, newly *complete* text out (vLLM V1's detokenizer);
stop strings found in that text; logprobs with their tokens' text.

Byte-level BPE tokens can split a multi-byte UTF-8 character; the bytes are held back until the
character is complete, so a streamed chunk never ends in half a character. The concatenation of
every `update()` plus the final `flush()` equals `tokenizer.decode(all_ids, skip_special_tokens=...)`
(with trailing U+FFFD for bytes that never completed, as `decode` shows them).

- Fast tokenizers use `tokenizers.decoders.DecodeStream` (Rust, about half a microsecond a token).
- Other tokenizers use vLLM's prefix/read-offset method on `tokenizer.decode`.
- `detokenize=False` (or no tokenizer) gets the base class, which decodes nothing.

The stream is primed with a few prompt tokens (as vLLM does) so that decoders which strip the
first token's leading space (SentencePiece/Metaspace) see the context the output continues.

`step()`, per core output, adds stop strings (`check_stop_strings`): while streaming, the last
len(longest stop) - 1 characters are held back, since they may begin one.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsArrays
from tidal.protocol.outputs import FlatLogprobs, Logprob, PromptLogprobs, SampleLogprobs
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams

try:  # tokenizers >= 0.21
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a dependency, DecodeStream may be missing
    _RustTokenizer = None  # type: ignore[assignment,misc]
    _DecodeStream = None  # type: ignore[assignment,misc]

_REPLACEMENT_CHAR = "\ufffd"
# Prompt suffix used as decoding context: the shortest of these lengths that decodes cleanly.
_PRIME_MIN_TOKENS = 4
_PRIME_MAX_TOKENS = 24
_UTF8_CONTEXT = 4  # context tokens for a split character's text (vLLM's LogprobsProcessor: at most 4)

_STOP = FinishReason.STOP
_DELTA, _CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE

DecodeFn = Callable[[list[int]], str]


def rust_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a fast (or raw Rust) tokenizer, else None."""
    if _RustTokenizer is None or tokenizer is None:
        return None
    if isinstance(tokenizer, _RustTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, _RustTokenizer) else None


def make_decode_fn(tokenizer: Any, skip_special_tokens: bool) -> DecodeFn:
    backend = rust_backend(tokenizer)
    if backend is not None:
        rust_decode = backend.decode
        return lambda ids: rust_decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _select_prime(decode: DecodeFn, prompt_token_ids: list[int]) -> list[int]:
    """A short prompt suffix that ends on a character boundary and decodes without U+FFFD."""
    n = len(prompt_token_ids)
    for k in range(min(_PRIME_MIN_TOKENS, n), min(_PRIME_MAX_TOKENS, n) + 1) if n else ():
        suffix = prompt_token_ids[-k:]
        if _REPLACEMENT_CHAR not in decode(suffix):
            return list(suffix)
    return []


def check_stop_strings(text: str, new_chars: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """The stop string that starts earliest among those ending in the last `new_chars`
    characters of `text` (the text before was searched already), and the length to cut `text`
    to: after the stop string when `include_in_output`, else before it. None when there is none."""
    new_start = len(text) - new_chars
    best, best_s = -1, ""
    for s in stop:
        i = text.find(s, max(new_start - len(s) + 1, 0))  # it must end in the new text
        if i != -1 and (best == -1 or i < best):
            best, best_s = i, s
    if best == -1:
        return None
    return best_s, best + len(best_s) if include_in_output else best


class IncrementalDetokenizer:
    """Base class, and the no-op detokenizer of a `detokenize=False` request (whose stop
    strings, with no text, never match). Subclasses decode (`update`, `flush`); this class finds
    stop strings in what they decode (`step`)."""

    __slots__ = ("_stop", "_include_stop", "_hold", "_min_tokens", "_num_tokens", "_held")

    def __init__(self, params: SamplingParams) -> None:
        self._stop: tuple[str, ...] = tuple(params.stop or ())
        self._include_stop = params.include_stop_str_in_output
        self._hold = max(map(len, self._stop), default=1) - 1
        self._min_tokens = params.min_tokens
        self._num_tokens = 0  # counted only with stop strings (for min_tokens)
        self._held = ""  # decoded text held back (at most _hold characters between steps)

    def update(self, new_token_ids: list[int]) -> str:
        """Consume new token ids; return only the text they complete."""
        return ""

    def flush(self) -> str:
        """At the end of the request: whatever is still held back (incomplete bytes as U+FFFD)."""
        return ""

    def step(self, new_token_ids: list[int], finish: FinishReason | None) -> tuple[str, str | None]:
        """One core output: (the text to release now, the stop string that ends the request or
        None). The core's stop token (the last id of a STOP finish) shows no text unless
        include_stop_str_in_output; at the finish, everything held back is released."""
        if finish is None:
            text = self.update(new_token_ids)
        elif finish == _STOP and new_token_ids and not self._include_stop:
            text = self.update(new_token_ids[:-1]) + self.flush()
        else:
            text = self.update(new_token_ids) + self.flush()
        if not self._stop:
            return text, None
        self._num_tokens += len(new_token_ids)
        pending = self._held + text if self._held else text
        found = None
        if text and self._num_tokens > self._min_tokens:  # no stop string within min_tokens
            hit = check_stop_strings(pending, len(text), self._stop, self._include_stop)
            if hit is not None:
                found, end = hit
                pending = pending[:end]
        end = len(pending) if finish is not None or found is not None else max(len(pending) - self._hold, 0)
        self._held = pending[end:]
        return pending[:end], found

    def step_tokens(self, new_token_ids: list[int], finish: FinishReason | None) -> tuple[str, str | None, int]:
        """`step`, but a stop string that a step of several tokens completes before its last
        token ends the output at the token that completes it, as decoding one token a step
        would (speculative decoding emits several): (text, stop string, tokens used)."""
        if not self._stop or len(new_token_ids) < 2:
            text, found = self.step(new_token_ids, finish)
            return text, found, len(new_token_ids)
        parts: list[str] = []
        last = len(new_token_ids) - 1
        for j, token in enumerate(new_token_ids):
            text, found = self.step([token], finish if j == last else None)
            parts.append(text)
            if found is not None:
                return "".join(parts), found, j + 1
        return "".join(parts), None, len(new_token_ids)

    @staticmethod
    def from_request(tokenizer: Any | None, request: EngineCoreRequest) -> "IncrementalDetokenizer":
        params = request.sampling_params
        if tokenizer is None or not params.detokenize:
            return IncrementalDetokenizer(params)
        if _DecodeStream is not None and rust_backend(tokenizer) is not None:
            return FastIncrementalDetokenizer(tokenizer, request.prompt_token_ids, params)
        return SlowIncrementalDetokenizer(tokenizer, request.prompt_token_ids, params)


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """`DecodeStream` over the Rust tokenizer. Keeps the ids only to flush at the end."""

    __slots__ = ("_backend", "_decode", "_stream", "_prime", "_token_ids", "_emitted", "_pending")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        super().__init__(params)
        self._backend = rust_backend(tokenizer)
        self._decode = make_decode_fn(tokenizer, params.skip_special_tokens)
        self._stream: Any = _DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._prime = _select_prime(self._decode, prompt_token_ids)
        self._token_ids: list[int] = []
        emitted = 0
        step = self._stream.step
        for tid in self._prime:
            text = step(self._backend, tid)
            if text is not None:
                emitted += len(text)
        self._emitted = emitted  # characters the stream has returned, the prime's included
        self._pending = False  # the last step returned nothing: bytes may be held back

    def update(self, new_token_ids: list[int]) -> str:
        self._token_ids.extend(new_token_ids)
        stream = self._stream
        if stream is None:
            return self._redecode(False)
        backend = self._backend
        if len(new_token_ids) == 1:
            try:
                text = stream.step(backend, new_token_ids[0])
            except Exception:  # e.g. "Invalid prefix encountered": decode in full from now on
                self._stream = None
                return self._redecode(False)
            if text is None:
                self._pending = True
                return ""
            self._pending = False
            self._emitted += len(text)
            return text
        out: list[str] = []
        for tid in new_token_ids:
            try:
                text = stream.step(backend, tid)
            except Exception:
                self._stream = None
                return "".join(out) + self._redecode(False)
            if text is None:
                self._pending = True
            else:
                self._pending = False
                self._emitted += len(text)
                out.append(text)
        return "".join(out)

    def flush(self) -> str:
        if not self._pending and self._stream is not None:
            return ""
        return self._redecode(True)

    def _redecode(self, final: bool) -> str:
        full = self._decode(self._prime + self._token_ids)
        if not final and full.endswith(_REPLACEMENT_CHAR):
            self._pending = True
            return ""
        text = full[self._emitted:]
        self._emitted += len(text)
        self._pending = False
        return text


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """vLLM's prefix/read-offset method over `tokenizer.decode` (any tokenizer)."""

    __slots__ = ("_decode", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        super().__init__(params)
        self._decode = make_decode_fn(tokenizer, params.skip_special_tokens)
        self._ids = _select_prime(self._decode, prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def update(self, new_token_ids: list[int]) -> str:
        out: list[str] = []
        ids, decode = self._ids, self._decode
        for tid in new_token_ids:
            ids.append(tid)
            prefix_text = decode(ids[self._prefix_offset:self._read_offset])
            new_text = decode(ids[self._prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
                out.append(new_text[len(prefix_text):])
                self._prefix_offset = self._read_offset
                self._read_offset = len(ids)
        return "".join(out)

    def flush(self) -> str:
        ids = self._ids
        if self._read_offset == len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(ids)
        return new_text[len(prefix_text):]


class TokenTexts:
    """Text of single tokens for `Logprob.decoded_token` (special tokens shown), cached. A byte-
    level token that only completes a UTF-8 character begun by the tokens before it decodes
    alone to U+FFFD; `in_context` then gives what vLLM's LogprobsProcessor gives
    (`correct_decoded_token`)."""

    __slots__ = ("_decode", "_cache")

    def __init__(self, tokenizer: Any) -> None:
        self._decode = make_decode_fn(tokenizer, skip_special_tokens=False)
        self._cache: dict[int, str] = {}

    def get(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id])
        return text

    def in_context(self, token_id: int, before: Sequence[int]) -> str:
        """The token's text after the tokens `before` it in the sequence (the last
        _UTF8_CONTEXT of them are used: a UTF-8 character has at most 4 bytes)."""
        text = self.get(token_id)
        if not text.endswith(_REPLACEMENT_CHAR):
            return text
        return correct_decoded_token(self._decode, token_id, before, self.get)


def correct_decoded_token(decode: DecodeFn, token_id: int, context_token_ids: Sequence[int],
                          decode_one: Callable[[int], str] | None = None) -> str:
    """vLLM's fix-up of a token whose text alone ends in U+FFFD (bytes of a character split
    across tokens), given the tokens before it in the sequence (oldest first; never top-k
    alternatives of the same position). The shortest context (1..4 tokens) with which the
    token decodes to complete text settles it: the token's text is that decode less the text of
    the context's leading tokens that decode cleanly on their own. The trailing context tokens
    that decode alone to U+FFFD belonged to the same character and showed "" themselves, so
    their text (a space before the character, say) goes with this token. "" when no context
    completes it: the token only begins a character, or nothing precedes it."""
    one = decode_one if decode_one is not None else (lambda t: decode([t]))
    context_token_ids = list(context_token_ids[-_UTF8_CONTEXT:])
    for num in range(1, len(context_token_ids) + 1):
        context = context_token_ids[-num:]
        full = decode(context + [token_id])
        if full.endswith(_REPLACEMENT_CHAR):
            continue  # still incomplete: more context
        clean = len(context)
        while clean > 0 and one(context[clean - 1]).endswith(_REPLACEMENT_CHAR):
            clean -= 1
        prefix = decode(context[:clean]) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0  # a normalizing decoder: strip the longest common prefix instead
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def _new_container(flat: bool) -> SampleLogprobs:
    return FlatLogprobs() if flat else []


def append_logprobs(rows: SampleLogprobs | PromptLogprobs, arrays: LogprobsArrays, texts: TokenTexts | None,
                    tail: list[int]) -> float:
    """Append rows of [chosen, top-1..top-k] (chosen first, its rank from `ranks`, top-j ranked
    j, a top-k duplicate of the chosen token dropped) to `rows`; `tail` holds the tokens before
    the first row's position and is advanced by each chosen token. Returns the chosen tokens'
    summed logprob."""
    total = 0.0
    flat = rows if isinstance(rows, FlatLogprobs) else None
    for ids, lps, rank in zip(arrays.token_ids.tolist(), arrays.logprobs.tolist(), arrays.ranks.tolist()):
        chosen = ids[0]
        names = [None] * len(ids) if texts is None else [texts.in_context(t, tail) for t in ids]
        if flat is not None:
            flat.start_position()
            flat.append_entry(chosen, lps[0], rank, names[0])
            for j in range(1, len(ids)):
                if ids[j] != chosen:
                    flat.append_entry(ids[j], lps[j], j, names[j])
            flat.end_position()
        else:
            row = {chosen: Logprob(lps[0], rank, names[0])}
            for j in range(1, len(ids)):
                if ids[j] not in row:
                    row[ids[j]] = Logprob(lps[j], j, names[j])
            rows.append(row)  # type: ignore[arg-type]
        total += lps[0]
        tail.append(chosen)
        del tail[:-_UTF8_CONTEXT]
    return total


class LogprobsAccumulator:
    """One request's logprobs (vLLM's LogprobsProcessor): rows as dicts (or one FlatLogprobs
    with flat_logprobs), each output getting what its kind shows (DELTA the rows not sent yet,
    CUMULATIVE a snapshot of all, FINAL_ONLY all: it is sent once). None for what was not
    requested."""

    __slots__ = ("_rows", "_sent", "_cumulative", "_prompt", "_prompt_sent", "_kind", "_texts",
                 "_tail", "_prompt_tail")

    def __init__(self, params: SamplingParams, texts: TokenTexts | None, prompt_token_ids: Sequence[int] = ()
                 ) -> None:
        want, flat = params.logprobs is not None, params.flat_logprobs
        self._rows: SampleLogprobs | None = _new_container(flat) if want else None
        self._cumulative: float | None = 0.0 if want else None
        self._prompt: PromptLogprobs | None = None
        if params.prompt_logprobs is not None:
            self._prompt = _new_container(flat)
            self._prompt.append(None)  # position 0 has no logprob (nothing precedes it), as in vLLM
        self._sent = self._prompt_sent = 0  # DELTA: rows already handed out
        self._kind = params.output_kind
        self._texts = texts
        # The last tokens before the next sample / prompt row: context for decoded_token.
        self._tail = list(prompt_token_ids[-_UTF8_CONTEXT:])
        self._prompt_tail = list(prompt_token_ids[:1])

    def add(self, out: EngineCoreOutput) -> None:
        if out.new_logprobs is not None and self._rows is not None:
            self._cumulative += append_logprobs(self._rows, out.new_logprobs, self._texts, self._tail)  # type: ignore[operator]
        if out.new_prompt_logprobs is not None and self._prompt is not None:
            append_logprobs(self._prompt, out.new_prompt_logprobs, self._texts, self._prompt_tail)

    def sample(self) -> tuple[SampleLogprobs | None, float | None]:
        """(the sample rows this output shows, the cumulative logprob)."""
        rows = self._rows
        if rows is not None and self._kind == _DELTA:
            rows, self._sent = rows[self._sent:], len(rows)
        elif rows is not None and self._kind == _CUMULATIVE:
            rows = rows[:]
        return rows, self._cumulative

    def prompt(self) -> PromptLogprobs | None:
        """The prompt rows this output shows (DELTA: those not sent yet, None once all were)."""
        rows = self._prompt
        if rows is None or self._kind != _DELTA:
            return rows
        rows, self._prompt_sent = rows[self._prompt_sent:], len(rows)
        return rows or None
