"""vLLM's `vllm.tokenizers` path for get_tokenizer."""
from tidal.transformers_utils.tokenizer import get_tokenizer

__all__ = ["get_tokenizer"]
