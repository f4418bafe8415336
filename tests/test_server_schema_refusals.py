"""A JSON schema no grammar backend enforces exactly is a 400 naming the keyword, where the schema
uses it and each backend's reason; one that some backend enforces is served by it (stories260K,
the default backend chain)."""

from __future__ import annotations

import json
import re

import pytest

from conftest import shared_server

PLAIN = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4}}


@pytest.fixture(scope="module")
def server(stories_server):
    yield from shared_server(stories_server)


# (schema, what the message names: the keyword at its pointer, then the reason)
REFUSED = {
    "uniqueItems": (
        {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
        "uniqueItems at /properties/tags/uniqueItems",
    ),
    "lookahead in a pattern": (
        {"type": "object", "properties": {"name": {"type": "string", "pattern": "^(?!a)a{3}$"}}},
        "pattern at /properties/name/pattern: it ignores the lookaround",
    ),
    "remote $ref": (
        {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}},
        "$ref at /properties/a/$ref: 'http://example.com/a.json' refers to another document",
    ),
    "$ref to itself": ({"$ref": "#"}, "$ref at /$ref: the references through '#' form a cycle"),
    "$ref cycle a -> b -> a": (
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "$ref at /$ref: the references through '#/$defs/a' form a cycle with no base case",
    ),
    "overlapping oneOf": (
        {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        "oneOf at /oneOf: it warned: oneOf with overlapping",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_schema_no_backend_enforces_is_a_400_naming_keyword_pointer_and_reasons(server, case):
    schema, names = REFUSED[case]
    body = {**PLAIN, "sampling_params": {"max_new_tokens": 4, "json_schema": json.dumps(schema)}}
    r = server.post("/generate", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "sampling_params.json_schema", error
    message = error["message"]
    assert message.startswith(
        "cannot compile the json_schema: xgrammar: xgrammar does not enforce "
    )
    assert names in message, message
    assert re.search("; llguidance: .+; outlines: .+", message), message
    assert server.generate(PLAIN)["meta_info"]["completion_tokens"] == 4  # still serving


def test_openai_completions_answer_the_same_400(server):
    schema, names = REFUSED["uniqueItems"]
    body = {"prompt": "Once upon a time", "max_tokens": 4, "json_schema": json.dumps(schema)}
    r = server.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert names in error["message"], error


def test_pattern_with_lengths_is_served_by_a_backend_that_enforces_both(server):
    # xgrammar would check the pattern and drop minLength/maxLength (it once let "ab" through)
    schema = {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 5}
    params = {"max_new_tokens": 16, "temperature": 0, "json_schema": json.dumps(schema)}
    out = server.generate({"text": "Once upon a time", "sampling_params": params})
    assert out["meta_info"]["grammar_backend"] == "llguidance"
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert re.fullmatch("[a-z]{3,5}", json.loads(out["text"])), out["text"]
