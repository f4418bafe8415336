"""Tool calling, response_format and constraint fields, without a model or a server: call-format
detection on real chat templates, the structural tags each tool_choice gives, parsing (whole text
and streamed in any chunking), and the 400s that name the bad field."""

from __future__ import annotations

import copy
import json
import random
from types import SimpleNamespace
from typing import Any

import jsonschema
import msgspec
import pytest

from weft.grammars.spec import parse_spec
from weft.runtime.server.chat import ChatRenderer
from weft.runtime.server.errors import ApiError
from weft.runtime.server.openai_api import _chat_job, _constraint, response_format_constraint
from weft.runtime.server.openai_jobs import ChatJob, Cursor
from weft.runtime.server.openai_protocol import ChatCompletionRequest
from weft.runtime.server.reasoning import MarkerIds
from weft.runtime.server.request_state import ReqState, Sample
from weft.runtime.server.sglang_params import parse_sampling_params
from weft.runtime.server.tool_calls import (
    ToolChoice,
    check_tool_choice,
    check_tools,
    closed_schema,
    plan_tools,
    strict_schema,
    structural_tag,
)
from weft.runtime.server.tool_formats import (
    GEMMA,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_ARGS,
    QWEN25,
    detect_format,
)
from weft.runtime.server.tool_parser import ToolCall, ToolCallParser, parse_tool_calls
from weft.runtime.server_config import ServerConfig

from chat_templates import GEMMA3, MISTRAL_V11, QWEN3
from conftest import fixture_path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add"}}  # parameters default to an empty object
TOOLS = [WEATHER, ADD]
NAMES = frozenset({"get_weather", "add"})
EMPTY_OBJECT = {"type": "object", "properties": {}}


def template(name: str) -> str:
    return fixture_path("tokenizers", "chat-templates", name).read_text()


def api_error(call: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        call(*args, **kwargs)
    assert err.value.status == 400
    return err.value


# ---- call formats --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,expected",
    [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", QWEN25),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3_JSON),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3_JSON),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL),
        ("microsoft-Phi-3.5-mini-instruct.jinja", None),
    ],
)
def test_format_detection_on_real_templates(name, expected):
    assert detect_format(template(name)) is expected


@pytest.mark.parametrize(
    "text,expected",
    [(QWEN3, QWEN25), (MISTRAL_V11, MISTRAL_ARGS), (GEMMA3, GEMMA)],
    ids=["qwen3", "mistral v11", "gemma3"],
)
def test_format_detection_on_other_families(text, expected):
    assert detect_format(text) is expected


def test_format_strings():
    assert QWEN25.begin("get_weather") == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert QWEN25.end == "}\n</tool_call>"
    assert LLAMA3_JSON.begin("add") == '{"name": "add", "parameters": '
    assert LLAMA3_JSON.end == "}"
    assert MISTRAL.begin("add") == '[TOOL_CALLS][{"name": "add", "arguments": '
    assert MISTRAL.end == "}]"
    assert MISTRAL_ARGS.begin("add") == "[TOOL_CALLS]add[ARGS]"
    assert MISTRAL_ARGS.end == ""
    assert GEMMA.begin("add") == '{"name": "add", "parameters": '
    assert GEMMA.end == "}"
    assert detect_format(None) is None and detect_format("{{ messages }}") is None
    for fmt in (MISTRAL, MISTRAL_ARGS):  # what Mistral's templates take back in a history
        call_id = fmt.call_id()
        assert len(call_id) == 9 and call_id.isalnum()


# ---- tools and tool_choice -----------------------------------------------------------------


def test_tools_are_normalized():
    assert check_tools(TOOLS) == [
        WEATHER,
        {"type": "function", "function": {"name": "add", "parameters": EMPTY_OBJECT}},
    ]


@pytest.mark.parametrize(
    "tools,param",
    [
        ("get_weather", "tools"),
        ([WEATHER, 5], "tools[1]"),
        ([{"type": "code", "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        (
            [WEATHER, {"type": "function", "function": {"name": "bad name"}}],
            "tools[1].function.name",
        ),
        ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
        ([{"type": "function", "function": {}}], "tools[0].function.name"),
        ([WEATHER, WEATHER], "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "description": 3}}],
            "tools[0].function.description",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
            "tools[0].function.strict",
        ),
    ],
)
def test_bad_tools_name_the_entry(tools, param):
    assert api_error(check_tools, tools).param == param


def test_tool_choice():
    names = ["get_weather", "add"]
    assert check_tool_choice(None, names) == ToolChoice("auto")
    assert check_tool_choice(None, []) == ToolChoice("none")
    assert check_tool_choice("none", []) == ToolChoice("none")
    assert check_tool_choice("required", names) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "add"}}
    assert check_tool_choice(named, names) == ToolChoice("function", "add")
    for bad in (
        "sometimes",
        {"type": "function", "function": {"name": "nope"}},
        {"type": "function"},
        {"function": {"name": "add"}},
        5,
    ):
        assert api_error(check_tool_choice, bad, names).param == "tool_choice"
    error = api_error(check_tool_choice, {"type": "function", "function": {"name": "nope"}}, names)
    assert "'nope'" in error.message
    assert api_error(check_tool_choice, "required", []).param == "tool_choice"


# ---- structural tags -----------------------------------------------------------------------


def _structure(fmt, name, schema):
    return {"begin": fmt.begin(name), "schema": schema, "end": fmt.end}


def test_structural_tag_auto_qwen():
    tag = structural_tag(QWEN25, check_tools(TOOLS), ToolChoice("auto"))
    assert tag == {
        "type": "structural_tag",
        "structures": [
            {
                "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
                "schema": WEATHER["function"]["parameters"],
                "end": "}\n</tool_call>",
            },
            {
                "begin": '<tool_call>\n{"name": "add", "arguments": ',
                "schema": EMPTY_OBJECT,
                "end": "}\n</tool_call>",
            },
        ],
        "triggers": ["<tool_call>"],
        "free_text": True,
        "at_least_one": False,
        "repeat": True,
        "separator": "\n",
    }
    assert json.loads(parse_spec("structural_tag", json.dumps(tag)).text) == tag


