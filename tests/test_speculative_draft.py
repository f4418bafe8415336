"""Speculative decoding with a draft model (--speculative-algorithm draft): greedy outputs equal
those without it (both schedules, grammars, stop strings and token limits inside a draft), with
the model drafting for itself (nearly every draft token kept) or a perturbed copy of it (fewer
kept); sampled tokens keep the model's distribution; a draft model of another vocabulary or end
tokens is refused; the draft model's KV pool is audited after every test (conftest)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_speculative import (
    GREEDY,
    REGEX,
    REPEATING,
    SPEC_KEYS,
    STORIES,
    _accepted,
    _req,
    assert_pairs_follow,
    pair_distribution,
)

from weft import Engine
from weft.runtime.config import EngineConfig

from conftest import make_engine

DRAFT_TOKENS = EngineConfig().speculative_num_draft_tokens  # the default
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["lily", "ben", "tom"]},
        "age": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@contextlib.contextmanager
def not_speculating(engine) -> Iterator[None]:
    """The engine without speculation for the block (the draft model stays loaded, unused)."""
    config = engine.scheduler.config
    engine.scheduler.config = config.replace(
        speculative_algorithm=None, speculative_draft_model_path=None
    )
    try:
        yield
    finally:
        engine.scheduler.config = config


def drafting_engine(target: Path, draft: Path, **kwargs) -> Engine:
    # NOTE: the schedule named and the pool fixed (on a GPU the overlap schedule is the default
    # and the pools are sized from free memory, which other modules hold); batches draft as a
    # request alone would (no row cost, no step budget)
    kwargs.setdefault("disable_overlap_schedule", True)
    kwargs.setdefault("speculative_max_step_rows", 1024)
    kwargs.setdefault("speculative_row_cost", 0.0)
    return make_engine(
        target,
        speculative_algorithm="draft",
        speculative_draft_model_path=str(draft),
        max_total_tokens=4096,
        **kwargs,
    )


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def perturbed_dir(stories_dir, tmp_path_factory) -> Path:
    """stories260K with noise (0.2 of each matrix's std) on its weight matrices: the same
    vocabulary, another model (it keeps about a quarter of the draft tokens)."""
    folder = copy_model(stories_dir, tmp_path_factory.mktemp("draft") / "perturbed")
    weights = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if w.dim() > 1:
            noise = torch.randn(w.shape, generator=gen) * 0.2 * w.float().std()
            weights[name] = (w.float() + noise).to(w.dtype)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def itself(stories_dir):
    return drafting_engine(stories_dir, stories_dir)


@pytest.fixture(scope="module")
def itself_overlap(stories_dir):
    return drafting_engine(
        stories_dir, stories_dir, disable_overlap_schedule=False, enable_overlap_schedule=True
    )


@pytest.fixture(scope="module")
def perturbed(stories_dir, perturbed_dir):
    return drafting_engine(stories_dir, perturbed_dir)


def _rate(outs: list[dict]) -> float:
    """Draft tokens kept / draft tokens verified, over the outputs."""
    kept = drafted = 0.0
    for o in outs:
        m = o["meta_info"]
        kept += (m["spec_accept_length"] - 1) * m["spec_verify_ct"]
        drafted += (
            (m["spec_accept_length"] - 1) * m["spec_verify_ct"] / max(m["spec_accept_rate"], 1e-9)
        )
    return kept / drafted


@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_the_model_drafting_for_itself_keeps_its_drafts(request, schedule):
    engine = request.getfixturevalue("itself" if schedule == "plain" else "itself_overlap")
    engine.flush_cache()
    with not_speculating(engine):
        plain = engine.generate(STORIES, GREEDY)
    assert all(SPEC_KEYS.isdisjoint(o["meta_info"]) for o in plain)
    batch = engine.generate(STORIES, GREEDY)  # the prompts are cached now
    alone = [engine.generate(p, GREEDY) for p in STORIES]
    for p, b, a in zip(plain, batch, alone, strict=True):
        assert b["output_ids"] == a["output_ids"] == p["output_ids"]
        assert b["meta_info"]["finish_reason"] == p["meta_info"]["finish_reason"]
    for o in batch + alone:
        m = o["meta_info"]
        # 64 tokens in drafts of up to 8: most verifies keep a whole draft
        assert m["spec_accept_rate"] >= 0.95, m
        assert m["spec_accept_length"] >= DRAFT_TOKENS - 2, m


def test_a_different_draft_model_changes_nothing_but_the_acceptance(perturbed, itself):
    with not_speculating(perturbed):
        plain = perturbed.generate(STORIES, GREEDY)
    spec = perturbed.generate(STORIES, GREEDY)
    for p, s in zip(plain, spec, strict=True):
        assert s["output_ids"] == p["output_ids"]
        assert s["meta_info"]["finish_reason"] == p["meta_info"]["finish_reason"]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in spec)
    assert _accepted(spec) > 0
    assert _rate(spec) < 0.6 < _rate(itself.generate(STORIES, GREEDY))


@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_constrained_greedy_is_the_same_with_a_draft_model(request, schedule, perturbed):
    engine = request.getfixturevalue("itself" if schedule == "plain" else "itself_overlap")
    record = '{"name": "lily", "mood": "happy", "place": "the park"}'
    regex = {**GREEDY, "regex": REGEX}
    schema = {**GREEDY, "json_schema": json.dumps(PERSON_SCHEMA)}
    prompts = [f"{record}\n{record}\n", "Lily is three years old. As JSON: "]
    for e in (engine, perturbed):
        with not_speculating(e):
            plain = e.generate(prompts, [regex, schema])
        spec = e.generate(prompts, [regex, schema])
        for p, s in zip(plain, spec, strict=True):
            assert s["output_ids"] == p["output_ids"]
            assert s["meta_info"]["spec_verify_ct"] > 0, (e is perturbed, s["meta_info"], s["text"])
        assert re.fullmatch(REGEX, spec[0]["text"])
        # (stories260K writes whitespace between the keys until its token limit: no full JSON)
        assert spec[1]["text"].startswith("{")
    assert _accepted(spec) > 0


@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_stop_strings_and_token_limits_inside_a_draft(request, schedule):
    engine = request.getfixturevalue("itself" if schedule == "plain" else "itself_overlap")
    prompt = STORIES[0]
    with not_speculating(engine):
        plain = engine.generate(prompt, GREEDY)
    text, ids = plain["text"], plain["output_ids"]
    for n in range(1, 30, 3):  # each limit lands inside a draft or at its edge
        out = engine.generate(prompt, {**GREEDY, "max_new_tokens": n})
        assert out["output_ids"] == ids[:n]
        assert out["meta_info"]["finish_reason"] == {"type": "length"}
    words = sorted(set(text.split()), key=text.find)[3:9]
    for stop in words:
        params = {**GREEDY, "stop": [stop]}
        out = engine.generate(prompt, params)
        with not_speculating(engine):
            want = engine.generate(prompt, params)
        assert out["text"] == want["text"] == text[: text.find(stop)]
        assert out["output_ids"] == want["output_ids"]
        assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def test_retractions_free_the_draft_kv(stories_dir, itself):
    """A pool too small for the batch retracts requests: their draft KV is freed then (and
    computed again on their return); the after-test audit checks both pools."""
    small = make_engine(
        stories_dir,
        speculative_algorithm="draft",
        speculative_draft_model_path=str(stories_dir),
        disable_overlap_schedule=True,
        max_total_tokens=250,
        speculative_max_step_rows=1024,
        speculative_row_cost=0.0,
    )
    prompts = [f"{STORIES[i % 3]} {i}" for i in range(12)]
    params = {**GREEDY, "max_new_tokens": 100, "ignore_eos": True}
    with not_speculating(itself):
        want = itself.generate(prompts, params)
    got = small.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert small.scheduler.num_retractions > 0
    assert small.memory_stats()["draft_in_use"] == 0


def test_a_failed_draft_round_costs_only_its_drafts(itself, monkeypatch):
    with not_speculating(itself):
        want = itself.generate(STORIES[1], GREEDY)
    draft = itself.scheduler.speculative.draft_model
    real, calls = draft._forward, []

    def flaky(parts):
        calls.append(len(parts))
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(parts)

    monkeypatch.setattr(draft, "_forward", flaky)
    got = itself.generate(STORIES[1], GREEDY)
    assert got["output_ids"] == want["output_ids"] and len(calls) > 3
    assert got["meta_info"]["spec_verify_ct"] > 0


def test_sampling_keeps_the_distribution_with_a_draft_model(itself):
    """As test_speculative's n-gram test: given the most likely first token t0, the pairs
    (t1, t2) at temperature 1 must follow p(t1 | t0) p(t2 | t0, t1); the model drafting for
    itself proposes t0's greedy continuation, so t2 is sampled at a drafted row when t1 is kept."""
    prompt = itself.tokenizer.encode(REPEATING)
    with not_speculating(itself):
        t0, exact = pair_distribution(itself, prompt)
    samples = 1200
    params = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}
    outs = itself.generate(input_ids=[prompt] * samples, sampling_params=params)
    drafted = [o for o in outs if o["output_ids"][0] == t0]
    assert len(drafted) >= samples // 3
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in drafted) >= len(drafted) // 2
    assert _accepted(drafted) >= len(drafted) // 4  # many t2 come from a draft's row
    assert_pairs_follow(drafted, exact)


