"""An output that opens its thinking itself (a generic reasoning parser with a start marker, a
prompt that leaves no block open): the Engine on a Qwen3 with dummy weights and Qwen3's
tokenizer (tests/qwen3_dummy.py), sampled with seeds.

Random weights write neither marker: a logit bias on the start marker's first token (added to
the model's logits, before the masks) makes the model take it (+) or leave it (-); the budget
forces the end marker. The same outputs come under the overlap schedule, and the server's text
split reads them as the scheduler ran them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import jsonschema
import pytest
from qwen3_dummy import build_qwen3_dummy

from weft.runtime.server.reasoning import marker_ids, reasoning_format, split_reasoning

from conftest import jump_forward_off, make_engine

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
PROMPT = "<|im_start|>user\nName and number, please.<|im_end|>\n<|im_start|>assistant\n"
MARKERS = {"one-token": ("<think>", "</think>"), "multi-token": ("<reason>", "</reason>")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen3_dummy(tmp_path_factory.mktemp("qwen3"))


def _engine(folder, **kwargs):
    return make_engine(
        folder,
        load_format="dummy",
        max_total_tokens=2048,
        constrained_json_disable_any_whitespace=True,  # random weights would pad JSON forever
        **kwargs,
    )


@pytest.fixture(scope="module")
def plain(folder):
    return _engine(folder, disable_overlap_schedule=True)


@pytest.fixture(scope="module")
def overlap(folder):
    engine = _engine(folder, enable_overlap_schedule=True)
    assert engine.scheduler.overlap
    return engine


@contextlib.contextmanager
def bias(engine, token: int, value: float) -> Iterator[None]:
    """`value` added to `token`'s logit in every row the model computes (a model that likes or
    shuns the token), for the block."""
    runner = engine.runner
    logits = runner.logits

    def biased(hidden, rows=None):
        out = logits(hidden, rows)
        out[:, token] += value
        return out

    runner.logits = biased
    try:
        yield
    finally:
        del runner.logits  # the class's method again


def _ids(engine, name):
    fmt = reasoning_format("generic", *MARKERS[name])
    return fmt, marker_ids(engine.tokenizer, fmt)


def _run(engine, name, value, *, budget=3, seeds=(1, 2), start=True, temperature=1.0):
    _, ids = _ids(engine, name)
    params = [
        {
            "temperature": temperature,
            "seed": seed,
            "max_new_tokens": 40,
            "json_schema": json.dumps(SCHEMA),
            "thinking_budget": budget,
        }
        for seed in seeds
    ]
    kw = {"reasoning_start_ids": ids.start, "reasoning_end_ids": ids.end} if start else {}
    with bias(engine, ids.start[0], value):
        return engine.generate([PROMPT] * len(seeds), params, **kw)


@pytest.mark.parametrize("name", list(MARKERS))
def test_a_start_marker_taken_opens_the_thinking_then_the_grammar(plain, name):
    fmt, ids = _ids(plain, name)
    assert len(ids.start) == (1 if name == "one-token" else 3)
    for out in _run(plain, name, 50.0):
        got = out["output_ids"]
        n = len(ids.start)
        # the marker (its later tokens forced), then 3 tokens of thinking, then the end marker
        assert got[:n] == ids.start
        assert got[n + 3 : n + 3 + len(ids.end)] == ids.end
        answer = plain.tokenizer.decode(got[n + 3 + len(ids.end) :], skip_special_tokens=True)
        # NOTE: lstrip: the gap after the marker may hold any whitespace token ("\x0b" too,
        # sampled on a GPU), which JSON does not read; the server's split drops it
        jsonschema.validate(json.loads(answer.lstrip()), SCHEMA)
        # the server's split reads the output as the scheduler ran it
        thought = plain.tokenizer.decode(got[n : n + 3])
        assert split_reasoning(fmt, out["text"], False) == (thought.strip(), answer.strip())


@pytest.mark.parametrize("name", list(MARKERS))
def test_any_other_first_token_is_the_answer_constrained_from_there(plain, name):
    fmt, ids = _ids(plain, name)
    for out in _run(plain, name, -50.0, budget=0):
        got = out["output_ids"]
        assert got[0] != ids.start[0]
        # no thinking: the budget forces nothing, the grammar holds every token
        assert ids.end[0] not in got
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert split_reasoning(fmt, out["text"], False) == ("", out["text"])


def test_without_the_start_ids_the_grammar_holds_the_first_token(plain):
    """The contrast: the same liked marker, no thinking phase (a request without the split)."""
    _, ids = _ids(plain, "one-token")
    for out in _run(plain, "one-token", 50.0, budget=None, start=False):
        assert out["output_ids"][0] != ids.start[0]
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_the_overlap_schedule_gives_the_same_outputs(plain, overlap):
    """Taken greedily (with jump-forward drafts), left and free to choose sampled (without
    them). NOTE: a draft's rows draw from the request's generator too, and the schedules draft
    at different steps (a token still on the device cannot feed one): sampled outputs with
    drafts differ between the schedules, as they did before the opening phase."""
    _, ids = _ids(plain, "multi-token")
    for value, budget, temperature in [(50.0, 2, 0.0), (-50.0, 0, 1.0), (0.0, 1, 1.0)]:
        with contextlib.ExitStack() as stack:
            if temperature:
                stack.enter_context(jump_forward_off(plain, overlap))
            want, got = (
                [
                    o["output_ids"]
                    for o in _run(e, "multi-token", value, budget=budget, temperature=temperature)
                ]
                for e in (plain, overlap)
            )
        assert got == want, (value, temperature)
        if value:
            assert all((o[0] == ids.start[0]) == (value > 0) for o in want)
