"""benchmarks/bench_extraction_quality.py without a model: its workload holds together and its
scorer gives exact scores on fixed outputs."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import jsonschema
import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_extraction_quality.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_extraction_quality", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_every_answer_is_valid_under_its_kinds_schema(bench):
    schemas = bench.load_schemas()
    records = bench.load_records()
    assert len(records) >= 40
    assert len({r.id for r in records}) == len(records)
    assert set(Counter(r.kind for r in records)) == set(schemas)
    for r in records:
        validator = jsonschema.Draft202012Validator(
            schemas[r.kind], format_checker=jsonschema.FormatChecker()
        )
        assert not list(validator.iter_errors(r.answer)), r.id
        # every field of the schema is in the answer (null where absent), so each is scored
        assert set(r.answer) == set(schemas[r.kind]["properties"]), r.id


def test_limit_takes_texts_round_robin_over_kinds(bench):
    records = bench.load_records()
    picked = bench.select(records, 7)
    assert [r.id for r in picked] == [
        "person-01",
        "invoice-01",
        "meeting-01",
        "product-01",
        "company-01",
        "person-02",
        "invoice-02",
    ]
    assert bench.select(records, None) == records


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ('  {"a": {"b": [1, 2]}}\n', {"a": {"b": [1, 2]}}),
        ('Here you go:\n```json\n{"a": "x}"}\n```\nDone.', {"a": "x}"}),
        ('```\n{"a": 2}\n```', {"a": 2}),
        ('The answer is {"a": 3} and also {"b": 4}.', {"a": 3}),
        ('[1, 2] then {"c": null}', {"c": None}),
        ('{"a": 1', None),  # cut off
        ("no JSON here", None),
        ("[1, 2]", None),
        ('{bad} {"d": true}', {"d": True}),
    ],
)
def test_parse_json_object(bench, text, expected):
    assert bench.parse_json_object(text) == expected


ANSWER = {
    "name": "Chloé Martin",
    "age": 31,
    "employer": None,
    "home": {"city": "Montreal", "country": "Canada"},
    "languages": ["French", "English"],
    "items": [{"description": "Yoga mat", "quantity": 10, "unit_price": 22.0}],
}


def test_score_record_field_by_field(bench):
    parsed = {
        "name": "  chloé   MARTIN ",  # case and whitespace do not count
        "age": 31.0,  # a number by value
        # employer absent: reads as null, which is right
        "home": {"city": "Montréal", "country": "Canada"},  # an accent does count
        "languages": ["English", "French"],  # a list in another order is wrong
        "items": [{"unit_price": 22, "quantity": 10, "description": "yoga mat", "note": None}],
        "extra": "ignored",
    }
    assert bench.score_record(ANSWER, parsed) == {
        "name": True,
        "age": True,
        "employer": True,
        "home.city": False,
        "home.country": True,
        "languages": False,
        "items": True,
    }


def test_score_record_types_and_missing_objects(bench):
    parsed = {"name": "Chloé Martin", "age": "31", "employer": "", "home": "Montreal, Canada"}
    assert bench.score_record(ANSWER, parsed) == {
        "name": True,
        "age": False,  # a string is not a number
        "employer": False,  # "" is not null
        "home.city": False,  # no object there
        "home.country": False,
        "languages": False,  # missing: null, and the answer is a list
        "items": False,
    }
    assert bench.score_record({"ok": True}, {"ok": 1}) == {"ok": False}  # 1 is not true
    assert bench.score_record({"n": 1}, {"n": True}) == {"n": False}


def test_unparsed_output_scores_zero_on_every_field_even_null_ones(bench):
    assert bench.score_record(ANSWER, None) == dict.fromkeys(
        ["name", "age", "employer", "home.city", "home.country", "languages", "items"], False
    )


def _scored(bench, rid, fields, *, parsed=True, tokens=10, jump=0, backend=None):
    return bench.Scored(
        id=rid,
        kind="person",
        output="",
        parsed={} if parsed else None,
        fields=fields,
        schema_valid=parsed,
        output_tokens=tokens,
        jump_forward_tokens=jump,
        backend=backend,
    )


def test_summaries_changes_and_failures(bench):
    base = [
        _scored(bench, "a", {"x": True, "y": True}),
        _scored(bench, "b", {"x": True, "y": False}, tokens=20),
        _scored(bench, "c", {"x": False, "y": False}, parsed=False, tokens=30),
    ]
    worse = [
        _scored(bench, "a", {"x": True, "y": False}, jump=4, backend="xgrammar"),
        _scored(bench, "b", {"x": True, "y": False}, jump=2, backend="xgrammar"),
        _scored(bench, "c", {"x": True, "y": False}, jump=1, backend="llguidance"),
    ]
    equal = [
        _scored(bench, "a", {"x": True, "y": True}),
        _scored(bench, "b", {"x": False, "y": True}),
        _scored(bench, "c", {"x": False, "y": False}),
    ]
    s_base = bench.summarize(bench.BASELINE, base, 1.5)
    s_worse = bench.summarize("worse", worse, 2.0)
    s_equal = bench.summarize("equal", equal, 2.0)
    assert (s_base.fields_right, s_base.fields_total, s_base.records_exact) == (3, 6, 1)
    assert (s_base.valid_json, s_base.schema_valid, s_base.mean_output_tokens) == (2, 2, 20.0)
    assert s_base.field_score == 0.5 and s_base.record_score == 1 / 3
    assert (s_worse.fields_right, s_worse.records_exact, s_worse.jump_forward_tokens) == (3, 0, 7)
    assert s_worse.served_by == {"xgrammar": 2, "llguidance": 1}
    assert bench.field_changes(base, worse) == (["a:y"], ["c:x"])
    assert bench.field_changes(base, equal) == (["b:x"], ["b:y"])
    # worse has as many fields right but fewer whole records; equal matches the baseline
    assert bench.failures([s_base, s_worse, s_equal]) == {"worse": ["whole records 0/3 < 1"]}


def test_run_configs_cover_each_backend_first_with_and_without_jump_forward(bench):
    configs = bench.run_configs()
    assert [(c.name, c.grammar_backend, c.jump_forward, c.compact_json) for c in configs] == [
        ("unconstrained", None, False, False),
        ("xgrammar-first +jump", "xgrammar,llguidance,outlines", True, False),
        ("xgrammar-first no-jump", "xgrammar,llguidance,outlines", False, False),
        ("llguidance-first +jump", "llguidance,xgrammar,outlines", True, False),
        ("llguidance-first no-jump", "llguidance,xgrammar,outlines", False, False),
        ("outlines-first +jump", "outlines,xgrammar,llguidance", True, False),
        ("outlines-first no-jump", "outlines,xgrammar,llguidance", False, False),
        ("xgrammar-first compact", "xgrammar,llguidance,outlines", True, True),
    ]


def test_run_configs_picks_the_baseline_and_the_named_ones(bench):
    picked = bench.run_configs(["llguidance-first no-jump"])
    assert [c.name for c in picked] == ["unconstrained", "llguidance-first no-jump"]
    with pytest.raises(ValueError, match="unknown config 'xgrammar-first'"):
        bench.run_configs(["xgrammar-first"])


def test_prompt_carries_the_schema(bench):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    prompt = bench.build_prompt(None, schema, "a is 3")
    assert json.dumps(schema) in prompt and prompt.endswith("Text: a is 3\nJSON: ")
