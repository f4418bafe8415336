"""Observability of the real server (stories260K): /metrics counted exactly against a known mix
of requests (plain, stream, regex-constrained, OpenAI, a bad one, an aborted one), and the JSON
request log (one line per finished request, no texts unless asked for). The log's record, the
bucket counts and the error kinds are also tested as units."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from weft.runtime.histogram import BucketCounts
from weft.runtime.server.errors import ApiError, error_kind
from weft.runtime.server.metrics import ServerMetrics
from weft.runtime.server.request_log import RequestLog, request_record
from weft.runtime.server.request_state import ReqState, Sample
from weft.runtime.server_config import ServerConfig

from server_utils import ServerProcess, schedule_args, stories_args

LOG_FIELDS = {
    "time",
    "rid",
    "tenant",
    "api",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_s",
    "e2e_s",
    "finish_reason",
    "status",
    "error",
}
GREEDY = {"temperature": 0, "max_new_tokens": 16}
REGEX = "(yes|no), [a-z]+ [a-z]+\\."
TTFT = "weft:time_to_first_token_seconds"
ITL = "weft:inter_token_latency_seconds"
E2E = "weft:e2e_request_latency_seconds"


@pytest.fixture(scope="module")
def log_path(tmp_path_factory, schedule):
    return tmp_path_factory.mktemp(f"request-log-{schedule}") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(stories_dir, log_path, schedule):
    srv = ServerProcess(
        *stories_args(stories_dir, *schedule_args(schedule)),
        "--enable-metrics",
        "--request-log",
        str(log_path),
    )
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def traffic(server):
    """Send the mix once: {rid: completion tokens the client saw (None: aborted)}."""
    seen = {}
    out = server.generate({"text": "Once upon a time", "sampling_params": GREEDY, "rid": "plain"})
    seen["plain"] = out["meta_info"]["completion_tokens"]
    body = {"text": "The little dog", "sampling_params": GREEDY, "rid": "stream", "stream": True}
    events = [e for e in server.stream("/generate", body) if e != "[DONE]"]
    seen["stream"] = events[-1]["meta_info"]["completion_tokens"]
    params = {"temperature": 0, "max_new_tokens": 24, "regex": REGEX}
    out = server.generate({"text": "Is it sunny?", "sampling_params": params, "rid": "regex"})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    seen["regex"] = out["meta_info"]["completion_tokens"]
    body = {"prompt": "Lily", "max_tokens": 8, "temperature": 0, "rid": "openai"}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    seen["openai"] = r.json()["usage"]["completion_tokens"]
    bad = server.post("/generate", {"text": "", "sampling_params": GREEDY})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text"
    _stream_then_hang_up(server, "gone", [1, 403, 407])
    seen["gone"] = None
    server.assert_kv_intact()  # nothing pending: every finished request is logged
    return seen


def _stream_then_hang_up(server: ServerProcess, rid: str, ids: list[int]) -> dict:
    """A long stream the client leaves after its first event (the server aborts it); returns
    /metrics as scraped while the request was running."""
    body = {
        "input_ids": ids,
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
    }
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                return _scrape(server)  # the connection closes here, long before 500 tokens
    raise AssertionError("the stream sent no event")


def _scrape(server: ServerProcess) -> dict[str, dict[tuple, float]]:
    """{family name: {(sample name, sorted labels): value}}."""
    r = server.get("/metrics")
    assert r.status_code == 200, r.text
    return _families(r.text)


def _families(text: str) -> dict[str, dict[tuple, float]]:
    return {
        family.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


def _value(families, family: str, suffix: str = "", **labels: str) -> float:
    return families[family][(family + suffix, tuple(sorted(labels.items())))]


def _log_lines(log_path) -> list[dict]:
    return [json.loads(line) for line in log_path.read_text().splitlines()]


def test_metrics_count_the_requests_exactly(server, traffic, log_path):
    m = _scrape(server)
    lines = _log_lines(log_path)
    finished = len(traffic)
    by_reason = {dict(k[1])["finish_reason"]: v for k, v in m["weft:num_requests"].items()}
    assert sum(by_reason.values()) == finished
    assert by_reason["abort"] == 1
    generated = _value(m, "weft:generation_tokens", "_total")
    assert generated == sum(line["completion_tokens"] for line in lines)
    assert _value(m, "weft:prompt_tokens", "_total") == sum(line["prompt_tokens"] for line in lines)
    # every request got tokens: one TTFT each, then one gap per later token
    assert _value(m, TTFT, "_count") == finished
    assert _value(m, ITL, "_count") == generated - finished
    assert _value(m, E2E, "_count") == finished
    assert 0 < _value(m, ITL, "_sum") < _value(m, E2E, "_sum")
    errors = {dict(k[1])["kind"]: v for k, v in m["weft:num_errors"].items()}
    assert errors == {
        "bad_request": 1,
        "unauthorized": 0,
        "forbidden": 0,
        "overloaded": 0,
        "timeout": 0,
        "internal": 0,
        "aborted": 1,
    }
    assert _value(m, "weft:num_aborted_requests", "_total") == 1
    assert _value(m, "weft:num_retracted_requests", "_total") == 0


def test_grammar_times_are_observed(server, traffic):
    m = _scrape(server)
    compile_s = "weft:grammar_compilation_time_seconds"
    assert _value(m, compile_s, "_count") == 1  # the one constrained request
    assert _value(m, compile_s, "_bucket", le="+Inf") == 1
    mask = "weft:grammar_mask_time_seconds"
    # one mask fill per step of the constrained request (a draft is verified in one step)
    assert 1 <= _value(m, mask, "_count") <= traffic["regex"]
    assert _value(m, mask, "_sum") > 0
    # served by the preferred backend (a small regex compiles well within the race's budget)
    served = {k: v for k, v in m["weft:grammar_requests"].items() if k[0].endswith("_total")}
    assert served == {("weft:grammar_requests_total", (("backend", "xgrammar"),)): 1}
    assert _value(m, "weft:grammar_cache_hits", "_total") == 0


def test_gauges_when_idle(server, traffic):
    info = server.assert_kv_intact()
    m = _scrape(server)
    for gauge in (
        "weft:num_queue_reqs",
        "weft:num_running_reqs",
        "weft:num_grammar_queue_reqs",
        "weft:num_pending_reqs",
        "weft:num_used_tokens",
        "weft:token_usage",
    ):
        assert _value(m, gauge) == 0, gauge
    assert _value(m, "weft:max_total_num_tokens") == 4096
    assert _value(m, "weft:num_cached_tokens") == info["kv_pool"]["cached"] > 0
    prompt = _value(m, "weft:prompt_tokens", "_total")
    cached = _value(m, "weft:cached_tokens", "_total")
    assert _value(m, "weft:cache_hit_rate") == pytest.approx(cached / prompt)


def test_request_log_has_one_line_per_finished_request(server, traffic, log_path):
    lines = _log_lines(log_path)
    by_rid = {line["rid"]: line for line in lines}
    assert len(lines) == len(traffic)  # the bad request never started: no line
    assert set(by_rid) == set(traffic)
    for rid, line in by_rid.items():
        assert set(line) == LOG_FIELDS, line  # no texts without --log-prompts
        assert line["tenant"] is None
        assert line["api"] == ("openai.completions" if rid == "openai" else "native")
        assert line["prompt_tokens"] > 0
        assert 0 < line["ttft_s"] <= line["e2e_s"]
        assert line["time"].endswith("Z")
        if traffic[rid] is not None:
            assert line["completion_tokens"] == traffic[rid]
            assert line["status"] == "ok" and line["error"] is None
    assert by_rid["regex"]["finish_reason"] == "stop"
    gone = by_rid["gone"]
    assert gone["finish_reason"] == "abort" and gone["status"] == "aborted"
    assert gone["error"] == "aborted by request"
    assert 0 < gone["completion_tokens"] < 500


def test_kv_usage_while_a_request_runs(server, traffic, log_path):
    # NOTE: last of the server tests: it adds an aborted request to the counts
    m = _stream_then_hang_up(server, "busy", [1, 403, 407, 9])
    assert _value(m, "weft:num_running_reqs") + _value(m, "weft:num_queue_reqs") == 1
    assert _value(m, "weft:num_pending_reqs") == 1
    used = _value(m, "weft:num_used_tokens")
    assert 0 < used <= 4 + 500
    assert _value(m, "weft:token_usage") == pytest.approx(used / 4096)
    server.assert_kv_intact()
    assert _log_lines(log_path)[-1]["rid"] == "busy"


# ---- units ------------------------------------------------------------------------------------


def test_error_kinds():
    statuses = (400, 401, 403, 404, 413, 422, 429, 503, 408, 504, 499, 500, 502)
    kinds = {s: error_kind(s) for s in statuses}
    assert kinds == {
        400: "bad_request",
        401: "unauthorized",
        403: "forbidden",
        404: "bad_request",
        413: "bad_request",
        422: "bad_request",
        429: "overloaded",
        503: "overloaded",
        408: "timeout",
        504: "timeout",
        499: "aborted",
        500: "internal",
        502: "internal",
    }


def test_bucket_counts_render_as_a_prometheus_histogram():
    counts = BucketCounts((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        counts.observe(value)
    assert counts.counts == [2, 2, 1]  # upper bounds are inclusive, as Prometheus' `le`
    assert sum(counts.counts) == 5 and counts.sum == pytest.approx(4.65)
    with pytest.raises(ValueError, match="increase"):
        BucketCounts((1.0, 0.5))
    empty = BucketCounts((0.5,)).snapshot()
    scheduler = {
        "num_running": 2,
        "num_waiting": 3,
        "num_grammar_waiting": 1,
        "kv_total": 1000,
        "kv_used": 250,
        "kv_cached": 40,
        "num_retractions": 4,
        "num_aborted": 5,
        "grammar_compile_s": counts.snapshot(),
        "grammar_mask_s": empty,
        "grammar_served_by": {"xgrammar": 6, "llguidance": 2},
        "grammar_cache_hits": 7,
        "spec_verify_ct": 8,
        "spec_draft_tokens": 9,
        "spec_accepted_tokens": 10,
    }
    metrics = ServerMetrics()
    m = _families(metrics.render(scheduler).decode())
    h = "weft:grammar_compilation_time_seconds"
    buckets = {dict(k[1])["le"]: v for k, v in m[h].items() if k[0] == h + "_bucket"}
    assert buckets == {"0.1": 2, "1.0": 4, "+Inf": 5}
    assert _value(m, h, "_count") == 5 and _value(m, h, "_sum") == pytest.approx(4.65)
    assert _value(m, "weft:grammar_mask_time_seconds", "_count") == 0
    assert _value(m, "weft:token_usage") == 0.25
    assert _value(m, "weft:num_queue_reqs") == 3
    assert _value(m, "weft:num_retracted_requests", "_total") == 4
    assert _value(m, "weft:grammar_cache_hits", "_total") == 7
    assert _value(m, "weft:spec_verify_ct", "_total") == 8
    assert _value(m, "weft:spec_draft_tokens", "_total") == 9
    assert _value(m, "weft:spec_accepted_tokens", "_total") == 10
    assert m["weft:grammar_requests"] == {
        ("weft:grammar_requests_total", (("backend", "llguidance"),)): 2,
        ("weft:grammar_requests_total", (("backend", "xgrammar"),)): 6,
    }
    # without the scheduler (dead): its families are left out, the server's stay
    m = _families(metrics.render(None).decode())
    assert "weft:num_queue_reqs" not in m and TTFT in m


def _state(**kw) -> ReqState:
    samples = [Sample(text="ab", output_ids=[5, 6], finish_reason={"type": "length"})]
    state = ReqState("r1", 3, samples, asyncio.Event(), created=10.0, **kw)
    samples[0].first_token_at, samples[0].finished_at = 10.25, 11.0
    return state


def test_request_record_has_texts_only_when_asked():
    record = request_record(_state(api="openai.chat"))
    assert set(record) == LOG_FIELDS
    assert record["api"] == "openai.chat" and record["tenant"] is None
    assert (record["ttft_s"], record["e2e_s"]) == (0.25, 1.0)
    assert (record["completion_tokens"], record["finish_reason"]) == (2, "length")
    assert (record["status"], record["error"]) == ("ok", None)
    with_texts = request_record(_state(tenant="team-a"), prompt="Once")
    assert set(with_texts) == LOG_FIELDS | {"prompt", "output"}
    assert (with_texts["prompt"], with_texts["output"]) == ("Once", ["ab"])
    assert with_texts["tenant"] == "team-a"


def test_request_outcomes():
    failed = _state(error=ApiError("the server is shutting down", 503))
    assert failed.outcome() == ("overloaded", "the server is shutting down")
    refused = _state()
    refused.samples[0].finish_reason = {"type": "abort", "message": "bad regex", "status_code": 400}
    assert refused.outcome() == ("bad_request", "bad regex")
    aborted = _state()
    aborted.samples[0].finish_reason = {"type": "abort", "message": "aborted by request"}
    assert aborted.outcome() == ("aborted", "aborted by request")


def test_request_log_appends_one_line_per_record(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"earlier": 1}\n')
    log = RequestLog(str(path), with_texts=False)
    log.write({"rid": "a", "text": "line\nbreak"})
    log.write({"rid": "b"})
    log.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"earlier": 1},
        {"rid": "a", "text": "line\nbreak"},
        {"rid": "b"},
    ]
    with pytest.raises(ValueError, match="cannot open the request log"):
        RequestLog(str(tmp_path / "missing" / "log.jsonl"), with_texts=False)


def test_log_prompts_needs_a_request_log():
    with pytest.raises(ValueError, match="log_prompts needs request_log"):
        ServerConfig(log_prompts=True)
    with pytest.raises(ValueError, match="request_log must not be empty"):
        ServerConfig(request_log="")
    assert ServerConfig(request_log="-", log_prompts=True).log_prompts
