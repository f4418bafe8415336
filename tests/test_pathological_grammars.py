"""Hostile output constraints against a live stories260K server: each is a 400 naming the
problem, a compile timeout, or a normal answer, and a plain request sent while it is in flight
finishes at once, never stalled behind it.

The servers run xgrammar alone, so that a grammar too big to compile in time is an error
instead of going to the next backend (which compiles the same alternation in a tenth of the
time); one has a short compile timeout, for the alternation. Bodies are built as JSON text:
json.dumps would recurse.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from weft.grammars.manager import MAX_FORCED_REPEATS, forced_repeats
from weft.grammars.spec import (
    INLINE_SPEC_CHARS,
    MAX_SPEC_CHARS,
    GrammarSpec,
    InvalidSpec,
    parse_off_loop,
    parse_spec,
)

from server_utils import ServerProcess, stories_args

COMPILE_TIMEOUT_S = 0.25  # xgrammar takes 1-3 s for ALTERNATION on a 2-core CPU
PLAIN_LIMIT_S = 2.0  # a plain 8-token request takes ~0.05 s
PLAIN = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8}}


def _nested_schema(levels: int) -> str:
    head = '{"type": "object", "properties": {"a": '
    return head * levels + '{"type": "integer"}' + ', "required": ["a"]}}' * levels


ALTERNATION = "(" + "|".join(f"w{i}x" for i in range(33_000)) + ")"  # 253k characters
ENUM = json.dumps({"enum": [f"s{i}" for i in range(100_000)]})
EBNF_NESTED = "root ::= " + "(" * 10_000 + '"x"' + ")" * 10_000
EBNF_CHAIN = "\n".join(
    ["root ::= r0", *(f'r{i} ::= "(" r{i + 1} ")"' for i in range(2000)), 'r2000 ::= "x"']
)


def _xgrammar_server(stories_dir, compile_timeout_s: float):
    srv = ServerProcess(
        *stories_args(stories_dir),
        "--grammar-backend",
        "xgrammar",
        "--grammar-compile-timeout",
        str(compile_timeout_s),
    )
    # the first constraint converts the vocabulary (not under the compile timeout)
    srv.generate({"text": "Hi", "sampling_params": {"max_new_tokens": 2, "regex": "[a-z]+"}})
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def server(stories_dir):
    yield from _xgrammar_server(stories_dir, 30.0)


# NOTE: its own server: a timeout short enough for ALTERNATION to pass it is one that a busy
# 2-core CI machine's compile of EBNF_CHAIN (0.07-0.3 s) can pass too.
@pytest.fixture(scope="module")
def short_timeout_server(stories_dir):
    yield from _xgrammar_server(stories_dir, COMPILE_TIMEOUT_S)


def _post_generate(server: ServerProcess, body: str) -> requests.Response:
    """POST a JSON text to /generate as it is (a spec inlined unescaped, in _send)."""
    return requests.post(
        server.url + "/generate",
        data=body.encode(),
        headers={"content-type": "application/json"},
        timeout=120,
    )


def _send(server: ServerProcess, field: str, spec_json: str) -> tuple[requests.Response, float]:
    """POST a request constrained by `spec_json` (JSON text) and, while it is in flight, a plain
    one; returns the constrained response and the plain request's latency."""
    body = (
        '{"text": "Once upon a time", "sampling_params": '
        f'{{"max_new_tokens": 16, "temperature": 0, "{field}": {spec_json}}}}}'
    )
    with ThreadPoolExecutor(1) as pool:
        bad = pool.submit(_post_generate, server, body)
        time.sleep(0.05)
        start = time.perf_counter()
        plain = server.post("/generate", PLAIN)
        elapsed = time.perf_counter() - start
        response = bad.result()
    assert plain.status_code == 200, plain.text
    assert len(plain.json()["output_ids"]) == 8
    return response, elapsed


