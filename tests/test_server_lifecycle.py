"""Processes: clean stops on SIGTERM (a drain) / SIGINT (at once), API keys, startup failures,
the CLI flags, and SGLang's own frontend client. A dead child: see test_server_faults."""

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


@pytest.mark.parametrize(
    ("signals", "grace_s", "drains"),
    [
        ([signal.SIGINT], 30, False),  # Ctrl-C: at once
        ([signal.SIGTERM], 1, True),  # the stream runs on for the grace period, then fails
        ([signal.SIGTERM, signal.SIGTERM], 30, False),  # a second signal cuts the drain short
    ],
    ids=["sigint", "sigterm-drain", "second-signal"],
)
def test_a_signal_during_a_stream_ends_it(stories_dir, signals, grace_s, drains):
    srv = ServerProcess(
        "--model-path",
        str(stories_dir),
        "--max-total-tokens",
        "2048",
        "--shutdown-grace-s",
        str(grace_s),
    )
    events: list = []
    ended: list[float] = []

    def stream() -> None:
        events.extend(
            srv.stream(
                "/generate", {"input_ids": [1, 5, 9], "stream": True, "sampling_params": LONG}
            )
        )
        ended.append(time.monotonic())

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 20
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    with srv.scheduler_paused():  # the stream cannot finish by itself
        sent = time.monotonic()
        srv.proc.send_signal(signals[0])
        if len(signals) > 1:
            srv.wait_health(503)  # draining
            srv.proc.send_signal(signals[1])
        thread.join(30)
    assert not thread.is_alive()
    waited = ended[0] - sent
    if drains:
        assert 1.0 <= waited < 10.0, waited
    else:
        assert waited < 10.0, waited  # far from the 30 s grace
    assert events[-1] == "[DONE]"
    assert "shutting down" in events[-2]["error"]["message"]
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
        # the API's description is behind the key too, and says so
        assert srv.get("/openapi.json").status_code == 401
        doc = srv.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
        assert doc["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
        assert "401" in doc["paths"]["/generate"]["post"]["responses"]
        assert "401" not in doc["paths"]["/health"]["get"]["responses"]
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
        "--shutdown-grace-s",
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
