"""`weft serve --tp-size 2` on CPUs (two gloo ranks): the greedy outputs of one rank (the
in-process Engine with the same settings) through prefix-cache hits, chunked prefill, retraction,
prompt logprobs and a JSON schema; a dead rank fails the server with its reason; no rank process
outlives the server (nor the in-process Engine); two "hosts" on 127.0.0.1 (--nnodes 2) serve a second architecture; what
cannot be split is refused before any rank starts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import psutil
import pytest
import requests
import torch
import torch.distributed as dist

from weft.runtime import tp_processes
from weft.runtime.config import EngineConfig
from weft.runtime.loaders.source import gguf_quantized
from weft.runtime.model_config import ModelConfig
from weft.runtime.tp_processes import check_tp

from conftest import make_engine
from hf_models import VOCAB, save_random_model
from server_utils import ServerProcess, checkout_env, checkout_path

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available in this torch build",
)

# a 200-slot pool: the retraction batch below runs out of KV while decoding (4 x ~70 tokens);
# one grammar backend (no race), so that the schema's outputs do not depend on which one wins
SETTINGS = {
    "device": "cpu",  # gloo ranks on any machine (a one-GPU one would refuse two CUDA ranks)
    "max_total_tokens": 200,
    "chunked_prefill_size": 16,
    "enable_overlap_schedule": True,
    "grammar_race_budget": float("inf"),
}
GREEDY = {"temperature": 0, "max_new_tokens": 24}
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# (request body, what it exercises); run one after another, so the second STORY hits the cache
REQUESTS = [
    ({"text": STORY, "sampling_params": GREEDY}, "chunked prefill (16-token chunks)"),
    ({"text": STORY + " in the sun.", "sampling_params": GREEDY}, "a prefix-cache hit"),
    (
        {
            "text": STORY,
            "sampling_params": GREEDY,
            "return_logprob": True,
            "logprob_start_len": 0,
        },
        "prompt logprobs (Scheduler._score_prompt's logits calls)",
    ),
    (
        {"text": "Tom said:", "sampling_params": {**GREEDY, "json_schema": json.dumps(SCHEMA)}},
        "a JSON schema (grammar masks, jump-forward drafts)",
    ),
    (
        {
            "input_ids": [[1, 403 + k, 407, 9 + k] for k in range(4)],
            "sampling_params": {"temperature": 0, "max_new_tokens": 66, "ignore_eos": True},
        },
        "retraction (decode runs out of the 200-slot pool)",
    ),
]


def _flags(settings: dict[str, object]) -> list[str]:
    out: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


@pytest.fixture(scope="module")
def one_rank(stories_dir):
    """Each request's outputs on one rank (the in-process Engine, the server's settings)."""
    engine = make_engine(stories_dir, **SETTINGS)
    outputs = []
    for body, _ in REQUESTS:
        params = body["sampling_params"]
        extra = {k: body[k] for k in ("return_logprob", "logprob_start_len") if k in body}
        if "text" in body:
            outputs.append(engine.generate(body["text"], params, **extra))
        else:
            outputs.append(engine.generate(input_ids=body["input_ids"], sampling_params=params))
    engine.shutdown()
    return outputs


def _assert_same_outputs(srv: ServerProcess, one_rank: list) -> None:
    for (body, what), want in zip(REQUESTS, one_rank, strict=True):
        got = srv.generate(body)
        if isinstance(want, list):
            assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want], what
            continue
        assert got["output_ids"] == want["output_ids"], what
        assert got["meta_info"]["cached_tokens"] == want["meta_info"]["cached_tokens"], what
        if "return_logprob" in body:
            ours = [entry[0] for entry in got["meta_info"]["input_token_logprobs"][1:]]
            ref = [entry[0] for entry in want["meta_info"]["input_token_logprobs"][1:]]
            assert ours == pytest.approx(ref, abs=1e-4), what
    assert one_rank[1]["meta_info"]["cached_tokens"] > 0  # (the hit the server matched)


def _rank_processes(srv: ServerProcess) -> list[psutil.Process]:
    pids = srv.server_info()["tp_rank_pids"]
    return [psutil.Process(pid) for pid in pids.values()]


def test_two_ranks_serve_one_ranks_outputs_and_fail_when_a_rank_dies(stories_dir, one_rank):
    srv = ServerProcess("--model-path", str(stories_dir), "--tp-size", "2", *_flags(SETTINGS))
    try:
        _assert_same_outputs(srv, one_rank)
        info = srv.assert_kv_intact()
        assert info["num_retractions"] > 0, info
        (rank1,) = _rank_processes(srv)
        assert rank1.pid in srv.children_pids  # (stop() checks that every child is gone)
        assert srv.get("/health").status_code == 200
        body = {"text": STORY, "sampling_params": {"max_new_tokens": 170, "ignore_eos": True}}
        with requests.post(srv.url + "/generate", json={**body, "stream": True}, stream=True) as r:
            lines = r.iter_lines()
            next(lines)  # the request is running
            rank1.kill()
            rest = b"".join(lines)
        assert b"tensor-parallel rank 1 exited (killed by SIGKILL)" in rest, rest
        deadline = time.monotonic() + 10
        while _healthy(srv):
            assert time.monotonic() < deadline, "/health still answers 200"
            time.sleep(0.05)
    finally:
        code = srv.stop()
    assert code == 1  # (a supervisor restarts it)
    assert "tensor-parallel rank 1 exited (killed by SIGKILL)" in srv.output


def _healthy(srv: ServerProcess) -> bool:
    try:
        return srv.get("/health").status_code == 200
    except requests.ConnectionError:  # the server exited (as it does when a child died)
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


HF_MODEL = "qwen2-bias"  # another architecture (qkv biases, GQA, an lm_head of its own)
HF_PROMPT = [(7 * i + 3) % VOCAB for i in range(40)]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp-hf") / HF_MODEL
    save_random_model(HF_MODEL, folder)
    return folder


def test_two_hosts_serve_one_ranks_outputs_and_stop_together(hf_folder):
    """Two "hosts" on 127.0.0.1 with one rank each, serving a random Qwen2 checkpoint: node 1
    runs rank 1 only (no HTTP server), node 0 serves; both stop cleanly when node 0 stops,
    leaving no process behind."""
    bodies = [
        {"input_ids": HF_PROMPT, "sampling_params": GREEDY},  # chunked prefill
        {"input_ids": HF_PROMPT + [5, 6], "sampling_params": GREEDY},  # a prefix-cache hit
    ]
    engine = make_engine(hf_folder, **SETTINGS)
    want = [engine.generate(input_ids=b["input_ids"], sampling_params=GREEDY) for b in bodies]
    engine.shutdown()
    flags = ["--model-path", str(hf_folder), "--tp-size", "2", "--nnodes", "2"]
    flags += ["--dist-init-addr", f"127.0.0.1:{_free_port()}", *_flags(SETTINGS)]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "weft.launch_server", *flags, "--node-rank", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=checkout_env(),
    )
    try:
        srv = ServerProcess(*flags)
        try:
            assert srv.server_info()["tp_rank_pids"] == {}  # (rank 1 is node 1's)
            ranks = psutil.Process(node1.pid).children()
            got = [srv.generate(body) for body in bodies]
            assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
            assert got[1]["meta_info"]["cached_tokens"] > 0
            srv.assert_kv_intact()
        finally:
            assert srv.stop() == 0
        out, _ = node1.communicate(timeout=30)
        assert node1.returncode == 0, out
        assert "runs tensor-parallel ranks [1]" in out, out
        assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_an_engine_of_two_ranks_gives_one_ranks_outputs_and_stops_its_rank(
    stories_dir, one_rank, monkeypatch
):
    monkeypatch.syspath_prepend(checkout_path())  # (the spawned rank imports weft from it)
    engine = make_engine(stories_dir, tp_size=2, **SETTINGS)
    try:
        (rank1,) = engine.scheduler.tp.ranks.procs.values()
        body, _ = REQUESTS[0]
        out = engine.generate(body["text"], body["sampling_params"])
        assert out["output_ids"] == one_rank[0]["output_ids"]
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert rank1.exitcode == 0  # told to stop, it left its loop (not killed)


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(stories_dir):
    with pytest.raises(ValueError, match=r"num_attention_heads \(8\) does not split over 3"):
        make_engine(stories_dir, tp_size=3)


def test_what_tensor_parallelism_cannot_run_is_refused(stories_dir, monkeypatch):
    model = ModelConfig.from_folder(stories_dir)
    check_tp(EngineConfig(tp_size=4, device="cpu"), model)  # 8 heads, 4 KV heads: splits
    with pytest.raises(ValueError, match=r"num_attention_heads \(8\) does not split over 16"):
        check_tp(EngineConfig(tp_size=16, device="cpu"), model)
    with monkeypatch.context() as patch:  # a host of one GPU
        patch.setattr(tp_processes, "resolve_device", lambda config: torch.device("cuda"))
        patch.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.raises(ValueError, match="2 tensor-parallel ranks on this host need as many"):
            check_tp(EngineConfig(tp_size=2), model)
    with pytest.raises(ValueError, match="cannot be split over tensor-parallel ranks yet"):
        gguf_quantized(EngineConfig(tp_size=2, quantization="gguf", device="cpu"), torch.bfloat16)
    # auto dequantizes under tensor parallelism (quantized weights would not split)
    assert not gguf_quantized(EngineConfig(tp_size=2, device="cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"tp_size \(3\) must be a multiple of nnodes \(2\)"):
        EngineConfig(tp_size=3, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="nnodes > 1 needs dist_init_addr"):
        EngineConfig(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="dist_init_addr must be host:port"):
        EngineConfig(tp_size=2, dist_init_addr="host")
