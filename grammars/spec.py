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

import asyncio
import functools
import json
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

MAX_SPEC_CHARS = 256 * 1024  # the text of one spec (EngineConfig.max_grammar_chars's default)
MAX_SCHEMA_DEPTH = 64  # nesting of JSON objects/arrays in a schema document
MAX_GROUP_DEPTH = 64  # nesting of parentheses in a regex or an EBNF grammar
KINDS = ("json_schema", "json_object", "regex", "ebnf", "choices", "structural_tag")
# JSON text under a schema: whitespace as the model writes it (compact, spaced or indented), at
# most JSON_WHITESPACE_MAX characters in a run. Forcing compact JSON on a model that indents cost
# extraction quality (benchmarks/RESULTS.md: ages and dates went wrong, items repeated); a small
# model offered unbounded whitespace can spend its tokens on it. Every backend gets this bound.
JSON_WHITESPACE_MAX = 16
JSON_WHITESPACE = f"[ \\n\\r\\t]{{0,{JSON_WHITESPACE_MAX}}}"
INLINE_SPEC_CHARS = 16 * 1024  # longer specs are checked off the event loop (`parse_off_loop`)
OFF_LOOP_WORKERS = 4  # threads for the work `parse_off_loop` moves off the event loop

T = TypeVar("T")


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


def choices_spec(choices: list[str]) -> GrammarSpec:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidSpec("choices must be a non-empty list of non-empty strings")
    return GrammarSpec("choices", json.dumps(list(choices)))


def parse_spec(
    field: str, text: str, max_chars: int = MAX_SPEC_CHARS, validated: bool = False
) -> GrammarSpec:
    """A SamplingParams constraint field -> a checked spec (InvalidSpec names the field).

    validated: the spec passed parse_spec before (the scheduler's requests were checked by the
    HTTP process or Engine): the JSON schema meta-validation, the costly check, is skipped.
    """
    if not isinstance(text, str):
        raise InvalidSpec(f"{field} must be a string, got {type(text).__name__}")
    if len(text) > max_chars:
        raise InvalidSpec(f"{field} is too large: {len(text)} characters (at most {max_chars})")
    if len(text) > INLINE_SPEC_CHARS:
        return off_loop(("spec", field, text), lambda: _parse_spec(field, text, validated))
    return _parse_spec(field, text, validated)


class _OffLoop(Exception):
    """Slow work met inside `parse_off_loop`: done on a worker thread, then parse reruns."""

    def __init__(self, key: Hashable, work: Callable[[], Any]) -> None:
        super().__init__("work moved off the event loop")
        self.key = key
        self.work = work


@dataclass
class _Raised:
    error: Exception


# Inside `parse_off_loop` (per asyncio task): the results of the work done off the loop so far.
_done_off_loop: ContextVar[dict[Hashable, Any] | None]
_done_off_loop = ContextVar("weft_done_off_loop", default=None)
_off_loop_pool = ThreadPoolExecutor(OFF_LOOP_WORKERS, thread_name_prefix="weft-off-loop")


def off_loop(key: Hashable, work: Callable[[], T]) -> T:
    """work() here, or inside `parse_off_loop` on one of its worker threads (`key` names the
    work: the parse that meets it again gets its result, or its exception raised again)."""
    done = _done_off_loop.get()
    if done is None:
        return work()
    if key not in done:
        raise _OffLoop(key, work)
    result = done[key]
    if isinstance(result, _Raised):
        raise result.error
    return result  # type: ignore[no-any-return]


async def parse_off_loop(parse: Callable[[], T]) -> T:
    """Run `parse` (sync code, e.g. a request's validation) on the event loop, except the slow
    parts it marks with `off_loop` (specs longer than INLINE_SPEC_CHARS, long prompts to
    tokenize): `parse` stops at each, which runs on a worker thread (OFF_LOOP_WORKERS of them),
    and runs again once it is done.

    NOTE: meta-validating a large JSON schema takes up to a second (thousands of patterns), and
    tokenizing a megabyte prompt seconds (it releases the GIL), while the loop serves every
    other client. `parse` must do nothing that cannot be done twice before its last `off_loop`
    call.
    """
    done: dict[Hashable, Any] = {}
    token = _done_off_loop.set(done)
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                return parse()
            except _OffLoop as pending:
                done[pending.key] = await loop.run_in_executor(
                    _off_loop_pool, _result_or_raised, pending.work
                )
    finally:
        _done_off_loop.reset(token)


