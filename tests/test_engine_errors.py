"""Bad input raises an error naming the problem; the engine keeps serving and leaks no KV."""

from __future__ import annotations

import json
import shutil

import pytest

from weft import Engine

from conftest import make_engine


@pytest.fixture(scope="module")
def engine(stories_dir):
    return make_engine(stories_dir, max_total_tokens=2048)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": [1] * 600}, "prompt is too long: 600 tokens"),
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
    out = engine.generate(
        input_ids=[1] * 500, sampling_params={"max_new_tokens": 100, "ignore_eos": True}
    )
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
