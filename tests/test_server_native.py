"""The native API of the real server (stories260K): /generate single and batch, streams, prompt
scoring, aborts, concurrency, and the info / health routes."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import make_engine
from server_utils import ServerProcess, schedule_args, stories_args

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They"]
REGEX = r'\{"name": "[a-z]{1,8}", "mood": "(happy|sad)", "place": "[a-z ]{1,12}"\}'
# English forced text: long jump-forward drafts the model takes (stories260K splits JSON its own
# way, so REGEX's drafts are short: under the overlap schedule they are not worth a step)
PROSE = r"[A-Z][a-z]+ was happy\. One day, (he|she) went to the park with (his|her) mom\."
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0, "max_new_tokens": 48}


@pytest.fixture(scope="module")
def server(stories_dir, schedule):
    # jump-forward on CUDA too, beside the decode graphs (the meta_info tests count its tokens)
    srv = ServerProcess(
        *stories_args(
            stories_dir, "--enable-metrics", "--enable-jump-forward", *schedule_args(schedule)
        )
    )
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def engine(stories_dir, schedule):
    # the same schedule as the server
    eng = make_engine(
        stories_dir,
        max_total_tokens=4096,
        enable_overlap_schedule=schedule == "overlap",
        disable_overlap_schedule=schedule == "plain",  # (the overlap one is CUDA's default)
        enable_jump_forward=True,
    )
    yield eng
    eng.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        {**GREEDY, "stop": [" park", "girl"]},
        {**GREEDY, "stop": "girl", "no_stop_trim": True},
        {**GREEDY, "stop_token_ids": [13]},
        {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 40},
        # grammars, with jump-forward (the overlap schedule feeds a token before jump-forward)
        {**GREEDY, "regex": REGEX},
        {**GREEDY, "json_schema": json.dumps(SCHEMA)},
    ],
)
def test_text_equals_the_in_process_engine(server, engine, params):
    for prompt in PROMPTS:
        expected = engine.generate(prompt, params)
        out = server.generate({"text": prompt, "sampling_params": params})
        assert out["text"] == expected["text"]
        assert out["output_ids"] == expected["output_ids"]
        assert out["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
        assert out["meta_info"]["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])


@pytest.mark.parametrize("params", [GREEDY, {**GREEDY, "stop": ["park", "Lily"]}])
def test_stream_ends_with_the_non_stream_text(server, params):
    for prompt in PROMPTS:
        full = server.generate({"text": prompt, "sampling_params": params})
        events = list(
            server.stream("/generate", {"text": prompt, "sampling_params": params, "stream": True})
        )
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks, "no chunk before [DONE]"
        for before, after in itertools.pairwise(chunks):
            assert after["text"].startswith(before["text"])  # cumulative text
        assert chunks[-1]["text"] == full["text"]
        assert chunks[-1]["output_ids"] == full["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


# meta_info: the same keys from the Engine and the server (one builder: runtime/results.py)
META_KEYS = {
    "id",
    "index",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "finish_reason",
    "e2e_latency",
}
GRAMMAR_KEYS = {"grammar_backend", "jump_forward_tokens", "grammar_wait_s", "grammar_cached"}
LOGPROB_KEYS = {
    "output_token_logprobs",
    "output_top_logprobs",
    "input_token_logprobs",
    "input_top_logprobs",
}
AGREE = ["id", "index", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"]
CONSTRAINTS = {
    "unconstrained": {},
    "regex": {"regex": REGEX},
    "json_schema": {"json_schema": json.dumps(SCHEMA)},
    "prose": {"regex": PROSE},
}


def _engine_stream(engine, prompt, params, **kwargs):
    async def run():
        return [c async for c in engine.generate_stream(prompt, params, **kwargs)]

    return asyncio.run(run())


def _same_meta(got, want, keys):
    """The server's meta_info (`got`) against the Engine's: the same keys, the same values but
    for the latency (each side times itself)."""
    assert set(got) == set(want) == keys
    compared = keys & {*AGREE, "grammar_backend", "jump_forward_tokens"}  # not the waits
    assert {k: got[k] for k in compared} == {k: want[k] for k in compared}


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_meta_info_equals_the_in_process_engines(server, engine, schedule, constraint):
    params = {**GREEDY, **CONSTRAINTS[constraint]}
    keys = META_KEYS | (GRAMMAR_KEYS if constraint != "unconstrained" else set())
    # a fresh prefix-cache namespace on both sides: no hit at first, then all but the last token
    salt = rid = f"meta-{constraint}-{schedule}"
    want = engine.generate(PROMPTS[1], params, rid=rid, namespace=salt)
    got = server.generate(
        {"text": PROMPTS[1], "sampling_params": params, "rid": rid, "cache_salt": salt}
    )
    assert got["output_ids"] == want["output_ids"]
    _same_meta(got["meta_info"], want["meta_info"], keys)
    meta = got["meta_info"]
    assert meta["id"] == rid and meta["index"] == 0 and meta["cached_tokens"] == 0
    assert meta["completion_tokens"] == len(got["output_ids"]) > 0
    assert meta["e2e_latency"] > 0 and want["meta_info"]["e2e_latency"] > 0
    if constraint != "unconstrained":
        assert meta["grammar_backend"] == "xgrammar"
        assert 0 <= meta["jump_forward_tokens"] < meta["completion_tokens"]
        assert meta["grammar_wait_s"] >= 0 and isinstance(meta["grammar_cached"], bool)
    if constraint == "prose":
        assert meta["jump_forward_tokens"] >= 5

    chunks = _engine_stream(engine, PROMPTS[1], params, rid=rid, namespace=salt)
    events = list(
        server.stream(
            "/generate",
            {
                "text": PROMPTS[1],
                "sampling_params": params,
                "rid": rid,
                "cache_salt": salt,
                "stream": True,
            },
        )
    )
    assert events[-1] == "[DONE]"
    for chunk in [*chunks, *events[:-1]]:  # every chunk, both sides: the same shape
        assert set(chunk) == {"text", "output_ids", "meta_info", "index"}
        assert chunk["index"] == 0 and set(chunk["meta_info"]) == keys
    for chunk in [*chunks[:-1], *events[:-2]]:
        assert chunk["meta_info"]["finish_reason"] is None
        assert chunk["meta_info"]["e2e_latency"] is None
    last, want_last = events[-2], chunks[-1]
    assert last["output_ids"] == want_last["output_ids"] == want["output_ids"]
    _same_meta(last["meta_info"], want_last["meta_info"], keys)
    assert last["meta_info"]["cached_tokens"] == last["meta_info"]["prompt_tokens"] - 1
    timed = {"cached_tokens", "e2e_latency", "grammar_wait_s", "grammar_cached"}
    assert {k: last["meta_info"][k] for k in keys - timed} == {k: meta[k] for k in keys - timed}
    if constraint != "unconstrained":  # the spec's second request on the server
        assert last["meta_info"]["grammar_cached"] is True


@pytest.mark.parametrize(
    "logprobs",
    [
        {"return_logprob": True},  # output tokens only
        {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2},
    ],
)
def test_logprob_meta_info_equals_the_in_process_engines(server, engine, logprobs):
    params = {"temperature": 0, "max_new_tokens": 6, "n": 2}
    prompt = "The old tree"
    want = engine.generate(prompt, params, **logprobs)
    got = server.generate({"text": prompt, "sampling_params": params, **logprobs})
    assert len(got) == len(want) == 2
    with_top = logprobs.get("top_logprobs_num", 0) > 0
    for g, w in zip(got, want, strict=True):
        gm, wm = g["meta_info"], w["meta_info"]
        assert set(gm) == set(wm) == META_KEYS | LOGPROB_KEYS
        for key in ("index", "completion_tokens", "finish_reason"):
            assert gm[key] == wm[key], key
        for key in LOGPROB_KEYS:
            assert len(gm[key]) == len(wm[key]), key
            for g_entry, w_entry in zip(gm[key], wm[key], strict=True):
                _same_logprob_entry(g_entry, w_entry, top=key.endswith("top_logprobs"))
        if logprobs.get("logprob_start_len", -1) < 0:
            assert gm["input_token_logprobs"] == gm["input_top_logprobs"] == []
        else:
            assert len(gm["input_token_logprobs"]) == gm["prompt_tokens"]
            assert gm["input_token_logprobs"][0][0] is None and gm["input_top_logprobs"][0] is None
        assert all((top is not None) == with_top for top in gm["output_top_logprobs"])

    # async_generate gives generate's result; the streams' last chunks carry the same logprobs
    awaited = asyncio.run(engine.async_generate(prompt, params, **logprobs))
    assert isinstance(awaited, list) and len(awaited) == 2  # both samples end in one step
    assert [o["output_ids"] for o in awaited] == [o["output_ids"] for o in want]
    assert [set(o["meta_info"]) for o in awaited] == [set(o["meta_info"]) for o in want]
    chunks = _engine_stream(engine, prompt, params, **logprobs)
    events = list(
        server.stream(
            "/generate", {"text": prompt, "sampling_params": params, **logprobs, "stream": True}
        )
    )
    for i in range(2):
        w_last = [c for c in chunks if c["index"] == i][-1]["meta_info"]
        g_last = [e for e in events[:-1] if e["index"] == i][-1]["meta_info"]
        assert set(g_last) == set(w_last) == META_KEYS | LOGPROB_KEYS
        assert g_last["finish_reason"] == w_last["finish_reason"] == {"type": "length"}
        for key in LOGPROB_KEYS:
            assert len(g_last[key]) == len(w_last[key]), key
            for g_entry, w_entry in zip(g_last[key], w_last[key], strict=True):
                _same_logprob_entry(g_entry, w_entry, top=key.endswith("top_logprobs"))


def _same_logprob_entry(got, want, top: bool) -> None:
    """A server entry (JSON lists) against the Engine's (tuples): the same ids, no text, the
    same logprobs within float noise; a top entry is None on both or a list on both."""
    if top:
        assert (got is None) == (want is None)
        for g, w in zip(got or [], want or [], strict=True):
            _same_logprob_entry(g, w, top=False)
        return
    assert isinstance(want, tuple) and len(got) == len(want) == 3
    assert got[1:] == [want[1], None] and want[2] is None
    assert (got[0] is None) == (want[0] is None)
    if got[0] is not None:
        assert got[0] == pytest.approx(want[0], abs=1e-4)


def test_batch_of_texts_keeps_order_and_per_prompt_params(server):
    params = [{**GREEDY, "max_new_tokens": n} for n in (5, 9, 13)]
    outs = server.generate({"text": PROMPTS, "sampling_params": params})
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [5, 9, 13]
    for prompt, p, out in zip(PROMPTS, params, outs, strict=True):
        assert out["text"] == server.generate({"text": prompt, "sampling_params": p})["text"]


def test_batch_of_input_ids_with_n_samples(server):
    ids = [[1, 403, 407, 261], [1, 500, 266]]
    params = {"temperature": 1.0, "max_new_tokens": 6, "n": 2, "seed": 3}
    outs = server.generate({"input_ids": ids, "sampling_params": params, "rid": ["a1", "b1"]})
    assert len(outs) == 4  # flat: n entries per prompt, in order
    assert [o["meta_info"]["id"] for o in outs] == ["a1", "a1", "b1", "b1"]
    assert [o["meta_info"]["index"] for o in outs] == [0, 1, 0, 1]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [4, 4, 3, 3]
    single = server.generate({"input_ids": ids[0], "sampling_params": params})
    assert isinstance(single, list) and len(single) == 2


def test_batch_stream_has_an_index_per_sample(server):
    events = list(
        server.stream("/generate", {"text": PROMPTS[:2], "sampling_params": GREEDY, "stream": True})
    )
    assert events[-1] == "[DONE]"
    last = {}
    for e in events[:-1]:
        last[e["index"]] = e
    assert sorted(last) == [0, 1]
    for i in (0, 1):
        assert (
            last[i]["text"]
            == server.generate({"text": PROMPTS[i], "sampling_params": GREEDY})["text"]
        )


def test_prompt_scoring_with_max_new_tokens_zero(server, engine):
    prompt = "Once upon a time there was a cat"
    out = server.generate(
        {
            "text": prompt,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        }
    )
    meta = out["meta_info"]
    assert out["text"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length"}
    entries = meta["input_token_logprobs"]
    assert len(entries) == meta["prompt_tokens"]
    assert entries[0][0] is None  # nothing predicts the first token
    assert all(isinstance(e[0], float) and e[0] <= 0 for e in entries[1:])
    assert "".join(e[2] for e in entries[1:]).strip() == prompt
    assert all(len(top) == 2 for top in meta["input_top_logprobs"][1:])
    expected = engine.generate(
        prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == [e[1] for e in expected]
    for got, want in zip(entries[1:], expected[1:], strict=True):
        assert got[0] == pytest.approx(want[0], abs=1e-4)
    # a later start scores fewer positions; output logprobs come with generated tokens
    out = server.generate(
        {
            "text": prompt,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 4,
        }
    )
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 4
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[2] is None for e in meta["output_token_logprobs"])


def test_sglang_clients_explicit_nulls_are_defaults(server):
    # what sglang's RuntimeEndpoint sends for a plain gen() call
    params = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 8,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": None,
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
        "ebnf": None,
        "sampling_seed": None,
        "custom_params": None,
        "logit_bias": None,
        "stream_interval": None,
    }
    out = server.generate(
        {
            "text": "Once upon a time",
            "sampling_params": params,
            "return_logprob": None,
            "logprob_start_len": None,
            "top_logprobs_num": None,
            "lora_path": None,
            "image_data": None,
        }
    )
    assert out["meta_info"]["completion_tokens"] == 8
    big_k = server.generate(
        {"text": "Once upon a time", "sampling_params": {**params, "top_k": 1 << 30}}
    )
    assert big_k["text"] == out["text"]


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("json_schema", "{nope", ["not valid JSON"]),
        ("json_schema", {"type": "nope"}, ["not a valid JSON schema"]),
        ("structural_tag", "[]", ["JSON object"]),
        ("regex", 5, ["must be a string"]),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(server, field, value, words):
    r = server.post("/generate", {"text": "Hi", "sampling_params": {field: value}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"sampling_params.{field}"
    assert all(w in error["message"] for w in words), error["message"]


def test_32_concurrent_streams_all_complete(server):
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    expected = server.generate({"text": PROMPTS[0], "sampling_params": params})["text"]

    def one(_: int) -> tuple[str, bool]:
        events = list(
            server.stream(
                "/generate", {"text": PROMPTS[0], "sampling_params": params, "stream": True}
            )
        )
        return events[-2]["text"], events[-1] == "[DONE]"

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(done for _, done in results)
    assert all(text == expected for text, _ in results)
    server.assert_kv_intact()


def test_client_disconnect_mid_stream_frees_the_kv(server):
    before = server.wait_idle()["num_aborted"]
    body = {
        "input_ids": [1, 403, 407],
        "stream": True,
        "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
    }
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith(b"data: "):
                seen += 1
                if seen == 2:
                    break
    # the connection is closed here, long before 500 tokens
    info = server.assert_kv_intact()
    assert info["num_aborted"] == before + 1


def test_client_gone_before_a_non_stream_answer_aborts_it(server):
    before = server.wait_idle()["num_aborted"]
    body = {
        "input_ids": [[1, 403, 407, k] for k in range(8)],
        "sampling_params": {"max_new_tokens": 480, "ignore_eos": True},
    }
    # NOTE: paused, so that the answer cannot come before the client leaves (on a GPU the 8
    # requests took less than the 0.5 s)
    with server.scheduler_paused(), pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/generate", json=body, timeout=0.5)
    # the server notices within a second and aborts all 8
    info = server.assert_kv_intact()
    assert info["num_aborted"] >= before + 1


def test_abort_request_ends_a_running_request(server):
    body = {
        "input_ids": [1, 403, 407],
        "rid": "to-abort",
        "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
    }
    result = {}

    def run() -> None:
        result["out"] = server.generate(body)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 10
    while server.wait_idle(0)["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = server.post("/abort_request", {"rid": "to-abort"})
    assert r.status_code == 200, r.text
    thread.join(30)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 500
    server.assert_kv_intact()


def test_info_routes(server, stories_dir):
    info = server.get("/get_model_info").json()
    assert info["model_path"] == str(stories_dir)
    assert info["tokenizer_path"] == str(stories_dir)
    assert info["is_generation"] is True
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200
    server_info = server.server_info()
    assert server_info["context_length"] == 512
    assert server_info["kv_pool"]["total"] == 4096
    assert server.get("/server_info").status_code == 200
    r = server.post("/flush_cache")
    assert r.status_code == 200, r.text
    assert server.server_info()["kv_pool"]["cached"] == 0
    metrics = server.get("/metrics")
    assert metrics.status_code == 200
    assert "weft:prompt_tokens_total" in metrics.text
    assert "weft:time_to_first_token_seconds_bucket" in metrics.text


def test_cache_hits_are_reported(server):
    prompt = "Once upon a time, in a small house, there lived a girl who liked cats."
    server.generate({"text": prompt, "sampling_params": {"max_new_tokens": 0}})
    out = server.generate({"text": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["cached_tokens"] == out["meta_info"]["prompt_tokens"] - 1
    assert server.server_info()["cache_hit_rate"] > 0


def test_sse_framing(server):
    """The raw bytes of a stream: `data: {...}` events separated by blank lines."""
    with requests.post(
        server.url + "/generate",
        stream=True,
        timeout=30,
        json={"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 3}},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_content(None))
    blocks = [b for b in raw.split(b"\n\n") if b]
    assert all(b.startswith(b"data: ") for b in blocks)
    assert blocks[-1] == b"data: [DONE]"


def test_cache_salt_isolates_the_prefix_cache(server):
    prompt = "One morning a red fox found a shiny key under the old oak tree by the river."

    def cached(salt: str | None) -> int:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
        if salt is not None:
            body["cache_salt"] = salt
        meta = server.generate(body)["meta_info"]
        return meta["cached_tokens"] - (meta["prompt_tokens"] - 1)  # 0: all but the last cached

    server.generate({"text": prompt, "sampling_params": {"max_new_tokens": 0}, "cache_salt": "a"})
    assert cached("b") < 0 and cached(None) < 0  # other namespaces: no hit on "a"'s KV
    assert cached("a") == 0 and cached("b") == 0 and cached(None) == 0  # each hits its own
    r = server.post("/generate", {"text": prompt, "cache_salt": 5})
    assert r.status_code == 400 and "cache_salt" in r.text


def test_retraction_keeps_the_in_process_engines_outputs(stories_dir, engine, schedule):
    # 8 requests need ~8 * 135 slots: a 400-slot pool makes decode run out and retract
    prompts = [[1, 403 + k, 407, 9 + k] for k in range(8)]
    params = {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}
    want = engine.generate(input_ids=prompts, sampling_params=params)
    srv = ServerProcess(
        "--model-path", str(stories_dir), "--max-total-tokens", "400", *schedule_args(schedule)
    )
    try:
        got = srv.generate({"input_ids": prompts, "sampling_params": params})
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        info = srv.assert_kv_intact()
        assert info["num_retractions"] > 0, info
    finally:
        assert srv.stop() == 0