def test_the_draft_model_drafts_less_after_the_grammar_cuts_its_drafts():
    """Tokens of the draft model that the grammar cut count as rejected (each cost a forward of
    the draft model); the counters count what was verified."""
    from weft.runtime.scheduler.speculative import Speculation, Speculative

    class Memory:
        def truncate(self, req, kv_len):
            pass

    config = EngineConfig(speculative_algorithm="draft", speculative_draft_model_path="/x")
    speculative = Speculative(config, Memory(), None)
    req = _req([1, 2, 3])
    req.spec = spec = Speculation(limit=8, proposed=8)
    assert speculative.take_draft(req, [4, 5], [4, 5, 6]) == 2  # cut after 2 of 8, both kept
    assert (spec.limit, spec.draft_tokens, spec.accepted_tokens) == (3, 2, 2)
    spec.proposed = 3
    assert speculative.take_draft(req, [], [7]) == 0  # cut whole: a miss, nothing verified
    assert (spec.limit, spec.misses, spec.skip, spec.verify_ct) == (2, 1, 1, 1)
    spec.proposed = 2
    assert speculative.take_draft(req, [8, 9], [8, 9, 1]) == 2  # kept whole: doubled
    assert (spec.limit, spec.misses) == (4, 0)


# ---- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"speculative_algorithm": "draft"}, "needs speculative_draft_model_path"),
        ({"speculative_draft_model_path": "/x"}, "speculative_draft_model_path is given but"),
        (
            {"speculative_draft_model_path": "/x", "speculative_algorithm": "ngram"},
            "speculative_draft_model_path is given but",
        ),
        (
            {"speculative_algorithm": "draft", "speculative_draft_model_path": "/x", "tp_size": 2},
            "speculative_draft_model_path: a draft model with tp_size > 1 is not supported",
        ),
    ],
)
def test_draft_options_are_checked(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**options)


