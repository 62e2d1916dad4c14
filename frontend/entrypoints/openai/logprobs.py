"""Logprobs in the shapes OpenAI's and vLLM's responses give them: completions' (per token its
text, logprob, top-k by text and character offset), chat's (per token its text, logprob, UTF-8
bytes and top-k) and vLLM's prompt_logprobs. A logprob of -inf is sent as -9999.0 (JSON has no
infinity; vLLM's floor)."""
from __future__ import annotations

from typing import Any

from tidal.frontend.entrypoints.openai.protocol import (
    ChatLogprobContent,
    ChatLogprobs,
    ChatTopLogprob,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
)
from tidal.protocol.outputs import RequestOutput

_FLOOR = -9999.0


def prompt_logprobs_out(out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt position, token id -> {logprob, rank, decoded_token}."""
    if out.prompt_logprobs is None:
        return None
    return [None if not pos else {t: PromptLogprob(max(lp.logprob, _FLOOR), lp.rank, lp.decoded_token)
                                  for t, lp in pos.items()}
            for pos in out.prompt_logprobs]


def chat_logprobs(token_ids: list[int], positions: Any, k: int, tokenizer: Any, as_ids: bool = False) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token its text ("token_id:N" with `as_ids`), logprob, UTF-8
    bytes and the top `k`."""
    def text(t: int, decoded: str | None) -> str:
        return decoded if decoded is not None else tokenizer.decode([t])

    def shown(t: int, decoded: str | None) -> str:
        return f"token_id:{t}" if as_ids else text(t, decoded)

    content = []
    for token_id, pos in zip(token_ids, positions):
        chosen = pos.get(token_id) if pos else None
        decoded = chosen.decoded_token if chosen is not None else None
        top = [ChatTopLogprob(s := shown(t, lp.decoded_token), max(lp.logprob, _FLOOR),
                              list(s.encode("utf-8", errors="replace")))
               for j, (t, lp) in enumerate(pos.items()) if j < k] if pos else []
        lp = max(chosen.logprob, _FLOOR) if chosen is not None else _FLOOR
        # `bytes` are the token's own text's, also when it is shown as "token_id:N" (vLLM's)
        content.append(ChatLogprobContent(shown(token_id, decoded), lp,
                                          list(text(token_id, decoded).encode("utf-8", errors="replace")), top))
    return ChatLogprobs(content)


class LogprobsBuilder:
    """OpenAI's completion logprobs (vLLM's _create_completion_logprobs): per token its text,
    logprob, the top `k` (plus the chosen one) by text, and its character offset in the text;
    `as_ids` (return_tokens_as_token_ids): each token's text is "token_id:N"."""

    def __init__(self, tokenizer: Any, k: int, as_ids: bool = False) -> None:
        self.tokenizer, self.k, self.as_ids = tokenizer, k, as_ids

    def _text(self, token_id: int, decoded: str | None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        if decoded is not None:
            return decoded
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def build(self, token_ids: list[int], positions: Any, offset: int) -> CompletionLogProbs:
        lps = CompletionLogProbs([], [], [], [])
        k = self.k
        for token_id, pos in zip(token_ids, positions):
            if not pos:  # the first prompt position: nothing precedes it
                text = self._text(token_id, None)
                lps.token_logprobs.append(None)
                lps.top_logprobs.append(None)
            else:
                chosen = pos.get(token_id)
                text = self._text(token_id, chosen.decoded_token if chosen is not None else None)
                lps.token_logprobs.append(max(chosen.logprob, _FLOOR) if chosen is not None else None)
                lps.top_logprobs.append({self._text(t, lp.decoded_token): max(lp.logprob, _FLOOR)
                                         for j, (t, lp) in enumerate(pos.items()) if j <= k})
            lps.tokens.append(text)
            lps.text_offset.append(offset)
            offset += len(text)
        return lps


def concat(a: CompletionLogProbs, b: CompletionLogProbs) -> CompletionLogProbs:
    """The prompt's logprobs (echo) followed by the completion's."""
    return CompletionLogProbs(a.text_offset + b.text_offset, a.token_logprobs + b.token_logprobs,
                              a.tokens + b.tokens, a.top_logprobs + b.top_logprobs)
