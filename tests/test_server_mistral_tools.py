"""Tool calls on a real server with a Mistral tokenizer whose `[TOOL_CALLS]` is a special token
(tests/mistral_dummy.py: Mistral-Nemo's template, dummy weights), under each grammar backend:
the constraint writes the marker, the detokenizer keeps it, the parser returns the calls, whole
and streamed alike. Random weights, sampled with a seed: the calls are whatever the constraint
lets through, so they are checked against the tools' schemas, not against fixed arguments.
The same server renders a Gemma 3 conversation with tool turns (its template, per request)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from mistral_dummy import TOOL_CALLS_ID, build_mistral_dummy, nemo_template

from weft.runtime.server.tool_calls import plan_tools

from chat_templates import GEMMA3
from server_utils import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "enum": [1, 2, 3, 4, 5, 6, 7]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2]}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SAMPLING = {"max_tokens": 120, "temperature": 1.0, "seed": 3}
CHAT = {"model": "mistral", "messages": MESSAGES, "tools": TOOLS, **SAMPLING}
# a seed with which each backend's constraint lets these random weights write several calls
PARALLEL_SEEDS = {"xgrammar": 7, "llguidance": 7, "outlines": 6}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_mistral_dummy(tmp_path_factory.mktemp("mistral"))


@pytest.fixture(scope="module", params=["xgrammar", "llguidance", "outlines"])
def server(request, folder):
    srv = ServerProcess(
        "--model-path",
        str(folder),
        "--load-format",
        "dummy",
        "--max-total-tokens",
        "4096",
        "--served-model-name",
        "mistral",
        "--grammar-backend",
        request.param,
        "--constrained-json-disable-any-whitespace",  # random weights would pad JSON
        "--trust-request-chat-template",  # the Gemma 3 template, per request
    )
    srv.backend = request.param  # type: ignore[attr-defined]
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client: Any, **fields: Any) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, calls, finish_reason) of a streamed chat: the deltas, concatenated."""
    content = ""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**fields, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, ["", ""])
            call[0] += part.function.name or ""
            call[1] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [(n, a) for n, a in calls.values()], finish


@pytest.mark.parametrize(
    "tool_choice,parallel",
    [("required", None), ("required", False), (NAMED, None)],
    ids=["required", "required, not parallel", "named"],
)
def test_calls_validate_and_stream_the_same(client, tool_choice, parallel):
    fields = {**CHAT, "tool_choice": tool_choice}
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    choice = client.chat.completions.create(**fields).choices[0]
    calls = calls_of(choice.message)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls, choice.message
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if tool_choice is NAMED or parallel is False:
        assert len(calls) == 1
    if tool_choice is NAMED:
        assert calls[0][0] == "get_weather"
    for call in choice.message.tool_calls:
        assert len(call.id) == 9 and call.id.isalnum()  # what Nemo's template takes back
    assert streamed(client, **fields) == (None, calls, "tool_calls")


def test_parallel_calls_in_one_array(server, client):
    """Random weights write a second call in some samples: the first seed (of a bounded search;
    the known one first, found on a CPU: a GPU samples otherwise) whose answer holds two."""
    seeds = [PARALLEL_SEEDS[server.backend], *range(16)]
    for seed in seeds:
        fields = {**CHAT, "tool_choice": "required", "seed": seed}
        choice = client.chat.completions.create(**fields).choices[0]
        calls = calls_of(choice.message)
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        if choice.finish_reason == "tool_calls" and len(calls) >= 2:
            break
    else:
        pytest.fail(f"no seed of {seeds} gave two calls in one array")
    assert streamed(client, **fields) == (None, calls, "tool_calls")


def test_the_marker_token_reaches_the_text(server):
    """/generate with the chat's prompt and tag: the output text keeps the special marker (its
    token, where the backend names it in the grammar: llguidance)."""
    prompt = server.post("/render_chat", {"messages": MESSAGES, "tools": TOOLS}).json()["text"]
    plan = plan_tools(TOOLS, "required", None, nemo_template())
    assert plan is not None
    params = {"max_new_tokens": 120, "temperature": 1.0, "seed": 3}
    params["structural_tag"] = plan.structural_tag
    out = server.generate({"text": prompt, "sampling_params": params})
    assert out["text"].startswith("[TOOL_CALLS][{")
    if server.backend == "llguidance":
        assert out["output_ids"][0] == TOOL_CALLS_ID


def test_auto_needs_free_text(server, client):
    # xgrammar constrains the calls inside free text; the others refuse, saying why
    if server.backend == "xgrammar":
        choice = client.chat.completions.create(**CHAT).choices[0]
        for name, arguments in calls_of(choice.message):
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        return
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**CHAT)
    assert "free text around structures is not supported" in err.value.message


GEMMA_TURNS = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "user", "content": "And in Oslo?"},
]


def test_gemma_tool_turns_are_served(client):
    # Gemma 3's template raises on tool turns: weft renders them as plain turns
    fields = {**CHAT, "messages": GEMMA_TURNS, "tool_choice": "required"}
    choice = client.chat.completions.create(**fields, extra_body={"chat_template": GEMMA3})
    calls = calls_of(choice.choices[0].message)
    assert choice.choices[0].finish_reason == "tool_calls" and calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
