"""Faults and overload: SIGTERM drains running requests, a crashed scheduler fails every pending
request at once, an overloaded server answers every request (a result or an explicit refusal),
and the soak benchmark runs clean for a few seconds."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from server_utils import ServerProcess

LONG = {"max_new_tokens": 480, "ignore_eos": True}
REPO = Path(__file__).resolve().parents[1]


class Call:
    """One HTTP call in a thread: its status, JSON body or SSE events, and when it ended."""

    def __init__(self, url: str, body: dict[str, Any], stream: bool = False) -> None:
        self.url, self.body, self.stream = url, body, stream
        self.status = 0
        self.json: Any = None
        self.events: list[Any] = []
        self.headers: Any = {}  # case-insensitive once answered
        self.ended = 0.0
        self.timed_out = False
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            with requests.post(self.url, json=self.body, stream=self.stream, timeout=15) as r:
                self.status, self.headers = r.status_code, r.headers
                if self.stream and r.status_code == 200:
                    for line in r.iter_lines():
                        if line.startswith(b"data: "):
                            data = line[6:]
                            self.events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
                else:
                    self.json = r.json()
        except requests.Timeout:
            self.timed_out = True
        self.ended = time.monotonic()

    def start(self) -> Call:
        self.thread.start()
        return self

    def join(self, timeout: float = 30.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.url} hung"

    def error(self) -> str:
        """The error message of a failed call (status or error event), '' when it succeeded."""
        if self.status != 200:
            return str(self.json["error"]["message"])
        errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
        return str(errors[0]["error"]["message"]) if errors else ""


def _server(stories_dir: Path, total_tokens: int, max_running: int, *args: str) -> ServerProcess:
    return ServerProcess(
        "--model-path",
        str(stories_dir),
        "--max-total-tokens",
        str(total_tokens),
        "--max-running-requests",
        str(max_running),
        *args,
    )


@pytest.fixture
def launch(stories_dir):
    """Servers for one test; one a failed test leaves running is killed (its children exit by
    themselves when they see it gone)."""
    started: list[ServerProcess] = []

    def start(total_tokens: int, max_running: int) -> ServerProcess:
        started.append(_server(stories_dir, total_tokens, max_running))
        return started[-1]

    yield start
    for srv in started:
        if srv.proc.poll() is None:
            srv.proc.kill()


def _pending(srv: ServerProcess) -> int:
    return int(srv.wait_idle(0)["num_pending"])


def _wait_pending(srv: ServerProcess, n: int) -> None:
    deadline = time.monotonic() + 20
    while _pending(srv) < n:
        assert time.monotonic() < deadline, f"{_pending(srv)} requests pending, not {n}"
        time.sleep(0.01)


def test_sigterm_lets_running_requests_finish_and_refuses_new_ones(launch):
    srv = launch(2048, 2)
    blocking = Call(srv.url + "/generate", {"input_ids": [1, 7, 8], "sampling_params": LONG})
    streaming = Call(
        srv.url + "/generate",
        {"input_ids": [1, 5, 9], "stream": True, "sampling_params": LONG},
        stream=True,
    )
    blocking.start()
    streaming.start()
    _wait_pending(srv, 2)
    with srv.scheduler_paused():  # both are still running when the late requests come
        srv.proc.send_signal(signal.SIGTERM)
        srv.wait_health(503)
        late = srv.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        assert late.status_code == 503
        assert "shutting down" in late.json()["error"]["message"]
        late = srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503
        assert blocking.thread.is_alive() and streaming.thread.is_alive()
    blocking.join()
    streaming.join()
    assert blocking.status == 200, blocking.json
    assert blocking.json["meta_info"]["completion_tokens"] == 480
    assert blocking.json["text"]
    assert streaming.events[-1] == "[DONE]" and not streaming.error()
    assert streaming.events[-2]["meta_info"]["completion_tokens"] == 480
    assert srv.proc.wait(30) == 0  # the drain ended with the last request, not the 30 s grace
    assert "weft: draining 2 pending request(s)" in srv.output
    assert "weft: stopped" in srv.output
    # the listening socket is closed now: refused, not answered
    with pytest.raises(requests.ConnectionError):
        requests.get(srv.url + "/health", timeout=5)
    assert srv.stop() == 0  # no child left behind


def test_the_shutdown_grace_is_checked():
    from weft.runtime.server_config import ServerConfig

    assert ServerConfig().shutdown_grace_s == 30.0
    assert ServerConfig(shutdown_grace_s=0).shutdown_grace_s == 0  # 0: no drain
    with pytest.raises(ValueError, match="shutdown_grace_s"):
        ServerConfig(shutdown_grace_s=-1)


def test_a_crashed_scheduler_fails_every_pending_request_and_the_server_exits(launch):
    srv = launch(2048, 1)
    url = srv.url
    completion = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    calls = [
        Call(url + "/generate", {"input_ids": [[1, 7, 8]] * 3, "sampling_params": LONG}),
        Call(
            url + "/generate",
            {"input_ids": [1, 5, 9], "stream": True, "sampling_params": LONG},
            stream=True,
        ),
        Call(url + "/v1/completions", completion),
        Call(url + "/v1/completions", {**completion, "stream": True}, stream=True),
    ]
    for call in calls:
        call.start()
    _wait_pending(srv, 6)  # 3 + 1 + 1 + 1 prompts; one runs, the others wait for it
    killed = time.monotonic()
    srv.child("scheduler").kill()
    for call in calls:
        call.join()
    # NOTE: the manager watches the scheduler's process sentinel (no polling): the errors leave
    # within milliseconds. One second is the contract, with room for a loaded CI machine.
    slowest = max(call.ended for call in calls) - killed
    assert slowest < 1.0, f"the last pending request ended {slowest:.2f} s after the crash"
    for call in calls:
        assert not call.timed_out
        assert "scheduler process" in call.error(), (call.status, call.json, call.events[-2:])
        if call.stream:
            assert call.status == 200 and call.events[-1] == "[DONE]"
        else:
            assert call.status == 503
    # then the server exits non-zero by itself, for a supervisor to restart it, saying why
    assert srv.proc.wait(30) == 1
    assert "the scheduler process exited (killed by SIGKILL)" in srv.output, srv.output
    assert srv.stop() == 1


@pytest.fixture(scope="module")
def busy_srv(stories_dir):
    """Two running requests at most and eight waiting: any real load is refused in part."""
    srv = _server(stories_dir, 8192, 2, "--max-queued-requests", "8")
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


def _overload_call(url: str, i: int) -> Call:
    """The i-th of a mix: native / OpenAI, streaming or not, 32 new tokens each."""
    prompt = [1, 100 + i, 200 + i]
    if i % 4 == 0:
        return Call(
            url + "/generate",
            {"input_ids": prompt, "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}},
        )
    if i % 4 == 1:
        return Call(
            url + "/generate",
            {
                "input_ids": prompt,
                "stream": True,
                "sampling_params": {"max_new_tokens": 32, "ignore_eos": True},
            },
            stream=True,
        )
    body = {"prompt": prompt, "max_tokens": 32, "ignore_eos": True}
    if i % 4 == 2:
        return Call(url + "/v1/completions", body)
    return Call(
        url + "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
        stream=True,
    )


def _completion_tokens(call: Call) -> int:
    last = call.events[-2] if call.stream else call.json  # OpenAI streams: the usage chunk
    counts = last.get("meta_info") or last["usage"]
    return int(counts["completion_tokens"])


def test_overload_answers_every_request(busy_srv):
    started = time.monotonic()
    calls = [_overload_call(busy_srv.url, i).start() for i in range(60)]
    for call in calls:
        call.join(20)
    assert time.monotonic() - started < 20
    assert not [c for c in calls if c.timed_out], "requests hit the client timeout"
    served = [c for c in calls if c.status == 200]
    refused = [c for c in calls if c.status == 503]
    assert len(served) + len(refused) == 60, sorted(c.status for c in calls)
    # 60 at once: the first 8 always find room in the queue, some later ones cannot
    assert len(served) >= 8 and refused, (len(served), len(refused))
    for call in refused:
        assert call.headers.get("Retry-After"), dict(call.headers)
        assert "busy" in call.error(), call.error()
    for call in served:
        assert not call.error(), call.error()
        if call.stream:
            assert call.events[-1] == "[DONE]"
        assert _completion_tokens(call) == 32
    busy_srv.assert_kv_intact()


def test_soak_runs_clean_for_a_few_seconds(busy_srv):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "soak.py"),
            "--url",
            busy_srv.url,
            "--duration-s",
            "8",
            "--request-rate",
            "8",
            "--progress-every-s",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unexpected errors: 0" in proc.stdout
    assert "integrity ok" in proc.stdout
