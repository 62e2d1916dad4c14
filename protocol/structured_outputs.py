"""vLLM's `StructuredOutputsParams`: constrain a request's output to a JSON schema, a regex, a
choice of strings, an EBNF grammar, any JSON object or an xgrammar structural tag.

It travels to the engine core inside `SamplingParams`, so it is a msgspec Struct whose
`__post_init__` (run on construction *and* on decode) checks what can be checked without the
tokenizer: exactly one constraint, the types, JSON texts that parse. Whether a regex, schema or
grammar compiles is found out by the core (xgrammar, against the model's tokenizer); one that
does not fails its request alone with an error naming the problem.
"""
from __future__ import annotations

import json as _json
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    JsonSpec = str | dict[str, Any] | None
else:
    # A dict (or pydantic model class) schema is turned into its JSON text by __post_init__:
    # the wire carries text only, so no untyped (Any) value is ever decoded from it.
    JsonSpec = str | None

# The constraint fields, exactly one of which is set (vLLM's rule).
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # a schema/grammar text larger than this is refused (1 MiB)


class StructuredOutputsParams(
    msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True, dict=False
):  # type: ignore[call-arg]
    # One of these is the constraint.
    json: JsonSpec = None  # a JSON schema: dict, JSON text, or a pydantic model class
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF) as xgrammar reads it
    json_object: bool | None = None  # any JSON object
    # Options (vLLM's names). xgrammar is tidal's only backend, so there is nothing to fall
    # back to; whitespace_pattern is an outlines option that vLLM's xgrammar backend ignores
    # too (accepted, unused).
    disable_fallback: bool = False
    disable_any_whitespace: bool = False  # JSON in one fixed layout, no free whitespace
    disable_additional_properties: bool = False  # objects take only the schema's properties
    whitespace_pattern: str | None = None
    structural_tag: str | None = None  # xgrammar structural tag, as JSON text
    # tidal's: the most whitespace characters a JSON grammar (json, json_object) allows between
    # two tokens; None: the engine's (structured_outputs_config.max_whitespace_cnt, 20 unless
    # set). A bound keeps a model from emitting whitespace until max_tokens.
    max_whitespace_cnt: int | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            self.json = _schema_text(self.json)
        count = sum(getattr(self, name) is not None for name in CONSTRAINTS)
        if count != 1:
            which = "multiple are" if count > 1 else "none is"
            set_ = {name: getattr(self, name) for name in CONSTRAINTS if getattr(self, name) is not None}
            raise ValueError(f"You can only use one kind of structured outputs constraint but {which} "
                             f"specified: {_short(set_)} (use exactly one of {', '.join(CONSTRAINTS)})")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern", "json"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a str, got {type(value).__name__}")
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs.{name} is {len(value)} characters, more than "
                                 f"the {MAX_SPEC_CHARS} allowed")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_whitespace_cnt is not None and (type(self.max_whitespace_cnt) is not int
                                                    or self.max_whitespace_cnt < 1):
            raise ValueError(f"structured_outputs.max_whitespace_cnt must be an integer >= 1 or None, "
                             f"got {self.max_whitespace_cnt!r}")
        self._check_constraint()

    def _check_constraint(self) -> None:
        if self.json is not None:
            _parse_json("json", self.json, (dict, bool))
        elif self.structural_tag is not None:
            _parse_json("structural_tag", self.structural_tag, (dict,))
        elif self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of str, got {_short(self.choice)}")
            if not self.choice:
                raise ValueError("structured_outputs.choice must hold at least one string")
        elif self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True when set, got {self.json_object!r}")
        elif self.regex is not None and not self.regex:
            raise ValueError("structured_outputs.regex must not be empty")
        elif self.grammar is not None and not self.grammar.strip():
            raise ValueError("structured_outputs.grammar must not be empty")

    @property
    def kind(self) -> str:
        """The name of the constraint that is set ("json", "regex", ...)."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    def key(self) -> tuple[str, str, bool, int | None]:
        """What the compiled grammar depends on, by this request's own settings (the core
        merges in the engine's before it caches by it): kind, spec, disable_any_whitespace,
        max_whitespace_cnt."""
        kind = self.kind
        spec = getattr(self, kind)
        text = _json.dumps(spec) if kind == "choice" else "" if kind == "json_object" else spec
        return kind, text, self.disable_any_whitespace, self.max_whitespace_cnt

    def all_constraints_none(self) -> bool:  # vLLM's helper
        return all(getattr(self, name) is None for name in CONSTRAINTS)


def _schema_text(schema: Any) -> str:
    """A dict schema (or pydantic model class) as JSON text."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()  # a pydantic model, as vLLM accepts
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON schema (dict or JSON text), "
                         f"got {type(schema).__name__}")
    try:
        return _json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"structured_outputs.json is not JSON-serialisable: {e}") from None


def _parse_json(name: str, text: str, types: tuple[type, ...]) -> None:
    try:
        value = _json.loads(text)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{name} is not valid JSON: {e}") from None
    except RecursionError:  # the request's mistake (400), not an engine failure
        raise ValueError(f"structured_outputs.{name} is nested too deeply to parse") from None
    if not isinstance(value, types):
        raise ValueError(f"structured_outputs.{name} must be a JSON object, got {type(value).__name__}")


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
