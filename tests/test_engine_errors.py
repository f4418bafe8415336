"""Bad input raises an error naming the problem; the engine keeps serving and leaks no KV."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from weft import Engine

from conftest import make_engine, within


@pytest.fixture(scope="module")
def engine(stories_dir):
    return make_engine(stories_dir, max_total_tokens=2048)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": [1] * 600}, "prompt is too long: 600 tokens"),
        (
            {"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 13}},
            "max_new_tokens is too large: the prompt has 500 tokens and max_new_tokens is 13, "
            "but the context length is 512",
        ),
        ({"input_ids": []}, "prompt is empty"),
        ({"prompt": ""}, "prompt is empty"),
        ({"input_ids": [1, 99999]}, "input_ids has 99999"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": -3}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "stop"),
        ({"input_ids": [1], "sampling_params": {"stop": [3]}}, "stop"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [100000]}}, "stop_token_ids"),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "n must be"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown sampling parameter"),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5},
            "logprob_start_len",
        ),
        ({"prompt": "a", "input_ids": [1]}, "exactly one of prompt and input_ids"),
    ],
)
def test_bad_requests_name_the_field(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    ok = engine.generate(input_ids=[1, 403], sampling_params={"max_new_tokens": 4})
    assert len(ok["output_ids"]) == 4


def test_generation_capped_by_context(engine):
    # the default max_new_tokens (128) is capped; one the caller sets must fit (a ValueError)
    out = engine.generate(input_ids=[1] * 500, sampling_params={"ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length"}
    assert 500 + len(out["output_ids"]) == engine.context_length == 512


def _copy(stories_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(stories_dir, folder)
    return folder


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine("/nonexistent/model")


def test_unknown_architecture(stories_dir, tmp_path):
    folder = _copy(stories_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GemmaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown architecture 'GemmaForCausalLM'"):
        Engine(str(folder), show_progress=False)


def test_missing_config_and_weights(stories_dir, tmp_path):
    folder = _copy(stories_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no .safetensors weights"):
        Engine(str(folder), show_progress=False)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config.json"):
        Engine(str(folder), show_progress=False)


def test_corrupt_weights_and_config(stories_dir, tmp_path):
    folder = _copy(stories_dir, tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model.safetensors"):
        Engine(str(folder), show_progress=False)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        Engine(str(folder), show_progress=False)


def test_checkpoint_missing_tensors(stories_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(stories_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensor"):
        Engine(str(folder), show_progress=False)


def test_bad_config_values():
    with pytest.raises(ValueError, match="dtype must be one of"):
        Engine("/x", dtype="float8")
    with pytest.raises(ValueError, match="chunked_prefill_size must be >= 1"):
        Engine("/x", chunked_prefill_size=0)


def test_checkpoint_missing_one_shard_of_a_merged_weight(stories_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(stories_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj\.weight"):
        Engine(str(folder), show_progress=False)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1e-40},
        {"temperature": 1e-300, "top_p": 1e-300},
        {"temperature": 1.0, "top_p": 1e-300, "min_p": 1.0},
    ],
)
def test_extreme_but_valid_sampling_values_do_not_break_the_engine(engine, params):
    out = engine.generate(
        input_ids=[1, 403], sampling_params={**params, "max_new_tokens": 4, "ignore_eos": True}
    )
    greedy = engine.generate(
        input_ids=[1, 403],
        sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
    )
    assert out["output_ids"] == greedy["output_ids"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"seed": 2**64 - 1, "n": 2}, "seed must be <="),
        ({"n": 1000}, "n must be <= 128"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ],
)
def test_out_of_range_values_are_rejected(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=[1, 403], sampling_params=params)


def test_duplicate_rid_is_rejected_and_the_other_completes(engine):
    import asyncio

    async def run():
        first = asyncio.ensure_future(
            engine.async_generate(
                input_ids=[1, 403],
                rid="dup",
                sampling_params={"max_new_tokens": 200, "ignore_eos": True},
            )
        )
        await asyncio.sleep(0.02)
        with pytest.raises(ValueError, match="rid 'dup' is already in use"):
            await engine.async_generate(input_ids=[1, 404], rid="dup")
        return await first

    out = asyncio.run(run())
    assert len(out["output_ids"]) == 200


def test_requests_posted_before_shutdown_do_not_hang(stories_dir):
    eng = make_engine(stories_dir, max_total_tokens=1024)
    import threading

    errors = []

    def call():
        try:
            eng.generate(
                input_ids=[1, 403], sampling_params={"max_new_tokens": 400, "ignore_eos": True}
            )
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    eng.shutdown()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)


# ---- the engine's own thread: what runs there must not wait for the engine ------------------

OWN_THREAD = r"Engine\.{}\(\) was called on the engine's own thread"


@pytest.fixture
def own_engine(stories_dir):
    """An engine of the test's own: one that deadlocks is shut down (after the join times out)
    and so skipped by the after-test audit, instead of hanging it."""
    eng = make_engine(stories_dir, max_total_tokens=1024)
    yield eng
    eng.shutdown()


def test_call_inside_call_runs_inline(own_engine):
    eng = own_engine
    assert within(10, lambda: eng.call(lambda: eng.call(lambda: 7))) == 7
    stats = within(10, lambda: eng.call(eng.memory_stats))
    assert stats == eng.memory_stats()


@pytest.mark.parametrize(
    ("name", "request_"),
    [
        ("generate", lambda e: e.generate(input_ids=[1, 403])),
        ("async_generate", lambda e: asyncio.run(e.async_generate(input_ids=[1, 403]))),
        ("generate_stream", lambda e: asyncio.run(_first(e.generate_stream(input_ids=[1, 403])))),
    ],
    ids=["generate", "async_generate", "generate_stream"],
)
def test_generate_inside_call_fails_fast(own_engine, name, request_):
    eng = own_engine
    with pytest.raises(RuntimeError, match=OWN_THREAD.format(name)):
        within(10, lambda: eng.call(lambda: request_(eng)))
    out = eng.generate(input_ids=[1, 403], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


async def _first(chunks: Any) -> Any:
    async for chunk in chunks:
        return chunk


@contextlib.contextmanager
def _main_thread_deadline(seconds: float) -> Iterator[None]:
    """A deadlock of the main thread raises TimeoutError there instead of hanging the suite."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still waiting after {seconds} s: deadlock")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_generate_inside_call_run_by_a_main_thread_generate_fails_fast(own_engine):
    # A blocking generate() on the main thread steps the scheduler itself, so a call() posted
    # meanwhile runs there, under the step lock: a generate() inside it took that lock again.
    eng = own_engine
    assert threading.current_thread() is threading.main_thread()
    with eng._cv:  # the engine thread sleeps: the main thread's generate takes the call
        eng._foreground += 1
    caller: dict[str, Any] = {}

    def post_call() -> None:
        try:
            eng.call(lambda: eng.generate(input_ids=[1, 403]))
        except BaseException as exc:
            caller["error"] = exc

    poster = threading.Thread(target=post_call, daemon=True)
    try:
        poster.start()
        while not eng._inbox and poster.is_alive():
            poster.join(0.01)
        with _main_thread_deadline(20):
            out = eng.generate(input_ids=[1, 404], sampling_params={"max_new_tokens": 3})
        poster.join(20)
    finally:
        with eng._cv:
            eng._foreground -= 1
            eng._cv.notify()
    assert not poster.is_alive()
    assert len(out["output_ids"]) == 3
    assert isinstance(caller["error"], RuntimeError)
    assert caller["error"].args[0].startswith("Engine.generate() was called on the engine's own")
