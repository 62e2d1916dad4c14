"""Chat messages rendered into a prompt by a chat template (vLLM's chat_utils): the one way
`LLM.chat` and the server's /v1/chat/completions and /tokenize do it. Bad messages, options or a
failing template raise ValueError (as vLLM's apply_hf_chat_template); each entry point words
only what is its own (the server's 400s name a field and its flags)."""
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


CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's --chat-template-content-format values


class ChatTemplateError(ValueError):
    """The template failed on these messages (a jinja2 error, its raise_exception(), bad kwargs)."""


class NoChatTemplateError(ValueError):
    """Neither the caller nor the tokenizer has a chat template (transformers has had no
    default one since v4.44). Each entry point names its own remedy (a flag, an argument)."""


def resolve_chat_template(tokenizer: Any, given: str | None) -> str:
    """The template to render with: `given`, else the tokenizer's own; NoChatTemplateError if
    there is neither."""
    template = given or getattr(tokenizer, "chat_template", None)
    if not template:
        raise NoChatTemplateError("this model's tokenizer has no chat template: pass chat_template (a Jinja "
                                  "template) or use generate()")
    return str(template)


def check_chat_options(add_generation_prompt: bool, continue_final_message: bool,
                       content_format: str = "auto") -> None:
    """ValueError for options no template can honour together (vLLM's checks)."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got {content_format!r}")


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], template: str, *, content_format: str = "auto",
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of `messages` by `template` (resolve_chat_template), rendered by
    transformers' apply_chat_template (jinja2 in a sandbox, with the globals every Hugging Face
    template expects). `content_format` "auto" renders text content as one string, as "string"
    does (tidal takes text parts only, so there is nothing for "auto" to detect); the template
    writes the special tokens, so its text is tokenized without adding any. ValueError for bad
    messages or options, ChatTemplateError (a ValueError) for whatever the template raises."""
    check_chat_options(add_generation_prompt, continue_final_message, content_format)
    conversation = normalize_messages(list(messages), "openai" if content_format == "openai" else "string")
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {}))
    except Exception as e:  # the template's own failure: one kind of error for every caller
        raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e
    return str(text)
