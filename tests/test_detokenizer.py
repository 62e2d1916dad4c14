"""IncrementalDetokenizer: streamed chunks concatenate to tokenizer.decode, never split a char."""
from __future__ import annotations

import random
from typing import Any

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tidal.frontend.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
)
from tidal.frontend.entrypoints.make_model import training_corpus
from tidal.protocol.messages import EngineCoreRequest
from tidal.protocol.sampling_params import SamplingParams

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MIXED_TEXT = "def f(x):\n    return 'héllo wörld' # 日本語のテキスト 中文 😀🎉👍🏽 done\n"


def train_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE (vocab 1000) trained on stdlib sources plus some CJK and emoji."""
    texts = training_corpus(300_000)
    texts.append("日本語のテキスト。中文文本测试。😀🎉👍 émoji ünïcödé " * 20)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer()


class SlowWrapper:
    """Hides the Rust backend, to exercise the prefix/read-offset fallback."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def make_request(prompt_ids: list[int], **kw: Any) -> EngineCoreRequest:
    return EngineCoreRequest("r", prompt_ids, SamplingParams(**kw))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    parts = [detok.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    parts.append(detok.flush())
    return parts


@pytest.mark.parametrize("cls_name", ["fast", "slow"])
@pytest.mark.parametrize("skip", [True, False])
def test_text_roundtrip_emoji_cjk(tokenizer: Any, cls_name: str, skip: bool) -> None:
    ids = tokenizer.encode(MIXED_TEXT)
    tok = tokenizer if cls_name == "fast" else SlowWrapper(tokenizer)
    for prompt in ([], tokenizer.encode("Hello there, 世界")):
        detok = IncrementalDetokenizer.from_request(tok, make_request(prompt, skip_special_tokens=skip))
        assert isinstance(detok, FastIncrementalDetokenizer if cls_name == "fast" else SlowIncrementalDetokenizer)
        parts = stream(detok, ids)
        assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=skip) == MIXED_TEXT
        # Multi-byte characters are never split: each chunk decodes to whole characters.
        assert all("\ufffd" not in p for p in parts)


def test_multibyte_char_held_back(tokenizer: Any) -> None:
    # Token ids of single bytes that together form one 4-byte emoji.
    byte_ids = [tokenizer.convert_tokens_to_ids(_byte_token(b)) for b in "😀".encode()]
    detok = IncrementalDetokenizer.from_request(tokenizer, make_request([]))
    assert [detok.update([t]) for t in byte_ids] == ["", "", "", "😀"]
    assert detok.flush() == ""


def _byte_token(b: int) -> str:
    """The GPT-2 byte-to-unicode symbol of byte `b` (what ByteLevel tokens are spelt in)."""
    return bytes_to_unicode()[b]


@pytest.mark.parametrize("cls_name", ["fast", "slow"])
@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_equal_decode(tokenizer: Any, cls_name: str, skip: bool) -> None:
    rng = random.Random(1234)
    tok = tokenizer if cls_name == "fast" else SlowWrapper(tokenizer)
    vocab = len(tokenizer)
    for trial in range(300 if cls_name == "fast" else 60):
        n = rng.randrange(1, 50)
        ids = [rng.choice([rng.randrange(vocab), rng.randrange(3), rng.randrange(3, 259)]) for _ in range(n)]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        detok = IncrementalDetokenizer.from_request(tok, make_request(prompt, skip_special_tokens=skip))
        chunk = rng.choice([1, 1, 2, 5])
        got = "".join(stream(detok, ids, chunk))
        assert got == tokenizer.decode(ids, skip_special_tokens=skip), (trial, ids, prompt)


def test_skip_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi 😀<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    for skip in (True, False):
        detok = IncrementalDetokenizer.from_request(tokenizer, make_request([5], skip_special_tokens=skip))
        text = "".join(stream(detok, ids))
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)
        assert ("<|im_start|>" in text) is (not skip)


def test_detokenize_false_decodes_nothing(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer.from_request(tokenizer, make_request([1], detokenize=False))
    assert type(detok) is IncrementalDetokenizer
    assert detok.update(tokenizer.encode("hello")) == "" and detok.flush() == ""
    assert type(IncrementalDetokenizer.from_request(None, make_request([1]))) is IncrementalDetokenizer


def test_incomplete_tail_flushed_as_replacement(tokenizer: Any) -> None:
    ids = tokenizer.encode("ab") + [tokenizer.convert_tokens_to_ids(_byte_token(b)) for b in "😀".encode()[:2]]
    detok = IncrementalDetokenizer.from_request(tokenizer, make_request([]))
    assert detok.update(ids) == "ab"
    assert detok.flush() == tokenizer.decode(ids)[2:]
    assert detok.flush() == ""


def test_stream_error_falls_back_to_full_decode(tokenizer: Any) -> None:
    ids = tokenizer.encode(MIXED_TEXT)
    detok = IncrementalDetokenizer.from_request(tokenizer, make_request([]))
    assert isinstance(detok, FastIncrementalDetokenizer)
    parts = [detok.update(ids[:7])]

    class Broken:
        def step(self, *args: Any) -> str:
            raise Exception("Invalid prefix encountered")

    detok._stream = Broken()
    parts += stream(detok, ids[7:])
    assert "".join(parts) == MIXED_TEXT
