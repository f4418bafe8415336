"""Tool calling for /v1/chat/completions.

A request's `tools` are checked and rendered into the prompt by the model's chat template; the
output is constrained by a structural tag (weft.grammars.spec) so that every call the model makes
has the exact format its template taught it; the finished text (or the streamed deltas) is parsed
back into OpenAI `tool_calls`.

The call format comes from the chat template text (never from the model's name):

- qwen25 (the template mentions `<tool_call>`): a call is
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, calls are joined by "\\n";
- llama3_json (it mentions `<|python_tag|>` or `Environment: ipython`): a call is
  `{"name": "f", "parameters": {...}}`, calls are joined by "; ".

Parsing is one left-to-right pass (`ToolCallParser`) that the whole-text parse and the stream
share, so a streamed answer yields exactly the calls and content of the same text parsed at once.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from weft.grammars.spec import InvalidSpec, parse_spec
from weft.runtime.server.errors import ApiError, bad_request

logger = logging.getLogger("weft")

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes a call: `open_tag` + a JSON object + `close_tag`.

    Without tags the JSON object itself is the call and `trigger` (the start of the object) marks
    where one begins in free text.
    """

    name: str
    trigger: str  # a call starts where this appears in the output
    open_tag: str  # before the JSON object ("" if none)
    close_tag: str  # after the JSON object ("" if none: the object ends the call)
    args_key: str  # the JSON key of the arguments object
    separator: str  # between calls when the output is nothing but calls

    def begin(self, name: str) -> str:
        """The text of a call up to its arguments object (the structure's `begin`)."""
        head = f"{self.open_tag}\n" if self.open_tag else ""
        return f'{head}{{"name": {json.dumps(name)}, "{self.args_key}": '

    @property
    def end(self) -> str:
        """The text of a call after its arguments object (the structure's `end`)."""
        return "}" + (f"\n{self.close_tag}" if self.close_tag else "")


QWEN25 = ToolFormat(
    name="qwen25",
    trigger="<tool_call>",
    open_tag="<tool_call>",
    close_tag="</tool_call>",
    args_key="arguments",
    separator="\n",
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    trigger='{"name": "',
    open_tag="",
    close_tag="",
    args_key="parameters",
    separator="; ",
)


def detect_format(template: str | None) -> ToolFormat | None:
    """The call format a chat template teaches, or None if it teaches none we know."""
    if not template:
        return None
    if "<tool_call>" in template:
        return QWEN25
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return LLAMA3_JSON
    return None


