"""What a request asks its output to match: a JSON schema, a regex, an EBNF grammar, a choice
among strings, or a structural tag (free text with constrained structures, e.g. tool calls).

Specs arrive as the text fields of `SamplingParams` (regex / json_schema / ebnf /
structural_tag, as in SGLang); `parse_spec` checks them once, before any backend sees them, so a
bad spec is an error that names the field.

Structural tag (JSON), SGLang's format plus three optional weft keys:

    {"type": "structural_tag",
     "structures": [{"begin": "<tool_call>\\n{\\"name\\": \\"f\\", \\"arguments\\": ",
                     "schema": {...}, "end": "}\\n</tool_call>"}],
     "triggers": ["<tool_call>"],
     "free_text": true,        # text around the structures (SGLang's meaning); false: the output
                               # is only structures, joined by "separator"
     "at_least_one": false,    # at least one structure (tool_choice = required)
     "repeat": true,           # more than one structure (parallel tool calls)
     "separator": "\\n"}
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 256 * 1024  # the text of one spec
MAX_SCHEMA_DEPTH = 64  # nesting of JSON objects/arrays in a schema document
KINDS = ("json_schema", "json_object", "regex", "ebnf", "choices", "structural_tag")


class InvalidSpec(ValueError):
    """The spec itself is wrong (not the backend's limitation): a 400 for that request."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    text: str  # canonical text: JSON for json_schema / choices / structural_tag

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidSpec(f"unknown grammar kind {self.kind!r} (known: {', '.join(KINDS)})")

    @property
    def value(self) -> Any:
        """The parsed JSON of json kinds, the text otherwise."""
        if self.kind in ("json_schema", "choices", "structural_tag"):
            return json.loads(self.text)
        return self.text

    def describe(self) -> str:
        short = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"{self.kind} {short!r}"


# The JSON object type: any JSON value that is an object (OpenAI's response_format json_object).
JSON_OBJECT_SCHEMA = {"type": "object"}


def json_object_spec() -> GrammarSpec:
    return GrammarSpec("json_object", json.dumps(JSON_OBJECT_SCHEMA))


def choices_spec(choices: list[str]) -> GrammarSpec:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidSpec("choices must be a non-empty list of non-empty strings")
    return GrammarSpec("choices", json.dumps(list(choices)))


def parse_spec(field: str, text: str) -> GrammarSpec:
    """A SamplingParams constraint field -> a checked spec (InvalidSpec names the field)."""
    if not isinstance(text, str):
        raise InvalidSpec(f"{field} must be a string, got {type(text).__name__}")
    return _parse_spec(field, text)


# NOTE: meta-validating a JSON schema takes milliseconds, and a request's spec is parsed two or
# three times (API, SamplingParams.validate, the scheduler) while clients repeat the same few
# schemas: cache the results (failures raise and are not cached).
@functools.lru_cache(maxsize=256)
def _parse_spec(field: str, text: str) -> GrammarSpec:
    if not text.strip():
        raise InvalidSpec(f"{field} is empty")
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidSpec(
            f"{field} is too large: {len(text)} characters (at most {MAX_SPEC_CHARS})"
        )
    if field == "json_schema":
        return GrammarSpec("json_schema", _canonical_json(field, _parse_schema(field, text)))
    if field == "structural_tag":
        return GrammarSpec("structural_tag", _canonical_json(field, parse_structural_tag(text)))
    if field == "regex":
        return GrammarSpec("regex", text)
    if field == "ebnf":
        return GrammarSpec("ebnf", text)
    raise InvalidSpec(f"unknown constraint field {field!r}")


def _parse_schema(field: str, text: str) -> Any:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidSpec(f"{field} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidSpec(f"{field} is nested too deeply (at most {MAX_SCHEMA_DEPTH})") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidSpec(f"{field} must be a JSON object, got {type(schema).__name__}")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidSpec(
            f"{field} is nested too deeply: depth {depth} (at most {MAX_SCHEMA_DEPTH})"
        )
    _check_schema(field, schema)
    return schema


def _check_schema(field: str, schema: Any) -> None:
    """Meta-validate against the JSON Schema spec (when jsonschema is installed)."""
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - jsonschema comes with the grammar backends
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise InvalidSpec(
            f"{field} is not a valid JSON schema: {exc.message}"
            + (f" (at {where})" if where else "")
        ) from None


def parse_structural_tag(text: str) -> dict[str, Any]:
    """Check and normalize a structural tag (module docstring) -> a dict with every key set."""
    try:
        tag = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidSpec(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise InvalidSpec("structural_tag must be a JSON object")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise InvalidSpec(f"structural_tag.type must be 'structural_tag', got {tag.get('type')!r}")
    structures = tag.get("structures")
    if not isinstance(structures, list) or not structures:
        raise InvalidSpec("structural_tag.structures must be a non-empty list")
    clean = []
    for i, item in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(item, dict):
            raise InvalidSpec(f"{where} must be an object")
        for key in ("begin", "end"):
            if not isinstance(item.get(key), str):
                raise InvalidSpec(f"{where}.{key} must be a string")
        if not item["begin"]:
            raise InvalidSpec(f"{where}.begin must not be empty")
        schema = item.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise InvalidSpec(f"{where}.schema must be a JSON schema object")
        _check_schema(f"{where}.schema", schema)
        clean.append({"begin": item["begin"], "schema": schema, "end": item["end"]})
    free_text = _flag(tag, "free_text", True)
    triggers = tag.get("triggers", [])
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidSpec("structural_tag.triggers must be a list of non-empty strings")
    if free_text:
        if not triggers:
            raise InvalidSpec("structural_tag.triggers must not be empty when free_text is true")
        for i, item in enumerate(clean):
            if not any(item["begin"].startswith(t) for t in triggers):
                raise InvalidSpec(
                    f"structural_tag.structures[{i}].begin does not start with any trigger"
                )
    separator = tag.get("separator", "\n")
    if not isinstance(separator, str):
        raise InvalidSpec("structural_tag.separator must be a string")
    return {
        "type": "structural_tag",
        "structures": clean,
        "triggers": list(triggers),
        "free_text": free_text,
        "at_least_one": _flag(tag, "at_least_one", False),
        "repeat": _flag(tag, "repeat", True),
        "separator": separator,
    }


def _flag(tag: dict[str, Any], key: str, default: bool) -> bool:
    value = tag.get(key, default)
    if not isinstance(value, bool):
        raise InvalidSpec(f"structural_tag.{key} must be a boolean")
    return value


def _canonical_json(field: str, value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _depth(value: Any) -> int:
    """Nesting depth of a JSON document, without recursion (a hostile document can be deep)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        stack.extend((child, depth + 1) for child in children)
    return deepest
