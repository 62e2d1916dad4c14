"""Loading the front-end's tokenizer (only the front-end touches text)."""
from __future__ import annotations

import os
from typing import Any

from tidal.protocol.config import EngineConfig, check_model_architecture


def load_tokenizer(config: EngineConfig) -> Any:
    """The Hugging Face tokenizer of `config.tokenizer_path` (a fast one when it exists)."""
    path = config.tokenizer_path
    if not path:
        raise ValueError("no model or tokenizer given")
    # "org/name" may be a hub id (resolved through the HF cache); an absolute or explicitly
    # relative path is a local directory, and a clear message beats the hub's validation error.
    if path.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(path)):
        raise ValueError(f"model directory {path!r} does not exist")
    if os.path.isdir(config.model):
        # Both front-ends load the tokenizer before starting a core: an unsupported model fails
        # here, as a ValueError, without a process started for nothing.
        check_model_architecture(config.model)
    if os.path.isdir(path) and not any(
            os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                            "tokenizer.model", "vocab.json")):
        raise ValueError(f"no tokenizer files in {path!r}; pass tokenizer=... to name another directory")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings from the Rust pool
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
