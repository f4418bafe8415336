"""Hypothesis over SamplingParams: any field values give valid params or a ValueError/TypeError
naming the bad field, and valid params cross the scheduler channel (msgspec) unchanged."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from weft.runtime.messages import tokenizer_to_scheduler as to_sched
from weft.runtime.sampling_params import MAX_N, MAX_SEED, SamplingParams

VOCAB = 512  # stories260K's: the server validates with the model's vocabulary
# (grammar: the constraint as validate parses it, not a caller's field)
FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.name != "grammar"]
CONSTRAINTS = {
    "regex": "[a-z]{1,8}",
    "json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}),
    "ebnf": 'root ::= "yes" | "no"',
    "structural_tag": json.dumps(
        {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a>"]}
    ),
}

unit = st.floats(0.0, 1.0)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": st.integers(4, 4096),
    "min_new_tokens": st.integers(0, 4),
    "temperature": st.floats(0.0, 100.0) | st.integers(0, 5),
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "top_k": st.integers(-1, 1 << 30),
    "min_p": unit,
    "frequency_penalty": st.floats(-2.0, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.01, 2.0),
    "stop": st.text(min_size=1, max_size=8) | st.lists(st.text(min_size=1), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "n": st.integers(1, MAX_N),
    "seed": st.none() | st.integers(0, MAX_SEED),
    "thinking_budget": st.none() | st.integers(0, 1 << 20),
    "speculative": st.booleans(),
    # at most one constraint: drawn once for all four fields (see valid_kwargs)
    **{name: st.none() for name in CONSTRAINTS},
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 0, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
ANYTHING = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def valid_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.sets(st.sampled_from(FIELDS)))
    kwargs = {name: draw(VALID[name]) for name in sorted(names)}
    constraint = draw(st.none() | st.sampled_from(sorted(CONSTRAINTS)))
    if constraint is not None:
        kwargs[constraint] = CONSTRAINTS[constraint]
    return kwargs


def build(kwargs: dict[str, Any]) -> SamplingParams:
    params = SamplingParams(**kwargs)
    params.validate(VOCAB)
    return params


def names_field(message: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}\b", message) is not None


def assert_round_trip(params: SamplingParams) -> None:
    req = to_sched.GenerateRequest("r", [1, 2], params)
    msg = to_sched.decoder.decode(to_sched.encoder.encode(to_sched.Generate([req])))
    assert isinstance(msg, to_sched.Generate)
    assert msg.reqs[0].params == params


@settings(max_examples=150, deadline=None)
@given(valid_kwargs())
def test_valid_params_validate_and_cross_the_scheduler_channel(kwargs):
    assert_round_trip(build(kwargs))


@settings(max_examples=300, deadline=None)
@given(valid_kwargs(), st.sampled_from(FIELDS), ANYTHING)
def test_one_bad_field_is_named(kwargs, name, value):
    kwargs[name] = value
    try:
        params = build(kwargs)
    except (ValueError, TypeError) as exc:
        assert names_field(str(exc), name), f"{name}={value!r}: {exc}"
        return
    assert_round_trip(params)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), ANYTHING, min_size=1))
def test_any_values_give_valid_params_or_a_named_error(kwargs):
    try:
        params = build(kwargs)
    except (ValueError, TypeError) as exc:
        assert any(names_field(str(exc), name) for name in kwargs), f"{kwargs!r}: {exc}"
        return
    assert_round_trip(params)


def test_known_edge_values():
    """Values the fuzzing found: each is a named error, not an overflow in the scheduler."""
    cases = {
        "top_k": 2**64 - 1,  # killed the scheduler (int64 overflow building the batch)
        "max_new_tokens": 2**64,  # could not be encoded for the scheduler
        "temperature": 10**30,  # an int for a float field, too big for the message
        "stop": 5,  # was "'int' object is not iterable"
        "stop_token_ids": None,
    }
    for name, value in cases.items():
        try:
            build({name: value})
        except (ValueError, TypeError) as exc:
            assert names_field(str(exc), name), exc
        else:
            raise AssertionError(f"{name}={value!r} was accepted")
    assert build({"temperature": 2}).temperature == 2.0
    assert isinstance(build({"temperature": 2}).temperature, float)
