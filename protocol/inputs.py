"""vLLM's prompt types (vllm.inputs): the dicts `LLM.generate` and `AsyncLLM.generate` take.

They are TypedDicts, so a plain dict with the same keys is the same prompt. (Required keys in a
base class, optional ones in a `total=False` subclass: `NotRequired` needs Python 3.11.)"""
from typing import TypedDict, Union


class _TextRequired(TypedDict):
    prompt: str


class TextPrompt(_TextRequired, total=False):
    cache_salt: str  # only requests with the same salt share prefix-cache blocks


class _TokensRequired(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensRequired, total=False):
    prompt: str  # the text, when known (RequestOutput.prompt)
    cache_salt: str


PromptType = Union[str, TextPrompt, TokensPrompt]
