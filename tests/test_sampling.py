"""Sampling: the math of each filter and penalty, stops, seeds and logprobs end to end."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil

import pytest
import torch

from weft.kernels.masked_sample_ref import _kept_mass
from weft.runtime.core import LogprobRequest, Req
from weft.runtime.sampler import _apply_penalties, sample_on_device
from weft.runtime.sampling_params import SamplingParams

from conftest import make_engine

PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" in stories260K's vocabulary


def _probs(values: list[float], **params) -> list[float]:
    """The probabilities the draw gives each token: its kept mass over the row's."""
    logits = torch.tensor([values]).log()
    p = SamplingParams(**params)
    mass = _kept_mass(
        logits,
        torch.tensor([len(values)]),
        logits.amax(-1),
        torch.tensor([p.temperature]),
        torch.tensor([p.top_k]),
        torch.tensor([p.top_p]),
        torch.tensor([p.min_p]),
    )
    return [round(x, 6) for x in (mass / mass.sum(-1, keepdim=True))[0].tolist()]


def test_top_k_keeps_the_k_largest():
    assert _probs([0.1, 0.4, 0.2, 0.3], top_k=2) == [0.0, round(4 / 7, 6), 0.0, round(3 / 7, 6)]


def test_top_p_keeps_the_smallest_set_reaching_p():
    # sorted 0.4, 0.3 (cum 0.7 >= 0.5 reached by the second), 0.2, 0.1 dropped
    assert _probs([0.1, 0.4, 0.2, 0.3], top_p=0.5) == [0.0, round(4 / 7, 6), 0.0, round(3 / 7, 6)]
    assert _probs([0.1, 0.4, 0.2, 0.3], top_p=0.3) == [0.0, 1.0, 0.0, 0.0]


def test_min_p_drops_tokens_below_a_share_of_the_peak():
    assert _probs([0.1, 0.4, 0.2, 0.3], min_p=0.6) == [0.0, round(4 / 7, 6), 0.0, round(3 / 7, 6)]


def test_temperature_sharpens():
    p = _probs([0.25, 0.75], temperature=0.5)  # p^2 renormalised
    assert p == [round(0.0625 / 0.625, 6), round(0.5625 / 0.625, 6)]


def test_penalties_exact_values():
    req = Req(
        "r",
        [0],
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0),
    )
    req.output_ids = [1, 1, 2]
    logits = torch.tensor([[1.0, 2.0, -2.0, 3.0]])
    _apply_penalties(logits, [req])
    # repetition over prompt+output {0, 1, 2}: 1/2, 2/2, -2*2; token 3 unseen
    # then frequency/presence over output: token 1 twice (-1.0 - 0.25), token 2 once (-0.5 - 0.25)
    assert logits.tolist() == [[0.5, 1.0 - 1.25, -4.0 - 0.75, 3.0]]


def test_min_new_tokens_blocks_end_tokens():
    req = Req("r", [0], SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[3]))
    logits = torch.tensor([[0.0, 5.0, 0.0, 9.0]])  # end id 1 and stop id 3 lead
    ids, _ = sample_on_device(logits, [req], frozenset({1}), fused=True)  # CPU: the twin
    assert ids.tolist() == [0] or ids.tolist() == [2]


@pytest.fixture(scope="module")
def engine(stories_dir):
    return make_engine(stories_dir, max_total_tokens=4096)


def _greedy(engine, **extra):
    params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True, **extra}
    return engine.generate(input_ids=PROMPT, sampling_params=params)


def test_top_k_1_is_greedy(engine):
    sampled = engine.generate(
        input_ids=PROMPT,
        sampling_params={"temperature": 0.8, "top_k": 1, "max_new_tokens": 40, "ignore_eos": True},
    )
    assert sampled["output_ids"] == _greedy(engine, max_new_tokens=40)["output_ids"]


def test_seeds(engine):
    params = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True}
    a = engine.generate(input_ids=PROMPT, sampling_params={**params, "seed": 1})
    b = engine.generate(input_ids=PROMPT, sampling_params={**params, "seed": 1})
    c = engine.generate(input_ids=PROMPT, sampling_params={**params, "seed": 2})
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]


def test_stop_string_spanning_tokens(engine):
    full = _greedy(engine)
    tok = engine.tokenizer
    pieces = [tok.decode(full["output_ids"][: i + 1]) for i in range(len(full["output_ids"]))]
    # a stop string made of the end of token 10's text and the start of token 11's
    cut = len(pieces[9])
    stop = full["text"][cut - 2 : cut + 2]
    assert len(stop) == 4 and full["text"].find(stop) == cut - 2
    out = _greedy(engine, stop=[stop, "zzzz-never"])
    assert out["text"] == full["text"][: cut - 2]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = _greedy(engine, stop=stop, no_stop_trim=True)
    assert kept["text"] == full["text"][: cut + 2]


def test_stop_token_ids(engine):
    full = _greedy(engine)
    target = full["output_ids"][7]
    first = full["output_ids"].index(target)
    out = _greedy(engine, stop_token_ids=[target])
    assert out["output_ids"] == full["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}


def test_end_tokens_from_generation_config(engine, stories_dir, tmp_path):
    # stories260K emits <s> (id 1) where a story ends; declaring it an eos id in
    # generation_config.json must make generation stop there
    full = _greedy(engine, max_new_tokens=400)
    end_at = full["output_ids"].index(1)
    folder = tmp_path / "stories"
    shutil.copytree(stories_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    eng = make_engine(folder, max_total_tokens=4096)
    assert eng.end_ids == frozenset({1, 2})
    out = _greedy(eng, max_new_tokens=400, ignore_eos=False)
    assert out["output_ids"] == full["output_ids"][: end_at + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 1}
    assert out["text"] == engine.tokenizer.decode(
        full["output_ids"][:end_at], skip_special_tokens=True
    )
    ignored = _greedy(eng, max_new_tokens=400)
    assert ignored["output_ids"] == full["output_ids"]
    later = _greedy(eng, max_new_tokens=400, ignore_eos=False, min_new_tokens=end_at + 3)
    assert 1 not in later["output_ids"][: end_at + 2] and len(later["output_ids"]) > end_at + 2
    eng.shutdown()


def test_output_logprobs_with_top_alternatives(engine):
    out = engine.generate(
        input_ids=PROMPT,
        sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=3,
    )
    meta = out["meta_info"]
    assert [tid for _, tid, _ in meta["output_token_logprobs"]] == out["output_ids"]
    for (lp, tid, _), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
    ):
        assert len(top) == 3 and top[0][1] == tid and top[0][0] == pytest.approx(lp)
        assert top[0][0] >= top[1][0] >= top[2][0]
    assert meta["input_token_logprobs"] == meta["input_top_logprobs"] == []  # start_len -1


def test_stream_chunks_end_with_the_final_text(engine):
    params = {"temperature": 0, "max_new_tokens": 50, "ignore_eos": True, "stop": "girl"}

    async def run():
        return [c async for c in engine.generate_stream(input_ids=PROMPT, sampling_params=params)]

    chunks = asyncio.run(run())
    final = engine.generate(input_ids=PROMPT, sampling_params=params)
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == final["text"] and "girl" not in texts[-1]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "girl"}


def test_logprob_request_defaults():
    assert LogprobRequest().start_len == -1


def test_penalties_end_to_end_reduce_repetition(engine):
    plain = _greedy(engine, max_new_tokens=120)["output_ids"]
    for extra in (
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.5},
    ):
        out = _greedy(engine, max_new_tokens=120, **extra)["output_ids"]
        assert len(set(out)) > len(set(plain)), extra
