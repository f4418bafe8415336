"""Processes: clean stops on SIGTERM / SIGINT, a dead child fails pending requests instead of
hanging them, API keys, startup failures, the CLI flags, and SGLang's own frontend client."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import psutil
import pytest

from server_utils import ServerProcess

LONG = {"max_new_tokens": 480, "ignore_eos": True}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_process(stories_dir, sig):
    srv = ServerProcess("--model-path", str(stories_dir), "--max-total-tokens", "2048")
    names = [" ".join(psutil.Process(pid).cmdline()) for pid in srv.children_pids]
    assert sum("spawn_main" in n for n in names) == 2  # the scheduler and the detokenizer
    assert srv.generate({"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    srv.proc.send_signal(sig)
    assert srv.stop() == 0  # exit code 0, and no child left (checked by stop)
    assert "weft: stopped" in srv.output


def test_a_signal_during_a_stream_ends_it(stories_dir):
    srv = ServerProcess(
        "--model-path",
        str(stories_dir),
        "--max-total-tokens",
        "2048",
        "--max-running-requests",
        "1",
    )
    events: list = []

    def stream() -> None:
        # queued behind each other: the last ones are still pending when the signal comes
        events.extend(
            srv.stream(
                "/generate", {"input_ids": [[1, 5, 9]] * 6, "stream": True, "sampling_params": LONG}
            )
        )

    thread = threading.Thread(target=stream)
    thread.start()
    while not events:
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert not thread.is_alive()
    assert events[-1] == "[DONE]"
    assert "shutting down" in events[-2]["error"]["message"]
    assert srv.stop() == 0


def test_a_dead_child_fails_pending_requests_and_health(stories_dir):
    srv = ServerProcess(
        "--model-path",
        str(stories_dir),
        "--max-total-tokens",
        "2048",
        "--max-running-requests",
        "1",
    )
    results: dict = {}
    events: list = []

    def blocking() -> None:
        r = srv.post("/generate", {"input_ids": [[1, 7, 8]] * 4, "sampling_params": LONG})
        results["status"], results["body"] = r.status_code, r.json()

    def stream() -> None:
        events.extend(
            srv.stream(
                "/generate", {"input_ids": [1, 5, 9], "stream": True, "sampling_params": LONG}
            )
        )

    threads = [threading.Thread(target=blocking), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while srv.wait_idle(0)["num_pending"] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.child("scheduler").kill()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a pending request hung after the scheduler died"
    assert results["status"] == 503
    assert "scheduler process" in results["body"]["error"]["message"]
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert srv.get("/health").status_code == 503
    r = srv.post("/generate", {"text": "Hi"})
    assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
    assert srv.stop() == 0


def test_api_key(stories_dir):
    srv = ServerProcess(
        "--model-path",
        str(stories_dir),
        "--max-total-tokens",
        "2048",
        "--api-key",
        "s3cret",
        "--served-model-name",
        "tiny",
    )
    try:
        r = srv.post("/generate", {"text": "Hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = srv.post(
            "/generate",
            {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
            headers={"Authorization": "Bearer wrong"},
        )
        assert r.status_code == 401
        r = srv.post(
            "/generate",
            {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert r.status_code == 200
        assert srv.get("/health").status_code == 200  # probes carry no key
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="no", max_retries=0).models.list()
    finally:
        assert srv.stop() == 0


def test_a_bad_model_path_fails_fast_and_cleanly(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "weft.launch_server",
            "--model-path",
            str(tmp_path / "none"),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr


def test_a_model_that_fails_to_load_stops_the_start(tmp_path, stories_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((stories_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "weft.launch_server",
            "--model-path",
            str(broken),
            "--port",
            "0",
            "--log-level",
            "error",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "scheduler process" in proc.stderr and "cannot start" in proc.stderr


def test_serve_flags_come_from_the_config(capsys):
    from weft.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--model-path",
        "--host",
        "--port",
        "--dtype",
        "--load-format",
        "--context-length",
        "--mem-fraction-static",
        "--max-total-tokens",
        "--max-running-requests",
        "--chunked-prefill-size",
        "--schedule-policy",
        "--disable-radix-cache",
        "--grammar-backend",
        "--disable-cuda-graph",
        "--cuda-graph-max-bs",
        "--disable-overlap-schedule",
        "--api-key",
        "--served-model-name",
        "--chat-template",
        "--log-level",
        "--enable-metrics",
    ):
        assert flag in text, flag
    assert "(default: 30000)" in text


def test_server_config_keeps_the_engines_grammar_chain():
    from weft.runtime.server_config import ServerConfig

    assert ServerConfig().grammar_backends == ["xgrammar", "llguidance", "outlines"]
    config = ServerConfig(grammar_backend="llguidance,xgrammar")
    assert config.engine_config.grammar_backends == ["llguidance", "xgrammar"]
    with pytest.raises(ValueError, match="grammar_backend"):
        ServerConfig(grammar_backend="xgrammar,regexy")


def _sglang_frontend_missing() -> str | None:
    for name in ("sglang", "aiohttp", "pybase64"):
        if importlib.util.find_spec(name) is None:
            return name
    return None


@pytest.mark.skipif(
    _sglang_frontend_missing() is not None,
    reason="sglang's frontend is not installed (pip install sglang --no-deps aiohttp pybase64)",
)
def test_sglang_runtime_endpoint_runs_programs(stories_dir):
    srv = ServerProcess("--model-path", str(stories_dir), "--max-total-tokens", "4096")
    try:
        script = Path(__file__).parent / "clients" / "sglang_program.py"
        proc = subprocess.run(
            [sys.executable, str(script), srv.url], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["animal"] in ("cat", "dog", "tree")
        prefix = f"Once upon a time, there was a little {out['animal']} named Tim. "
        direct = srv.generate(
            {
                "text": prefix,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "stop": ["."]},
            }
        )
        assert out["rest"] == direct["text"]
        assert out["text"] == prefix + out["rest"]
        assert out["streamed_text"] == out["text"]
        assert len(out["batch"]) == 2
        srv.assert_kv_intact()
    finally:
        assert srv.stop() == 0
