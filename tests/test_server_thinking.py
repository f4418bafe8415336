"""Constrained answers after the thinking, and thinking_budget, on a real server: a Qwen3 with
dummy weights and Qwen3's tokenizer (tests/qwen3_dummy.py), `--reasoning-parser qwen3`, sampled
with a seed (greedy, random weights write "\n" forever: thinking the parser strips to nothing).

Random weights never write `</think>` themselves: the budget forces it here (the stories server
of test_server_reasoning.py has its model write its marker). The forced marker is sampled through
a one-token mask and then watched like any other token, so the switch to the grammar is the one
a model-written marker takes."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from qwen3_dummy import CHAT_TEMPLATE, THINK_END_ID, build_qwen3_dummy

from weft.runtime.server.tool_calls import plan_tools

from server_utils import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Name and number, please."}]
SAMPLING = {"temperature": 1.0, "seed": 5}
CHAT = {"model": "qwen3", "messages": MESSAGES, "max_tokens": 40, **SAMPLING}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = build_qwen3_dummy(tmp_path_factory.mktemp("qwen3"))
    srv = ServerProcess(
        "--model-path",
        str(folder),
        "--load-format",
        "dummy",
        "--max-total-tokens",
        "4096",
        "--served-model-name",
        "qwen3",
        "--reasoning-parser",
        "qwen3",
        "--constrained-json-disable-any-whitespace",  # random weights would pad JSON forever
        # NOTE: the tests compare a spec's first request with later ones: each served by
        # xgrammar (a race may hand the first to llguidance, whose masks differ at the edges
        # of what random weights pick, and later ones to xgrammar once its compile lands)
        "--grammar-race-budget",
        "inf",
    )
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(qwen3):
    return openai.OpenAI(base_url=qwen3.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def prompt(qwen3):
    body = {"messages": MESSAGES, "add_generation_prompt": True}
    return qwen3.post("/render_chat", body).json()["text"]


def generate(srv, prompt, **sampling):
    params = {"max_new_tokens": 40, **SAMPLING, **sampling}
    return srv.generate({"text": prompt, "sampling_params": params, "separate_reasoning": True})


@pytest.mark.parametrize("budget", [0, 5])
def test_the_budget_then_the_marker_then_a_valid_answer(qwen3, client, prompt, budget):
    out = generate(qwen3, prompt, thinking_budget=budget, json_schema=json.dumps(SCHEMA))
    ids = out["output_ids"]
    assert THINK_END_ID not in ids[:budget] and ids[budget] == THINK_END_ID
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert bool(out["reasoning_text"]) == (budget > 0)

    # the chat API: the same output, split the same way, whole and streamed
    chat = {**CHAT, "response_format": JSON_FORMAT}
    extra = {"thinking_budget": budget}
    message = client.chat.completions.create(**chat, extra_body=extra).choices[0].message
    assert (message.reasoning_content or "", message.content) == (
        out["reasoning_text"],
        out["text"],
    )
    deltas = [
        c.choices[0].delta
        for c in client.chat.completions.create(**chat, stream=True, extra_body=extra)
        if c.choices
    ]
    assert (
        "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        == (out["reasoning_text"])
    )
    assert "".join(d.content or "" for d in deltas) == out["text"]


def test_a_regex_answer_after_the_whitespace_gap(qwen3, prompt):
    out = generate(qwen3, prompt, thinking_budget=3, regex="(yes|no)")
    assert out["output_ids"][3] == THINK_END_ID
    assert out["text"] in ("yes", "no")
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    # without a constraint the budget alone bounds the thinking; the answer is free
    free = generate(qwen3, prompt, thinking_budget=2, max_new_tokens=8)
    assert free["output_ids"][2] == THINK_END_ID and len(free["output_ids"]) == 8


def test_a_required_tool_call_after_the_thinking(qwen3, client):
    """The tools' structural tag holds the answer: after the thinking (and its gap) comes the
    call. NOTE: the call itself stays unfinished here: the tool's open object schema lets random
    weights write properties without end, so the raw text (not the parsed call) is checked, on
    /generate with the chat's prompt and tag."""
    tool = {
        "type": "function",
        "function": {"name": "pick", "parameters": {"type": "object"}},
    }
    chat = {**CHAT, "max_tokens": 24, "tools": [tool], "tool_choice": "required"}
    out = client.chat.completions.create(**chat, extra_body={"thinking_budget": 4})
    assert out.choices[0].message.reasoning_content
    body = {"messages": MESSAGES, "tools": [tool], "add_generation_prompt": True}
    prompt = qwen3.post("/render_chat", body).json()["text"]
    tag = plan_tools([tool], "required", None, CHAT_TEMPLATE).structural_tag
    raw = generate(qwen3, prompt, thinking_budget=4, structural_tag=tag, max_new_tokens=24)
    assert raw["output_ids"][4] == THINK_END_ID
    assert raw["text"].startswith('<tool_call>\n{"name": "pick"')


def test_thinking_off_needs_no_budget_and_constrains_at_once(client, qwen3):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = client.chat.completions.create(
        **CHAT, response_format=JSON_FORMAT, extra_body=off
    ).choices[0]
    assert out.message.reasoning_content is None
    jsonschema.validate(json.loads(out.message.content), SCHEMA)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**CHAT, extra_body={**off, "thinking_budget": 1})
    assert err.value.body["param"] == "thinking_budget"
