"""A tokenizer for the front-end that loads in milliseconds: `tokenizers` reads `tokenizer.json`.

`transformers` 5 spends ~1.5 s importing itself (it scans every model package to build its lazy
import table) and `AutoTokenizer` then imports torch: the front-end paid seconds of start-up to
get the very same Rust tokenizer. `LeanTokenizer` builds that Rust tokenizer as transformers'
`TokenizersBackend` (what `PreTrainedTokenizerFast` is in transformers 5) would, and answers what
the front-end uses on its hot paths itself: encode, decode, the special tokens, token <-> id.
Anything else (chat templates, batch encoding, a user's call on `llm.get_tokenizer()`) goes to
the real transformers tokenizer, loaded on first use, so nothing a user could call is missing.

`load_lean_tokenizer` returns None whenever the directory holds something this class does not
reproduce exactly (another tokenizer class, special tokens outside tokenizer.json, truncation or
padding, split_special_tokens, remote code); the caller then loads transformers' tokenizer.
tests/test_startup.py checks the two against each other.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

# Tokenizer classes that transformers loads as a plain TokenizersBackend over tokenizer.json,
# without model-specific changes to the pre-tokenizer or normalizer.
_PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
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


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _chat_template(path: str, tok_cfg: dict[str, Any]) -> str | None:
    """The default chat template as transformers 5 finds it: chat_template.jinja, then
    chat_template.json, then tokenizer_config.json. A dict of named templates: "default"."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template",
                                                                        tok_cfg.get("chat_template"))
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


class LeanTokenizer:
    """The front-end's view of a fast tokenizer; see the module docstring."""

    is_fast = True

    def __init__(self, path: str, backend: Any, tok_cfg: dict[str, Any], specials: dict[str, str | None],
                 chat_template: str | None, load_full: Callable[[], Any]) -> None:
        self._tokenizer = backend  # the name transformers uses: detokenizer.rust_backend finds it
        self.name_or_path = path
        self.chat_template = chat_template
        self.model_max_length = int(tok_cfg.get("model_max_length", int(1e30)))
        self.clean_up_tokenization_spaces = bool(tok_cfg.get("clean_up_tokenization_spaces", False))
        for name in _NAMED_SPECIAL:
            setattr(self, name, specials.get(name))
        extra = tok_cfg.get("additional_special_tokens") or tok_cfg.get("extra_special_tokens") or []
        self.additional_special_tokens = [t for t in map(_token_text, extra) if t]
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
        named = [getattr(self, n) for n in _NAMED_SPECIAL]
        return list(dict.fromkeys(t for t in [*named, *self.additional_special_tokens] if t))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in map(self._id, self.all_special_tokens) if i is not None]

    # ---------------------------------------------------------------- text
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:  # truncation, padding, return_tensors, pairs...: transformers' job
            return self._full_tokenizer().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return rust_encode(self._tokenizer, text, add_special_tokens)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs or self.clean_up_tokenization_spaces:
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
        if name.startswith("__") or name in ("_full", "_full_lock", "_load_full", "_tokenizer"):
            raise AttributeError(name)  # copy/pickle probes, and a half-built instance
        return getattr(self._full_tokenizer(), name)

    def __repr__(self) -> str:
        return f"LeanTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"


def load_lean_tokenizer(path: str, load_full: Callable[[], Any]) -> LeanTokenizer | None:
    """A LeanTokenizer for the local directory `path`, or None where it would not behave
    exactly as transformers' tokenizer (the caller then loads that one)."""
    tok_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_json):
        return None
    tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    if tok_cfg.get("tokenizer_class") not in _PLAIN_CLASSES or "auto_map" in tok_cfg:
        return None
    if tok_cfg.get("split_special_tokens") or tok_cfg.get("add_prefix_space") is not None:
        return None
    if tok_cfg.get("add_bos_token") or tok_cfg.get("add_eos_token"):
        return None  # when transformers adds them depends on its version: let it decide
    with open(tok_json, encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return None
    added = {t["content"]: bool(t.get("special")) for t in spec.get("added_tokens", [])}
    for entry in (tok_cfg.get("added_tokens_decoder") or {}).values():
        # transformers adds these to the Rust tokenizer when missing; here they must be there.
        if added.get(entry.get("content")) != bool(entry.get("special")):
            return None
    specials_map = _read_json(os.path.join(path, "special_tokens_map.json"))
    specials: dict[str, str | None] = {}
    for name in _NAMED_SPECIAL:
        value, mapped = _token_text(tok_cfg.get(name)), _token_text(specials_map.get(name))
        if value is not None and mapped is not None and value != mapped:
            return None
        token = value if value is not None else mapped
        if token is not None and token not in added:
            return None  # transformers would add it as a new token
        specials[name] = token
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_str(json.dumps(spec))
    if "add_bos_token" in tok_cfg or "add_eos_token" in tok_cfg or backend.post_processor is None:
        # TokenizersBackend.update_post_processor with neither bos nor eos to add.
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    backend.no_truncation()
    backend.no_padding()
    return LeanTokenizer(path, backend, tok_cfg, specials, _chat_template(path, tok_cfg), load_full)