def test_structural_tag_required_named_and_not_parallel():
    tools = check_tools(TOOLS)
    required = structural_tag(QWEN25, tools, ToolChoice("required"))
    assert (required["free_text"], required["at_least_one"], required["repeat"]) == (
        False,
        True,
        True,
    )
    assert len(required["structures"]) == 2
    named = structural_tag(QWEN25, tools, ToolChoice("function", "add"))
    assert named["structures"] == [_structure(QWEN25, "add", EMPTY_OBJECT)]
    assert (named["free_text"], named["at_least_one"], named["repeat"]) == (False, True, False)
    single = structural_tag(QWEN25, tools, ToolChoice("auto"), parallel=False)
    assert (single["free_text"], single["at_least_one"], single["repeat"]) == (True, False, False)
    for tag in (required, named, single):
        assert json.loads(parse_spec("structural_tag", json.dumps(tag)).text) == tag


def test_structural_tag_llama():
    tag = structural_tag(LLAMA3_JSON, check_tools([WEATHER]), ToolChoice("required"))
    assert tag == {
        "type": "structural_tag",
        "structures": [
            {
                "begin": '{"name": "get_weather", "parameters": ',
                "schema": WEATHER["function"]["parameters"],
                "end": "}",
            }
        ],
        "triggers": ['{"name": "'],
        "free_text": False,
        "at_least_one": True,
        "repeat": True,
        "separator": "; ",
    }
    auto = structural_tag(LLAMA3_JSON, check_tools([WEATHER]), ToolChoice("auto"))
    parse_spec("structural_tag", json.dumps(auto))
    assert auto["triggers"] == ['{"name": "'] and auto["free_text"] is True


def test_plan_tools():
    qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    plan = plan_tools(TOOLS, "required", False, qwen)
    assert plan is not None and plan.format is QWEN25
    assert json.loads(plan.structural_tag) == structural_tag(
        QWEN25, check_tools(TOOLS), ToolChoice("required"), parallel=False
    )
    assert plan.names == NAMES
    assert plan_tools(TOOLS, "none", None, qwen) is None
    assert plan_tools(None, None, None, qwen) is None
    assert plan_tools([], None, None, qwen) is None
    phi = template("microsoft-Phi-3.5-mini-instruct.jinja")
    assert plan_tools(TOOLS, "none", None, phi) is None  # no call format needed
    error = api_error(plan_tools, TOOLS, None, None, phi)
    assert error.param == "tools" and "no tool-call format" in error.message
    assert api_error(plan_tools, [{"type": "x"}], "none", None, qwen).param == "tools[0].type"


# ---- parsing -------------------------------------------------------------------------------


def q(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def calls_of(text: str, fmt=QWEN25) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, fmt, NAMES)
    for call in calls:
        if fmt in (MISTRAL, MISTRAL_ARGS):
            assert len(call.id) == 9 and call.id.isalnum()
        else:
            assert call.id.startswith("call_") and len(call.id) == 5 + 24
            int(call.id[5:], 16)
    return content, [(c.name, c.arguments) for c in calls]


