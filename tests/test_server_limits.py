"""Request limits: each refusal is a clear error naming the field, the refused request never
reaches the scheduler, and the KV pool stays intact (prompt and output length, the caps on
stop strings, logprobs and grammars, the body size, the queue, the request timeout)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from weft.grammars.spec import InvalidSpec, group_depth
from weft.runtime.config import EngineConfig
from weft.runtime.sampling_params import SamplingParams

from conftest import make_engine
from server_utils import ServerProcess, schedule_args, stories_args

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
MAX_PROMPT = 1000
CAP = 4000  # --max-new-tokens-cap; the context is 4096 tokens
MAX_GRAMMAR = 2000
MAX_BODY = 64 * 1024
TIMEOUT_S = 3.0
# NOTE: ~10 s of decoding or more, far past TIMEOUT_S: it never ends by itself here
LONG = {"max_new_tokens": CAP, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(stories_dir, schedule):
    srv = ServerProcess(
        *stories_args(stories_dir, *schedule_args(schedule)),
        "--context-length",
        "4096",
        "--served-model-name",
        "stories",
        "--chat-template",
        TEMPLATE,
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "1",
        "--max-prompt-tokens",
        str(MAX_PROMPT),
        "--max-new-tokens-cap",
        str(CAP),
        "--max-grammar-chars",
        str(MAX_GRAMMAR),
        "--max-request-body-bytes",
        str(MAX_BODY),
        "--request-timeout",
        str(TIMEOUT_S),
    )
    _warm_up(srv)
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


def _warm_up(srv: ServerProcess) -> None:
    """Until a request finishes within TIMEOUT_S. NOTE: on a GPU whose Triton cache is cold, the
    first requests compile kernels (seconds): they would time out and not test their limit."""
    deadline = time.monotonic() + 120
    while srv.post("/generate", native()).status_code != 200:
        assert time.monotonic() < deadline, "no request finished within the timeout"


def refused(r: requests.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def native(**sampling: Any) -> dict:
    return {"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 2, **sampling}}


def completion(**fields: Any) -> dict:
    return {"prompt": [1, 5, 9], "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


# ---- prompt and output length -------------------------------------------------------------


def test_max_prompt_tokens(server):
    r = server.post("/generate", {"input_ids": [5] * (MAX_PROMPT + 1)})
    error = refused(r, 400, "input_ids", f"{MAX_PROMPT + 1} tokens", str(MAX_PROMPT))
    assert error["code"] == "prompt_too_long"
    r = server.post("/v1/completions", completion(prompt=[5] * (MAX_PROMPT + 1)))
    refused(r, 400, "prompt", "--max-prompt-tokens")
    assert server.generate({"input_ids": [5] * MAX_PROMPT, **native()})["meta_info"]


def test_prompt_and_output_beyond_the_context(server):
    body = {"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 3700}}
    error = refused(server.post("/generate", body), 400, "max_new_tokens", "context length")
    assert error["code"] == "context_length_exceeded"
    r = server.post("/v1/completions", completion(prompt=[5] * 500, max_tokens=3700))
    refused(r, 400, "max_tokens", "4096")


def test_max_new_tokens_cap(server):
    r = server.post("/generate", native(max_new_tokens=CAP + 1))
    refused(r, 400, "sampling_params.max_new_tokens", str(CAP), "--max-new-tokens-cap")
    r = server.post("/v1/completions", completion(max_tokens=CAP + 1))
    refused(r, 400, "max_tokens", f"max_tokens must be <= {CAP}")
    r = server.post("/v1/chat/completions", chat(max_completion_tokens=CAP + 1))
    refused(r, 400, "max_completion_tokens", f"max_completion_tokens must be <= {CAP}")
    # asking for nothing is not refused: chat's default (the rest of the context) is capped
    r = server.post(
        "/v1/chat/completions", {**chat(), "max_tokens": None, "stop": ["."], "temperature": 0}
    )
    assert r.status_code == 200, r.text


# ---- caps on what one request may ask for --------------------------------------------------

_NESTED = "(" * 65 + "a" + ")" * 65

CAPS = [
    ("stop count", native(stop=[f"s{i}" for i in range(33)]), "sampling_params.stop", "33"),
    ("stop length", native(stop=["x" * 1025]), "sampling_params.stop", "1024"),
    ("top_logprobs_num", {**native(), "top_logprobs_num": 1025}, "top_logprobs_num", "1024"),
    ("n", native(n=129), "sampling_params.n", "128"),
    ("regex size", native(regex="a" * (MAX_GRAMMAR + 1)), "sampling_params.regex", "too large"),
    ("regex depth", native(regex=_NESTED), "sampling_params.regex", "nested too deeply"),
    (
        "ebnf depth",
        native(ebnf=f"root ::= {_NESTED.replace('a', '[a]')}"),
        "sampling_params.ebnf",
        "nested too deeply",
    ),
    (
        "json_schema size",
        native(json_schema={"type": "string", "description": "x" * MAX_GRAMMAR}),
        "sampling_params.json_schema",
        str(MAX_GRAMMAR),
    ),
]


@pytest.mark.parametrize("body,param,word", [c[1:] for c in CAPS], ids=[c[0] for c in CAPS])
def test_native_caps(server, body, param, word):
    refused(server.post("/generate", body), 400, param, word)


OPENAI_CAPS = [
    ("top_logprobs", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("logprobs", "/v1/completions", completion(logprobs=21), "logprobs"),
    ("stop count", "/v1/completions", completion(stop=[f"s{i}" for i in range(33)]), "stop"),
    ("regex size", "/v1/completions", completion(regex="a" * (MAX_GRAMMAR + 1)), "regex"),
    ("ebnf depth", "/v1/completions", completion(ebnf=f"root ::= {_NESTED}"), "ebnf"),
    (
        "response_format size",
        "/v1/chat/completions",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "title": "x" * 2000}},
            }
        ),
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize(
    "path,body,param", [c[1:] for c in OPENAI_CAPS], ids=[c[0] for c in OPENAI_CAPS]
)
def test_openai_caps(server, path, body, param):
    refused(server.post(path, body), 400, param)


# ---- the body size -------------------------------------------------------------------------


def test_a_large_body_is_refused_from_its_content_length(server):
    r = server.post("/generate", {"text": "x" * MAX_BODY})
    error = refused(r, 413, None, str(MAX_BODY), "--max-request-body-bytes")
    assert error["code"] == "request_too_large"


def _chunks(body: bytes, size: int = 4096) -> Iterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


def test_a_large_chunked_body_is_refused_while_read(server):
    large = json.dumps({"text": "x" * MAX_BODY}).encode()
    r = requests.post(server.url + "/generate", data=_chunks(large), timeout=60)
    assert r.request.headers.get("Transfer-Encoding") == "chunked"
    refused(r, 413, None, "--max-request-body-bytes")
    small = json.dumps({"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 2}})
    r = requests.post(server.url + "/generate", data=_chunks(small.encode(), 8), timeout=60)
    assert r.status_code == 200, r.text


# ---- the queue -----------------------------------------------------------------------------


def _wait_for(server: ServerProcess, key: str, value: int) -> dict:
    deadline = time.monotonic() + 30
    while (info := server.server_info())[key] != value:
        assert time.monotonic() < deadline, info
        time.sleep(0.02)
    return info


def test_a_full_queue_is_refused_with_retry_after(server):
    """One request runs (--max-running-requests 1), one waits (--max-queued-requests 1): a third
    is a 503 that never reaches the scheduler.
    NOTE: the checks must end before the running request's --request-timeout (they take ~0.1 s
    of its 3 s); it is aborted then."""
    events: list = []
    first = threading.Event()

    def running() -> None:
        body = {"input_ids": [1, 5, 9], "stream": True, "rid": "run", "sampling_params": LONG}
        for event in server.stream("/generate", body):
            events.append(event)
            first.set()

    waited: dict = {}

    def waiting() -> None:
        waited["r"] = server.post("/generate", {**native(), "rid": "wait"})

    threads = [threading.Thread(target=running), threading.Thread(target=waiting)]
    threads[0].start()
    assert first.wait(30), "the long request produced no token"
    threads[1].start()
    _wait_for(server, "num_queued", 1)
    for path, body in (("/generate", native()), ("/v1/completions", completion())):
        r = server.post(path, {**body, "rid": "refused"})
        error = refused(r, 503, None, "--max-queued-requests")
        assert error["code"] == "server_busy" and r.headers["Retry-After"] == "1"
    info = server.server_info()
    assert (info["num_pending"], info["num_running"], info["num_waiting"]) == (2, 1, 1), info
    assert server.post("/abort_request", {"rid": "run"}).status_code == 200
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert waited["r"].status_code == 200, waited["r"].text  # it ran once the first one ended
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    # room again
    assert server.generate(native())["meta_info"]["completion_tokens"] == 2


# ---- the request timeout -------------------------------------------------------------------


def test_a_request_past_its_timeout_is_a_504(server):
    # NOTE: paused, so that the request cannot finish in time (on a GPU, CAP tokens took 2.6 s)
    with server.scheduler_paused():
        started = time.monotonic()
        r = server.post("/generate", {"input_ids": [1, 5, 9], "sampling_params": LONG})
        took = time.monotonic() - started
    error = refused(r, 504, None, "--request-timeout", f"{TIMEOUT_S:g} s")
    assert error["code"] == "request_timeout"
    assert TIMEOUT_S <= took < TIMEOUT_S + 8, took
    info = server.wait_idle()  # the scheduler aborted it: its KV is back in the pool
    assert info["kv_pool"]["in_use"] == 0 and info["num_pending"] == 0, info


def test_streams_past_their_timeout_end_with_an_error_event(server):
    """One stream runs, one waits behind it (--max-running-requests 1): both time out."""
    native_events: list = []
    running = threading.Event()

    def native_stream() -> None:
        body = {"input_ids": [1, 5, 9], "stream": True, "sampling_params": LONG}
        for event in server.stream("/generate", body):
            native_events.append(event)
            running.set()

    thread = threading.Thread(target=native_stream)
    thread.start()
    assert running.wait(30)
    # NOTE: paused, so that neither can finish in time (on a GPU the CAP tokens took 2.6 s)
    with server.scheduler_paused():
        body = completion(max_tokens=CAP, ignore_eos=True, stream=True)
        r = server.post("/v1/completions", body)  # waits its turn, then times out
        thread.join(30)
    assert r.status_code == 200
    chunks = [c for c in r.content.split(b"\n\n") if c]
    assert chunks[-1] == b"data: [DONE]"
    assert json.loads(chunks[-2][6:])["error"]["code"] == "request_timeout"
    assert native_events[-1] == "[DONE]"
    assert native_events[-2]["error"]["code"] == "request_timeout"
    assert "text" in native_events[0]  # it had streamed tokens before


# ---- the same limits in-process ----------------------------------------------------------


def test_the_engine_applies_the_limits_too(stories_dir):
    engine = make_engine(
        stories_dir, max_total_tokens=1024, max_prompt_tokens=8, max_new_tokens_cap=4
    )
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        engine.generate(input_ids=[1] * 9, sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match="max_new_tokens must be <= 4"):
        engine.generate(input_ids=[1] * 8, sampling_params={"max_new_tokens": 5})
    with pytest.raises(ValueError, match="stop has 33 entries"):
        engine.generate(input_ids=[1], sampling_params={"stop": [str(i) for i in range(33)]})
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate(input_ids=[1], return_logprob=True, top_logprobs_num=1025)
    out = engine.generate(input_ids=[1] * 8, sampling_params={"max_new_tokens": 4})
    assert isinstance(out, dict) and out["meta_info"]["completion_tokens"] == 4
    engine.shutdown()


def test_grammar_limits():
    limits = EngineConfig(max_grammar_chars=10).request_limits
    with pytest.raises(InvalidSpec, match="at most 10"):
        SamplingParams(regex="a" * 11).validate(limits=limits)
    SamplingParams(regex="a" * 10).validate(limits=limits)
    # parentheses that do not nest: escaped, in a class, quoted or commented (EBNF)
    assert group_depth(r"(a(b)\(\(\()[((((]", quotes="") == 2
    assert group_depth("[]((]([^](])", quotes="") == 1
    ebnf = 'root ::= ("((" x) # (((\nx ::= [(] | ")" | ((y))'
    assert group_depth(ebnf, quotes="\"'") == 2
