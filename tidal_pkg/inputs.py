"""vLLM's `vllm.inputs` names."""
from tidal.protocol.inputs import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
