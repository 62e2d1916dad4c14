"""A tokenizer for the front-end that loads in milliseconds: `tokenizers` reads `tokenizer.json`.

`transformers` 5 spends ~1.5 s importing itself (it scans every model package to build its lazy
import table) and `AutoTokenizer` then imports torch: the front-end paid seconds of start-up to
get the very same Rust tokenizer. `LeanTokenizer` builds that Rust tokenizer as transformers'
`TokenizersBackend` (what `PreTrainedTokenizerFast` is in transformers 5) would, and answers what
the front-end uses on its hot paths itself: encode, decode, the special tokens, token <-> id.
Anything else (chat templates, batch encoding, a user's call on `llm.get_tokenizer()`) goes to
the real transformers tokenizer, loaded on first use, so nothing a user could call is missing.

Which Rust pipeline that is, is not read off the files: transformers' tokenizer class may rebuild
parts of it (frontend/tokenizer_verdict.py). The first start on a directory loads transformers'
tokenizer, records what it runs and caches that verdict; later starts build the same pipeline
from the file plus the verdict's patch without importing transformers. `load_lean_tokenizer`
returns None where the verdict refuses (a class with Python of its own, remote code, truncation,
clean-up of decoded text); the caller then uses transformers' tokenizer.
tests/test_tokenizer_parity.py and tests/test_startup.py check the two against each other.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from tidal.frontend.tokenizer_verdict import NAMED_SPECIAL, build_backend, judge, read_verdict, verdict_key, write_verdict

logger = logging.getLogger(__name__)
# Longer texts (characters) are tokenized in a worker thread, so the event loop keeps serving,
# and by `encode_batch`, which releases the GIL while it works (`encode` holds it: a thread
# encoding a 20 MB prompt with `encode` stalled every stream of the server for 35 s).
LONG_TEXT_CHARS = 2000
# Unicode normalization shrinks text by at most this factor (NFC composes up to four code points
# into one, e.g. U+1F82); see prompt_char_limit.
_NORMALIZER_SHRINK = 4


def rust_encode(backend: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text` by a `tokenizers.Tokenizer`, releasing the GIL for long texts."""
    if len(text) > LONG_TEXT_CHARS:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int:
    """Characters beyond which a text prompt cannot fit in `max_model_len` tokens, so it is
    refused without tokenizing it (which would cost seconds per megabyte). One token covers at
    most as many characters as its longest vocabulary entry (added tokens included; byte-level
    entries spell one character per byte, so they overstate), and Unicode normalization shrinks
    text by at most _NORMALIZER_SHRINK: no prompt that fits is refused, for tokenizers that keep
    every character (byte-level BPE, SentencePiece). Those that drop some (BERT's whitespace
    pre-tokenizer, T5's collapsing of repeated spaces, control-character cleaning) could refuse
    a prompt made mostly of what they drop. The bound is loose (the longest token x 4): it stops
    megabytes, not a prompt a few times too long, which tokenizes fast enough."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_model_len * max(longest, 1) * _NORMALIZER_SHRINK


def check_prompt_chars(num_chars: int, limit: int, max_model_len: int) -> None:
    """ValueError when a text prompt of `num_chars` characters cannot fit (prompt_char_limit)."""
    if num_chars > limit:
        raise ValueError(f"prompt of {num_chars} characters is too long for max_model_len {max_model_len}: "
                         f"no text over {limit} characters fits in that many tokens; shorten it, or set "
                         f"truncate_prompt_tokens to keep its end")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


class LeanTokenizer:
    """The front-end's view of a fast tokenizer; see the module docstring."""

    is_fast = True

    def __init__(self, path: str, backend: Any, verdict: dict[str, Any], load_full: Callable[[], Any]) -> None:
        self._tokenizer = backend  # the name transformers uses: detokenizer.rust_backend finds it
        self.name_or_path = path
        self.chat_template: str | None = verdict["chat_template"]
        self.model_max_length = verdict["model_max_length"]
        self.clean_up_tokenization_spaces: bool = verdict["clean_up_tokenization_spaces"]
        for name in NAMED_SPECIAL:
            setattr(self, name, verdict["specials"][name])
        self._all_special_tokens: list[str] = list(verdict["all_special_tokens"])
        self._load_full = load_full
        self._full: Any = None
        self._full_lock = threading.Lock()

    # ---------------------------------------------------------------- ids
    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self._all_special_tokens)

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in map(self._id, self.all_special_tokens) if i is not None]

    # ---------------------------------------------------------------- text
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:  # truncation, padding, return_tensors, pairs...: transformers' job
            return self._full_tokenizer().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return rust_encode(self._tokenizer, text, add_special_tokens)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:  # clean_up_tokenization_spaces=...: transformers' job
            return self._full_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        if isinstance(tokens, str):
            return self._id(tokens)
        return [self._id(t) for t in tokens]

    # ---------------------------------------------------------------- the rest
    def _full_tokenizer(self) -> Any:
        """transformers' own tokenizer of the same directory, loaded once, on first need."""
        with self._full_lock:
            if self._full is None:
                self._full = self._load_full()
            return self._full

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        # transformers renders templates with its own jinja2 environment, message normalisation
        # and tool handling; its tokenizer does it, so rendered prompts are byte-identical.
        return self._full_tokenizer().apply_chat_template(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._full_tokenizer()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_full", "_full_lock", "_load_full", "_tokenizer", "_all_special_tokens"):
            raise AttributeError(name)  # copy/pickle probes, and a half-built instance
        return getattr(self._full_tokenizer(), name)

    def __repr__(self) -> str:
        return f"LeanTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"


def _cached(path: str, spec: dict[str, Any], key: str, load_full: Callable[[], Any]) -> LeanTokenizer | None:
    verdict = read_verdict(key)
    if verdict is None:
        return None
    try:
        backend = build_backend(spec, verdict)
    except Exception:  # a patch this tokenizers version cannot read: judged afresh
        logger.warning("cached tokenizer verdict for %s does not load; comparing with transformers again", path)
        return None
    return LeanTokenizer(path, backend, verdict, load_full)


def load_lean_tokenizer(path: str, load_full: Callable[[], Any]) -> LeanTokenizer | None:
    """A LeanTokenizer for the local directory `path`, or None where it would not behave
    exactly as transformers' tokenizer (the caller then loads that one). Without a cached
    verdict this calls `load_full` once and hands the tokenizer it got to the LeanTokenizer."""
    tok_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_json):
        return None
    if "auto_map" in _read_json(os.path.join(path, "tokenizer_config.json")):
        return None  # remote code: what it runs may change without the files changing
    with open(tok_json, encoding="utf-8") as f:
        spec = json.load(f)
    key = verdict_key(path)
    lean = _cached(path, spec, key, load_full)
    if lean is not None:
        return lean
    full = load_full()
    verdict = judge(spec, full)
    if verdict is None:
        logger.info("tokenizer of %s: using transformers' %s (its pipeline is not reproduced)", path,
                    type(full).__name__)
        return None
    write_verdict(key, verdict)
    return LeanTokenizer(path, build_backend(spec, verdict), verdict, lambda: full)
