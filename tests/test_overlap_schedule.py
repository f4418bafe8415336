"""The overlap schedule (the default on CUDA) gives the outputs of the plain one
(--disable-overlap-schedule). On this CPU it is forced on: the logic is the same, only the device
work is not asynchronous."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from conftest import jump_forward_off, make_engine


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(4, 24))] for _ in range(n)]


def _overlapped(engine):
    assert engine.scheduler.overlap
    return engine


@pytest.fixture(scope="module")
def plain(stories_dir):
    return make_engine(
        stories_dir, max_total_tokens=8192, disable_overlap_schedule=True, enable_jump_forward=True
    )


@pytest.fixture(scope="module")
def overlap(stories_dir):
    return _overlapped(
        make_engine(
            stories_dir,
            max_total_tokens=8192,
            enable_overlap_schedule=True,
            enable_jump_forward=True,  # (on CUDA too, beside the decode graphs)
        )
    )


def _same(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        assert x["text"] == y["text"]
        assert x["meta_info"]["finish_reason"] == y["meta_info"]["finish_reason"]


def test_mixed_lengths_stops_and_end_tokens(plain, overlap):
    prompts = [[1] + p[1:] for p in _prompts(8, seed=1)]
    params = [
        {"temperature": 0, "max_new_tokens": n, **extra}
        for n, extra in zip(
            [1, 2, 3, 17, 60, 200, 200, 90],
            [{}, {}, {"stop": ["."]}, {}, {"stop": [" the"]}, {}, {"stop_token_ids": [13]}, {}],
            strict=True,
        )
    ]
    want = plain.generate(input_ids=prompts, sampling_params=params)
    got = overlap.generate(input_ids=prompts, sampling_params=params)
    _same(got, want)
    reasons = {o["meta_info"]["finish_reason"]["type"] for o in got}
    assert reasons == {"length", "stop"}
    assert overlap.scheduler.num_overlapped_steps > 150
    assert plain.scheduler.num_overlapped_steps == 0


def test_logprobs_and_seeded_samples(plain, overlap):
    prompts = _prompts(3, seed=2)
    params = {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 24, "seed": 7, "n": 2}
    kw = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    want = plain.generate(input_ids=prompts, sampling_params=params, **kw)
    got = overlap.generate(input_ids=prompts, sampling_params=params, **kw)
    _same(got, want)
    for x, y in zip(got, want, strict=True):
        assert x["meta_info"]["output_token_logprobs"] == y["meta_info"]["output_token_logprobs"]
        assert x["meta_info"]["input_token_logprobs"] == y["meta_info"]["input_token_logprobs"]


def test_retraction_under_a_tiny_pool(stories_dir, plain):
    prompts = _prompts(8)
    greedy = {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}
    # half of them think (up to stories' "." or a budget): the phase survives a retraction
    params = [{**greedy, "thinking_budget": 40} if i % 2 else greedy for i in range(8)]
    kw = {"reasoning_end_ids": [DOT]}
    want = plain.generate(input_ids=prompts, sampling_params=params, **kw)
    tiny = _overlapped(make_engine(stories_dir, max_total_tokens=400, enable_overlap_schedule=True))
    got = tiny.generate(input_ids=prompts, sampling_params=params, **kw)
    assert tiny.scheduler.num_retractions > 0
    _same(got, want)
    tiny.check_integrity()
    tiny.shutdown()


REGEX = r'\{"name": "[a-z]{1,8}", "mood": "(happy|sad)", "place": "[a-z ]{1,12}"\}'
PROMPTS = ["Once upon a time", "One day", "Lily", "Tom was", "The sun"]


def test_constrained_outputs_match_without_jump_forward(plain, overlap):
    params = {"temperature": 0, "max_new_tokens": 60, "regex": REGEX}
    with jump_forward_off(plain, overlap):
        want = plain.generate(PROMPTS, params)
        got = overlap.generate(PROMPTS, params)
    _same(got, want)
    assert all(re.fullmatch(REGEX, o["text"]) for o in got)


def test_masks_filled_during_the_read_back_leave_the_outputs_alike(plain, overlap, monkeypatch):
    """Without drafts, a step's mask fill starts once the read-back's grammars have taken their
    tokens, before those are output: requests the output then finishes (token limits, stop
    strings, the grammar's end) are sampled unmasked and dropped. The outputs are the plain
    schedule's, unconstrained requests beside them included."""
    early = []
    start_early = overlap.scheduler._start_early

    def spy(plans):
        start_early(plans)
        early.append(overlap.scheduler._early is not None)

    monkeypatch.setattr(overlap.scheduler, "_start_early", spy)
    limits = [2, 5, 9, 13, 60, 60, 60, 60, 60, 60]
    params = [
        {
            "temperature": 0,
            "max_new_tokens": n,
            "regex": REGEX,
            **({"stop": ['"']} if i % 4 == 3 else {}),
        }
        for i, n in enumerate(limits)
    ] + [{"temperature": 0, "max_new_tokens": n} for n in (3, 40)]
    prompts = PROMPTS * 2 + PROMPTS[:2]
    with jump_forward_off(plain, overlap):
        want = plain.generate(prompts, params)
        got = overlap.generate(prompts, params)
    _same(got, want)
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in got[:10]]
    assert reasons == ["length"] * 3 + ["stop"] * 7  # (two at '"', five at the grammar's end)
    ended = [o["text"] for o in got[:10] if o["meta_info"]["finish_reason"].get("matched") == 2]
    assert len(ended) == 5 and all(re.fullmatch(REGEX, t) for t in ended)
    assert sum(early) > 20  # the fill did start during read-backs
    overlap.check_integrity()


