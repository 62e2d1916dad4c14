"""Starting a front-end: its tokenizer (only the front-end touches text) and its core client."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Generic, Protocol, TypeVar

from tidal.frontend.input_processor import InputProcessor
from tidal.frontend.output_processor import OutputProcessor
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo, check_model_architecture


class _CoreClient(Protocol):
    def wait_ready(self) -> ResolvedEngineInfo: ...

    def shutdown(self) -> None: ...


C = TypeVar("C", bound=_CoreClient)


@dataclass
class FrontEndParts(Generic[C]):
    client: C
    tokenizer: Any
    info: ResolvedEngineInfo
    input_processor: InputProcessor
    output_processor: OutputProcessor


def start_front_end(config: EngineConfig, make_client: Callable[[EngineConfig], C]) -> FrontEndParts[C]:
    """What `LLM` and `AsyncLLM` share: check the model (a ValueError before any process
    starts), start the core client (the core loads its model while this process loads the
    tokenizer), wait for the core's limits, and build the input/output processors on them."""
    if config.model and os.path.isdir(config.model):
        check_model_architecture(config.model)
    client = make_client(config)
    try:
        tokenizer = load_tokenizer(config)
        info = client.wait_ready()
    except BaseException:
        client.shutdown()
        raise
    inputs = InputProcessor(tokenizer, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                            max_logprobs=config.max_logprobs)
    return FrontEndParts(client, tokenizer, info, inputs, OutputProcessor(tokenizer))


def load_tokenizer(config: EngineConfig) -> Any:
    """The Hugging Face tokenizer of `config.tokenizer_path` (a fast one when it exists)."""
    path = config.tokenizer_path
    if not path:
        raise ValueError("no model or tokenizer given")
    # "org/name" may be a hub id (resolved through the HF cache); an absolute or explicitly
    # relative path is a local directory, and a clear message beats the hub's validation error.
    if path.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(path)):
        raise ValueError(f"model directory {path!r} does not exist")
    if os.path.isdir(path) and not any(
            os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                            "tokenizer.model", "vocab.json")):
        raise ValueError(f"no tokenizer files in {path!r}; pass tokenizer=... to name another directory")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings from the Rust pool
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
