"""CLI flags generated from the EngineArgs fields, as vLLM derives them (`get_kwargs`):
`--field-name`, vLLM's short aliases, bools as --x/--no-x (store_true where vLLM has it),
lists as nargs="+", JSON for dict-valued args, "None" for an optional value, and 1k/1K-style
numbers where vLLM takes them. A flag that is not given leaves no attribute, so
`from_cli_args` keeps the field's default (one copy of every default: the dataclass's)."""
from __future__ import annotations

import argparse
import json
import re
import types
import typing
from dataclasses import fields
from typing import Any, Callable, Union

from tidal.frontend.arg_rules import RULES, Implemented, NoOp, Refused

SHORT_ALIASES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "data_parallel_size": ("-dp",),
    "decode_context_parallel_size": ("-dcp",), "prefill_context_parallel_size": ("-pcp",),
    "data_parallel_rank": ("-dpn",), "data_parallel_start_rank": ("-dpr",),
    "data_parallel_size_local": ("-dpl",), "data_parallel_address": ("-dpa",),
    "data_parallel_rpc_port": ("-dpp",), "data_parallel_backend": ("-dpb",),
    "data_parallel_hybrid_lb": ("-dph",), "data_parallel_external_lb": ("-dpe",),
    "nnodes": ("-n",), "node_rank": ("-r",), "quantization": ("-q",), "compilation_config": ("-cc",),
}
STORE_TRUE = frozenset({"disable_log_stats", "aggregate_engine_logging", "disable_mm_preprocessor_cache",
                        "enable_multimodal_encoder_data_parallel"})
HUMAN_READABLE_INTS = frozenset({"max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"})
NO_FLAG = frozenset({"tokens_only", "_api_process_count", "_api_process_rank"})  # vLLM adds none either

_UNITS = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}


def human_readable_int(value: str) -> int:
    """vLLM's: 1k = 1000, 1K = 1024, 25.6k, 2M, 2G; plain integers too."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", value.strip())
    if m is None:
        return int(value)
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def json_or_str(value: str) -> Any:
    """A JSON object/array/number when it looks like one, else the text (vLLM's
    union_dict_and_str; -cc 3 is compilation level 3)."""
    text = value.strip()
    if text[:1] in "{[" or re.fullmatch(r"-?\d+", text):
        return json.loads(text)
    return value


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_or_none(value: str) -> Any:
        return None if value in ("", "None") else parse(value)

    parse_or_none.__name__ = getattr(parse, "__name__", "value")  # argparse names it in errors
    return parse_or_none


def _parts(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def flag_kwargs(name: str, tp: Any) -> dict[str, Any]:
    """argparse keyword arguments for the field `name` of type `tp` (vLLM's rules, in order)."""
    parts = _parts(tp)
    if name in STORE_TRUE:
        return {"action": "store_true"}
    if name == "hf_token":  # a bare --hf-token means "use the stored token"
        return {"type": str, "nargs": "?", "const": True}
    if bool in parts:
        return {"action": argparse.BooleanOptionalAction}
    nullable = type(None) in parts
    lists = [p for p in parts if typing.get_origin(p) is list]
    if lists:
        elem = (typing.get_args(lists[0]) or (str,))[0]
        return {"nargs": "+", "type": elem if elem in (int, float) else str}
    if int in parts and dict not in parts and all(typing.get_origin(p) is not dict for p in parts):
        parse: Callable[[str], Any] = human_readable_int if name in HUMAN_READABLE_INTS else int
    elif float in parts:
        parse = float
    elif any(p is dict or typing.get_origin(p) is dict or p is Any for p in parts):
        parse = json_or_str
    else:
        parse = str
    return {"type": _optional(parse) if nullable else parse}


def _help(name: str) -> str:
    rule = RULES[name]
    if isinstance(rule, NoOp):
        return f"accepted, no effect in tidal: {rule.why}"
    if isinstance(rule, Refused):
        return f"refused unless default: {rule.feature}"
    if isinstance(rule, Implemented) and rule.refuse is not None:
        return f"not supported: {rule.feature}"
    return ""


def add_fields_as_flags(cls: type, parser: argparse.ArgumentParser, *,
                        exclude: frozenset[str] = frozenset()) -> argparse.ArgumentParser:
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group("engine arguments (vLLM's EngineArgs)")
    for f in fields(cls):
        if f.name in NO_FLAG or f.name in exclude:
            continue
        flags = ["--" + f.name.replace("_", "-"), *SHORT_ALIASES.get(f.name, ())]
        group.add_argument(*flags, dest=f.name, default=argparse.SUPPRESS, help=_help(f.name) or None,
                           **flag_kwargs(f.name, hints[f.name]))
    return parser
