"""Chat messages as chat templates get them (vLLM's chat_utils): shared by `LLM.chat` and the
server's /v1/chat/completions and /tokenize. Bad messages raise ValueError."""
from __future__ import annotations

from typing import Any


def content_text(content: Any) -> str | None:
    """OpenAI content: a string, or parts of which tidal takes the text ones (joined by newlines,
    vLLM's "string" content format)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"message content part of type {kind!r} is not supported (text only)")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError("message content must be a string or a list of content parts")


def normalize_messages(messages: list[dict[str, Any]], content_format: str = "string") -> list[dict[str, Any]]:
    """Messages as the template gets them: content as one string, or (content_format "openai")
    as OpenAI's list of text parts, a string content becoming one part; no content (an assistant
    turn that only called tools) is empty, as vLLM renders it."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("every message needs a string 'role'")
        text = content_text(m.get("content"))  # validates the parts (text only)
        if content_format == "openai" and text is not None:
            content: Any = ([{"type": "text", "text": p["text"]} for p in m["content"]]
                            if isinstance(m["content"], list) else [{"type": "text", "text": text}])
        else:
            content = "" if text is None else text
        out.append({**m, "content": content})
    return out