def _refused(target: Path, draft: Path) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        Engine(
            str(target),
            speculative_algorithm="draft",
            speculative_draft_model_path=str(draft),
            max_total_tokens=1024,
            show_progress=False,
            log_level="warning",
        )
    return str(info.value)


def test_a_draft_model_of_another_vocabulary_is_refused(stories_dir, tmp_path):
    from conftest import fixture_path

    other = copy_model(stories_dir, tmp_path / "other-tokenizer")
    llama2 = fixture_path("tokenizers", "llama2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).unlink()
    for f in llama2.iterdir():
        if f.is_file():
            shutil.copy(f, other / f.name)
    message = _refused(stories_dir, other)
    assert "speculative_draft_model_path" in message and "tokenizer differs" in message


def test_a_draft_model_of_other_end_tokens_is_refused(stories_dir, tmp_path):
    other = copy_model(stories_dir, tmp_path / "other-eos")
    (other / "generation_config.json").write_text('{"eos_token_id": [2, 5]}')
    message = _refused(stories_dir, other)
    assert "speculative_draft_model_path" in message and "end tokens [2, 5]" in message
    assert "speculative_draft_model_path" in _refused(stories_dir, tmp_path / "missing")


# ---- through the server ---------------------------------------------------------------------


def test_server_speculates_with_a_draft_model(stories_dir, itself):
    from server_utils import ServerProcess, stories_args

    srv = ServerProcess(
        *stories_args(
            stories_dir,
            "--speculative-algorithm",
            "draft",
            "--speculative-draft-model-path",
            str(stories_dir),
            "--disable-overlap-schedule",
        ),
        "--enable-metrics",
    )
    try:
        body = {"text": STORIES[1], "sampling_params": GREEDY}
        spec = srv.generate(body)
        with not_speculating(itself):
            plain = itself.generate(STORIES[1], GREEDY)
        assert spec["output_ids"] == plain["output_ids"] and spec["text"] == plain["text"]
        assert set(spec["meta_info"]) >= SPEC_KEYS and _accepted([spec]) > 0
        metrics = srv.get("/metrics").text
        assert f"weft:spec_verify_ct_total {float(spec['meta_info']['spec_verify_ct'])}" in metrics
        info = srv.assert_kv_intact()
        assert info["kv_pool"]["draft_total"] == 4096
    finally:
        assert srv.stop() == 0
