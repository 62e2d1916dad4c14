"""What a completions or chat request's own fields make of it before the engine sees it: the
checks no SamplingParams field covers, its SamplingParams (constraint included), its ids."""
from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.requests import Request
from tidal.frontend import RequestIds, random_request_id
from tidal.frontend.entrypoints.openai.chat_tools import TOOLS_AND_CONSTRAINT
from tidal.frontend.entrypoints.openai.errors import APIError, range_message
from tidal.frontend.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams
from tidal.protocol.structured_outputs import CONSTRAINTS, StructuredOutputsParams


def request_ids(prefix: str, request: Request, req: SamplingFields, ids: RequestIds) -> tuple[str, str]:
    """(the id the response reports, the base of its engine request ids). As vLLM's: the
    `X-Request-Id` header, else the body's `request_id`, else a random one, after `prefix-`.
    A caller's id need not be unique, so the engine's ids are made unique by the library's one
    scheme (RequestIds)."""
    given = request.headers.get("x-request-id") or req.request_id
    rid = f"{prefix}-{given or random_request_id()}"
    return rid, ids.unique(rid)


def check_request(req: SamplingFields) -> None:
    """vLLM's request validators that no SamplingParams field covers: 400 naming the field, in
    vLLM's words (its `check_logprobs`, `validate_stream_options`, ...; a token id below 0 in
    pydantic's, as its `Field(ge=0)` on prompt ids words it)."""
    if isinstance(req, CompletionRequest):
        check_prompt_ids(req.prompt)
    prompt_lps = req.prompt_logprobs
    if prompt_lps is not None:
        if req.stream and (prompt_lps > 0 or prompt_lps == -1):  # 0 asks for none, as vLLM allows
            raise APIError("`prompt_logprobs` are not available when `stream=True`.",
                           HTTPStatus.BAD_REQUEST, "prompt_logprobs")
        if prompt_lps < -1:
            raise APIError("`prompt_logprobs` must be a positive value or -1.", HTTPStatus.BAD_REQUEST,
                           "prompt_logprobs")
    name, count = (("logprobs", req.logprobs) if isinstance(req, CompletionRequest) else
                   ("top_logprobs", req.top_logprobs) if isinstance(req, ChatCompletionRequest) else ("", None))
    if count is not None and count < -1:
        raise APIError(f"`{name}` must be a positive value or -1.", HTTPStatus.BAD_REQUEST, name)
    if req.stream_options is not None and req.stream_options.given and not req.stream:
        raise APIError("Stream options can only be defined when `stream=True`.",
                       HTTPStatus.BAD_REQUEST, "stream_options")
    if req.use_beam_search:
        raise APIError("use_beam_search is not supported by tidal's server (LLM.beam_search offers it offline)",
                       HTTPStatus.BAD_REQUEST, "use_beam_search")
    if req.logits_processors:
        raise APIError("The `logits_processors` argument is not supported by this server.",
                       HTTPStatus.BAD_REQUEST, "logits_processors")
    if req.cache_salt is not None and not req.cache_salt:
        raise APIError("Parameter 'cache_salt' must be a non-empty string if provided.",
                       HTTPStatus.BAD_REQUEST, "cache_salt")


def check_prompt_ids(prompt: object) -> None:
    """A token-id prompt (a list of ids, or a list of such lists) with an id below 0: 400 in
    pydantic's words, as vLLM's `list[Annotated[int, Field(ge=0)]]` refuses it. Anything else
    (text, ids of other types) is left to completion_prompts. One C pass (min) per list."""
    if not isinstance(prompt, list) or not prompt:
        return
    rows: Any = enumerate(prompt) if isinstance(prompt[0], list) else [(None, prompt)]
    for i, row in rows:
        if not isinstance(row, list) or not row:
            continue
        try:
            low = min(row)
        except TypeError:  # not all numbers: not a token-id list
            continue
        if type(low) is int and low < 0:
            j = row.index(low)
            loc = f"prompt.{j}" if i is None else f"prompt.{i}.{j}"
            raise APIError(range_message(loc, ">=", 0, low), HTTPStatus.BAD_REQUEST, "prompt")


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None, tool_schema: dict[str, Any] | None = None,
                    skip_special_tokens: bool | None = None) -> SamplingParams:
    """The request's SamplingParams (ValueError, i.e. 400, for a value out of range);
    DELTA output when streamed, else FINAL_ONLY. truncate_prompt_tokens is the server's to
    apply (it needs the prompt's length first), so it is not passed on. `tool_schema`: the
    JSON schema a forced tool_choice constrains the output to (see structured_outputs);
    `skip_special_tokens`: the server's override of the request's (False when a reply parser
    reads special tokens)."""
    return SamplingParams.from_optional(
        n=req.n, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, temperature=req.temperature, top_p=req.top_p,
        top_k=0 if req.top_k is None else req.top_k, min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, bad_words=req.bad_words,
        include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
        max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
        structured_outputs=structured_outputs(req, tool_schema))


def structured_outputs(req: SamplingFields, tool_schema: dict[str, Any] | None = None
                       ) -> StructuredOutputsParams | None:
    """The request's constraint from `structured_outputs` and `response_format` (as vLLM: both
    may be given only if they name one constraint together; ValueError, i.e. 400, otherwise).
    With `tool_schema` (tool_choice "required" or named) that schema is the constraint, and one
    of the request's own is a 400 (vLLM's words); its options (whitespace) still apply."""
    so, rf = req.structured_outputs, req.response_format
    fields: dict[str, Any] = {} if so is None else msgspec.structs.asdict(so)
    if rf is not None and rf.type == "json_object":
        fields["json_object"] = True
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema.schema",
                           HTTPStatus.BAD_REQUEST, "response_format")
        fields["json"] = rf.json_schema.json_schema
    elif rf is not None and rf.type == "structural_tag":
        tag = ({"type": "structural_tag", "format": rf.format} if rf.format is not None
               else {"structures": rf.structures or [], "triggers": rf.triggers or []})
        fields["structural_tag"] = json.dumps(tag)
    own = any(fields.get(name) is not None for name in CONSTRAINTS)
    if tool_schema is not None:
        if own:
            raise APIError(TOOLS_AND_CONSTRAINT, HTTPStatus.BAD_REQUEST, "tool_choice")
        fields["json"] = tool_schema
    elif not own:
        return None  # no constraint (options alone, or response_format "text")
    if fields.get("json") is not None:
        check_schema_depth(fields["json"])
    return StructuredOutputsParams(**fields)


# A JSON schema nested deeper than this is refused before its grammar is compiled: the
# compiler recurses per level, and a 1000-deep schema raised RecursionError (a 500).
MAX_SCHEMA_DEPTH = 128


def check_schema_depth(schema: Any, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """400 naming the limit when `schema` (a dict or its JSON text) nests past `limit` levels.
    Walked with an explicit stack, so the check itself cannot overflow."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return  # malformed or too deep to parse: left to the grammar compiler's own 400
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise APIError(f"JSON schema nested deeper than {limit} levels (MAX_SCHEMA_DEPTH)",
                           HTTPStatus.BAD_REQUEST, "response_format")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
