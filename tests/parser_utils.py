"""What the reply-parser tests share (test_reasoning_parsers.py, test_tool_parsers.py): a text
split every way a stream can split it, and a parser run over the pieces."""
from __future__ import annotations

import random
from typing import Any

from tokenizers import Tokenizer


def byte_bpe_tokenizer() -> Tokenizer:
    """make_model's byte-level BPE (512 tokens: markers such as `<think>` or `<tool_call>` are
    several tokens, as with any tokenizer that lacks them as added tokens). Call it with
    TIDAL_CACHE_DIR set to the test session's cache."""
    from tidal.frontend.entrypoints.make_model import train_tokenizer_json

    return Tokenizer.from_file(train_tokenizer_json(512))


def token_pieces(tok: Tokenizer, text: str) -> list[str]:
    """`text` as a detokenizer streams it: one piece per token, a piece held while it ends in
    an incomplete UTF-8 character."""
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces, done = [], ""
    for i in range(1, len(ids) + 1):
        cur = tok.decode(ids[:i])
        if cur.endswith("\ufffd") and i < len(ids):
            continue
        assert cur.startswith(done)
        pieces.append(cur[len(done):])
        done = cur
    assert done == text
    return pieces


def splits(tok: Tokenizer, text: str) -> dict[str, list[str]]:
    """The text whole, per character, per token and in random chunks (5 seeds)."""
    out = {"whole": [text], "chars": list(text), "tokens": token_pieces(tok, text)}
    for seed in range(5):
        rng, chunks, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            chunks.append(text[i:i + n])
            i += n
        out[f"random{seed}"] = chunks
    return out


def run(parser: Any, pieces: list[str]) -> list[Any]:
    """The events of `parser` fed `pieces`, then finished."""
    events: list[Any] = []
    for p in pieces:
        events += parser.feed(p)
    return events + parser.finish()
