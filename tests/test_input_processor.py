"""InputProcessor: prompt forms, seeding, eos, and every ValueError (raised before queueing)."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tidal.frontend.input_processor import InputProcessor
from tidal.protocol.messages import EngineCoreRequest
from tidal.protocol.request_rules import check_request
from tidal.protocol.sampling_params import SamplingParams

try:
    from test_detokenizer import train_tokenizer
except ImportError:  # tests/ made a package
    from tests.test_detokenizer import train_tokenizer  # type: ignore[no-redef]

MAX_LEN = 64


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer()


@pytest.fixture
def ip(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, max_model_len=MAX_LEN, vocab_size=len(tokenizer), max_logprobs=5)


def test_prompt_forms(ip: InputProcessor, tokenizer: Any) -> None:
    p = SamplingParams(max_tokens=8)
    text = "Hello, 世界 😀"
    r1, t1 = ip.process("a", text, p)
    r2, t2 = ip.process("b", {"prompt": text}, p)
    r3, t3 = ip.process("c", {"prompt_token_ids": r1.prompt_token_ids}, p)
    r4, _ = ip.process("d", {"prompt_token_ids": [np.int64(5), 6]}, p)
    assert isinstance(r1, EngineCoreRequest) and r1.request_id == "a"
    assert r1.prompt_token_ids == tokenizer(text).input_ids == r2.prompt_token_ids == r3.prompt_token_ids
    assert (t1, t2, t3) == (text, text, None)
    assert r4.prompt_token_ids == [5, 6] and all(type(t) is int for t in r4.prompt_token_ids)
    assert ip.process("t", {"prompt_token_ids": (5, 6)}, p)[0].prompt_token_ids == [5, 6]
    for bad in ([5, True], [5, 6.0], [5, "6"]):
        with pytest.raises(ValueError, match="'prompt_token_ids' must hold ints"):
            ip.process("x", {"prompt_token_ids": bad}, p)
    assert r1.eos_token_id == tokenizer.eos_token_id == 0
    assert r1.arrival_time > 0 and ip.process("e", "x", p, arrival_time=7.0)[0].arrival_time == 7.0


def test_seed_drawn_on_a_clone(ip: InputProcessor) -> None:
    user = SamplingParams(max_tokens=4, n=3, temperature=0.0)  # n > 1 greedy: allowed
    r1, _ = ip.process("a", "hi", user)
    r2, _ = ip.process("b", "hi", user)
    assert user.seed is None  # never mutated
    s1, s2 = r1.sampling_params.seed, r2.sampling_params.seed
    assert isinstance(s1, int) and 0 <= s1 < 2**63 and s1 != s2
    assert r1.sampling_params.n == 3
    seeded = SamplingParams(max_tokens=4, seed=7)
    assert ip.process("c", "hi", seeded)[0].sampling_params.seed == 7


def test_max_tokens_none_means_up_to_max_model_len(ip: InputProcessor) -> None:
    req, _ = ip.process("a", {"prompt_token_ids": [1] * (MAX_LEN - 1)}, SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens is None


def test_max_tokens_past_the_window_is_accepted(ip: InputProcessor) -> None:
    """As vLLM: the engine caps the request at max_model_len (finish_reason "length")."""
    req, _ = ip.process("a", {"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=5))
    assert req.sampling_params.max_tokens == 5


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": [1] * (MAX_LEN + 1)}, SamplingParams(max_tokens=1),
     f"prompt length {MAX_LEN + 1} exceeds max_model_len {MAX_LEN}"),
    ({"prompt_token_ids": [1] * MAX_LEN}, SamplingParams(max_tokens=None), f"max_model_len {MAX_LEN}"),
    ({"prompt_token_ids": [1] * MAX_LEN}, SamplingParams(max_tokens=1), "leaves no room to generate"),
    ({"prompt_token_ids": [1, 1000]}, SamplingParams(), r"out of vocabulary range \[0, 1000\)"),
    ({"prompt_token_ids": [-1, 3]}, SamplingParams(), r"\[0, 1000\)"),
    ({"prompt_token_ids": [1, 2.0]}, SamplingParams(), "must hold ints"),
    ({"prompt_token_ids": [1, True]}, SamplingParams(), "must hold ints"),
    ({"prompt_token_ids": ["1"]}, SamplingParams(), "must hold ints"),
    ({"prompt_token_ids": "1 2"}, SamplingParams(), "list of ints"),
    ({"prompt": "hi", "images": []}, SamplingParams(), "unknown prompt key"),
    ({}, SamplingParams(), "needs 'prompt' or 'prompt_token_ids'"),
    ({"prompt": 3}, SamplingParams(), "'prompt' must be a str"),
    ([1, 2, 3], SamplingParams(), "prompt must be"),
    ("hi", SamplingParams(logprobs=6), "Requested sample logprobs of 6, which is greater than max allowed: 5"),
    ("hi", SamplingParams(prompt_logprobs=9), "Requested prompt logprobs of 9, which is greater than max allowed: 5"),
    ("hi", SamplingParams(logprobs=-1), "Requested sample logprobs of 1000, which is greater than max allowed: 5"),
    ("hi", SamplingParams(allowed_token_ids=[]), "allowed_token_ids is not None and empty!"),
    ("hi", SamplingParams(allowed_token_ids=[3, 1000]), r"allowed_token_ids contains out-of-vocab token id!"),
    ("hi", SamplingParams(logit_bias={-1: 1.0}), r"token_id\(s\) \[-1\] in logit_bias contain out-of-vocab"),
    ("hi", SamplingParams(stop_token_ids=[1000]), r"token_id\(s\) \[1000\] in stop_token_ids"),
    ("hi", SamplingParams(truncate_prompt_tokens=MAX_LEN + 1), "is greater than max_model_len"),
])
def test_value_errors(ip: InputProcessor, prompt: Any, params: SamplingParams, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ip.process("r", prompt, params)


@pytest.mark.parametrize("bad", ["1700000000", True, float("nan"), float("inf"), [1.0]])
def test_arrival_time_must_be_a_finite_number(ip: InputProcessor, bad: Any) -> None:
    """A non-number would reach the latency stats of the steps it is in (and raise there)."""
    with pytest.raises(ValueError, match="arrival_time must be a finite number"):
        ip.process("r", "hi", SamplingParams(), arrival_time=bad)
    assert ip.process("r", "hi", SamplingParams(), arrival_time=1_700_000_000)[0].arrival_time == 1.7e9


def test_bad_request_id_and_params(ip: InputProcessor) -> None:
    with pytest.raises(ValueError, match="request_id"):
        ip.process("", "hi", SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        ip.process("r", "hi", {"max_tokens": 3})  # type: ignore[arg-type]


def test_long_text_prompt_over_limit(ip: InputProcessor) -> None:
    with pytest.raises(ValueError, match=f"exceeds max_model_len {MAX_LEN}"):
        ip.process("r", "word " * 200, SamplingParams())


def test_generation_config_eos(tokenizer: Any, tmp_path: Any) -> None:
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ip = InputProcessor(tok, max_model_len=MAX_LEN, vocab_size=len(tok), max_logprobs=5)
    req, _ = ip.process("r", "hi", SamplingParams(stop_token_ids=[7]))
    assert req.eos_token_id == 0 and req.sampling_params.stop_token_ids == [7, 2]
    req, _ = ip.process("r", "hi", SamplingParams(ignore_eos=True))
    assert req.sampling_params.stop_token_ids == []
    ip2 = InputProcessor(tok, max_model_len=MAX_LEN, vocab_size=len(tok), max_logprobs=5, eos_token_id=2)
    assert ip2.process("r", "hi", SamplingParams())[0].eos_token_id == 2


async def test_process_async(ip: InputProcessor, tokenizer: Any) -> None:
    big = InputProcessor(tokenizer, max_model_len=100_000, vocab_size=len(tokenizer), max_logprobs=5)
    text = "def f(x):\n    return x * 2\n" * 200  # > 2000 chars: tokenized in a thread
    req, t = await big.process_async("r", text, SamplingParams())
    assert t == text and req.prompt_token_ids == tokenizer(text).input_ids
    req, t = await ip.process_async("s", {"prompt_token_ids": [1, 2]}, SamplingParams())
    assert t is None and req.prompt_token_ids == [1, 2]
    with pytest.raises(ValueError, match="empty"):
        await ip.process_async("r", "", SamplingParams())


def test_bad_words_tokenized_as_vllm(ip: InputProcessor, tokenizer: Any) -> None:
    """Each bad word as written (leading spaces stripped), and after a space where that gives a
    different first token and the same length (vLLM's update_from_tokenizer)."""
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    words = ["hello", "  world", "世界"]
    req, _ = ip.process("a", "hi", SamplingParams(bad_words=words))
    expected: list[list[int]] = []
    for w in words:
        plain, spaced = enc(w.lstrip()), enc(" " + w.lstrip())
        expected.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            expected.append(spaced)
    assert req.sampling_params.bad_words_token_ids == expected
    assert any(len(seq) > 1 for seq in expected)  # a multi-token bad word is exercised
    no_tok = InputProcessor(None, max_model_len=MAX_LEN, vocab_size=1000, max_logprobs=5)
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        no_tok.process("b", {"prompt_token_ids": [1, 2]}, SamplingParams(bad_words=["x"]))


def test_bad_word_token_ids_range_checked(ip: InputProcessor) -> None:
    params = SamplingParams()
    params._bad_words_token_ids = [[5, 1000]]  # as a client could send it to the core
    problem = check_request([1, 2], params, ip.limits)
    assert problem is not None and "specified as bad: [1000]" in problem
    # The front-end sets the field from bad_words alone: a caller's own value never travels.
    assert ip.process("a", "hi", params)[0].sampling_params.bad_words_token_ids is None


def test_truncate_prompt_tokens_keeps_the_last(ip: InputProcessor) -> None:
    def truncated(ids: list[int], keep: int) -> list[int]:
        return ip.process("a", {"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=keep))[0].prompt_token_ids

    assert truncated(list(range(10)), 3) == [7, 8, 9]
    assert truncated(list(range(10)), 20) == list(range(10))
    assert truncated(list(range(MAX_LEN - 1)), -1) == list(range(MAX_LEN - 1))  # -1: max_model_len
    with pytest.raises(ValueError, match=f"prompt length {MAX_LEN} leaves no room"):  # cut to MAX_LEN
        truncated(list(range(MAX_LEN + 5)), -1)


def test_truncate_text_prompt_and_validation(ip: InputProcessor, tokenizer: Any) -> None:
    text = "Hello, 世界 😀 and more words"
    full = tokenizer(text).input_ids
    req, prompt = ip.process("a", text, SamplingParams(truncate_prompt_tokens=4))
    assert req.prompt_token_ids == full[-4:] and prompt == text
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1 or -1"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_extra_args_kept_by_caller_not_sent(ip: InputProcessor) -> None:
    user = SamplingParams(extra_args={"plugin": {"x": [1, 2]}})
    req, _ = ip.process("a", "hi", user)
    assert req.sampling_params.extra_args is None and user.extra_args == {"plugin": {"x": [1, 2]}}


def test_whole_vocab_logprobs_within_unlimited_max_logprobs(tokenizer: Any) -> None:
    ip = InputProcessor(tokenizer, max_model_len=MAX_LEN, vocab_size=len(tokenizer), max_logprobs=-1)
    req, _ = ip.process("a", "hi", SamplingParams(logprobs=-1, prompt_logprobs=-1))
    assert req.sampling_params.logprobs == -1


# ------------------------------------------------------------------ long text prompts
def _texts(tokenizer: Any) -> list[str]:
    """Texts that pack many characters into few tokens, and the reverse."""
    vocab = tokenizer.get_vocab()
    longest = tokenizer.decode([vocab[max(vocab, key=len)]])  # its text (vocab keys spell bytes)
    specials = "".join(tokenizer.all_special_tokens)
    return ["ab " * 3000, "\u00e9\u4f60\U0001F600" * 1500, specials * 400, longest * 900,
            "".join(chr(0x1100 + i % 19) + chr(0x1161 + i % 21) for i in range(3000))]  # Hangul jamo


def test_prompt_char_limit_never_refuses_what_fits(tokenizer: Any) -> None:
    """The bound a long text prompt is refused by, untokenized: it holds against the tokenizer's
    own token counts on texts built to beat it (the longest token repeated, special tokens,
    multibyte and composable characters)."""
    from tidal.frontend.tokenizer import prompt_char_limit

    for text in _texts(tokenizer):
        n_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        # Fits iff n_tokens <= max_model_len: the limit at exactly that length must admit it.
        assert len(text) <= prompt_char_limit(tokenizer, n_tokens), (text[:20], n_tokens)


def test_prompt_char_limit_allows_for_unicode_composition() -> None:
    """NFC composes up to four code points into one (U+1F82 is alpha + three combining marks):
    a tokenizer with one character per token and an NFC normalizer, fed the decomposed form,
    makes one token of every four characters, and such a prompt that fits is not refused."""
    import unicodedata

    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    from tidal.frontend.tokenizer import prompt_char_limit

    composed = "\u1f82"
    tok = Tokenizer(models.WordLevel({composed: 0, "a": 1}, unk_token="a"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    text = unicodedata.normalize("NFD", composed) * 1000
    assert len(text) == 4000 and tok.encode(text).ids == [0] * 1000  # 1000 tokens: fits 1000
    assert len(text) <= prompt_char_limit(tok, 1000)


def test_long_prompt_that_cannot_fit_is_refused_untokenized(ip: InputProcessor, tokenizer: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    text = "ab " * 20000
    assert len(tokenizer.encode(text)) > MAX_LEN  # the reference: it really does not fit
    calls: list[int] = []
    assert ip.encoder is not None
    tokenize = ip.encoder.tokenize
    monkeypatch.setattr(ip.encoder, "tokenize", lambda t, special=True: calls.append(len(t)) or tokenize(t, special))
    with pytest.raises(ValueError, match=rf"prompt of {len(text)} characters is too long for max_model_len {MAX_LEN}"):
        ip.process("r", text, SamplingParams())
    assert calls == []  # refused before tokenizing
    # Asked to keep its end, it is tokenized and truncated like any other prompt.
    req, _ = ip.process("r", text, SamplingParams(truncate_prompt_tokens=8))
    assert req.prompt_token_ids == list(tokenizer.encode(text))[-8:] and calls == [len(text)]
    with pytest.raises(ValueError, match="truncate_prompt_tokens value"):  # out of range: named, untokenized
        ip.process("r", text, SamplingParams(truncate_prompt_tokens=MAX_LEN + 1))
    assert calls == [len(text)]


def test_long_text_encoding_releases_the_gil(tokenizer: Any) -> None:
    """A long prompt is tokenized in a worker thread; `encode_batch` lets the event loop's thread
    run meanwhile (`encode` holds the GIL throughout: the loop's thread then gets at most the
    moments around the call), and gives the same ids."""
    import threading
    import time

    from tidal.frontend.detokenizer import rust_backend
    from tidal.frontend.tokenizer import LONG_TEXT_CHARS, rust_encode

    backend = rust_backend(tokenizer)
    text = "the quick brown fox " * 60000
    assert len(text) > LONG_TEXT_CHARS

    def spin(seconds: float, done: threading.Event | None = None) -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end and not (done is not None and done.is_set()):
            n += 1
        return n

    rate = spin(0.1) / 0.1  # spins per second with the GIL to itself
    done, result = threading.Event(), []
    worker = threading.Thread(target=lambda: (result.append(rust_encode(backend, text)), done.set()))
    t0 = time.perf_counter()
    worker.start()
    spins = spin(60.0, done)
    seconds = time.perf_counter() - t0
    worker.join()
    assert result[0] == backend.encode(text).ids
    assert seconds > 0.2, "the text encodes too fast to tell"
    # Released: the spinning thread keeps most of its pace (it shares 2 cores with the worker);
    # held: it would only spin before the call starts and after it ends.
    assert spins > 0.25 * rate * seconds, (spins, rate, seconds)
