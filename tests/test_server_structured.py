"""Structured output end to end on the embedded Qwen model: tool calls and response_format through
the official `openai` client, regex / EBNF / JSON schema constraints on the native /generate, and
bad specs as 400s that leave the server serving. Greedy and short, one server for the module."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from conftest import shared_server

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers", "parameters": ADD_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
WEATHER_Q = [{"role": "user", "content": "What is the weather like in Paris today?"}]
HELLO = [{"role": "user", "content": "Say hello to me."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat_prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen(qwen_api_server):
    yield from shared_server(qwen_api_server)


@pytest.fixture(scope="module")
def client(qwen):
    return openai.OpenAI(base_url=qwen.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 48)
    return client.chat.completions.create(model="qwen", **kwargs)


def check_calls(message) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        calls.append((call.function.name, args))
    return calls


# ---- tools ---------------------------------------------------------------------------------


def test_named_tool_is_called_with_valid_arguments(client):
    out = chat(
        client,
        messages=WEATHER_Q,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = out.choices[0]
    calls = check_calls(choice.message)
    assert [name for name, _ in calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None


def test_required_forces_a_call_for_a_prompt_that_needs_none(client):
    out = chat(
        client, messages=HELLO, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    choice = out.choices[0]
    assert len(check_calls(choice.message)) == 1
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None  # nothing but the call
    # parallel calls allowed: this small model keeps calling until max_tokens; every complete
    # call is valid and the cut-off one is dropped (markup is never content)
    out = chat(client, messages=HELLO, tools=TOOLS, tool_choice="required", max_tokens=40)
    choice = out.choices[0]
    assert len(check_calls(choice.message)) >= 1
    assert choice.finish_reason in ("length", "tool_calls")
    assert choice.message.content is None


def test_tool_choice_none_gives_no_calls(client):
    out = chat(client, messages=WEATHER_Q, tools=TOOLS, tool_choice="none", max_tokens=16)
    choice = out.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and "<tool_call>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_streamed_calls_equal_the_whole_response(client):
    kwargs = {
        "messages": WEATHER_Q,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    whole = chat(client, **kwargs).choices[0]
    chunks = list(chat(client, stream=True, **kwargs))
    calls: dict[int, dict[str, str]] = {}
    content = ""
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": "", "arguments": ""})
            if part.id:
                call["id"] = part.id
            if part.function.name:
                call["name"] += part.function.name
            call["arguments"] += part.function.arguments or ""
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finish[-1] == whole.finish_reason == "tool_calls"
    assert all(f is None for f in finish[:-1])
    assert (content or None) == whole.message.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_conversation_with_a_tool_result(client):
    messages = [
        *WEATHER_Q,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_0",
            "content": '{"temperature": 21, "sky": "clear"}',
        },
    ]
    out = chat(client, messages=messages, tools=TOOLS, max_tokens=24)
    assert out.choices[0].message.content or out.choices[0].message.tool_calls
    assert out.usage.prompt_tokens > 100  # the tools and the whole history were rendered


def test_tools_errors_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(
            client,
            messages=HELLO,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert err.value.body["param"] == "tool_choice"
    bad = [TOOLS[0], {"type": "function", "function": {"name": "bad name!"}}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, messages=HELLO, tools=bad)
    assert err.value.body["param"] == "tools[1].function.name"


# ---- response_format -----------------------------------------------------------------------


def test_response_format_json_schema(client):
    out = chat(
        client,
        messages=[{"role": "user", "content": "Invent a person with a name and an age."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object(client):
    out = chat(
        client,
        messages=[{"role": "user", "content": "Reply with a JSON object whose key ok is true."}],
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_openai_constraint_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(
            client,
            messages=HELLO,
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},
        )
    assert err.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, messages=HELLO, response_format={"type": "json_object"}, tools=TOOLS)
    assert err.value.body["param"] == "response_format"
    # refused by the grammar backend (the scheduler), still a 400 naming the field
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, messages=HELLO, extra_body={"regex": "("})
    assert err.value.body["param"] == "regex" and "regex" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="qwen", prompt="Hi", max_tokens=2, extra_body={"ebnf": "x"})
    assert err.value.body["param"] == "ebnf"
    assert chat(client, messages=HELLO, max_tokens=2).choices[0].finish_reason == "length"


# ---- the native API --------------------------------------------------------------------------


def generate(qwen, text: str, max_new_tokens: int = 24, **constraint) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, **constraint}
    return qwen.generate({"text": chat_prompt(text), "sampling_params": params})


def test_native_regex(qwen):
    pattern = r"(yes|no), [0-9]{1,3} (apples|pears)"
    out = generate(qwen, "How many apples do you have?", regex=pattern)
    assert re.fullmatch(pattern, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_native_ebnf(qwen):
    out = generate(qwen, "Is the sky blue? Answer yes or no.", ebnf='root ::= "yes" | "no"')
    assert out["text"] in ("yes", "no")
    arithmetic = 'root ::= num " + " num " = " num\nnum ::= [1-9] [0-9]?'
    out = generate(qwen, "Write a sum of two numbers.", ebnf=arithmetic)
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]? = [1-9][0-9]?", out["text"]), out["text"]


def test_native_json_schema(qwen):
    # NOTE: each from an empty prefix cache, so that the comparison holds wherever a prompt
    # after a cached prefix could round apart from the whole prompt (another backend's kernels)
    assert qwen.post("/flush_cache").status_code == 200
    out = generate(qwen, "Invent a person.", max_new_tokens=48, json_schema=json.dumps(PERSON))
    jsonschema.validate(json.loads(out["text"]), PERSON)
    assert qwen.post("/flush_cache").status_code == 200
    as_object = generate(qwen, "Invent a person.", max_new_tokens=48, json_schema=PERSON)
    assert as_object["text"] == out["text"]
    assert as_object["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("json_schema", '{"type": "objekt"}', ["json_schema", "not a valid JSON schema"]),
        ("json_schema", "{not json", ["json_schema", "not valid JSON"]),
        ("regex", "(", ["regex"]),
        ("ebnf", "root ::= undefined_rule", ["ebnf"]),
        ("ebnf", "this is not a grammar", ["ebnf"]),
    ],
)
def test_bad_spec_is_a_400_and_the_server_keeps_serving(qwen, field, value, words):
    r = qwen.post(
        "/generate",
        {"text": chat_prompt("Hi"), "sampling_params": {"max_new_tokens": 4, field: value}},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert all(w in error["message"] for w in words), error["message"]
    assert field in (error["param"] or "") or field in error["message"]
    out = generate(qwen, "Hi", max_new_tokens=2)
    assert out["meta_info"]["completion_tokens"] == 2


def test_a_bad_grammar_does_not_disturb_a_concurrent_request(qwen):
    plain = {
        "text": chat_prompt("Count to five."),
        "sampling_params": {"temperature": 0, "max_new_tokens": 16},
    }
    assert qwen.post("/flush_cache").status_code == 200  # (see test_native_json_schema)
    expected = qwen.generate(plain)["text"]
    assert qwen.post("/flush_cache").status_code == 200
    bad = {"text": chat_prompt("Hi"), "sampling_params": {"max_new_tokens": 8, "regex": "a{2,1}("}}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(qwen.post, "/generate", bad) for _ in range(2)]
        good = pool.submit(qwen.post, "/generate", plain)
        futures.append(pool.submit(qwen.post, "/generate", bad))
        statuses = [f.result().status_code for f in futures]
        reply = good.result()
    assert statuses == [400, 400, 400]
    assert reply.status_code == 200 and reply.json()["text"] == expected
    # streamed: an error event, then the end of the stream
    events = list(qwen.stream("/generate", {**bad, "stream": True}))
    assert len(events) == 2 and events[1] == "[DONE]"
    assert events[0]["error"]["param"] == "sampling_params.regex"