PROSE = r"[A-Z][a-z]+ was happy\. One day, (he|she) went to the park with (his|her) mom\. The end\."
DOT = 426  # stories' "." written after a word: the end of the thinking in the tests below
SHE = 338  # "▁She": with DOT, a two-token marker the model writes too


def _marker_at(ids: list[int], marker: list[int]) -> int:
    return next(i for i in range(len(ids)) if ids[i : i + len(marker)] == marker)


@pytest.mark.parametrize(
    ("marker", "budgets"),
    [
        ([DOT], [None, 3, 0, 1, None]),
        # "The sun" writes ". It" at 16 (a false start of ". She") before its budget forces
        ([DOT, SHE], [None, None, 0, 1, 20]),
    ],
    ids=["one-token", "two-token"],
)
def test_thinking_then_a_grammar_alike_under_both_schedules_and_without_drafts(
    plain, overlap, marker, budgets
):
    """The thinking (free up to the marker the model writes, or the one a budget forces)
    switches to the grammar, whose drafts then run: the same outputs under either schedule, and
    with jump-forward off."""
    params = [
        {"temperature": 0, "max_new_tokens": 80, "regex": PROSE, "thinking_budget": b}
        for b in budgets
    ]
    kw = {"reasoning_end_ids": marker}
    want = plain.generate(PROMPTS, params, **kw)
    _same(overlap.generate(PROMPTS, params, **kw), want)
    with jump_forward_off(plain, overlap):
        _same(plain.generate(PROMPTS, params, **kw), want)
        _same(overlap.generate(PROMPTS, params, **kw), want)
    for out, budget in zip(want, budgets, strict=True):
        ids = out["output_ids"]
        at = _marker_at(ids, marker)
        if budget is not None:
            assert at == budget
        answer = plain.tokenizer.decode(ids[at + len(marker) :], skip_special_tokens=True)
        assert re.fullmatch(PROSE, answer.strip()), answer
        assert out["meta_info"]["jump_forward_tokens"] > 0
    if marker == [DOT]:  # stories writes " \n" after "." (and "\n" after ". "): the gap's
        assert any(o["text"].split(".", 1)[1][:1].isspace() for o in want)


def test_each_sample_thinks_on_its_own(overlap):
    """n > 1: every sample has its own phase (its own budget count and marker watch)."""
    params = {"temperature": 0.9, "seed": 1, "n": 3, "max_new_tokens": 80, "regex": PROSE}
    outs = overlap.generate(
        "Once upon a time", {**params, "thinking_budget": 2}, reasoning_end_ids=[DOT]
    )
    for out in outs:
        assert out["output_ids"][2] == DOT and DOT not in out["output_ids"][:2]
        assert re.fullmatch(PROSE, out["text"].split(".", 1)[1].strip())