def _result_or_raised(work: Callable[[], Any]) -> Any:
    try:
        return work()
    except Exception as exc:
        return _Raised(exc)


# NOTE: meta-validating a JSON schema takes milliseconds, and clients repeat the same few schemas:
# cache the results (failures raise and are not cached). A request's spec is parsed once, by
# SamplingParams.validate into `SamplingParams.grammar`, which travels to the scheduler; an API's
# earlier check of the field (to name it the API's way) is a hit here.
@functools.lru_cache(maxsize=256)
def _parse_spec(field: str, text: str, validated: bool = False) -> GrammarSpec:
    if not text.strip():
        raise InvalidSpec(f"{field} is empty")
    if field == "json_schema":
        schema = _parse_schema(field, text, validated)
        return GrammarSpec("json_schema", _canonical_json(field, schema))
    if field == "structural_tag":
        tag = parse_structural_tag(text, validated)
        return GrammarSpec("structural_tag", _canonical_json(field, tag))
    if field in ("regex", "ebnf"):
        depth = group_depth(text, quotes="" if field == "regex" else "\"'")
        if depth > MAX_GROUP_DEPTH:
            raise InvalidSpec(
                f"{field} is nested too deeply: {depth} levels of parentheses "
                f"(at most {MAX_GROUP_DEPTH})"
            )
        return GrammarSpec(field, text)
    raise InvalidSpec(f"unknown constraint field {field!r}")


def group_depth(text: str, quotes: str) -> int:
    """The deepest nesting of parentheses, outside escapes, character classes ([...]), quoted
    literals (`quotes`, EBNF) and `#` comments (EBNF). A cheap bound on what a backend's
    recursive compiler will face, not a parse: an unbalanced text just counts what it has."""
    deepest = depth = 0
    i, end = 0, len(text)
    while i < end:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = skip_class(text, i + 1)
            continue
        if c in quotes:
            i = _skip_quoted(text, i + 1, c)
            continue
        if c == "#" and quotes:
            newline = text.find("\n", i)
            i = end if newline < 0 else newline + 1
            continue
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def skip_class(text: str, i: int) -> int:
    """The index after the `]` closing a character class whose content starts at `i` (a `]`
    first in the class, or right after `^`, is a literal)."""
    if text.startswith("^", i):
        i += 1
    if text.startswith("]", i):
        i += 1
    return _skip_quoted(text, i, "]")


def _skip_quoted(text: str, i: int, quote: str) -> int:
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _parse_schema(field: str, text: str, validated: bool = False) -> Any:
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
    if not validated:
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


def parse_structural_tag(text: str, validated: bool = False) -> dict[str, Any]:
    """Check and normalize a structural tag (module docstring) -> a dict with every key set
    (validated: its schemas are not meta-validated again, see parse_spec)."""
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
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise InvalidSpec(f"{where}.schema is nested too deeply (at most {MAX_SCHEMA_DEPTH})")
        if not validated:
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


def _depth(root: Any) -> int:
    """Nesting depth of a JSON document, a local `$ref` counting as its target nested in place
    (a cycle of refs, a recursive schema, is followed once). Without recursion: a hostile
    document can be deep.

    NOTE: backends expand refs recursively: llguidance overflows its stack (the process dies)
    on a chain of a thousand refs, each of them shallow.
    """
    heights: dict[int, int] = {}  # id(container) -> its height
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            heights[key] = 1 + max(
                (heights.get(id(c), 0) if _is_container(c) else 1 for c in _children(root, node)),
                default=0,
            )
        elif key not in heights and key not in on_path:  # on the path: a cycle, counted once
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in _children(root, node) if _is_container(c))
    return heights.get(id(root), 1)


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list))


def _children(root: Any, node: Any) -> list[Any]:
    if isinstance(node, list):
        return node
    if not isinstance(node, dict):
        return []
    children = list(node.values())
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = resolve_pointer(root, ref[1:])
        if target is not None:
            children.append(target)
    return children


def resolve_pointer(root: Any, pointer: str) -> Any:
    """The value at a JSON pointer ("/$defs/item"), or None."""
    node = root
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
