"""A generic reasoning parser with a start marker on a real server (a Qwen3 with dummy weights,
tests/qwen3_dummy.py): the chat prompt leaves no block open, so an output opens its thinking by
writing `<think>` itself, or answers at once; either way a constraint holds the answer only,
and the text split agrees with the phase the scheduler ran.

Sampled with seeds (random weights): seed 5 writes `<think>` first (the row allows it beside the
grammar's first tokens), seed 2 writes the grammar's `{`; the budget forces `</think>`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from qwen3_dummy import THINK_END_ID, build_qwen3_dummy
from transformers import AutoTokenizer

from server_utils import ServerProcess

THINK_START_ID = 151667
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Name and number, please."}]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
TAKES, LEAVES = 5, 2  # seeds whose first token is <think>, and one of the grammar's


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen3_dummy(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen3(folder):
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
        "generic",
        "--reasoning-start",
        "<think>",
        "--reasoning-end",
        "</think>",
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
    text = qwen3.post("/render_chat", body).json()["text"]
    assert text.endswith("<|im_start|>assistant\n")  # no thinking left open
    return text


def _both(qwen3, client, prompt, seed):
    """/generate (ids, split) and the chat API's message, streamed too, for one seed."""
    params = {"max_new_tokens": 40, "temperature": 1.0, "seed": seed, "thinking_budget": 3}
    body = {"text": prompt, "separate_reasoning": True}
    out = qwen3.generate({**body, "sampling_params": {**params, "json_schema": json.dumps(SCHEMA)}})
    chat = {
        "model": "qwen3",
        "messages": MESSAGES,
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": seed,
        "response_format": JSON_FORMAT,
    }
    extra = {"thinking_budget": 3}
    message = client.chat.completions.create(**chat, extra_body=extra).choices[0].message
    deltas = [
        c.choices[0].delta
        for c in client.chat.completions.create(**chat, stream=True, extra_body=extra)
        if c.choices
    ]
    streamed = (
        "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
        "".join(d.content or "" for d in deltas),
    )
    return out, message, streamed


def test_the_output_opens_its_thinking_then_answers_in_the_grammar(qwen3, client, prompt, folder):
    out, message, streamed = _both(qwen3, client, prompt, TAKES)
    ids = out["output_ids"]
    # <think>, three tokens of thinking (the budget counts from the marker), </think>
    assert ids[0] == THINK_START_ID and ids[4] == THINK_END_ID and THINK_END_ID not in ids[:4]
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    thought = AutoTokenizer.from_pretrained(folder).decode(ids[1:4]).strip()
    assert out["reasoning_text"] == thought
    assert (message.reasoning_content, message.content) == (out["reasoning_text"], out["text"])
    assert streamed == (out["reasoning_text"], out["text"])


def test_an_output_that_does_not_open_it_is_constrained_from_its_first_token(qwen3, client, prompt):
    out, message, streamed = _both(qwen3, client, prompt, LEAVES)
    ids = out["output_ids"]
    assert ids[0] != THINK_START_ID and THINK_END_ID not in ids  # the budget forced nothing
    assert out["text"].startswith("{")
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["reasoning_text"] == ""
    assert (message.reasoning_content, message.content) == (None, out["text"])
    assert streamed == ("", out["text"])
