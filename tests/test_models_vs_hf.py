"""weft against HF transformers on the same random weights (fp32): logits and greedy outputs."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import make_engine
from hf_models import CONFIGS, VOCAB, hf_greedy, hf_logprobs, save_random_model

NEW_TOKENS = 12


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 17, 33, 64]
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(request.param, folder)
    # chunked_prefill_size 16: the longer prompts cross several chunk boundaries
    engine = make_engine(folder, dtype="float32", max_total_tokens=2048, chunked_prefill_size=16)
    return hf, engine


def _greedy(new=NEW_TOKENS, **extra):
    return {"temperature": 0, "max_new_tokens": new, "ignore_eos": True, **extra}


def test_prompt_logprobs_match_hf(pair):
    hf, engine = pair
    for prompt in _prompts(1)[1:]:
        out = engine.generate(
            input_ids=prompt,
            sampling_params=_greedy(1),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=VOCAB,
        )
        ref = hf_logprobs(hf, prompt)
        tops = out["meta_info"]["input_top_logprobs"]
        assert len(tops) == len(prompt) and tops[0] is None  # nothing predicts the first token
        for pos in range(1, len(prompt)):
            ours = torch.zeros(VOCAB, dtype=torch.float64)
            for lp, tid, _ in tops[pos]:
                ours[tid] = lp
            assert torch.allclose(ours, ref[pos - 1], atol=2e-5), f"position {pos}"
            assert out["meta_info"]["input_token_logprobs"][pos][1] == prompt[pos]


def test_greedy_batch_matches_hf(pair):
    hf, engine = pair
    prompts = _prompts(2)
    outs = engine.generate(input_ids=prompts, sampling_params=_greedy())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(hf, prompt, NEW_TOKENS)
        assert out["meta_info"]["finish_reason"] == {"type": "length"}
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS


def test_prefix_cache_hits_give_same_outputs(pair):
    hf, engine = pair
    base = _prompts(3)[-1]  # 64 tokens
    first = engine.generate(input_ids=base, sampling_params=_greedy())
    branches = [base[:40] + [7, 8, 9], base + [1, 2], base]
    outs = engine.generate(input_ids=branches, sampling_params=_greedy())
    assert outs[2]["output_ids"] == first["output_ids"]
    assert outs[2]["meta_info"]["cached_tokens"] == len(base) - 1
    assert outs[0]["meta_info"]["cached_tokens"] == 40
    for prompt, out in zip(branches, outs, strict=True):
        assert out["output_ids"] == hf_greedy(hf, prompt, NEW_TOKENS)


def test_n_samples_share_the_prompt(pair):
    hf, engine = pair
    prompt = _prompts(4)[3]
    outs = engine.generate(input_ids=prompt, sampling_params=_greedy(n=3))
    assert isinstance(outs, list) and len(outs) == 3
    expected = hf_greedy(hf, prompt, NEW_TOKENS)
    assert [o["output_ids"] for o in outs] == [expected] * 3
    # the shared prompt was prefilled once: each sample found all but its last token cached
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(prompt) - 1] * 3
    assert [o["meta_info"]["index"] for o in outs] == [0, 1, 2]


def test_seeded_samples_repeat_and_differ(pair):
    _, engine = pair
    prompt = _prompts(5)[2]
    params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "seed": 11, "n": 2}
    a = engine.generate(input_ids=prompt, sampling_params=params)
    b = engine.generate(input_ids=prompt, sampling_params=params)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert a[0]["output_ids"] != a[1]["output_ids"]  # samples of n use different seeds
