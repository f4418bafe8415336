"""--reasoning-parser on the real server (stories260K, greedy): a generic parser whose end marker
is "." and no start marker, so the thinking of an output is its first sentence and the answer the
rest; the unparsed text (separate_reasoning false) tells the exact split."""

from __future__ import annotations

import itertools
import json

import openai
import pytest

from weft.runtime.server.openai_jobs import ChatJob
from weft.runtime.server.reasoning import ReasoningPlan, reasoning_format
from weft.runtime.server.request_state import Sample
from weft.runtime.server.tool_calls import plan_tools

from server_utils import ServerProcess, stories_args

# prints a template variable (chat_template_kwargs reach the template); enable_thinking false
# closes the "thinking" in the prompt, as Qwen3's template does with its </think>; tools in
# Qwen's <tool_call> format
TEMPLATE = (
    "{{ bos_token }}{% if tools %}call a tool as <tool_call>{...}</tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}The end.{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
YN = {"enum": ["yes", "no"]}  # (JSON without whitespace to spend: stories loves " \n")
GREEDY = {"model": "stories", "messages": MESSAGES, "max_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
def stories(stories_dir):
    srv = ServerProcess(
        *stories_args(stories_dir),
        "--served-model-name",
        "stories",
        "--chat-template",
        TEMPLATE,
        "--reasoning-parser",
        "generic",
        "--reasoning-end",
        ".",
    )
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(stories):
    return openai.OpenAI(base_url=stories.url + "/v1", api_key="unused", max_retries=0)


def expected_split(raw: str) -> tuple[str, str]:
    """The generic "." parser's split of an unparsed output (which has a ".")."""
    thought, dot, answer = raw.partition(".")
    assert dot, raw
    return thought.strip(), answer.lstrip()


def test_chat_returns_reasoning_content_apart(client):
    raw = client.chat.completions.create(**GREEDY, extra_body={"separate_reasoning": False})
    message = raw.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    thought, answer = expected_split(message.content)
    assert thought and answer

    out = client.chat.completions.create(**GREEDY)
    message = out.choices[0].message
    assert message.reasoning_content == thought  # the official client: an extra attribute
    assert message.content == answer
    assert out.usage.completion_tokens == raw.usage.completion_tokens == 48


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_chat_streams_reasoning_deltas(client, stream_reasoning):
    whole = client.chat.completions.create(**GREEDY).choices[0].message
    chunks = list(
        client.chat.completions.create(
            **GREEDY, stream=True, extra_body={"stream_reasoning": stream_reasoning}
        )
    )
    deltas = [c.choices[0].delta for c in chunks]
    thoughts = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    contents = [d.content for d in deltas if d.content]
    assert "".join(thoughts) == whole.reasoning_content
    assert "".join(contents) == whole.content
    assert deltas[0].role == "assistant"
    if not stream_reasoning:
        assert len(thoughts) == 1  # in one piece, once the thinking ended
    # every thinking delta comes before the first answer delta
    kinds = [
        ("r" if getattr(d, "reasoning_content", None) else "c")
        for d in deltas
        if d.content or getattr(d, "reasoning_content", None)
    ]
    assert kinds == sorted(kinds, reverse=True)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_native_generate_separates_reasoning(stories):
    body = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 40}}
    raw = stories.generate(body)
    assert "reasoning_text" not in raw
    thought, answer = expected_split(raw["text"])
    out = stories.generate({**body, "separate_reasoning": True})
    assert (out["reasoning_text"], out["text"]) == (thought, answer)
    assert out["output_ids"] == raw["output_ids"]
    for live in (True, False):
        events = list(
            stories.stream(
                "/generate",
                {**body, "stream": True, "separate_reasoning": True, "stream_reasoning": live},
            )
        )
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert (last["reasoning_text"], last["text"]) == (thought, answer)
        # cumulative: each event extends the one before
        for before, after in itertools.pairwise(events[:-1]):
            assert after["reasoning_text"].startswith(before["reasoning_text"])
            assert after["text"].startswith(before["text"])
        if not live:
            assert {e["reasoning_text"] for e in events[:-1]} <= {"", thought}


def test_a_constraint_holds_the_answer_after_the_marker_the_model_writes(client, stories):
    """The thinking is free (the unconstrained output's first sentence, as the model writes
    it); the "." it ends with switches to the constraint, which holds the answer alone."""
    thought, _ = expected_split(
        client.chat.completions.create(**GREEDY, extra_body={"separate_reasoning": False})
        .choices[0]
        .message.content
    )
    for extra in [
        {"extra_body": {"regex": "(yes|no)"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": YN}}},
    ]:
        out = client.chat.completions.create(**{**GREEDY, **extra})
        message = out.choices[0].message
        assert message.reasoning_content == thought, extra
        assert message.content in ("yes", "no", '"yes"', '"no"')
    sampling = {"temperature": 0, "max_new_tokens": 48, "regex": "(yes|no)"}
    body = {"text": "Once upon a time", "sampling_params": sampling}
    raw = stories.generate({**body, "sampling_params": {**sampling, "regex": None}})
    split = stories.generate({**body, "separate_reasoning": True})
    assert split["reasoning_text"] == expected_split(raw["text"])[0]
    assert split["text"] in ("yes", "no")
    # without separate_reasoning a native request is not split: the constraint holds it all
    assert stories.generate(body)["text"] in ("yes", "no")


def test_thinking_budget_needs_a_thinking_phase(client, stories):
    budget = client.chat.completions.create(**GREEDY, extra_body={"thinking_budget": 3})
    message = budget.choices[0].message
    assert message.reasoning_content and len(message.reasoning_content.split()) <= 3
    off = {"chat_template_kwargs": {"enable_thinking": False}, "thinking_budget": 3}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**GREEDY, extra_body=off)
    assert err.value.body["param"] == "thinking_budget"
    r = stories.post("/v1/completions", {"prompt": "Once", "thinking_budget": 2})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "thinking_budget")
    r = stories.post("/generate", {"text": "Once", "sampling_params": {"thinking_budget": -1}})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "sampling_params.thinking_budget")


