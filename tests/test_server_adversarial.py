"""Attacks on a running server that once killed it, hung it or held its memory: crafted rids,
grammar storms, oversized prompts, frozen and killed children. Each asserts that the server keeps
serving (or exits cleanly, non-zero, when it cannot) and that the KV pool stays intact.

The HTTP-level attacks (undecodable bodies, slow headers, authentication) are in
test_server_adversarial_http.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
import requests

from weft.grammars.spec import off_loop, parse_off_loop
from weft.runtime.server.liveness import (
    HEARTBEAT_TIMEOUT_S,
    STALL_HEALTH_S,
    scheduler_liveness,
)

from conftest import shared_server
from server_utils import ServerProcess, stories_args

LONG = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(stories_server):
    yield from shared_server(stories_server)


class Stream(threading.Thread):
    """A native /generate stream read to its end on a thread; `events` as they arrive."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.events: list[Any] = []
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        with requests.post(self.url + "/generate", json=self.body, stream=True, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    data = line[6:]
                    self.events.append("[DONE]" if data == b"[DONE]" else json.loads(data))

    def wait_first_event(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.events:
            assert time.monotonic() < deadline and self.is_alive(), "no event came"
            time.sleep(0.01)


# ---- crafted rids -----------------------------------------------------------------------------


def test_a_rid_naming_another_requests_sample_is_refused(server):
    # n = 2 samples were named rid + "\x1f" + i inside the scheduler: a second request with rid
    # "v\x1f0" collided with the first's sample and the scheduler died with KeyError
    stream = Stream(
        server.url, {"input_ids": [1, 5, 9], "rid": "v", "sampling_params": {**LONG, "n": 2}}
    )
    stream.wait_first_event()
    for rid in ["v\x1f0", "v\x1fprompt", "line\nbreak", "\x00", "del\x7f", "x" * 257, ""]:
        r = server.post(
            "/generate", {"text": "Hi", "rid": rid, "sampling_params": {"max_new_tokens": 2}}
        )
        assert r.status_code == 400, (rid, r.text)
        assert r.json()["error"]["param"] == "rid", r.text
    stream.join(120)
    assert stream.status == 200 and stream.events[-1] == "[DONE]"
    finals = [e for e in stream.events[:-1] if e["meta_info"]["finish_reason"] is not None]
    assert sorted(e["index"] for e in finals) == [0, 1]
    assert all(e["meta_info"]["finish_reason"]["type"] == "length" for e in finals)
    assert server.get("/health").status_code == 200


def test_a_printable_rid_is_echoed_and_aborts_its_request(server):
    rid = "tenant/req 42 · ü"
    stream = Stream(server.url, {"input_ids": [1, 5, 9], "rid": rid, "sampling_params": LONG})
    stream.wait_first_event()
    assert server.post("/abort_request", {"rid": rid}).status_code == 200
    stream.join(60)
    last = stream.events[-2]
    assert last["meta_info"]["id"] == rid
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    server.assert_kv_intact()


# ---- grammar storms ---------------------------------------------------------------------------


def test_a_batch_of_distinct_schemas_all_finish(server):
    # 40 prompts each with its own schema: the compiles that finished before the grammar
    # manager registered its callback deadlocked every grammar worker, and 31 requests hung
    schemas = [
        {
            "type": "object",
            "properties": {
                f"k{i}": {"type": "integer"},
                "name": {"type": "string", "maxLength": 4},
            },
            "required": [f"k{i}", "name"],
            "additionalProperties": False,
        }
        for i in range(40)
    ]
    body = {
        "text": ["Once upon a time"] * 40,
        "sampling_params": [
            {"temperature": 0, "max_new_tokens": 24, "json_schema": json.dumps(s)} for s in schemas
        ],
    }
    r = requests.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 40
    for i, out in enumerate(outs):
        reason = out["meta_info"]["finish_reason"]["type"]
        assert reason in ("stop", "length"), out
        if reason == "stop":
            assert set(json.loads(out["text"])) == {f"k{i}", "name"}
    server.assert_kv_intact()


# ---- liveness -----------------------------------------------------------------------------


def test_liveness_decisions():
    assert scheduler_liveness(0.5, 0.0, 0, 300) == (None, 0.5)
    # idle for long: nothing pending, nothing stuck
    assert scheduler_liveness(1.0, 999.0, 0, 300) == (None, 1.0)
    why, stalled = scheduler_liveness(HEARTBEAT_TIMEOUT_S + 1, 0.0, 0, 300)
    assert why is not None and "not answered" in why and stalled == HEARTBEAT_TIMEOUT_S + 1
    # alive but not stepping while requests wait (e.g. stuck grammar workers)
    why, stalled = scheduler_liveness(0.5, STALL_HEALTH_S + 1, 3, 300)
    assert why is not None and "3 pending request(s)" in why and stalled == STALL_HEALTH_S + 1
    assert scheduler_liveness(0.5, STALL_HEALTH_S - 1, 3, 300)[0] is None
    # a watchdog shorter than the health bound reports sooner; 0 turns it off
    assert scheduler_liveness(0.5, 6.0, 1, 5)[0] is not None
    assert scheduler_liveness(0.5, STALL_HEALTH_S - 1, 1, 0)[0] is None


def test_a_frozen_scheduler_fails_health_and_recovers(server):
    # (the shared server: it serves on after this test; the session stops it and checks exit 0)
    with server.scheduler_paused():
        server.wait_health(503, timeout=HEARTBEAT_TIMEOUT_S + 5)
        body = server.get("/health").json()["error"]["message"]
        assert "the scheduler process has not answered" in body
        started = time.monotonic()
        r = server.get("/get_server_info")
        assert r.status_code == 503 and time.monotonic() - started < 2.0, r.text
    server.wait_health(200, timeout=10)
    server.assert_kv_intact()


def test_the_watchdog_fails_pending_requests_and_exits(stories_dir):
    srv = ServerProcess(*stories_args(stories_dir, "--watchdog-timeout", "2"))
    stream = Stream(srv.url, {"input_ids": [1, 5, 9], "sampling_params": LONG})
    stream.wait_first_event()
    srv.child("scheduler").suspend()  # frozen for good (the launcher kills it on the way out)
    stream.join(60)
    assert stream.events[-1] == "[DONE]"
    error = stream.events[-2]["error"]["message"]
    # (with a watchdog this short, the stall bound trips before the missed heartbeats do)
    assert "watchdog: the scheduler" in error, error
    assert srv.proc.wait(30) == 1
    assert "weft: stopping: watchdog" in srv.output, srv.output
    assert srv.stop() == 1


def test_a_killed_detokenizer_fails_pending_requests_and_the_server_exits(stories_dir):
    srv = ServerProcess(*stories_args(stories_dir))
    stream = Stream(srv.url, {"input_ids": [1, 5, 9], "sampling_params": LONG})
    stream.wait_first_event()
    srv.child("detokenizer").kill()
    stream.join(30)
    assert stream.events[-1] == "[DONE]"
    assert (
        "the detokenizer process exited (killed by SIGKILL)"
        in stream.events[-2]["error"]["message"]
    )
    assert srv.proc.wait(30) == 1
    assert srv.stop() == 1


# ---- oversized prompts --------------------------------------------------------------------


def test_a_huge_prompt_is_refused_before_tokenizing_and_health_stays_live(server):
    # a 16 MB prompt (under the 32 MiB body limit) was tokenized on the event loop: /health and
    # every other client's stream froze for 26 s
    health: list[tuple[int, float]] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            started = time.monotonic()
            status = server.get("/health").status_code
            health.append((status, time.monotonic() - started))
            time.sleep(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    model = server.get("/v1/models").json()["data"][0]["id"]
    huge = "Once upon a time " * (1 << 20)  # 17 MiB
    started = time.monotonic()
    try:
        for path, body in [
            ("/generate", {"text": huge, "sampling_params": {"max_new_tokens": 1}}),
            ("/v1/completions", {"model": model, "prompt": huge, "max_tokens": 1}),
        ]:
            r = requests.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded", error
            assert "characters can only make more than" in error["message"], error
    finally:
        stop.set()
        prober.join(10)
    assert time.monotonic() - started < 20
    assert health and all(status == 200 for status, _ in health), health
    assert max(seconds for _, seconds in health) < 2.0, health


def test_slow_work_inside_a_parse_runs_on_a_worker_thread():
    # what tokenize() and parse_spec() do with long texts inside the server's request parsing
    calls: list[str] = []

    def work(value: int) -> int:
        calls.append(threading.current_thread().name)
        if value < 0:
            raise ValueError("negative")
        return value * 2

    def parse(value: int) -> int:
        return off_loop(("double", value), lambda: work(value)) + 1

    assert parse(3) == 7 and calls == [threading.current_thread().name]  # outside: inline
    calls.clear()
    assert asyncio.run(parse_off_loop(lambda: parse(4))) == 9
    assert len(calls) == 1 and calls[0].startswith("weft-off-loop")
    with pytest.raises(ValueError, match="negative"):
        asyncio.run(parse_off_loop(lambda: parse(-1)))