@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_the_kv_of_verified_drafts_is_the_models(stories_dir, request, schedule):
    # Jump-forward feeds a draft behind the model's last token (under the overlap schedule, once
    # that token is read back) and keeps the KV of the draft tokens the model takes, freeing
    # the rest. Check: the KV cached for each output gives the same next-token logprobs as a
    # recomputation from scratch.
    engine = request.getfixturevalue(schedule)
    params = [{"temperature": 0, "max_new_tokens": 60, "regex": r} for r in (REGEX, PROSE)]
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS] * 2
    outs = engine.generate(input_ids=prompts, sampling_params=[params[i // 5] for i in range(10)])
    assert all(re.fullmatch(REGEX, o["text"]) for o in outs[:5])
    assert all(re.fullmatch(PROSE, o["text"]) for o in outs[5:])
    assert all(o["meta_info"]["jump_forward_tokens"] > 0 for o in outs[5:])
    engine.check_integrity()
    full = [p + o["output_ids"] for p, o in zip(prompts, outs, strict=True)]
    probe = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    kw = {"return_logprob": True, "top_logprobs_num": 5}
    cached = engine.generate(input_ids=full, sampling_params=probe, **kw)
    fresh = make_engine(stories_dir, max_total_tokens=8192, disable_radix_cache=True)
    recomputed = fresh.generate(input_ids=full, sampling_params=probe, **kw)
    fresh.shutdown()
    for c, r, ids in zip(cached, recomputed, full, strict=True):
        assert c["meta_info"]["cached_tokens"] == len(ids) - 1
        got = c["meta_info"]["output_top_logprobs"][0]
        want = r["meta_info"]["output_top_logprobs"][0]
        assert [t[1] for t in got] == [t[1] for t in want]
        assert [t[0] for t in got] == pytest.approx([t[0] for t in want], abs=1e-4)


def test_abort_while_a_step_is_in_flight(overlap):
    async def run():
        task = asyncio.ensure_future(
            overlap.async_generate(
                input_ids=_prompts(1, seed=5)[0],
                rid="victim",
                sampling_params={"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
            )
        )
        await asyncio.sleep(0.05)
        overlap.abort("victim")
        return await task

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 400
    overlap.call(lambda: None)  # let the abort land
    assert overlap.memory_stats()["in_use"] == 0


def test_a_request_aborted_while_in_flight_is_reported_once(overlap):
    # The abort reads the in-flight step back (the request got a token: resolved) and then ends
    # it (reported): step() returned it twice, and the server's scheduler process died with a
    # KeyError on the second update (every client disconnect on a GPU took the server down).
    from weft.runtime.core import Req
    from weft.runtime.sampling_params import SamplingParams

    def drive() -> list[list[str]]:
        scheduler = overlap.scheduler
        params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
        req = Req(rid="twice", input_ids=_prompts(1, seed=6)[0], params=params)
        scheduler.add(req)
        steps = [[r.rid for r in scheduler.step()] for _ in range(2)]  # prefill, then a decode
        assert scheduler._inflight is not None and req.pending is not None
        assert scheduler.abort("twice")
        while scheduler.has_work:
            steps.append([r.rid for r in scheduler.step()])
        return steps

    steps = overlap.call(drive)
    assert all(len(step) == len(set(step)) for step in steps), steps
    assert sum(step.count("twice") for step in steps) == 2  # the first token, then the abort


def test_requests_aborted_one_by_one_after_a_read_back_are_reported_once(overlap):
    # A client that leaves a batch aborts its rids one by one: the first abort reads the step
    # back (every request of it resolved), the later ones found nothing in flight and reported
    # their request a second time (the server's scheduler process died with a KeyError).
    from weft.runtime.core import Req
    from weft.runtime.sampling_params import SamplingParams

    def drive() -> list[list[str]]:
        scheduler = overlap.scheduler
        params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
        rids = [f"batch-{k}" for k in range(3)]
        for rid, prompt in zip(rids, _prompts(3, seed=7), strict=True):
            scheduler.add(Req(rid=rid, input_ids=prompt, params=params))
        steps = [[r.rid for r in scheduler.step()] for _ in range(2)]  # prefill, then a decode
        assert scheduler._inflight is not None
        assert all(scheduler.abort(rid) for rid in rids)
        while scheduler.has_work:
            steps.append([r.rid for r in scheduler.step()])
        return steps

    steps = overlap.call(drive)
    assert all(len(step) == len(set(step)) for step in steps), steps
    for rid in ("batch-0", "batch-1", "batch-2"):
        assert sum(step.count(rid) for step in steps) == 2, steps  # the first token, the abort