PARSE_CASES = [
    ("no calls", "Just text.", QWEN25, ("Just text.", [])),
    ("empty", "", QWEN25, (None, [])),
    ("whitespace", " \n ", QWEN25, (None, [])),
    (
        "one call",
        q("get_weather", '{"city": "Paris"}'),
        QWEN25,
        (None, [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        "parallel calls",
        q("get_weather", '{"city": "Paris"}') + "\n" + q("add", "{}"),
        QWEN25,
        (None, [("get_weather", '{"city": "Paris"}'), ("add", "{}")]),
    ),
    (
        "content around calls",
        "Let me check.\n" + q("get_weather", '{"city":"Oslo","days":2}') + "\nDone.",
        QWEN25,
        ("Let me check.\n\nDone.", [("get_weather", '{"city": "Oslo", "days": 2}')]),
    ),
    (
        "malformed JSON stays content",
        'Hi <tool_call>\n{"name": "add", "arguments": {oops}\n</tool_call> end',
        QWEN25,
        ('Hi <tool_call>\n{"name": "add", "arguments": {oops}\n</tool_call> end', []),
    ),
    (
        "an unknown tool stays content",
        q("launch", "{}"),
        QWEN25,
        (q("launch", "{}"), []),
    ),
    (
        "arguments not an object stay content",
        q("add", "[1, 2]"),
        QWEN25,
        (q("add", "[1, 2]"), []),
    ),
    (
        "a malformed call next to a good one",
        q("add", "{") + "\n" + q("add", '{"a": 1}'),
        QWEN25,
        (q("add", "{"), [("add", '{"a": 1}')]),
    ),
    (
        "a call that never closed is no content",
        'Sure. <tool_call>\n{"name": "add", "argu',
        QWEN25,
        ("Sure.", []),
    ),
    (
        "a call without its close tag at the end",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n',
        QWEN25,
        (None, [("add", '{"a": 1}')]),
    ),
    (
        "a trigger prefix at the end is content",
        "Hmm <tool_",
        QWEN25,
        ("Hmm <tool_", []),
    ),
    (
        "arguments given as JSON text",
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        QWEN25,
        (None, [("add", '{"a": 1}')]),
    ),
    (
        "llama: one call",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        LLAMA3_JSON,
        (None, [("get_weather", '{"city": "Rome"}')]),
    ),
    (
        "llama: parallel calls joined by '; '",
        '{"name": "add", "parameters": {"a": "}{"}}; {"name": "get_weather", "parameters": {}}',
        LLAMA3_JSON,
        (None, [("add", '{"a": "}{"}'), ("get_weather", "{}")]),
    ),
    (
        "llama: content before a call, separator after",
        'Calling now: {"name": "add", "parameters": {"a": [1, {"b": 2}]}}; ',
        LLAMA3_JSON,
        ("Calling now:", [("add", '{"a": [1, {"b": 2}]}')]),
    ),
    (
        "llama: a call that never closed is no content",
        'x {"name": "add", "parameters": {',
        LLAMA3_JSON,
        ("x", []),
    ),
    (
        "llama: JSON that is not a call stays content",
        '{"name": "Bob", "age": 3} is a record',
        LLAMA3_JSON,
        ('{"name": "Bob", "age": 3} is a record', []),
    ),
]


def m(*calls: tuple[str, str]) -> str:
    """A Mistral v3 call block holding `calls`."""
    body = ", ".join(f'{{"name": "{name}", "arguments": {args}}}' for name, args in calls)
    return f"[TOOL_CALLS][{body}]"


PARSE_CASES += [
    (
        "mistral: one call",
        m(("get_weather", '{"city": "Paris"}')),
        MISTRAL,
        (None, [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        "mistral: one array, two calls (as the template writes them)",
        m(("add", '{"a": "]["}'), ("get_weather", "{}")),
        MISTRAL,
        (None, [("add", '{"a": "]["}'), ("get_weather", "{}")]),
    ),
    (
        "mistral: a block per call (as the constraint writes them), content before",
        "Checking. " + m(("add", '{"a": 1}')) + m(("add", '{"a": 2}')),
        MISTRAL,
        ("Checking.", [("add", '{"a": 1}'), ("add", '{"a": 2}')]),
    ),
    (
        "mistral: a space after the marker",
        '[TOOL_CALLS] [{"name": "add", "arguments": {}}]',
        MISTRAL,
        (None, [("add", "{}")]),
    ),
    (
        "mistral: an unknown tool in the array keeps it all content",
        m(("add", "{}"), ("launch", "{}")),
        MISTRAL,
        (m(("add", "{}"), ("launch", "{}")), []),
    ),
    (
        "mistral: the marker without an array is content",
        "Use [TOOL_CALLS] wisely",
        MISTRAL,
        ("Use [TOOL_CALLS] wisely", []),
    ),
    (
        "mistral: a call that never closed is no content",
        'Ok. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}',
        MISTRAL,
        ("Ok.", []),
    ),
    (
        "mistral v11: parallel calls",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]add[ARGS]{}',
        MISTRAL_ARGS,
        (None, [("get_weather", '{"city": "Rome", "days": 2}'), ("add", "{}")]),
    ),
    (
        "mistral v11: a call id before the arguments",
        'Sure [TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": "{"}',
        MISTRAL_ARGS,
        ("Sure", [("add", '{"a": "{"}')]),
    ),
    (
        "mistral v11: no arguments object is content",
        "[TOOL_CALLS]add[ARGS] nothing",
        MISTRAL_ARGS,
        ("[TOOL_CALLS]add[ARGS] nothing", []),
    ),
    (
        "mistral v11: a marker in prose without [ARGS] is content",
        "The [TOOL_CALLS] marker starts a call, " + "and this sentence is long enough " * 5,
        MISTRAL_ARGS,
        (
            (
                "The [TOOL_CALLS] marker starts a call, " + "and this sentence is long enough " * 5
            ).strip(),
            [],
        ),
    ),
    (
        "gemma: a bare JSON call",
        '{"name": "get_weather", "parameters": {"city": "Lima"}}',
        GEMMA,
        (None, [("get_weather", '{"city": "Lima"}')]),
    ),
    (
        "gemma: calls on lines of their own, text before",
        'I will call.\n{"name": "add", "parameters": {}}\n{"name": "add", "parameters": {"a": 1}}',
        GEMMA,
        ("I will call.", [("add", "{}"), ("add", '{"a": 1}')]),
    ),
]

GEMMA_CALL = '{"name": "get_weather", "parameters": {"city": "Lima"}}'
PARSE_CASES += [
    (
        "gemma: a call in a json fence",
        f"```json\n{GEMMA_CALL}\n```",
        GEMMA,
        (None, [("get_weather", '{"city": "Lima"}')]),
    ),
    (
        "gemma: a call in a tool_code fence, text around",
        f"Let me check.\n```tool_code\n{GEMMA_CALL}\n```\nDone.",
        GEMMA,
        ("Let me check.\n\nDone.", [("get_weather", '{"city": "Lima"}')]),
    ),
    (
        "gemma: two calls in one fence",
        f'```json\n{GEMMA_CALL}\n{{"name": "add", "parameters": {{}}}}\n```',
        GEMMA,
        (None, [("get_weather", '{"city": "Lima"}'), ("add", "{}")]),
    ),
    (
        "gemma: only the fence that holds the call goes",
        f"```python\nprint(1)\n```\n```json\n{GEMMA_CALL}\n```\n```json\n[1]\n```",
        GEMMA,
        (
            "```python\nprint(1)\n```\n\n```json\n[1]\n```",
            [("get_weather", '{"city": "Lima"}')],
        ),
    ),
    (
        "gemma: a fence around JSON that is no call stays",
        '```json\n{"name": "Bob", "age": 3}\n```',
        GEMMA,
        ('```json\n{"name": "Bob", "age": 3}\n```', []),
    ),
    (
        "gemma: a fence without a language stays (it may close another block)",
        f"```\n{GEMMA_CALL}\n```",
        GEMMA,
        ("```\n\n```", [("get_weather", '{"city": "Lima"}')]),
    ),
    (
        "gemma: a fence left open loses its opener only",
        f"```json {GEMMA_CALL} and more",
        GEMMA,
        ("and more", [("get_weather", '{"city": "Lima"}')]),
    ),
    ("gemma: an opener alone is content", "See ```json", GEMMA, ("See ```json", [])),
]

# outputs cut off by max_tokens (finish reason length): what may begin a call at the end is no
# content either
CUT_OFF_CASES = [
    ("a trigger prefix at the end", "Hmm <tool_", QWEN25, ("Hmm", [])),
    ("a trigger prefix alone (tool_choice required)", "<to", QWEN25, (None, [])),
    ("the trigger alone", "<tool_call>", QWEN25, (None, [])),
    (
        "a call, then one cut off",
        "Sure.\n" + q("add", '{"a": 1}') + '\n<tool_call>\n{"name": "get_',
        QWEN25,
        ("Sure.", [("add", '{"a": 1}')]),
    ),
    ("a call, then a trigger prefix", q("add", "{}") + "\n<", QWEN25, (None, [("add", "{}")])),
    ("text that begins no call", "a < b", QWEN25, ("a < b", [])),
    ("llama: a trigger prefix at the end", 'x {"na', LLAMA3_JSON, ("x", [])),
    ("llama: a call cut off", '{"name": "add", "parameters": {"a"', LLAMA3_JSON, (None, [])),
    ("mistral: a marker prefix at the end", "Ok [TOOL_CA", MISTRAL, ("Ok", [])),
    ("mistral: an array cut off", m(("add", "{}"))[:-3], MISTRAL, (None, [])),
    ("mistral v11: a name cut off", "[TOOL_CALLS]get_wea", MISTRAL_ARGS, (None, [])),
    ("mistral v11: arguments cut off", '[TOOL_CALLS]add[ARGS]{"a": ', MISTRAL_ARGS, (None, [])),
    ("gemma: a call cut off", 'Hi {"name": "add", "param', GEMMA, ("Hi", [])),
    ("gemma: a fenced call cut off", 'Hi\n```json\n{"name": "add", "param', GEMMA, ("Hi", [])),
    ("gemma: a fenced trigger prefix", 'Hi\n```json\n{"na', GEMMA, ("Hi", [])),
    ("gemma: an opener at the end stays", "Hi\n```json\n", GEMMA, ("Hi\n```json", [])),
]


@pytest.mark.parametrize(
    "text,fmt,expected", [c[1:] for c in PARSE_CASES], ids=[c[0] for c in PARSE_CASES]
)
def test_parse(text, fmt, expected):
    assert calls_of(text, fmt) == expected


@pytest.mark.parametrize(
    "text,fmt,expected", [c[1:] for c in CUT_OFF_CASES], ids=[c[0] for c in CUT_OFF_CASES]
)
def test_parse_cut_off(text, fmt, expected):
    content, calls = parse_tool_calls(text, fmt, NAMES, cut_off=True)
    assert (content, [(c.name, c.arguments) for c in calls]) == expected


def _stream(
    text: str, fmt, cuts: list[int], cut_off: bool = False
) -> tuple[str | None, list[tuple[str, str]]]:
    parser = ToolCallParser(fmt, NAMES)
    events = []
    last = 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.finish(cut_off)
    content = "".join(e for e in events if isinstance(e, str))
    calls = [(e.name, e.arguments) for e in events if not isinstance(e, str)]
    assert parser.num_calls == len(calls)
    return content or None, calls


@pytest.mark.parametrize(
    "case,cut_off",
    [(c, False) for c in PARSE_CASES] + [(c, True) for c in CUT_OFF_CASES],
    ids=[c[0] for c in PARSE_CASES] + ["cut off: " + c[0] for c in CUT_OFF_CASES],
)
def test_streaming_parse_equals_whole_parse(case, cut_off):
    _, text, fmt, expected = case
    rng = random.Random(hash(text) & 0xFFFF)
    assert _stream(text, fmt, [], cut_off) == expected
    one_by_one = list(range(1, len(text)))
    assert _stream(text, fmt, one_by_one, cut_off) == expected
    for _ in range(200 if len(text) > 1 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
        assert _stream(text, fmt, cuts, cut_off) == expected, cuts


def test_streaming_holds_back_only_what_may_start_a_call():
    parser = ToolCallParser(QWEN25, NAMES)
    assert parser.feed("Hello <tool") == ["Hello"]  # " <tool" may begin a call
    assert parser.feed("box> ") == [" <toolbox>"]  # it did not; the trailing space waits
    assert parser.feed(q("add", '{"a": 1}')[:-1]) == []  # the close tag is not complete
    [call] = parser.feed(">")
    assert isinstance(call, ToolCall) and (call.name, call.arguments) == ("add", '{"a": 1}')
    assert parser.feed("\n") == []  # a separator after a call is no content
    assert parser.feed(" Bye") == [" \n Bye"]  # the held space, the gap, the text
    assert parser.finish() == []


# ---- the stream chunks of a chat job -------------------------------------------------------


def _job(plan) -> tuple[ChatJob, Sample]:
    sample = Sample()
    state = ReqState(rid="r", prompt_tokens=3, samples=[sample], listener=None)  # type: ignore[arg-type]
    return ChatJob(None, "m", [state], None, tools=plan), sample  # type: ignore[arg-type]


def test_stream_chunks_carry_the_same_calls_as_the_response():
    plan = plan_tools(TOOLS, None, None, template("Qwen-Qwen2.5-7B-Instruct.jinja"))
    text = "Sure.\n" + q("get_weather", '{"city": "Paris"}') + "\n" + q("add", '{"a": 2}')
    rng = random.Random(7)
    for _ in range(20):
        job, sample = _job(plan)
        cur = Cursor(parser=plan.parser())
        choices = []
        at = 0
        while at < len(text):
            step = rng.randint(1, 9)
            sample.text += text[at : at + step]
            at += step
            if at >= len(text):
                sample.finish_reason = {"type": "stop", "matched": 151645}
            choices += job._stream_choices(0, sample, cur)
        deltas = [c["delta"] for c in choices]
        assert deltas[0]["role"] == "assistant"
        assert [c["finish_reason"] for c in choices][-1] == "tool_calls"
        assert all(c["finish_reason"] is None for c in choices[:-1])
        content = "".join(d.get("content") or "" for d in deltas)
        calls: dict[int, dict[str, Any]] = {}
        for d in deltas:
            for part in d.get("tool_calls", []):
                call = calls.setdefault(part["index"], {"arguments": ""})
                if "id" in part:
                    assert part["type"] == "function" and part["function"]["arguments"] == ""
                    call.update(id=part["id"], name=part["function"]["name"])
                call["arguments"] += part["function"]["arguments"]
        whole = job.response()["choices"][0]
        assert whole["finish_reason"] == "tool_calls"
        assert whole["message"]["content"] == content == "Sure."
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c["function"]["name"], c["function"]["arguments"])
            for c in whole["message"]["tool_calls"]
        ]


def test_no_tool_calls_finish_on_length_or_without_calls():
    plan = plan_tools(TOOLS, None, None, template("Qwen-Qwen2.5-7B-Instruct.jinja"))
    job, sample = _job(plan)
    sample.text = q("add", "{}")
    sample.finish_reason = {"type": "length", "length": 9}
    assert job.response()["choices"][0]["finish_reason"] == "length"
    job, sample = _job(plan)
    sample.text = "No tools needed."
    sample.finish_reason = {"type": "stop", "matched": 151645}
    choice = job.response()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "No tools needed."}


def _streamed(job: ChatJob, sample: Sample, text: str, finish: dict[str, Any], step: int) -> Any:
    """(content, [(name, arguments)], finish_reason) of a chat job's chunks, `step` characters
    of `text` at a time."""
    cur = Cursor(parser=job.tools.parser() if job.tools is not None else None)
    choices = []
    for at in range(0, len(text), step):
        sample.text = text[: at + step]
        if at + step >= len(text):
            sample.finish_reason = finish
        choices += job._stream_choices(0, sample, cur)
    deltas = [c["delta"] for c in choices]
    content = "".join(d.get("content") or "" for d in deltas) or None
    calls: dict[int, list[str]] = {}
    for part in (p for d in deltas for p in d.get("tool_calls", [])):
        call = calls.setdefault(part["index"], [part["function"].get("name", ""), ""])
        call[1] += part["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()], choices[-1]["finish_reason"]


def test_a_gemma_call_in_a_fence_whole_and_streamed():
    plan = plan_tools(TOOLS, None, None, GEMMA3)
    text = f"Checking.\n```json\n{GEMMA_CALL}\n```"
    stop = {"type": "stop", "matched": 106}
    job, sample = _job(plan)
    sample.text = text
    sample.finish_reason = stop
    choice = job.response()["choices"][0]
    calls = [("get_weather", '{"city": "Lima"}')]
    assert choice["message"]["content"] == "Checking."
    assert [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ] == calls
    for step in (1, 2, 5, len(text)):
        job, sample = _job(plan)
        assert _streamed(job, sample, text, stop, step) == ("Checking.", calls, "tool_calls")


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
@pytest.mark.parametrize(
    "text,content,calls",
    [
        ("<to", None, []),
        ('<tool_call>\n{"name": "add", "arguments": {"a', None, []),
        (q("add", '{"a": 1}') + "\n<tool_call>\n", None, [("add", '{"a": 1}')]),
        ('Let me see. <tool_call>\n{"name": "get_weather", "ar', "Let me see.", []),
    ],
)
def test_a_call_cut_off_by_max_tokens_is_no_content(tool_choice, text, content, calls):
    # the whole response and the stream (any chunking) say the same: no markup in content
    plan = plan_tools(TOOLS, tool_choice, None, template("Qwen-Qwen2.5-7B-Instruct.jinja"))
    length = {"type": "length", "length": 9}
    job, sample = _job(plan)
    sample.text = text
    sample.finish_reason = length
    choice = job.response()["choices"][0]
    assert choice["message"].get("content") == content
    whole = [
        (c["function"]["name"], c["function"]["arguments"])
        for c in choice["message"].get("tool_calls", [])
    ]
    assert whole == calls
    assert choice["finish_reason"] == "length"
    for step in (1, 3, len(text)):
        job, sample = _job(plan)
        assert _streamed(job, sample, text, length, step) == (content, calls, "length")


# ---- response_format and the OpenAI constraint fields ---------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format_mapping():
    assert response_format_constraint(None) is None
    assert response_format_constraint({"type": "text"}) is None
    assert response_format_constraint({"type": "json_object"}) == '{"type": "object"}'
    for strict in (None, False):  # the schema as given
        fmt = {"type": "json_schema", "json_schema": {"name": "a_1", "schema": SCHEMA}}
        if strict is not None:
            fmt["json_schema"]["strict"] = strict
        assert json.loads(response_format_constraint(fmt) or "") == SCHEMA
    # strict: a closed schema
    fmt = {"type": "json_schema", "json_schema": {"name": "a_1", "schema": SCHEMA, "strict": True}}
    assert json.loads(response_format_constraint(fmt) or "") == {
        **SCHEMA,
        "additionalProperties": False,
    }
    assert "additionalProperties" not in SCHEMA  # the request's schema is left alone


# ---- strict mode: closed object schemas ----------------------------------------------------

INT = {"type": "integer"}
OPEN = {"type": "object", "properties": {"a": INT}}
SHUT = {"type": "object", "properties": {"a": INT}, "additionalProperties": False}


@pytest.mark.parametrize(
    "schema,closed",
    [
        (OPEN, SHUT),
        ({"type": "object"}, {"type": "object", "additionalProperties": False}),
        ({"properties": {"a": INT}}, {"properties": {"a": INT}, "additionalProperties": False}),
        (
            {"type": ["object", "null"], "properties": {}},
            {"type": ["object", "null"], "properties": {}, "additionalProperties": False},
        ),
        # an explicit additionalProperties is kept; a schema given there is closed inside
        ({**OPEN, "additionalProperties": True}, {**OPEN, "additionalProperties": True}),
        (
            {"type": "object", "additionalProperties": OPEN},
            {"type": "object", "additionalProperties": SHUT},
        ),
        # nested: properties, items (a schema or a list), prefixItems
        (
            {"type": "object", "properties": {"p": OPEN, "n": INT}, "required": ["p"]},
            {
                "type": "object",
                "properties": {"p": SHUT, "n": INT},
                "required": ["p"],
                "additionalProperties": False,
            },
        ),
        ({"type": "array", "items": OPEN}, {"type": "array", "items": SHUT}),
        ({"type": "array", "items": [OPEN, INT]}, {"type": "array", "items": [SHUT, INT]}),
        (
            {"type": "array", "prefixItems": [OPEN], "items": {"properties": {"q": OPEN}}},
            {
                "type": "array",
                "prefixItems": [SHUT],
                "items": {"properties": {"q": SHUT}, "additionalProperties": False},
            },
        ),
        # branches and definitions
        ({"anyOf": [OPEN, INT]}, {"anyOf": [SHUT, INT]}),
        ({"oneOf": [OPEN], "allOf": [OPEN]}, {"oneOf": [SHUT], "allOf": [SHUT]}),
        (
            {"$defs": {"A": OPEN}, "definitions": {"B": OPEN}, "$ref": "#/$defs/A"},
            {"$defs": {"A": SHUT}, "definitions": {"B": SHUT}, "$ref": "#/$defs/A"},
        ),
        (
            {"type": "object", "patternProperties": {"^x": OPEN}},
            {"type": "object", "patternProperties": {"^x": SHUT}, "additionalProperties": False},
        ),
        # deep: objects in arrays in branches in objects
        (
            {"properties": {"a": {"anyOf": [{"items": {"$defs": {"D": OPEN}}}]}}},
            {
                "properties": {"a": {"anyOf": [{"items": {"$defs": {"D": SHUT}}}]}},
                "additionalProperties": False,
            },
        ),
        # left alone: what is no object schema, a negation, a condition, values that are data
        ({"type": "string", "maxLength": 3}, {"type": "string", "maxLength": 3}),
        ({"not": OPEN, "if": OPEN}, {"not": OPEN, "if": OPEN}),
        (
            {"enum": [{"properties": 1}], "const": {"type": "object"}, "default": OPEN},
            {"enum": [{"properties": 1}], "const": {"type": "object"}, "default": OPEN},
        ),
        (True, True),
        ({}, {}),
    ],
)
def test_closed_schema(schema, closed):
    before = copy.deepcopy(schema)
    assert closed_schema(schema) == closed
    assert schema == before  # a new schema; the given one is left alone


def test_strict_schema_nested_too_deeply_is_a_400():
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    error = api_error(strict_schema, deep, "response_format.json_schema.schema")
    assert error.param == "response_format.json_schema.schema"
    assert error.message == "invalid response_format.json_schema.schema: nested too deeply"


def test_strict_functions_take_closed_arguments():
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    loose = {"type": "function", "function": {"name": "add", "parameters": OPEN, "strict": False}}
    tools = check_tools([strict, loose])
    closed_weather = {**WEATHER["function"]["parameters"], "additionalProperties": False}
    assert tools == [
        {"type": "function", "function": {**WEATHER["function"], "parameters": closed_weather}},
        {"type": "function", "function": {"name": "add", "parameters": OPEN}},
    ]
    tag = structural_tag(QWEN25, tools, ToolChoice("required"))
    assert [st["schema"] for st in tag["structures"]] == [closed_weather, OPEN]
    # a strict function without parameters takes the empty object, closed
    bare = check_tools([{"type": "function", "function": {"name": "f", "strict": True}}])
    assert bare[0]["function"]["parameters"] == {**EMPTY_OBJECT, "additionalProperties": False}


@pytest.mark.parametrize(
    "fmt,param",
    [
        ("json", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a"}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": 1}},
            "response_format.json_schema.strict",
        ),
    ],
)
def test_response_format_errors_name_the_part(fmt, param):
    assert api_error(response_format_constraint, fmt).param == param


