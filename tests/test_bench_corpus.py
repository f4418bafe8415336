"""benchmarks/bench_constrained.py's corpus: every example valid under its schema, names unique,
and the production-like shapes all present (checked by the classifier, itself checked here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema", minversion="4.18")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # (its main imports benchmarks/common.py)
    path = BENCHMARKS / "bench_constrained.py"
    spec = importlib.util.spec_from_file_location("bench_constrained", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCHMARKS))


def test_examples_valid_and_names_unique(bench):
    entries = bench.load_corpus()
    assert [e["corpus"] for e in entries].count("production") == 15
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names))
    for e in entries:
        jsonschema.Draft202012Validator.check_schema(e["schema"])
        jsonschema.validate(e["example"], e["schema"], format_checker=FORMATS)
        assert e["prompt_text"]


def test_production_corpus_has_every_shape(bench):
    entries = bench.load_corpus(("production",))
    for e in entries:  # its feature tags name the shapes it holds
        assert bench.shapes(e["schema"]) <= set(e["features"]), e["name"]
    found = {s for e in entries for s in bench.shapes(e["schema"])}
    assert found == set(bench.SHAPES)


def test_shapes_classifier(bench):
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string"},
            "b": {"type": "string", "maxLength": 5},
            "c": {"type": "string", "pattern": "x+"},  # not free text
            "d": {"type": "array", "items": {"$ref": "#/$defs/D"}},
            "e": {"anyOf": [{"type": "object"}, {"type": "null"}]},  # optional nested object
            "f": {"type": "object"},  # required: not optional
        },
        "required": ["a", "f"],
        "$defs": {"D": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}}},
    }
    assert bench.shapes(schema) == {
        "free-text-unbounded",
        "free-text-bounded",
        "array-of-objects",
        "optional-nested-object",
        "anyOf",
        "bounded-number",
    }
    assert bench.shapes({"enum": [1, 2]}) == {"enum"}
