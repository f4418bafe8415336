"""Bad input gets a 4xx naming the problem (OpenAI's error shape), and the server keeps serving."""

from __future__ import annotations

import pytest
import requests

from conftest import shared_server
from server_utils import ServerProcess

OK_NATIVE = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4}}
OK_COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4}


def _nested_schema(levels: int) -> str:
    """JSON text of an object schema `levels` objects deep (json.dumps would recurse)."""
    head = '{"type": "object", "properties": {"a": '
    return head * levels + '{"type": "integer"}' + "}}" * levels


def _ref_chain(length: int) -> dict:
    """A schema whose $refs chain `length` shallow definitions."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(length)
    }
    defs[f"d{length}"] = {"type": "integer"}
    return {"$defs": defs, "allOf": [{"$ref": "#/$defs/d0"}]}


@pytest.fixture(scope="module")
def server(stories_server):
    yield from shared_server(stories_server)


def _check(
    server: ServerProcess,
    r: requests.Response,
    status: int,
    words: list[str],
    ok_path: str,
    ok_body: dict,
) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    # and the server still serves
    after = server.post(ok_path, ok_body)
    assert after.status_code == 200, after.text
    return error


NATIVE_CASES = [
    ("malformed json", b'{"text": ', 400, ["malformed JSON"]),
    ("text not a string", {"text": 5}, 400, ["text"]),
    ("stream not a bool", {**OK_NATIVE, "stream": "yes"}, 400, ["stream"]),
    (
        "max_new_tokens a string",
        {"text": "Hi", "sampling_params": {"max_new_tokens": "5"}},
        400,
        ["max_new_tokens"],
    ),
    (
        "temperature negative",
        {"text": "Hi", "sampling_params": {"temperature": -1}},
        400,
        ["temperature"],
    ),
    (
        "negative max_new_tokens",
        {"text": "Hi", "sampling_params": {"max_new_tokens": -1}},
        400,
        ["max_new_tokens"],
    ),
    (
        "oversized max_new_tokens",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 5000}},
        400,
        ["max_new_tokens", "context length"],
    ),
    ("prompt too long", {"input_ids": [5] * 600}, 400, ["too long", "512"]),
    ("stop list of ints", {"text": "Hi", "sampling_params": {"stop": [1, 2]}}, 400, ["stop"]),
    (
        "stop with an empty string",
        {"text": "Hi", "sampling_params": {"stop": ["a", ""]}},
        400,
        ["stop", "empty"],
    ),
    ("stop a number", {"text": "Hi", "sampling_params": {"stop": 3}}, 400, ["stop"]),
    ("empty text", {"text": ""}, 400, ["empty"]),
    ("empty input_ids", {"input_ids": []}, 400, ["input_ids"]),
    ("empty batch", {"text": []}, 400, ["text"]),
    ("token id outside the vocabulary", {"input_ids": [1, 9999]}, 400, ["9999"]),
    ("text and input_ids", {"text": "Hi", "input_ids": [1]}, 400, ["exactly one"]),
    ("neither text nor input_ids", {"sampling_params": {}}, 400, ["exactly one"]),
    (
        "unknown sampling parameter",
        {"text": "Hi", "sampling_params": {"temprature": 0}},
        400,
        ["temprature"],
    ),
    (
        "per-prompt list of the wrong length",
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]},
        400,
        ["2 prompts"],
    ),
    (
        "logprob_start_len past the prompt",
        {"text": "Hi", "return_logprob": True, "logprob_start_len": 50},
        400,
        ["logprob_start_len"],
    ),
    ("image input", {"text": "Hi", "image_data": "x.png"}, 400, ["image_data", "not supported"]),
    # found by tests/test_fuzz_api.py and tests/test_fuzz_params.py: each was a 5xx or a crash
    (
        "top_k past int64 (killed the scheduler)",
        {"text": "Hi", "sampling_params": {"top_k": 2**64 - 1}},
        400,
        ["top_k"],
    ),
    (
        "top_k past uint64 (could not be sent to the scheduler)",
        {"text": "Hi", "sampling_params": {"top_k": 10**20}},
        400,
        ["top_k"],
    ),
    (
        "a chain of 1000 $refs (llguidance overflowed its stack: the scheduler died)",
        {"text": "Hi", "sampling_params": {"json_schema": _ref_chain(1000)}},
        400,
        ["json_schema", "nested too deeply"],
    ),
]


@pytest.mark.parametrize(
    "body,status,words", [c[1:] for c in NATIVE_CASES], ids=[c[0] for c in NATIVE_CASES]
)
def test_native_bad_input(server, body, status, words):
    if isinstance(body, bytes):
        r = requests.post(
            server.url + "/generate",
            data=body,
            timeout=30,
            headers={"content-type": "application/json"},
        )
    else:
        r = server.post("/generate", body)
    _check(server, r, status, words, "/generate", OK_NATIVE)


def test_unknown_rid_on_abort(server):
    r = server.post("/abort_request", {"rid": "no-such-request"})
    _check(server, r, 404, ["no-such-request"], "/generate", OK_NATIVE)
    r = server.post("/abort_request", {"rid": 5})
    _check(server, r, 400, ["rid"], "/generate", OK_NATIVE)


OPENAI_CASES = [
    ("unknown model", {**OK_COMPLETION, "model": "gpt-9"}, 404, ["gpt-9"], "model"),
    ("negative max_tokens", {**OK_COMPLETION, "max_tokens": -1}, 400, ["max_tokens"], "max_tokens"),
    (
        "oversized max_tokens",
        {**OK_COMPLETION, "max_tokens": 100000},
        400,
        ["max_tokens", "context length"],
        "max_tokens",
    ),
    ("max_tokens a float", {**OK_COMPLETION, "max_tokens": 2.5}, 400, ["int"], "max_tokens"),
    ("stop list of ints", {**OK_COMPLETION, "stop": [1]}, 400, ["stop"], "stop[0]"),
    ("stop with an empty string", {**OK_COMPLETION, "stop": [""]}, 400, ["empty"], "stop"),
    ("empty prompt", {**OK_COMPLETION, "prompt": ""}, 400, ["empty"], "prompt"),
    ("empty prompt list", {**OK_COMPLETION, "prompt": []}, 400, ["prompt"], "prompt"),
    ("prompt too long", {**OK_COMPLETION, "prompt": [7] * 600}, 400, ["too long"], "prompt"),
    (
        "temperature a string",
        {**OK_COMPLETION, "temperature": "hot"},
        400,
        ["temperature"],
        "temperature",
    ),
    ("top_p out of range", {**OK_COMPLETION, "top_p": 1.5}, 400, ["top_p"], "top_p"),
    ("n zero", {**OK_COMPLETION, "n": 0}, 400, ["n must be"], "n"),
    ("logprobs too many", {**OK_COMPLETION, "logprobs": 50}, 400, ["logprobs"], "logprobs"),
    ("suffix", {**OK_COMPLETION, "suffix": "x"}, 400, ["suffix", "not supported"], "suffix"),
    ("top_k past int64", {**OK_COMPLETION, "top_k": 2**64 - 1}, 400, ["top_k"], "top_k"),
    (
        "a json_schema nested past the json encoder",
        {**OK_COMPLETION, "json_schema": _ref_chain(1000)},
        400,
        ["json_schema", "nested too deeply"],
        "json_schema",
    ),
]


@pytest.mark.parametrize(
    "body,status,words,param", [c[1:] for c in OPENAI_CASES], ids=[c[0] for c in OPENAI_CASES]
)
def test_openai_bad_input(server, body, status, words, param):
    r = server.post("/v1/completions", body)
    error = _check(server, r, status, words, "/v1/completions", OK_COMPLETION)
    assert error["param"] == param


def test_openai_malformed_json_and_missing_fields(server):
    r = requests.post(server.url + "/v1/completions", data=b"{nope", timeout=30)
    _check(server, r, 400, ["malformed JSON"], "/v1/completions", OK_COMPLETION)
    r = server.post("/v1/chat/completions", {"model": None})
    error = _check(server, r, 400, ["messages"], "/v1/completions", OK_COMPLETION)
    assert error["param"] == "messages"


def test_chat_without_a_chat_template_is_a_400(server):
    # stories260K has no chat template
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    _check(server, r, 400, ["chat template"], "/v1/completions", OK_COMPLETION)


def test_unknown_route_and_method(server):
    assert server.get("/v1/nothing").status_code == 404
    assert server.get("/generate").status_code == 405
    assert "error" in server.get("/v1/nothing").json()


def test_metrics_off_by_default(server):
    assert server.get("/metrics").status_code == 404


def test_forced_text_starting_inside_a_character(server):
    # The grammar forces U+008F... after a token that ends inside its UTF-8 bytes: xgrammar
    # cannot return that jump-forward string (it killed the scheduler).
    body = {**OK_COMPLETION, "regex": "'\u008f\u00af\u00f1\u001d", "temperature": 0}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("'")
    assert server.post("/v1/completions", OK_COMPLETION).status_code == 200


def test_deeply_nested_bodies(server):
    # Around the depth where the body decoder gives up, json.dumps / json.loads of the schema
    # gave up first: a RecursionError, a 500. Every depth is a 400 now.
    bodies = {
        "/generate": '{{"text": "Hi", "sampling_params": {{"json_schema": {}}}}}',
        "/v1/completions": '{{"prompt": "Hi", "max_tokens": 2, "json_schema": {}}}',
    }
    for levels in range(440, 520, 3):
        for path, body in bodies.items():
            data = body.format(_nested_schema(levels)).encode()
            r = requests.post(server.url + path, data=data, timeout=30)
            assert r.status_code == 400, (levels, r.text)
            assert "nested too deeply" in r.json()["error"]["message"]
    assert server.post("/generate", OK_NATIVE).status_code == 200