def chat_request(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def test_extension_constraint_fields():
    assert _constraint(chat_request(), []) is None
    assert _constraint(chat_request(regex="[ab]+"), []) == ("regex", "[ab]+")
    assert _constraint(chat_request(ebnf='root ::= "yes"'), []) == ("ebnf", 'root ::= "yes"')
    as_object = _constraint(chat_request(json_schema=SCHEMA), [])
    assert as_object is not None and json.loads(as_object[1]) == SCHEMA
    as_text = json.dumps(SCHEMA)
    assert _constraint(chat_request(json_schema=as_text), []) == ("json_schema", as_text)
    assert _constraint(chat_request(regex=""), []) is None  # empty = unset
    error = api_error(_constraint, chat_request(regex="a", ebnf='root ::= "a"'), [])
    assert error.param == "ebnf" and "regex and ebnf" in error.message
    error = api_error(_constraint, chat_request(json_schema="{not json"), [])
    assert error.param == "json_schema" and "not valid JSON" in error.message
    error = api_error(
        _constraint, chat_request(regex="a"), [("json_schema", "{}", "response_format")]
    )
    assert error.param == "response_format"


# ---- whole chat requests (a fake tokenizer manager, a real tokenizer and template) -----------


class FakeTM:
    """What _chat_job needs from the tokenizer manager; remembers the request it built."""

    served_model_name = "m"
    source = SimpleNamespace(display_path="m")
    info = SimpleNamespace(context_length=32768, vocab_size=151936)
    config = ServerConfig()
    reasoning_ids = MarkerIds([], [])  # no --reasoning-parser

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.built: list[Any] = []

    def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def build_request(self, ids: list[int], params: Any, *args: Any, **kwargs: Any) -> Any:
        self.built.append(SimpleNamespace(ids=ids, params=params))
        return self.built[-1]

    def submit(self, reqs: list[Any], stream: bool = False, **_: Any) -> list[ReqState]:
        return [ReqState(rid="r", prompt_tokens=1, samples=[Sample()], listener=None)]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fixture_path("tokenizers", "qwen2")))