def test_thinking_off_makes_the_output_the_answer(client):
    """enable_thinking false: the template closes the thinking in the prompt ("The end."), so
    the output is the answer alone, and a constraint holds it from its first token."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = client.chat.completions.create(**GREEDY, extra_body={**off, "separate_reasoning": False})
    out = client.chat.completions.create(**GREEDY, extra_body=off)
    assert out.choices[0].message.content == raw.choices[0].message.content
    assert out.choices[0].message.reasoning_content is None
    constrained = client.chat.completions.create(**GREEDY, extra_body={**off, "regex": "(yes|no)"})
    assert constrained.choices[0].message.content in ("yes", "no")
    assert constrained.choices[0].message.reasoning_content is None


def test_chat_template_kwargs_reach_the_template(client, stories):
    body = {"messages": MESSAGES, "add_generation_prompt": True}
    kwargs = {"greeting": "Hello there", "enable_thinking": False}
    text = stories.post("/render_chat", {**body, "chat_template_kwargs": kwargs}).json()["text"]
    assert text.endswith("user: Once upon a time\nHello there\nThe end.")
    plain = client.chat.completions.create(**GREEDY)
    greeted = client.chat.completions.create(
        **GREEDY, extra_body={"chat_template_kwargs": {"greeting": "Hello there"}}
    )
    assert greeted.usage.prompt_tokens > plain.usage.prompt_tokens
    for bad, param in [
        ({"tools": []}, "chat_template_kwargs.tools"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**GREEDY, extra_body={"chat_template_kwargs": bad})
        assert err.value.body["param"] == param
    r = stories.post("/v1/chat/completions", {**GREEDY, "chat_template_kwargs": "x"})
    assert r.status_code == 400


def test_openapi_shows_the_fields(stories):
    schemas = stories.get("/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    for name in ("chat_template_kwargs", "separate_reasoning", "stream_reasoning"):
        assert name in chat
    assert chat["thinking_budget"]["anyOf"][0]["minimum"] == 0
    assert "thinking_budget" in schemas["SamplingParams"]["properties"]
    assert "separate_reasoning" in schemas["GenerateReqInput"]["properties"]
    assert "reasoning_text" in schemas["GenerateOutput"]["properties"]


# ---- tool calls are parsed from the answer only (the chat job, without a server) -----------

QWEN_TOOLS = "{% if tools %}<tool_call>{% endif %}"
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def test_tool_calls_come_from_the_answer_only():
    tools = plan_tools([{"type": "function", "function": {"name": "f"}}], "auto", None, QWEN_TOOLS)
    plan = ReasoningPlan(reasoning_format("qwen3"), in_reasoning=True)
    job = ChatJob(None, "m", [], None, tools=tools, reasoning=plan)  # type: ignore[arg-type]
    text = f"<think>\nmaybe {CALL}\n</think>\n\nSure. {CALL}"
    done = Sample(text=text, finish_reason={"type": "stop"})
    body, reason = job._choice(0, done)
    message = body["message"]
    assert message["reasoning_content"] == f"maybe {CALL}"
    assert message["content"] == "Sure."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "f", "arguments": json.dumps({"x": 1})}
    ]
    assert reason == "tool_calls"

    # streamed one character at a time: the same thinking, answer and call
    cur, sample, deltas = job._cursor(), Sample(), []
    for ch in text:
        sample.text += ch
        deltas += [c["delta"] for c in job._stream_choices(0, sample, cur)]
    sample.finish_reason = {"type": "stop"}
    deltas += [c["delta"] for c in job._stream_choices(0, sample, cur)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == f"maybe {CALL}"
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    calls = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert calls == [{"name": "f", "arguments": ""}, {"arguments": json.dumps({"x": 1})}]


# ---- the DSL's separate_reasoning on this server ------------------------------------------


def _thinking_program(role: bool):
    import weft

    split = weft.separate_reasoning(
        weft.gen("answer", max_tokens=48), model_type="generic", reasoning_end="."
    )

    @weft.function
    def program(s):
        if role:
            s += weft.user("Once upon a time")
            s += weft.assistant(split)
        else:
            s += "Once upon a time" + split

    return program


def test_dsl_split_is_the_servers(stories):
    # the frontend splits /generate's text with the server's parser code: the same parts as
    # the server's own separate_reasoning
    import weft

    s = _thinking_program(role=False).run(backend=weft.RuntimeEndpoint(stories.url), temperature=0)
    body = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
    native = stories.generate({**body, "separate_reasoning": True})
    assert (s["answer_reasoning_content"], s["answer"]) == (
        native["reasoning_text"],
        native["text"],
    )
    assert s.text() == "Once upon a time" + native["text"]


def test_dsl_reads_an_openai_endpoints_reasoning_content(stories, client):
    import weft

    backend = weft.OpenAIBackend(stories.url + "/v1", "stories")
    s = _thinking_program(role=True).run(backend=backend, temperature=0)
    reply = client.chat.completions.create(**GREEDY).choices[0].message
    assert reply.reasoning_content and reply.content
    assert (s["answer_reasoning_content"], s["answer"]) == (reply.reasoning_content, reply.content)
    assert s.messages()[-1] == {"role": "assistant", "content": reply.content}
    streamed = _thinking_program(role=True).run(backend=backend, temperature=0, stream=True)
    assert streamed.variables == s.variables