# ---- the request side: tools, tool_choice, the structural tag --------------------------------


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI `tools` -> normalized tool dicts (parameters filled in); a 400 names the bad entry."""
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools has {len(tools)} entries; at most {MAX_TOOLS}", "tools")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise bad_request(
                f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type"
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad_request(
                f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise bad_request(
                f"{where}.function.name {name!r} is given twice", f"{where}.function.name"
            )
        seen.add(name)
        clean: dict[str, Any] = {"name": name}
        description = fn.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise bad_request(
                    f"{where}.function.description must be a string",
                    f"{where}.function.description",
                )
            clean["description"] = description
        parameters = _check_parameters(fn.get("parameters"), f"{where}.function")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(
                f"{where}.function.strict must be a boolean", f"{where}.function.strict"
            )
        # the template shows the model the schema its arguments are held to
        clean["parameters"] = (
            strict_schema(parameters, f"{where}.function.parameters") if strict else parameters
        )
        out.append({"type": "function", "function": clean})
    return out


def _check_parameters(value: Any, where: str) -> dict[str, Any]:
    param = f"{where}.parameters"
    if value is None:
        return dict(DEFAULT_PARAMETERS)
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object", param)
    try:
        parse_spec("json_schema", json.dumps(value))
    except RecursionError:  # the body decoder goes a little deeper than json does
        raise bad_request(f"invalid {param}: nested too deeply", param) from None
    except InvalidSpec as exc:
        raise bad_request(f"invalid {param}: {exc}", param) from None
    return value


# ---- strict mode: closed object schemas -------------------------------------------------------

# Where object schemas nest: maps of name -> subschema, subschemas, lists of subschemas.
# NOTE: not `not`, `if` or `dependentSchemas`, nor `contains`: closing an object inside a
# negation, a condition or a "some item" changes what the schema around it allows.
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")


def closed_schema(schema: Any) -> Any:
    """OpenAI's strict mode: a copy of `schema` in which every object schema (type "object", or
    no type and `properties`) that leaves `additionalProperties` unset has it false, at any
    depth. An explicit additionalProperties is kept (object schemas inside it are closed)."""
    if not isinstance(schema, dict):
        return schema  # true / false, or not a schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            value = {name: closed_schema(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [closed_schema(sub) for sub in value]
        elif key in _SUBSCHEMAS:
            value = closed_schema(value)
        out[key] = value
    kind = schema.get("type")
    is_object = (
        kind == "object"
        or (isinstance(kind, list) and "object" in kind)
        or (kind is None and "properties" in schema)
    )
    if is_object and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def strict_schema(schema: dict[str, Any], param: str) -> dict[str, Any]:
    """The schema a strict response format or function holds the output to (closed_schema); a
    400 names `param` if it is nested too deeply to walk."""
    try:
        closed: dict[str, Any] = closed_schema(schema)
    except RecursionError:
        raise bad_request(f"invalid {param}: nested too deeply", param) from None
    return closed


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # the forced function (mode "function")


def check_tool_choice(choice: Any, names: list[str]) -> ToolChoice:
    """OpenAI `tool_choice` (given the tools' names) -> a ToolChoice; a 400 names tool_choice."""
    if choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad_request(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function; got "
                f"{choice!r}",
                "tool_choice",
            )
        if choice != "none" and not names:
            raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
        return ToolChoice(choice)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise bad_request(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    name = fn.get("name")
    if not isinstance(name, str):
        raise bad_request("tool_choice.function.name must be a string", "tool_choice")
    if name not in names:
        raise bad_request(
            f"tool_choice names {name!r}, which is not one of the tools", "tool_choice"
        )
    return ToolChoice("function", name)


def structural_tag(
    fmt: ToolFormat, tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool = True
) -> dict[str, Any]:
    """The structural tag (weft.grammars.spec) that lets the model call `tools` as `choice` asks.

    auto: free text in which a call may start at the format's trigger; required: only calls, at
    least one; a named function: exactly one call of it. `parallel` false: at most one call.
    """
    if choice.mode not in ("auto", "required", "function"):
        raise ValueError(f"no structural tag for tool_choice {choice.mode!r}")
    chosen = [t for t in tools if choice.mode != "function" or t["function"]["name"] == choice.name]
    structures = [
        {
            "begin": fmt.begin(t["function"]["name"]),
            "schema": t["function"]["parameters"],
            "end": fmt.end,
        }
        for t in chosen
    ]
    return {
        "type": "structural_tag",
        "structures": structures,
        "triggers": [fmt.trigger],
        "free_text": choice.mode == "auto",
        "at_least_one": choice.mode != "auto",
        "repeat": parallel and choice.mode != "function",
        "separator": fmt.separator,
    }


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request with active tools needs: the tools for the template, the constraint
    and how to parse the output."""

    format: ToolFormat
    tools: list[dict[str, Any]]
    choice: ToolChoice
    structural_tag: str  # JSON text for SamplingParams.structural_tag

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.format, self.names)

    def parse(self, text: str, cut_off: bool = False) -> tuple[str | None, list[ToolCall]]:
        return parse_tool_calls(text, self.format, self.names, cut_off)


def plan_tools(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, template: str | None
) -> ToolPlan | None:
    """Check a request's tools and tool_choice; None when no tool may be called (no tools, or
    tool_choice "none": the tools are then neither rendered nor parsed)."""
    checked = check_tools(tools) if tools else []
    choice = check_tool_choice(tool_choice, [t["function"]["name"] for t in checked])
    if choice.mode == "none":
        return None
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    fmt = detect_format(template)
    if fmt is None:
        raise bad_request(
            "this model's chat template has no tool-call format (known: Qwen2.5 <tool_call> "
            "tags, Llama 3.1 JSON calls)",
            "tools",
        )
    tag = structural_tag(fmt, checked, choice, parallel_tool_calls is not False)
    text = json.dumps(tag, ensure_ascii=False)
    try:
        parse_spec("structural_tag", text)
    except InvalidSpec as exc:  # pragma: no cover - the tools were checked one by one above
        raise ApiError(
            f"the tools give an invalid structural tag: {exc}", 400, param="tools"
        ) from None
    return ToolPlan(fmt, checked, choice, text)


# ---- the output side: parsing calls -----------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


ParseEvent = str | ToolCall  # a piece of content, or a complete call


class _Trim:
    """Passes text through so that what comes out, joined, is the input joined and stripped."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""  # trailing whitespace: sent only if more text follows

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body


class ToolCallParser:
    """Splits model output into content and calls, fed any chunking of the text.

    Text is content until the format's trigger; a trigger starts a call that ends at the close
    tag (or where the JSON object closes, for formats without tags). A complete call whose JSON
    does not decode to {"name": <a tool>, <args key>: {...}} stays content. Between calls, and
    after the last one, whitespace and the separator are dropped. Content is stripped as a whole.
    Text that might still become part of a call (a prefix of the trigger, an unclosed call) is
    held back until it is decided or the output ends; then a call that never closed is dropped
    (max_tokens or a stop string cut it off: it is no content), and so is a prefix of the
    trigger at the end of an output that was cut off (the call it began is cut off too).
    """

    def __init__(self, fmt: ToolFormat, names: frozenset[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.pending = ""  # text not decided yet
        self.after_call = False  # pending starts right after a call
        self.trim = _Trim()
        self.num_calls = 0
        core = fmt.separator.strip()
        self._gap = re.compile(r"\s*" + (f"(?:{re.escape(core)})?\\s*" if core else ""))

    def feed(self, text: str) -> list[ParseEvent]:
        self.pending += text
        return self._advance(final=False)

    def finish(self, cut_off: bool = False) -> list[ParseEvent]:
        """The output ended: decide everything held back. `cut_off`: it did not end by itself
        (finish reason length, not stop)."""
        out = self._advance(final=True, cut_off=cut_off)
        if self.pending:
            logger.debug("tool call parser: a call cut off, dropped: %r", self.pending[:200])
            self.pending = ""
        return out

    def _advance(self, final: bool, cut_off: bool = False) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        while self.pending:
            if self.after_call and not self._skip_gap(final):
                break
            trigger = self.fmt.trigger
            start = self.pending.find(trigger)
            if start < 0:
                keep = 0 if final and not cut_off else _held_prefix(self.pending, trigger)
                self._content(out, self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            self._content(out, self.pending[:start])
            self.pending = self.pending[start:]
            end = self._call_end(self.pending)
            if end is None and not final:
                break
            segment = self.pending if end is None else self.pending[:end]
            call = self._decode(segment, closed=end is not None)
            if call is None and end is None:
                break  # an unclosed call: never content (finish drops it)
            if call is None:
                self._content(out, segment)
            else:
                out.append(call)
                self.num_calls += 1
                self.after_call = True
            self.pending = self.pending[len(segment) :]
        return out

    def _skip_gap(self, final: bool) -> bool:
        """After a call: drop a gap (whitespace, the separator) that precedes another call or
        ends the output. False: wait for more text."""
        match = self._gap.match(self.pending)
        gap = match.end() if match else 0
        rest = self.pending[gap:]
        if not rest:
            if not final:
                return False
            self.pending = ""  # the gap ends the output
            self.after_call = False
            return True
        if rest.startswith(self.fmt.trigger):
            self.pending = rest
            self.after_call = False
            return True
        if not final and self.fmt.trigger.startswith(rest):
            return False
        self.after_call = False  # the gap is content after all
        return True

    def _content(self, out: list[ParseEvent], text: str) -> None:
        piece = self.trim.add(text)
        if piece:
            if out and isinstance(out[-1], str):
                out[-1] += piece
            else:
                out.append(piece)

    def _call_end(self, text: str) -> int | None:
        """Where the call starting at text[0] ends (exclusive), None if it has not ended yet."""
        if self.fmt.close_tag:
            at = text.find(self.fmt.close_tag, len(self.fmt.trigger))
            return None if at < 0 else at + len(self.fmt.close_tag)
        return _object_end(text)

    def _decode(self, segment: str, closed: bool) -> ToolCall | None:
        body = segment
        if self.fmt.open_tag:
            body = body[len(self.fmt.open_tag) :]
            if closed:
                body = body[: -len(self.fmt.close_tag)]
        elif not closed:
            return None  # an unclosed JSON object is never a call
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            logger.debug("tool call parser: not JSON, kept as content: %r", segment[:200])
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            logger.debug("tool call parser: not a call of a known tool: %r", segment[:200])
            return None
        args = obj.get(self.fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                args = None
        if not isinstance(args, dict):
            logger.debug("tool call parser: arguments are not an object: %r", segment[:200])
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, trigger: str) -> int:
    """The length of the longest end of `text` that begins `trigger` (it may become one)."""
    for size in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0


def _object_end(text: str) -> int | None:
    """text starts with "{": the index after the matching "}" (strings respected), or None."""
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


def parse_tool_calls(
    text: str, fmt: ToolFormat, names: frozenset[str], cut_off: bool = False
) -> tuple[str | None, list[ToolCall]]:
    """Finished output -> (content outside the calls, stripped, None if empty; the calls).
    `cut_off`: the output did not end by itself (see ToolCallParser.finish)."""
    parser = ToolCallParser(fmt, names)
    events = parser.feed(text) + parser.finish(cut_off)
    content = "".join(e for e in events if isinstance(e, str))
    return content or None, [e for e in events if isinstance(e, ToolCall)]