def run_chat(tokenizer: Any, tmpl: str, **fields: Any) -> tuple[str, Any, ChatJob]:
    tm = FakeTM(tokenizer)
    job = _chat_job(chat_request(**fields), tm, ChatRenderer(tokenizer, tmpl))  # type: ignore[arg-type]
    built = tm.built[-1]
    return tokenizer.decode(built.ids), built.params, job


def test_chat_with_tools_renders_them_and_constrains_the_output(qwen_tokenizer):
    qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    prompt, params, job = run_chat(qwen_tokenizer, qwen, tools=TOOLS)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert params.constraint is not None and params.constraint[0] == "structural_tag"
    tag = json.loads(params.structural_tag)
    assert tag == structural_tag(QWEN25, check_tools(TOOLS), ToolChoice("auto"))
    assert job.tools is not None
    # tool_choice none: no tools in the prompt, no constraint, no parsing
    prompt, params, job = run_chat(qwen_tokenizer, qwen, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in prompt and params.constraint is None and job.tools is None
    _, params, _ = run_chat(
        qwen_tokenizer,
        qwen,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    tag = json.loads(params.structural_tag)
    assert [s["begin"] for s in tag["structures"]] == [QWEN25.begin("add")]
    assert tag["repeat"] is False and tag["free_text"] is False


def test_chat_response_format(qwen_tokenizer):
    qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    _, params, _ = run_chat(qwen_tokenizer, qwen, response_format={"type": "json_object"})
    assert params.constraint == ("json_schema", '{"type": "object"}')
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    _, params, _ = run_chat(qwen_tokenizer, qwen, response_format=fmt)
    assert json.loads(params.json_schema) == SCHEMA
    _, params, _ = run_chat(qwen_tokenizer, qwen, response_format={"type": "text"}, regex="a+")
    assert params.constraint == ("regex", "a+")


def test_chat_strict_means_a_closed_schema(qwen_tokenizer):
    qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}
    _, params, _ = run_chat(qwen_tokenizer, qwen, response_format=fmt)
    assert json.loads(params.json_schema) == {**SCHEMA, "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA, "strict": True}}
    prompt, params, _ = run_chat(qwen_tokenizer, qwen, tools=[tool], tool_choice="required")
    closed = {**SCHEMA, "additionalProperties": False}
    assert [st["schema"] for st in json.loads(params.structural_tag)["structures"]] == [closed]
    assert '"additionalProperties": false' in prompt  # the model is shown what it is held to


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"response_format": {"type": "json_object"}, "tools": TOOLS}, "response_format"),
        (
            {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "none"},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "response_format"),
        ({"tools": TOOLS, "ebnf": 'root ::= "a"'}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools[0].function.name"),
        ({"regex": 5}, "regex"),
    ],
)
def test_chat_constraint_errors(qwen_tokenizer, fields, param):
    qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    try:
        error = api_error(run_chat, qwen_tokenizer, qwen, **fields)
    except msgspec.ValidationError as exc:  # a wrongly typed field: msgspec names it
        assert param in str(exc)
        return
    assert error.param == param


