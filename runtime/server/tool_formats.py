"""The tool-call formats chat templates teach, read from the template text (never the model's name).

| format        | template mentions                  | one call                                          | calls joined by |
|---------------|------------------------------------|---------------------------------------------------|-----------------|
| qwen25        | `<tool_call>` (Qwen2.5, Qwen3)     | `<tool_call>\\n{"name": "f", "arguments": {..}}\\n</tool_call>` | "\\n" |
| mistral       | `[TOOL_CALLS]` (v3 / v7, Nemo)     | `[TOOL_CALLS][{"name": "f", "arguments": {..}}]`  | ""              |
| mistral_args  | `[TOOL_CALLS]` and `[ARGS]` (v11+) | `[TOOL_CALLS]f[ARGS]{..}`                         | ""              |
| llama3_json   | `<|python_tag|>`, `Environment: ipython` | `{"name": "f", "parameters": {..}}`         | "; "            |
| gemma         | `<start_of_turn>` (Gemma 3)        | `{"name": "f", "parameters": {..}}`               | "\\n"           |

Each format gives the structural tag (weft.grammars.spec) its pieces (`structures`: for most,
`begin(name)` + the arguments' schema + `end` per tool), and tells the parser
(`tool_parser.ToolCallParser`) where a call that starts at its `trigger` ends (`call_end`) and
which calls it holds (`decode`).

Mistral: the v3/v7 templates write an assistant turn's calls as ONE JSON array after
`[TOOL_CALLS]`, and so does the constraint: one structure, the marker and then a JSON array of
calls whose items are `{"name": <const>, "arguments": <that tool's parameters>}` (`calls_array`:
one or more calls, one unless parallel); the parser reads arrays of any length, and blocks one
after another (as SGLang's constraint writes them). The v11+ templates write `[TOOL_CALLS]name[ARGS]{...}` per call (a
`[CALL_ID]id` before `[ARGS]`, which some of them render, is read and ignored).
Markers: real Mistral tokenizers make `[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` special (control)
tokens, which have no text by default: no grammar could emit them and skip_special_tokens would
strip them from the output, so the parser would never see a call. Every format's `markers` are
therefore text wherever a tokenizer has them (TOOL_MARKERS, runtime/tokenizer.py): in the grammar
vocabulary and in every output's text, as Qwen's non-special `<tool_call>` always is.

Gemma 3 has no tool tokens and its template ignores `tools`. The convention is the one Google's
Gemma function-calling guide documents (its JSON variant): the prompt lists the functions as JSON
and says "If you decide to invoke any of the function(s), you MUST put it in the format of
{"name": function name, "parameters": dictionary of argument name and its value}"; the model then
answers with that bare JSON object, which is the call; a model that puts it in a code fence
("```json" or "```tool_code" ... "```") gets the call without the fence (`fences`). `tool_prompt` is that text:
the chat renderer puts it into the prompt as a system message (Gemma's template folds it into
the first user turn) when the template itself does not render tools.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from weft.grammars.schema_walk import map_subschemas

logger = logging.getLogger("weft")

ParsedCall = tuple[str, dict[str, Any]]  # (function name, arguments)


@dataclass(frozen=True)
class ToolFormat(ABC):
    """How one model family writes calls. Subclasses say how a call is spelled."""

    name: str
    trigger: str  # a call starts where this appears in the output
    separator: str  # between calls when the output is nothing but calls
    markers: tuple[str, ...] = ()  # the texts of the format's own tokens (TOOL_MARKERS)
    fences: tuple[str, ...] = ()  # code-fence openers a model may put calls in (then FENCE)

    @abstractmethod
    def begin(self, name: str) -> str:
        """The text of a call up to its arguments object (the structure's `begin`)."""

    @property
    @abstractmethod
    def end(self) -> str:
        """The text of a call after its arguments object (the structure's `end`)."""

    @abstractmethod
    def call_end(self, text: str) -> int | None:
        """text starts with the trigger: where that call ends (exclusive), None if not yet."""

    @abstractmethod
    def decode(self, segment: str, closed: bool) -> list[ParsedCall] | None:
        """The calls a segment from `call_end` holds (closed), or a call that never closed
        holds (the output ended first); None: it holds no call (it is content, if closed)."""

    def call_id(self) -> str:
        """A new id for a parsed call."""
        return "call_" + uuid.uuid4().hex[:24]

    def structures(
        self, tools: list[dict[str, Any]], parallel: bool
    ) -> tuple[list[dict[str, Any]], bool]:
        """The structural tag's structures for calls of `tools` (checked OpenAI tool dicts),
        and whether the tag repeats them: `parallel`, more than one call may be made. One
        structure per tool: `begin(name)` + its parameters + `end`."""
        structures = [
            {
                "begin": self.begin(t["function"]["name"]),
                "schema": t["function"]["parameters"],
                "end": self.end,
            }
            for t in tools
        ]
        return structures, parallel

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str | None:
        """Text that teaches the model the tools, for templates that do not render them (None:
        the format relies on the template)."""
        return None


@dataclass(frozen=True)
class JsonCallFormat(ToolFormat):
    """`open_tag` + {"name": ..., <args_key>: {...}} + `close_tag`. Without tags the JSON object
    itself is the call and the trigger (the start of the object) marks where one begins."""

    open_tag: str = ""  # before the JSON object ("" if none)
    close_tag: str = ""  # after the JSON object ("" if none: the object ends the call)
    args_key: str = "arguments"  # the JSON key of the arguments object
    prompt: str | None = None  # a tool_prompt template ({tools} and {args_key} filled in)

    def begin(self, name: str) -> str:
        head = f"{self.open_tag}\n" if self.open_tag else ""
        return f'{head}{{"name": {json.dumps(name)}, "{self.args_key}": '

    @property
    def end(self) -> str:
        return "}" + (f"\n{self.close_tag}" if self.close_tag else "")

    def call_end(self, text: str) -> int | None:
        if self.close_tag:
            at = text.find(self.close_tag, len(self.trigger))
            return None if at < 0 else at + len(self.close_tag)
        return object_end(text)

    def decode(self, segment: str, closed: bool) -> list[ParsedCall] | None:
        body = segment
        if self.open_tag:
            body = body[len(self.open_tag) :]
            if closed:
                body = body[: -len(self.close_tag)]
        elif not closed:
            return None  # an unclosed JSON object is never a call
        call = _named_call(_loads(body), self.args_key)
        return None if call is None else [call]

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str | None:
        if self.prompt is None:
            return None
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return self.prompt.format(tools=listed)


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's templates refuse a history whose call ids are not 9 letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class MistralArrayFormat(ToolFormat):
    """`[TOOL_CALLS]` + a JSON array of {"name": ..., "arguments": {...}} (Mistral v3 / v7)."""

    def begin(self, name: str) -> str:
        return f'{self.trigger}[{{"name": {json.dumps(name)}, "arguments": '

    @property
    def end(self) -> str:
        return "}]"

    def call_end(self, text: str) -> int | None:
        start = _skip_space(text, len(self.trigger))
        if start == len(text):
            return None
        if text[start] != "[":
            return start  # no array follows: the marker alone, content
        end = object_end(text[start:])
        return None if end is None else start + end

    def call_id(self) -> str:
        return mistral_call_id()

    def structures(
        self, tools: list[dict[str, Any]], parallel: bool
    ) -> tuple[list[dict[str, Any]], bool]:
        """One structure: the marker, then ONE array of calls (of one or more of `tools`; one
        call unless `parallel`), as the templates write an assistant turn's calls."""
        structure = {"begin": self.trigger, "schema": calls_array(tools, parallel), "end": ""}
        return [structure], False

    def decode(self, segment: str, closed: bool) -> list[ParsedCall] | None:
        if not closed:
            return None
        items = _loads(segment[len(self.trigger) :])
        if not isinstance(items, list) or not items:
            return None
        calls = [_named_call(item, "arguments") for item in items]
        if any(c is None for c in calls):
            return None  # a bad element: the whole array stays content
        return [c for c in calls if c is not None]


def calls_array(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of an array of calls [{"name": ..., "arguments": {...}}, ...], each
    call's arguments held to its own tool's parameters; at least one call, at most one unless
    `parallel`."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        args = fn["parameters"]
        if _has_local_ref(args):
            # NOTE: a "#..." $ref points into the tool's own schema, which is no longer the
            # document's root here: the schema moves to the root's $defs, its refs rebased
            # onto it (no JSON pointer through an array: xgrammar cannot follow one)
            key = f"tool_{i}"
            defs[key] = _rebased(args, f"#/$defs/{key}")
            args = {"$ref": f"#/$defs/{key}"}
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _is_pointer_ref(ref: Any) -> bool:
    """A JSON pointer into the same document: "#" or "#/..." (not an anchor, "#name")."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def _has_local_ref(schema: Any) -> bool:
    return any(_is_pointer_ref(node.get("$ref")) for node in _own_subschemas(schema))


def _own_subschemas(schema: Any) -> list[dict[str, Any]]:
    """Every object subschema of `schema` as written (refs not followed)."""
    found: list[dict[str, Any]] = []

    def visit(original: dict[str, Any], copy: dict[str, Any]) -> dict[str, Any]:
        found.append(original)
        return copy

    map_subschemas(schema, visit)
    return found


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each JSON-pointer $ref ("#", "#/...") made relative to `base` instead."""

    def rebase(original: dict[str, Any], copy: dict[str, Any]) -> dict[str, Any]:
        ref = copy.get("$ref")
        if isinstance(ref, str) and _is_pointer_ref(ref):
            copy["$ref"] = base + ref[1:]
        return copy

    return map_subschemas(schema, rebase)


FENCE = "```"  # closes a code fence
ARGS_MARK = "[ARGS]"
CALL_ID_MARK = "[CALL_ID]"
MAX_NAME_CHARS = 64 + len(CALL_ID_MARK) + 64  # a name, and a call id the template may show


@dataclass(frozen=True)
class MistralArgsFormat(ToolFormat):
    """`[TOOL_CALLS]name[ARGS]{...}` per call (Mistral v11+ templates)."""

    def begin(self, name: str) -> str:
        return f"{self.trigger}{name}{ARGS_MARK}"

    @property
    def end(self) -> str:
        return ""

    def call_end(self, text: str) -> int | None:
        head = len(self.trigger)
        mark = text.find(ARGS_MARK, head, head + MAX_NAME_CHARS + len(ARGS_MARK))
        if mark < 0:
            # NOTE: a bound, so that a stray marker in prose does not hold back the rest of
            # the output: no name that long, so no call
            return None if len(text) < head + MAX_NAME_CHARS + len(ARGS_MARK) else head
        start = _skip_space(text, mark + len(ARGS_MARK))
        if start == len(text):
            return None
        if text[start] != "{":
            return start  # no arguments object: content
        end = object_end(text[start:])
        return None if end is None else start + end

    def call_id(self) -> str:
        return mistral_call_id()

    def decode(self, segment: str, closed: bool) -> list[ParsedCall] | None:
        if not closed or ARGS_MARK not in segment:
            return None
        head, _, body = segment[len(self.trigger) :].partition(ARGS_MARK)
        name = head.partition(CALL_ID_MARK)[0].strip()
        call = _named_call({"name": name, "arguments": _loads(body)}, "arguments")
        return None if call is None else [call]


def _named_call(obj: Any, args_key: str) -> ParsedCall | None:
    """{"name": str, <args_key>: {...} or its JSON text} -> (name, args); None if it is not."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        logger.debug("tool call parser: arguments are not an object: %r", obj)
        return None
    return obj["name"], args


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        logger.debug("tool call parser: not JSON: %r", text[:200])
        return None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def object_end(text: str) -> int | None:
    """text starts with "{" or "[": the index after the matching close (strings respected), or
    None if it has not closed yet."""
    depth = 0
    in_string = False
    escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


QWEN25 = JsonCallFormat(
    name="qwen25",
    trigger="<tool_call>",
    separator="\n",
    markers=("<tool_call>", "</tool_call>"),
    open_tag="<tool_call>",
    close_tag="</tool_call>",
)
LLAMA3_JSON = JsonCallFormat(
    name="llama3_json", trigger='{"name": "', separator="; ", args_key="parameters"
)
MISTRAL = MistralArrayFormat(
    name="mistral", trigger="[TOOL_CALLS]", separator="", markers=("[TOOL_CALLS]",)
)
MISTRAL_ARGS = MistralArgsFormat(
    name="mistral_args",
    trigger="[TOOL_CALLS]",
    separator="",
    markers=("[TOOL_CALLS]", ARGS_MARK, CALL_ID_MARK),
)
# The JSON variant of the prompt in Google's Gemma function-calling guide.
GEMMA_PROMPT = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST put "
    'it in the format of {{"name": function name, "parameters": dictionary of argument name and '
    "its value}}\n"
    "You SHOULD NOT include any other text in the response if you call a function\n"
    "{tools}"
)
GEMMA = JsonCallFormat(
    name="gemma",
    trigger='{"name": "',
    separator="\n",
    fences=("```json", "```tool_code"),
    args_key="parameters",
    prompt=GEMMA_PROMPT,
)
FORMATS = (QWEN25, MISTRAL, MISTRAL_ARGS, LLAMA3_JSON, GEMMA)
# Tokens that are text wherever a tokenizer has them, special or not (runtime/tokenizer.py).
TOOL_MARKERS = frozenset(mark for fmt in FORMATS for mark in fmt.markers)


def detect_format(template: str | None) -> ToolFormat | None:
    """The call format a chat template teaches, or None if it teaches none we know.

    NOTE: the order matters: a Qwen3 template mentions `<think>` and `<tool_call>`; a template
    that writes Mistral calls may mention `[INST]` of older ones."""
    if not template:
        return None
    if "<tool_call>" in template:
        return QWEN25
    if "[TOOL_CALLS]" in template:
        return MISTRAL_ARGS if ARGS_MARK in template else MISTRAL
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return LLAMA3_JSON
    if "<start_of_turn>" in template:
        return GEMMA
    return None


def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads its `tools` variable (Gemma 3's does not)."""
    return bool(template) and "tools" in (template or "")
