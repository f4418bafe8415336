"""Tool calling for /v1/chat/completions.

A request's `tools` are checked and rendered into the prompt by the model's chat template; the
output is constrained by a structural tag (weft.grammars.spec) so that every call the model makes
has the exact format its template taught it; the finished text (or the streamed deltas) is parsed
back into OpenAI `tool_calls`.

The call format comes from the chat template text (never from the model's name): `tool_formats`
(Qwen2.5/Qwen3 `<tool_call>`, Mistral `[TOOL_CALLS]`, Llama 3.1 JSON, Gemma 3 JSON in text).

Parsing (`tool_parser`) is one left-to-right pass that the whole-text parse and the stream
share, so a streamed answer yields exactly the calls and content of the same text parsed at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from weft.grammars.spec import InvalidSpec, parse_spec
from weft.runtime.server.errors import ApiError, bad_request
from weft.runtime.server.tool_formats import ToolFormat, detect_format
from weft.runtime.server.tool_parser import ToolCall, ToolCallParser, parse_tool_calls

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")


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
        fn, at = tool.get("function"), f"{where}.function"
        if not isinstance(fn, dict):
            raise bad_request(f"{at} must be an object", at)
        name = check_name(fn.get("name"), f"{at}.name")
        if name in seen:
            raise bad_request(f"{at}.name {name!r} is given twice", f"{at}.name")
        seen.add(name)
        clean: dict[str, Any] = {"name": name}
        description = fn.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise bad_request(f"{at}.description must be a string", f"{at}.description")
            clean["description"] = description
        parameters = _check_parameters(fn.get("parameters"), at)
        strict = check_flag(fn.get("strict"), f"{at}.strict")
        # the template shows the model the schema its arguments are held to
        clean["parameters"] = (
            strict_schema(parameters, f"{at}.parameters") if strict else parameters
        )
        out.append({"type": "function", "function": clean})
    return out


def check_name(name: Any, param: str) -> str:
    """A function's (or a response format's) name, as OpenAI allows it; a 400 names `param`."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(f"{param} must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", param)
    return name


def check_flag(value: Any, param: str) -> bool | None:
    """An optional boolean; a 400 names `param`."""
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{param} must be a boolean", param)
    return value


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
    structures, repeat = fmt.structures(chosen, parallel and choice.mode != "function")
    return {
        "type": "structural_tag",
        "structures": structures,
        "triggers": [fmt.trigger],
        "free_text": choice.mode == "auto",
        "at_least_one": choice.mode != "auto",
        "repeat": repeat,
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
    check_flag(parallel_tool_calls, "parallel_tool_calls")
    fmt = detect_format(template)
    if fmt is None:
        raise bad_request(
            "this model's chat template has no tool-call format (known: Qwen2.5/Qwen3 "
            "<tool_call> tags, Mistral [TOOL_CALLS], Llama 3.1 JSON calls, Gemma 3 "
            "<start_of_turn> turns)",
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