def _error(response: requests.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_schema_nested_1000_deep(server):
    r, plain_s = _send(server, "json_schema", json.dumps(_nested_schema(1000)))
    assert "nested too deeply" in _error(r, "sampling_params.json_schema")
    assert plain_s < PLAIN_LIMIT_S
    # the same schema as a JSON object: deeper than the body decoder goes
    r, plain_s = _send(server, "json_schema", _nested_schema(1000))
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert plain_s < PLAIN_LIMIT_S


def test_enum_of_100k_strings(server):
    r, plain_s = _send(server, "json_schema", ENUM)
    assert "too large" in _error(r, "sampling_params.json_schema")
    assert plain_s < PLAIN_LIMIT_S


def test_huge_alternation_times_out(short_timeout_server):
    r, plain_s = _send(short_timeout_server, "regex", json.dumps(ALTERNATION))
    message = _error(r, "sampling_params.regex")
    assert f"compile timed out after {COMPILE_TIMEOUT_S:g} s" in message, message
    assert plain_s < PLAIN_LIMIT_S


def test_backtracking_shape_is_harmless(server):
    # (a+)+b backtracks exponentially in a backtracking engine; the backends build automata
    r, plain_s = _send(server, "regex", json.dumps("(a+)+b"))
    assert r.status_code == 200, r.text
    out = r.json()
    assert re.fullmatch("a*b?", out["text"]), out["text"]
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert re.fullmatch("(a+)+b", out["text"])
    assert plain_s < PLAIN_LIMIT_S


@pytest.mark.parametrize(
    "field,spec",
    [
        ("regex", "((a{1000}){1000}){1000}"),
        ("json_schema", {"type": "array", "minItems": 10**7, "items": {"const": "x"}}),
    ],
    ids=["regex", "json_schema"],
)
def test_forced_repetition_does_not_stall_the_scheduler(server, field, spec):
    # Both force 10^7..10^9 characters: asking the backend for the forced text (jump-forward)
    # took seconds to minutes on the scheduler's loop, stalling every request.
    r, plain_s = _send(server, field, json.dumps(spec))
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 16
    assert plain_s < PLAIN_LIMIT_S


def test_ebnf_nested_10000_deep(server):
    r, plain_s = _send(server, "ebnf", json.dumps(EBNF_NESTED))
    assert "nest" in _error(r, "sampling_params.ebnf").lower()
    assert plain_s < PLAIN_LIMIT_S


def test_ebnf_recursing_through_2000_rules(server):
    r, plain_s = _send(server, "ebnf", json.dumps(EBNF_CHAIN))
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "(" * 16  # the grammar forces 2000 "(" first
    assert plain_s < PLAIN_LIMIT_S


def test_forced_repeats_multiply_along_nesting_only():
    def repeats(kind: str, text: str) -> int:
        return forced_repeats(GrammarSpec(kind, text))

    assert repeats("regex", "((a{1000}){1000}){1000}") > MAX_FORCED_REPEATS
    assert repeats("regex", "a{1000}b{1000}") == 1000  # in a row: they add up, not multiply
    assert repeats("regex", "(a{10}){10}b{10}") == 100
    assert repeats("regex", r"[{]{5}\{{3}\d{3}-\d{4}") == 5
    assert repeats("ebnf", 'root ::= r{40}\nr ::= "a"{40}') == 1600  # through rules: all
    schema = {"type": "array", "minItems": 2000, "items": {"const": "x"}}
    assert repeats("json_schema", json.dumps(schema)) == 2000


def _patterned_schema(count: int, salt: str) -> str:
    """`count` string properties with a pattern each: meta-validation compiles every pattern
    (~0.35 ms each here), so 3000 take ~1 s; distinct per salt (nothing is cached). Under
    allOf, which xgrammar refuses at once: its compile would run on after the test."""
    props = {
        f"{salt}{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}-{i}(x|y)*$"}
        for i in range(count)
    }
    schema = {"allOf": [{"type": "object", "properties": props}]}
    return json.dumps(schema, separators=(",", ":"))


def test_a_large_schema_is_validated_off_the_event_loop(server):
    """Neither the HTTP process nor the scheduler validates it on its loop: /health and plain
    requests sent one after another while it is in flight are all answered at once."""
    schema = _patterned_schema(3000, "p")
    assert INLINE_SPEC_CHARS < len(schema) <= MAX_SPEC_CHARS
    start = time.perf_counter()
    parse_spec("json_schema", _patterned_schema(3000, "q"))  # as slow, and not cached
    validate_s = time.perf_counter() - start
    assert validate_s > 0.3, "the schema is too fast to validate to show a stall: enlarge it"
    limit_s = validate_s / 2  # a request waited out a validation on the loop before the fix
    body = json.dumps(
        {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "json_schema": schema}}
    )
    waits: dict[str, list[float]] = {"/health": [], "/generate": []}
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(_post_generate, server, body)
        time.sleep(validate_s / 10)  # the server is validating now
        while not big.done():
            for path, waited in waits.items():
                start = time.perf_counter()
                r = server.get(path) if path == "/health" else server.post(path, PLAIN)
                waited.append(time.perf_counter() - start)
                assert r.status_code == 200, r.text
        r = big.result()
    assert sum(len(w) for w in waits.values()) >= 4  # probes ran all along
    assert max(max(w) for w in waits.values()) < limit_s, (waits, validate_s)
    # valid: refused by the backend (allOf), not as an invalid schema
    assert "cannot compile the json_schema: xgrammar: " in _error(r, "sampling_params.json_schema")


def test_a_large_invalid_schema_checked_off_the_loop_is_a_400(server):
    schema = json.loads(_patterned_schema(400, "bad"))
    schema["allOf"][0]["properties"]["bad7"]["pattern"] = "^(unclosed$"
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "json_schema": schema}}
    assert len(json.dumps(body)) > INLINE_SPEC_CHARS
    message = _error(server.post("/generate", body), "sampling_params.json_schema")
    assert "not a valid JSON schema" in message and "bad7" in message, message
    r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "json_schema": schema})
    assert "not a valid JSON schema" in _error(r, "json_schema")


def test_parse_off_loop_gives_what_parse_spec_gives():
    large = _patterned_schema(300, "same")
    wrong = large.replace('"string"', '"strin"', 1)
    assert len(wrong) > INLINE_SPEC_CHARS

    def both() -> tuple[GrammarSpec, GrammarSpec]:
        return parse_spec("regex", "[a-z]+"), parse_spec("json_schema", large)

    assert asyncio.run(parse_off_loop(both)) == both()
    with pytest.raises(InvalidSpec) as inline:
        parse_spec("json_schema", wrong)
    with pytest.raises(InvalidSpec) as off_loop:
        asyncio.run(parse_off_loop(lambda: parse_spec("json_schema", wrong)))
    assert str(off_loop.value) == str(inline.value)