def test_tools_on_a_template_without_a_call_format(qwen_tokenizer):
    phi = template("microsoft-Phi-3.5-mini-instruct.jinja")
    error = api_error(run_chat, qwen_tokenizer, phi, tools=TOOLS)
    assert error.param == "tools" and "no tool-call format" in error.message
    prompt, params, _ = run_chat(qwen_tokenizer, phi, tools=TOOLS, tool_choice="none")
    assert "get_weather" not in prompt and params.constraint is None


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_history_with_tool_calls_renders_through_the_template(qwen_tokenizer):
    qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    prompt, _, _ = run_chat(qwen_tokenizer, qwen, messages=HISTORY, tools=TOOLS)
    assert prompt.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    llama = template("meta-llama-Llama-3.1-8B-Instruct.jinja")
    prompt, _, _ = run_chat(qwen_tokenizer, llama, messages=HISTORY, tools=TOOLS)
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": {"city": "Paris"}}<|eot_id|>'
        # NOTE: this template writes a tool's string content through tojson
        '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp\\": 21}"<|eot_id|>'
    ) in prompt


@pytest.mark.parametrize(
    "call,param",
    [
        ("x", "messages[1].tool_calls"),
        ([5], "messages[1].tool_calls[0]"),
        ([{"function": {"arguments": "{}"}}], "messages[1].tool_calls[0].function"),
        (
            [{"function": {"name": "f", "arguments": "{oops"}}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            [{"function": {"name": "f", "arguments": "[1]"}}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        ([{"id": 3, "function": {"name": "f"}}], "messages[1].tool_calls[0].id"),
    ],
)
def test_bad_history_tool_calls(qwen_tokenizer, call, param):
    qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    messages = [HISTORY[0], {**HISTORY[1], "tool_calls": call}]
    assert api_error(run_chat, qwen_tokenizer, qwen, messages=messages).param == param
    user_calls = [{**HISTORY[0], "tool_calls": HISTORY[1]["tool_calls"]}]
    error = api_error(run_chat, qwen_tokenizer, qwen, messages=user_calls)
    assert error.param == "messages[0].tool_calls"


# ---- the native API's sampling_params ------------------------------------------------------


def native(**values: Any) -> Any:
    params, _ = parse_sampling_params(values, vocab_size=1000)
    return params


def test_native_constraint_fields():
    assert native(regex="[0-9]+").constraint == ("regex", "[0-9]+")
    assert native(ebnf='root ::= "yes" | "no"').ebnf == 'root ::= "yes" | "no"'
    text = '{"type": "integer"}'
    assert native(json_schema=text).json_schema == text  # kept as sent
    assert json.loads(native(json_schema=SCHEMA).json_schema) == SCHEMA
    tag = structural_tag(QWEN25, check_tools([WEATHER]), ToolChoice("auto"))
    assert json.loads(native(structural_tag=tag).structural_tag) == tag
    assert json.loads(native(structural_tag=json.dumps(tag)).structural_tag) == tag
    empty = native(regex="", json_schema=None, ebnf="", structural_tag="")
    assert empty.constraint is None


@pytest.mark.parametrize(
    "values,param,words",
    [
        ({"regex": 5}, "sampling_params.regex", ["must be a string"]),
        ({"ebnf": {"root": "x"}}, "sampling_params.ebnf", ["must be a string"]),
        ({"json_schema": ["x"]}, "sampling_params.json_schema", ["string or a JSON object"]),
        ({"json_schema": "{nope"}, "sampling_params.json_schema", ["not valid JSON"]),
        ({"json_schema": '{"type": 5}'}, "sampling_params.json_schema", ["JSON schema"]),
        ({"json_schema": '"text"'}, "sampling_params.json_schema", ["JSON object"]),
        ({"json_schema": "   "}, "sampling_params.json_schema", ["empty"]),
        (
            {"structural_tag": '{"structures": []}'},
            "sampling_params.structural_tag",
            ["structures"],
        ),
        ({"regex": "a" * 300_000}, "sampling_params.regex", ["too large"]),
        (
            {"regex": "a", "json_schema": "{}"},
            "sampling_params.json_schema",
            ["regex and json_schema"],
        ),
    ],
)
def test_native_constraint_errors(values, param, words):
    with pytest.raises(ApiError) as err:
        parse_sampling_params(values, vocab_size=1000)
    assert err.value.status == 400 and err.value.param == param
    for word in words:
        assert word in err.value.message


# ---- the other families' templates ---------------------------------------------------------


def test_gemma_gets_the_tools_from_weft(qwen_tokenizer):
    # Gemma 3's template ignores `tools`: the documented prompt goes into the first user turn
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for messages, opening in ((None, ""), (system, "Be brief.\n\n")):
        fields = {"messages": messages} if messages else {}
        prompt, params, job = run_chat(qwen_tokenizer, GEMMA3, tools=TOOLS, **fields)
        assert job.tools is not None and job.tools.format is GEMMA
        tools_text = "\n".join(json.dumps(t) for t in check_tools(TOOLS))
        assert prompt.endswith(
            f"<start_of_turn>user\n{opening}You have access to functions. If you decide to invoke "
            'any of the function(s), you MUST put it in the format of {"name": function name, '
            '"parameters": dictionary of argument name and its value}\nYou SHOULD NOT include '
            f"any other text in the response if you call a function\n{tools_text}\n\n"
            f"{(messages or [{'content': 'Hi'}])[-1]['content']}<end_of_turn>\n"
            "<start_of_turn>model\n"
        ), prompt
        tag = json.loads(params.structural_tag)
        assert tag == structural_tag(GEMMA, check_tools(TOOLS), ToolChoice("auto"))
    prompt, _, job = run_chat(qwen_tokenizer, GEMMA3, tools=TOOLS, tool_choice="none")
    assert "You have access to functions" not in prompt and job.tools is None
    # a template that shows the tools itself is left alone
    prompt, _, _ = run_chat(qwen_tokenizer, MISTRAL_V11, tools=TOOLS)
    assert "You have access to functions" not in prompt
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in prompt


GEMMA_HISTORY = [
    {"role": "system", "content": "Be brief."},
    *HISTORY,
    {"role": "user", "content": "And in Oslo?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [
            {"id": "c2", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c3", "function": {"name": "add", "arguments": ""}},
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 9}'},
    {"role": "tool", "tool_call_id": "c3", "content": "3"},
]


def test_gemma_renders_tool_calls_and_results_as_plain_turns(qwen_tokenizer):
    # the calls as the model writes them; the results as ```tool_output blocks in user turns,
    # merged with the user turn next to them so that the roles alternate
    prompt, params, _ = run_chat(qwen_tokenizer, GEMMA3, messages=GEMMA_HISTORY, tools=TOOLS)
    tools_text = "\n".join(json.dumps(t) for t in check_tools(TOOLS))
    assert prompt == (
        "<start_of_turn>user\nBe brief.\n\nYou have access to functions. If you decide to "
        'invoke any of the function(s), you MUST put it in the format of {"name": function '
        'name, "parameters": dictionary of argument name and its value}\nYou SHOULD NOT '
        f"include any other text in the response if you call a function\n{tools_text}\n\n"
        "Weather in Paris?<end_of_turn>\n"
        '<start_of_turn>model\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
        "<end_of_turn>\n"
        '<start_of_turn>user\n```tool_output\n{"temp": 21}\n```\n\nAnd in Oslo?<end_of_turn>\n'
        "<start_of_turn>model\nChecking both.\n"
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}\n'
        '{"name": "add", "parameters": {}}<end_of_turn>\n'
        '<start_of_turn>user\n```tool_output\n{"temp": 9}\n```\n\n```tool_output\n3\n```'
        "<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert params.structural_tag is not None
    # without tools (tool_choice none): the same turns, no tool prompt
    prompt, _, _ = run_chat(
        qwen_tokenizer, GEMMA3, messages=GEMMA_HISTORY, tools=TOOLS, tool_choice="none"
    )
    assert prompt.startswith("<start_of_turn>user\nBe brief.\n\nWeather in Paris?<end_of_turn>")
    assert '<start_of_turn>user\n```tool_output\n{"temp": 21}\n```\n\nAnd in' in prompt
    # the template's own check still holds where weft adds no turns
    error = api_error(run_chat, qwen_tokenizer, GEMMA3, messages=[HISTORY[0], HISTORY[0]])
    assert "roles must alternate" in error.message


def test_qwen3_template_takes_tools_and_thinking(qwen_tokenizer):
    prompt, params, job = run_chat(
        qwen_tokenizer, QWEN3, tools=TOOLS, chat_template_kwargs={"enable_thinking": False}
    )
    assert job.tools is not None and job.tools.format is QWEN25
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert json.loads(params.structural_tag)["triggers"] == ["<tool_call>"]


def test_a_request_template_needs_the_servers_trust(qwen_tokenizer, tmp_path):
    qwen = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    error = api_error(run_chat, qwen_tokenizer, qwen, chat_template=GEMMA3)
    assert error.param == "chat_template" and "--trust-request-chat-template" in error.message
    chat = ChatRenderer(qwen_tokenizer, qwen)
    assert chat.for_request(None, trusted=False) is chat
    assert chat.for_request(GEMMA3, trusted=True).template_text == GEMMA3
    # a file name is text, never read (a client must not make the server read its files)
    path = tmp_path / "t.jinja"
    path.write_text(GEMMA3)
    assert chat.for_request(str(path), trusted=True).template_text == str(path)


@pytest.mark.parametrize(
    "fmt", [QWEN25, MISTRAL, MISTRAL_ARGS, LLAMA3_JSON, GEMMA], ids=lambda f: f.name
)
def test_every_format_gives_a_valid_tag_for_every_choice(fmt):
    tools = check_tools(TOOLS)
    for choice in (ToolChoice("auto"), ToolChoice("required"), ToolChoice("function", "add")):
        for parallel in (True, False):
            tag = structural_tag(fmt, tools, choice, parallel)
            assert json.loads(parse_spec("structural_tag", json.dumps(tag)).text) == tag
            # what the constraint lets the model write, the parser reads back as the call
            call = tag["structures"][0]
            name = "add" if choice.mode == "function" else "get_weather"
            args = {"city": "Oslo"}
            if fmt is MISTRAL:  # one array of calls
                body: Any = [{"name": name, "arguments": args}]
            else:
                body = args
            jsonschema.validate(body, call["schema"])
            text = call["begin"] + json.dumps(body) + call["end"]
            assert calls_of(text, fmt) == (None, [(name, '{"city": "Oslo"}')])


def _mistral_call(name: str, args: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": args},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def test_mistral_calls_are_one_array():
    # [TOOL_CALLS][{...}, {...}]: as Mistral's templates write parallel calls; each call's
    # arguments are held to its own tool's parameters
    tools = check_tools(TOOLS)
    tag = structural_tag(MISTRAL, tools, ToolChoice("required"))
    calls = [_mistral_call("get_weather", WEATHER["function"]["parameters"])]
    calls.append(_mistral_call("add", EMPTY_OBJECT))
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    assert tag == {
        "type": "structural_tag",
        "structures": [{"begin": "[TOOL_CALLS]", "schema": array, "end": ""}],
        "triggers": ["[TOOL_CALLS]"],
        "free_text": False,
        "at_least_one": True,
        "repeat": False,
        "separator": "",
    }
    two = [{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "X"}}]
    jsonschema.validate(two, array)
    text = "[TOOL_CALLS]" + json.dumps(two)
    assert calls_of(text, MISTRAL) == (None, [("add", "{}"), ("get_weather", '{"city": "X"}')])
    for bad in ([], [{"name": "add", "arguments": {}, "id": "abcdefghi"}], [{"name": "x"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, array)
    with pytest.raises(jsonschema.ValidationError):  # get_weather's arguments need a city
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], array)
    # not parallel: one call; a named function: one call of it; auto: after the marker
    one = structural_tag(MISTRAL, tools, ToolChoice("required"), parallel=False)
    assert one["structures"][0]["schema"] == {**array, "maxItems": 1}
    named = structural_tag(MISTRAL, tools, ToolChoice("function", "add"))
    assert named["structures"][0]["schema"] == {
        "type": "array",
        "items": _mistral_call("add", EMPTY_OBJECT),
        "minItems": 1,
        "maxItems": 1,
    }
    auto = structural_tag(MISTRAL, tools, ToolChoice("auto"))
    assert auto["free_text"] and auto["structures"] == tag["structures"]


def test_mistral_array_keeps_a_tools_refs():
    # a tool's "#/..." refs point into its own schema: it moves under the root's $defs
    node = {
        "type": "object",
        "properties": {
            "v": {"$ref": "#/$defs/V"},
            "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        },
        "required": ["v"],
        "$defs": {"V": {"type": "integer"}},
    }
    tools = check_tools([{"type": "function", "function": {"name": "walk", "parameters": node}}])
    [structure] = structural_tag(MISTRAL, tools, ToolChoice("required"))["structures"]
    rebased = {
        **node,
        "properties": {
            "v": {"$ref": "#/$defs/tool_0/$defs/V"},
            "next": {"anyOf": [{"$ref": "#/$defs/tool_0"}, {"type": "null"}]},
        },
    }
    assert structure["schema"] == {
        "type": "array",
        "items": _mistral_call("walk", {"$ref": "#/$defs/tool_0"}),
        "minItems": 1,
        "$defs": {"tool_0": rebased},
    }
    good = [{"name": "walk", "arguments": {"v": 1, "next": {"v": 2, "next": None}}}]
    jsonschema.validate(good, structure["schema"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            [{"name": "walk", "arguments": {"v": 1, "next": {"v": "2"}}}], structure["schema"]
        )
