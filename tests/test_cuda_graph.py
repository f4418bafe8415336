"""CUDA graphs for decode: captured sizes, padded replays equal to eager steps, no KV damage."""

from __future__ import annotations

import json

import pytest
import torch

from weft.runtime.cuda_graph import capture_sizes

from conftest import make_engine

PROMPTS = [
    "Once upon a time",
    "The cat",
    "Lily had a big red ball and she",
    "One day",
    "Tom and his dog went to the park to play. They",
    "Sue",
    "The sun was hot and the little bird",
    "Ben liked to run",
    "Mom said",
    "There was a tree",
    "A frog",
]
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def graph_engine(stories_dir):
    return make_engine(stories_dir, device="cuda", max_total_tokens=4096, cuda_graph_max_bs=8)


@pytest.fixture(scope="module")
def eager_engine(stories_dir):
    return make_engine(stories_dir, device="cuda", max_total_tokens=4096, disable_cuda_graph=True)


@cuda
def test_graphs_are_captured_only_when_enabled(graph_engine, eager_engine):
    assert graph_engine.runner.graphs is not None
    assert graph_engine.runner.graphs.sizes == [1, 2, 4, 8]
    assert eager_engine.runner.graphs is None


@cuda
def test_golden_greedy_output_from_graphs(graph_engine, stories_dir):
    golden = json.loads((stories_dir / "GOLDEN.json").read_text())
    before = graph_engine.runner.graphs.num_replays
    out = graph_engine.generate(
        input_ids=golden["prompt_ids"],
        sampling_params={"temperature": 0, "max_new_tokens": 200, "ignore_eos": True},
    )
    assert out["output_ids"] == golden["greedy_ids_including_prompt"][1:]
    # every step: the 1-token prompt's prefill is decode-shaped too
    assert graph_engine.runner.graphs.num_replays - before == 200


@cuda
@pytest.mark.parametrize("sizes", [[8, 3], [1, 5, 11]])
def test_padded_batches_equal_eager_steps(graph_engine, eager_engine, sizes):
    # a smaller batch after a larger one replays with stale rows past its size: they must not
    # write into live KV; 11 rows exceed the largest graph and run eagerly
    for n in sizes:
        got = graph_engine.generate(PROMPTS[:n], GREEDY, return_logprob=True)
        want = eager_engine.generate(PROMPTS[:n], GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        for g, w in zip(got, want, strict=True):
            g_lp = [t[0] for t in g["meta_info"]["output_token_logprobs"]]
            w_lp = [t[0] for t in w["meta_info"]["output_token_logprobs"]]
            assert g_lp == pytest.approx(w_lp, abs=1e-4)
    pool = graph_engine.runner.kv_pool
    assert not pool.k_buffers[0][0].any() and not pool.v_buffers[0][0].any()  # slot 0 untouched


@cuda
def test_moe_decode_steps_replay_graphs_and_match_hf(tmp_path):
    """Qwen3-MoE's fused MoE kernels inside the captured decode steps (fp32: exact greedy)."""
    from hf_models import hf_greedy, save_random_model

    hf = save_random_model("qwen3-moe-8x2-norm-dense1", tmp_path)
    engine = make_engine(
        tmp_path, device="cuda", dtype="float32", max_total_tokens=1024, cuda_graph_max_bs=4
    )
    prompts = [[3, 17, 42], [5, 8, 13, 21, 34], [99]]
    before = engine.runner.graphs.num_replays
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.runner.graphs.num_replays - before >= 11
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(hf, prompt, 12)
    engine.shutdown()
