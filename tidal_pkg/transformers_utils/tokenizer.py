"""vLLM's `get_tokenizer`: the checkpoint's `transformers` tokenizer (what vLLM's tests and
users tokenize with before passing token ids). tidal's own front-end tokenizes the same text
to the same ids (see tidal.frontend.tokenizer)."""
from __future__ import annotations

from typing import Any


def get_tokenizer(tokenizer_name: str, *args: Any, tokenizer_mode: str = "auto", trust_remote_code: bool = False,
                  revision: str | None = None, download_dir: str | None = None, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    if tokenizer_mode not in ("auto", "hf"):
        raise ValueError(f"tokenizer_mode={tokenizer_mode!r}: tidal loads tokenizers with transformers "
                         "('auto' or 'hf')")
    return AutoTokenizer.from_pretrained(tokenizer_name, *args, trust_remote_code=trust_remote_code,
                                         revision=revision, cache_dir=download_dir, **kwargs)


__all__ = ["get_tokenizer"]
