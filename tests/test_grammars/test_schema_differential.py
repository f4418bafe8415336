"""The grammar chain against the `jsonschema` package, schema by schema: whatever the chain serves
must accept exactly the JSON texts of the valid instances, and what it cannot serve exactly it
must refuse, naming the keyword and where the schema uses it (grammars/schema_keywords.py).

For each served schema, instances come from hypothesis-jsonschema (valid, mostly) plus a few
written here, each also mutated (invalid, mostly: a bound crossed, a key dropped, a type
changed); the text of each walks token by token through the matcher the chain picked, on the
real Qwen2 vocabulary. Its verdict (every token accepted and the grammar can end) must equal
jsonschema's, where the backend can write the instance at all (`writable`: the ways a backend
is stricter than the schema, none of them a weakening). A raw control character put into a
string of a valid text must be refused (the output would not be JSON).
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest

from weft.grammars.bitmask import allocate_bitmask, bit_is_set
from weft.grammars.manager import DEFAULT_ORDER, GrammarError, GrammarManager, RequestGrammar
from weft.grammars.schema_walk import resolve_ref
from weft.grammars.spec import JSON_WHITESPACE_MAX, parse_spec

from conftest import fixture_path

hypothesis = pytest.importorskip("hypothesis")
hypothesis_jsonschema = pytest.importorskip("hypothesis_jsonschema")
jsonschema = pytest.importorskip("jsonschema", minversion="4.18")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VOCAB_SIZE = 151936  # Qwen2's lm_head rows
END_IDS = [151643, 151645]
EXAMPLES = 20  # hypothesis examples per schema (two instances each, one or two texts each)
# JSON text as models write it: every backend allows whitespace runs (spec.JSON_WHITESPACE).
SPACED, COMPACT, NEWLINED = (", ", ": "), (",", ":"), (",\n    ", " : ")
FORMS = {backend: [SPACED, COMPACT, NEWLINED] for backend in DEFAULT_ORDER}


@dataclass
class Entry:
    name: str
    schema: Any
    served_by: str | None  # the backend the chain picks, or None: refused
    examples: list[Any] = field(default_factory=list)  # valid instances, besides generated ones
    generate: bool = True  # hypothesis-jsonschema can generate instances
    refusals: list[str] = field(default_factory=list)  # each backend's reason, when refused
    # invalid instances, besides the mutations (which hypothesis versions draw differently)
    invalid: list[Any] = field(default_factory=list)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "born": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
NUMBERS = {
    "type": "object",
    "properties": {
        "i": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 12},
        "n": {"type": "number", "minimum": -1.5, "maximum": 2.25},
        "e": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "m": {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 30},
    },
    "required": ["i", "n", "e", "m"],
    "additionalProperties": False,
}
STRINGS = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "word": {"type": "string", "minLength": 2, "maxLength": 5},
        "day": {"type": "string", "format": "date"},
    },
    "required": ["code", "word", "day"],
    "additionalProperties": False,
}
TUPLE = {
    "type": "array",
    "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 3}],
    "items": {"type": "boolean"},
    "minItems": 1,
    "maxItems": 4,
}
OPEN_OBJECT = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "additionalProperties": {"type": "string", "maxLength": 4},
    "minProperties": 1,
    "maxProperties": 3,
}
KEYS = {
    "type": "object",
    "properties": {"ab": {"type": "integer", "minimum": 0}},
    "propertyNames": {"pattern": "^[a-z]{1,6}$"},
    "additionalProperties": {"type": "integer"},
    "maxProperties": 3,
}
NULLABLE = {
    "type": "object",
    "properties": {
        "v": {
            "anyOf": [
                {"type": "string", "maxLength": 3},
                {"type": "null"},
                {"type": "integer", "minimum": 0},
            ]
        }
    },
    "required": ["v"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["v"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
CONSTS = {
    "type": "object",
    "properties": {
        "kind": {"const": "point"},
        "unit": {"type": "string", "enum": ["cm", "m"]},
        "flag": {"enum": [True, None, 3]},
    },
    "required": ["kind"],
    "additionalProperties": False,
}

SHAPES = {
    "$defs": {
        "circle": {
            "type": "object",
            "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
            "required": ["kind", "r"],
            "additionalProperties": False,
        },
        "square": {
            "type": "object",
            "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1}},
            "required": ["kind", "side"],
            "additionalProperties": False,
        },
    },
    "oneOf": [{"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/square"}],
}

CORPUS = [
    # served by xgrammar (its length-bounded strings are rewritten as patterns)
    Entry("person", PERSON, "xgrammar", [{"name": "Ann", "age": 31, "tags": ["blue"]}]),
    Entry("numbers", NUMBERS, "xgrammar", [{"i": 11, "n": 2.25, "e": 0.5, "m": 30}]),
    Entry("strings", STRINGS, "xgrammar", [{"code": "AB-123", "word": "hé", "day": "2024-02-29"}]),
    Entry("tuple", TUPLE, "xgrammar", [[1], [2, "ab", True, False]]),
    Entry("open-object", OPEN_OBJECT, "xgrammar", [{"a": 1, "b": "xy"}]),
    Entry("property-names", KEYS, "xgrammar", [{"ab": 1}]),
    Entry("nullable", NULLABLE, "xgrammar", [{"v": None}, {"v": "abc"}]),
    Entry("tree", TREE, "xgrammar", [{"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}], False),
    Entry("consts", CONSTS, "xgrammar", [{"kind": "point", "unit": "m", "flag": None}]),
    Entry("disjoint-oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "xgrammar"),
    # xgrammar warns it reads this oneOf as anyOf; weft proves the branches disjoint (the tag)
    Entry("tagged-union", SHAPES, "xgrammar", [{"kind": "square", "side": 2}]),
    # ... and with a pattern beside lengths, llguidance, told to read the proven oneOf as anyOf
    Entry(
        "tagged-union-with-lengths",
        {
            **SHAPES,
            "$defs": {
                **SHAPES["$defs"],
                "square": {
                    **SHAPES["$defs"]["square"],
                    "properties": {
                        **SHAPES["$defs"]["square"]["properties"],
                        "label": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
                    },
                },
            },
        },
        "llguidance",
        [{"kind": "square", "side": 2, "label": "abc"}],
    ),
    # a length range as wide as xgrammar serves fast: it gets a spelled-out class, not "."
    Entry(
        "query",
        {
            "type": "object",
            "properties": {"q": {"type": "string", "minLength": 1, "maxLength": 128}},
            "required": ["q"],
            "additionalProperties": False,
        },
        "xgrammar",
        [{"q": "Apple iPhone"}, {"q": "a" * 128}],
        invalid=[{"q": ""}, {"q": "a" * 129}],
    ),
    # wider: xgrammar's masks take ~80 ms inside such a string; llguidance serves it
    Entry(
        "long-query",
        {
            "type": "object",
            "properties": {"q": {"type": "string", "minLength": 1, "maxLength": 200}},
            "required": ["q"],
            "additionalProperties": False,
        },
        "llguidance",
        [{"q": "Apple iPhone"}],
        invalid=[{"q": ""}, {"q": "a" * 201}],
    ),
    # xgrammar would weaken these: llguidance serves them
    Entry(
        "wide-repetition-pattern",
        {"type": "string", "pattern": "^.{1,200}$"},
        "llguidance",
        ['say "hi"', "a\\b"],
        invalid=["", "a" * 201],
    ),
    Entry(
        "pattern-and-lengths",
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 5},
        "llguidance",
    ),
    Entry(
        "format-and-pattern",
        {"type": "string", "format": "date", "pattern": "^2024-"},
        "llguidance",
        ["2024-01-31", "2024-12-01"],
        False,
    ),
    Entry(
        "format-and-length",
        {"type": "string", "format": "date-time", "maxLength": 20},
        "llguidance",
        ["2024-01-05T10:00:00Z"],
        invalid=["2024-01-05T10:00:00.000Z", "2024-01-05", "hello", 3],
    ),
    Entry(
        "patternProperties",
        {
            "type": "object",
            "properties": {"x_id": {"type": "integer"}},
            "patternProperties": {"^x_": {"type": "integer", "minimum": 0}},
            "additionalProperties": False,
        },
        "llguidance",
        [{"x_id": 3, "x_b": 0}],
    ),
    Entry(
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        "llguidance",
        [{"a": 1, "b": "x"}],
    ),
    Entry(
        "required-beside-anyOf",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {}, "c": {}},
            "required": ["a"],
            "anyOf": [{"required": ["b"]}, {"required": ["c"]}],
            "additionalProperties": False,
        },
        "llguidance",
        [{"a": 1, "b": 2}],
    ),
    Entry(
        "ref-siblings",
        {
            "$defs": {"s": {"type": "string", "pattern": "^[a-z]*$"}},
            "$ref": "#/$defs/s",
            "maxLength": 3,
        },
        "llguidance",
    ),
    Entry(
        "anchor-ref",
        {
            "$defs": {"s": {"$anchor": "word", "type": "string", "maxLength": 3}},
            "type": "object",
            "properties": {"w": {"$ref": "#word"}},
            "required": ["w"],
            "additionalProperties": False,
        },
        "llguidance",
        [{"w": "abc"}],
        False,
    ),
    Entry(
        "required-undeclared",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
        "llguidance",
        [{"a": 1, "b": None}],
    ),
    Entry(
        "number-multipleOf",
        {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 2},
        "llguidance",
    ),
    Entry(
        "typeless",
        {"minLength": 2, "minimum": 3},
        "llguidance",
        ["ab", 3, None],
        invalid=["a", "", 2, -1.5],
    ),
    Entry(
        "enum-beside-keywords",
        {"type": "string", "enum": ["ab", "abc", 1], "maxLength": 2},
        "llguidance",
    ),
    # nothing serves these exactly: a 400 naming the keyword, its pointer and each reason
    Entry(
        "uniqueItems",
        {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
        None,
        refusals=[
            "xgrammar: xgrammar does not enforce uniqueItems at /properties/tags/uniqueItems",
            'llguidance: Unimplemented keys: ["uniqueItems"] (at /properties/tags/uniqueItems)',
            "outlines: outlines-core does not enforce uniqueItems at /properties/tags/uniqueItems",
        ],
    ),
    Entry(
        "lookahead",
        {"type": "object", "properties": {"name": {"type": "string", "pattern": "^(?!a)a{3}$"}}},
        None,
        refusals=[
            "xgrammar: xgrammar does not enforce pattern at /properties/name/pattern: it ignores "
            "the lookaround in '^(?!a)a{3}$'",
            "llguidance: regex parse error:",
            "outlines: outlines-core does not enforce pattern at /properties/name/pattern",
        ],
    ),
    Entry(
        "remote-ref",
        {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
        None,
        refusals=[
            f"{name} does not enforce $ref at /properties/a/$ref: 'https://example.com/a.json' "
            "refers to another document; weft resolves references inside the schema only "
            "('#...') and fetches nothing"
            for name in ("xgrammar: xgrammar", "llguidance: llguidance", "outlines: outlines-core")
        ],
    ),
    Entry(
        "self-ref",
        {"$ref": "#"},
        None,
        refusals=[
            f"{name} does not enforce $ref at /$ref: the references through '#' form a cycle with "
            "no base case: no finite JSON value matches it"
            for name in ("xgrammar: xgrammar", "llguidance: llguidance", "outlines: outlines-core")
        ],
    ),
    Entry(
        "ref-cycle",
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        None,
        refusals=[
            f"{name} does not enforce $ref at /$ref: the references through '#/$defs/a' form a "
            "cycle with no base case"
            for name in ("xgrammar: xgrammar", "llguidance: llguidance", "outlines: outlines-core")
        ],
    ),
    Entry(
        "recursion-without-base-case",
        {
            "type": "object",
            "properties": {"next": {"$ref": "#"}},
            "required": ["next"],
        },
        None,
        refusals=[
            f"{name} does not enforce $ref at /properties/next/$ref: the references through '#' "
            "form a cycle with no base case"
            for name in ("xgrammar: xgrammar", "llguidance: llguidance", "outlines: outlines-core")
        ],
    ),
    Entry(
        "declared-name-propertyNames-refuses",
        {
            "type": "object",
            "properties": {"ABC": {"type": "integer"}},
            "propertyNames": {"pattern": "^[a-z]+$"},
        },
        None,
        refusals=[
            "xgrammar: xgrammar does not enforce propertyNames at /propertyNames: it lets the "
            "declared property 'ABC' through",
            'llguidance: Unimplemented keys: ["propertyNames"] (at /propertyNames)',
            "outlines: outlines-core does not enforce propertyNames at /propertyNames",
        ],
    ),
    Entry(
        "overlapping-oneOf",
        {
            "type": "object",
            "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
        },
        None,
        refusals=[
            "xgrammar: xgrammar does not enforce oneOf at /properties/v/oneOf: it warned: oneOf "
            "with overlapping or non-provably-disjoint branches cannot be represented exactly; "
            "falling back to anyOf semantics",
            "llguidance: oneOf constraints are not supported.",
            "outlines: outlines-core does not enforce oneOf at /properties/v/oneOf",
        ],
    ),
]
OUTLINES_ONLY = [
    Entry(
        "outlines-object",
        {
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["cm", "m"]},
                "n": {"type": "integer"},
                "label": {"type": "string", "maxLength": 4},
            },
            "required": ["unit", "n"],
            "additionalProperties": False,
        },
        "outlines",
        [{"unit": "cm", "n": -3, "label": "a b"}],
    ),
    Entry(
        "outlines-array",
        {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "outlines",
    ),
]
SERVED = [e for e in CORPUS if e.served_by is not None]
REFUSED = [e for e in CORPUS if e.served_by is None]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fixture_path("tokenizers", "qwen2"))


@pytest.fixture(scope="module")
def vocab(tokenizer):
    from weft.grammars.vocab import TokenVocab

    return TokenVocab.from_tokenizer(tokenizer, VOCAB_SIZE, END_IDS)


@pytest.fixture(scope="module")
def chains(vocab):
    """The default chain, and each fallback alone (built on first use). NOTE: no race: the
    chain's order routes each schema (`served_by`), whatever a loaded CPU makes xgrammar take."""
    made: dict[str, GrammarManager] = {}

    def chain(name: str) -> GrammarManager:
        if name not in made:
            order = DEFAULT_ORDER if name == "chain" else [name]
            made[name] = GrammarManager(lambda: vocab, order=order, race_budget_s=math.inf)
        return made[name]

    yield chain
    for manager in made.values():
        manager.shutdown()


@pytest.fixture(scope="module")
def chain(chains):
    return chains("chain")


def _compile(chain: GrammarManager, schema: Any):
    return chain.compile(parse_spec("json_schema", json.dumps(schema)))


def accepts(chain: GrammarManager, compiled, tokenizer, text: str) -> bool:
    """Every token of the text accepted, and the grammar can end there."""
    grammar = RequestGrammar(compiled, END_IDS)
    for tid in tokenizer.encode(text, add_special_tokens=False):
        if not grammar.accept(tid):
            return False
    bitmask = allocate_bitmask(1, VOCAB_SIZE)
    chain.fill([grammar], bitmask, [0])
    return bit_is_set(bitmask, 0, END_IDS[0])


# ---- the JSON text a backend writes for an instance -----------------------------------------


def _formats(schema: Any) -> set[str]:
    """Every `format` value anywhere in the schema."""
    if isinstance(schema, dict):
        found = {schema["format"]} if isinstance(schema.get("format"), str) else set()
        return found.union(*(_formats(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_formats(v) for v in schema))
    return set()


class Texts:
    """Instances of one schema as JSON text: properties in the schema's order (the backends
    write them so), floats without exponents (the backends' bounded numbers have none)."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        cls = jsonschema.validators.validator_for(schema)
        # NOTE: jsonschema checks some formats only where an optional package is installed and
        # passes every string otherwise: this test's verdict would be wrong, not weaker
        unchecked = _formats(schema) - set(cls.FORMAT_CHECKER.checkers)
        if unchecked:
            pytest.fail(f"jsonschema cannot check format {sorted(unchecked)} here (test extra)")
        self.validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def valid(self, instance: Any, schema: Any = None) -> bool:
        check = self.validator if schema is None else self.validator.evolve(schema=schema)
        return bool(check.is_valid(instance))

    def applicable(self, schemas: list[Any], instance: Any) -> list[dict[str, Any]]:
        """The subschemas that describe this instance: each $ref target, each allOf, the first
        anyOf/oneOf branch it matches."""
        out: list[dict[str, Any]] = []
        stack = list(reversed(schemas))
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or any(node is seen for seen in out):
                continue
            out.append(node)
            ref = node.get("$ref")
            if isinstance(ref, str):
                stack.append(self._resolve(ref))
            stack.extend(reversed(node.get("allOf", [])))
            for key in ("anyOf", "oneOf"):
                branch = next((b for b in node.get(key, []) if self.valid(instance, b)), None)
                if branch is not None:
                    stack.append(branch)
        return out

    def _resolve(self, ref: str) -> Any:
        target = resolve_ref(self.schema, ref)
        assert target is not None, ref
        return target[1]

    def children(self, nodes: list[dict[str, Any]], key: str | int) -> list[Any]:
        out = []
        for node in nodes:
            if isinstance(key, int):
                prefix = node.get("prefixItems", [])
                out.append(prefix[key] if key < len(prefix) else node.get("items", True))
                continue
            if key in node.get("properties", {}):
                out.append(node["properties"][key])
                continue
            matched = [s for p, s in node.get("patternProperties", {}).items() if re.search(p, key)]
            out.extend(matched or [node.get("additionalProperties", True)])
        return out

    def text(self, instance: Any, backend: str, separators: tuple[str, str]) -> str:
        item, colon = separators

        def dump(x: Any, schemas: list[Any]) -> str:
            nodes = self.applicable(schemas, x)
            if isinstance(x, dict):
                order = [k for n in nodes for k in n.get("properties", {}) if k in x]
                order = list(dict.fromkeys(order + list(x)))
                members = (dump(k, []) + colon + dump(x[k], self.children(nodes, k)) for k in order)
                return "{" + item.join(members) + "}"
            if isinstance(x, list):
                items = (dump(v, self.children(nodes, i)) for i, v in enumerate(x))
                return "[" + item.join(items) + "]"
            if isinstance(x, float):
                return number_text(x, nodes, backend)
            text = json.dumps(x, ensure_ascii=False)
            # NOTE: llguidance writes DEL escaped only
            return text.replace("\x7f", "\\u007f") if backend == "llguidance" else text

        return dump(instance, [self.schema])

    def writable(self, backend: str, instance: Any) -> bool:
        """Whether the backend can write this instance at all, where it is stricter than the
        schema (not a weakening): xgrammar's patterns, formats and length-bounded strings allow
        no escape (no quote, backslash or control character), its bounded numbers at most 6
        decimals; outlines-core writes no \\uXXXX escape."""
        if backend == "outlines":
            return not any(
                isinstance(x, str) and OUTLINES_UNWRITABLE.search(x) for x in _leaves(instance)
            )
        if backend != "xgrammar":
            return True

        def ok(x: Any, schemas: list[Any]) -> bool:
            nodes = self.applicable(schemas, x)
            if isinstance(x, str):
                strict = any(k in n for n in nodes for k in STRING_KEYWORDS)
                return not strict or not re.search(r'["\\\x00-\x1f]', x)
            if isinstance(x, float):
                bounded = any(k in n for n in nodes for k in NUMBER_BOUNDS)
                decimals = number_text(x, nodes, backend).partition(".")[2]
                return not bounded or len(decimals) <= XGRAMMAR_DECIMALS
            if isinstance(x, dict):
                names = [n["propertyNames"] for n in nodes if "propertyNames" in n]
                return all(ok(k, names) and ok(v, self.children(nodes, k)) for k, v in x.items())
            if isinstance(x, list):
                return all(ok(v, self.children(nodes, i)) for i, v in enumerate(x))
            return True

        return ok(instance, [self.schema])


STRING_KEYWORDS = ("pattern", "format", "minLength", "maxLength")
# outlines-core writes no \uXXXX escape (a control character without a short escape such as \n),
# and no DEL or C1 control
OUTLINES_UNWRITABLE = re.compile(r"[\x00-\x07\x0b\x0e-\x1f\x7f-\x9f]")
NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
XGRAMMAR_DECIMALS = 6


def number_text(x: float, nodes: list[dict[str, Any]], backend: str) -> str:
    """A float as the backends write it: no exponent, 0 for -0.0; under a multipleOf,
    llguidance writes a whole number without decimals and any other with the multiple's
    decimals (0.5 as 0.50 for 0.25)."""
    value = Decimal(repr(x + 0.0))  # NOTE: -0.0 + 0.0 is 0.0
    multiples = [n["multipleOf"] for n in nodes if "multipleOf" in n]
    if backend == "llguidance" and multiples:
        if value == value.to_integral_value():
            return str(int(value))
        scale = max(-Decimal(repr(m)).normalize().as_tuple().exponent for m in multiples)
        if scale > 0 and value == value.quantize(Decimal(1).scaleb(-scale)):
            return format(value.quantize(Decimal(1).scaleb(-scale)), "f")
    return format(value, "f")


# ---- mutations: mostly invalid instances near the valid ones --------------------------------


def _leaves(x: Any) -> list[Any]:
    """Every value and key inside an instance."""
    if isinstance(x, dict):
        return [*x, *(leaf for v in x.values() for leaf in _leaves(v))]
    if isinstance(x, list):
        return [leaf for v in x for leaf in _leaves(v)]
    return [x]


def _paths(x: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(x, dict):
        for k, v in x.items():
            out.extend(_paths(v, (*path, k)))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out.extend(_paths(v, (*path, i)))
    return out


def _get(x: Any, path: tuple) -> Any:
    for part in path:
        x = x[part]
    return x


def _replace(x: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(x, dict):
        return {**x, head: _replace(x[head], rest, value)}
    return [_replace(v, rest, value) if i == head else v for i, v in enumerate(x)]


def _bounds(schema: Any) -> list[Any]:
    """The numbers a schema names (bounds, multiples, lengths): mutations cross them."""
    found: set[Any] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("enum", "const", "examples", "default"):
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    found.add(v)
                else:
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)
    return sorted(found)


@st.composite
def mutated(draw: Any, instance: Any, schema: Any) -> Any:
    """The instance with one value replaced: by one of another type, or by one near it (a bound
    of the schema crossed, a character or item more or less, a key dropped or added)."""
    path = draw(st.sampled_from(_paths(instance)))
    x = _get(instance, path)
    bounds = _bounds(schema)
    others = [v for v in (None, True, 0.5, 7, "x", [], {}) if type(v) is not type(x)]
    near: list[Any] = [x]
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        crossing = [b + d for b in bounds for d in (-1, 0, 1, 0.5, -0.000001)]
        near = [x + 1, x - 1, -x, x + 0.5, x * 10, *crossing]
    elif isinstance(x, str):
        lengths = [int(b) for b in bounds if float(b).is_integer() and 0 <= b < 64]
        near = [x + "a", x[:-1], "", x.upper() + "Z", "-" + x, *("b" * n for n in lengths)]
    elif isinstance(x, list):
        near = [x + x[:1], x[1:], [], x + [x[0] if x else 0] * 4, [*x, "x"]]
    elif isinstance(x, dict):
        dropped = [{k: v for k, v in x.items() if k != key} for key in x]
        near = [*dropped, {**x, "zz": 1}, {**x, "x_b": -1}, {**x, "b": "c"}]
    value = draw(st.sampled_from(others) | st.sampled_from(near))
    return _replace(instance, path, value)


@st.composite
def raw_control(draw: Any, text: str) -> str | None:
    """The text with a raw control character or quote put into one of its strings (not JSON)."""
    strings = [m.start() + 1 for m in re.finditer(r'"(?:[^"\\]|\\.)*"', text)]
    if not strings:
        return None
    at = draw(st.sampled_from(strings))
    return text[:at] + draw(st.sampled_from(["\t", "\x01", "\x1f", '"'])) + text[at:]


# ---- the tests -------------------------------------------------------------------------------


# what llguidance refuses itself: propertyNames, and minProperties beside optional properties
LLG_REFUSES = ("open-object", "property-names")
# (entry, chain): the default chain on every served schema; llguidance, the fallback, alone on
# those xgrammar serves; outlines-core alone on the two small ones it compiles in a second or two
RUNS = [
    *((e, "chain") for e in SERVED),
    *((e, "llguidance") for e in SERVED if e.served_by == "xgrammar" and e.name not in LLG_REFUSES),
    *((e, "outlines") for e in OUTLINES_ONLY),
]


@pytest.mark.parametrize(("entry", "order"), RUNS, ids=[f"{e.name}-{order}" for e, order in RUNS])
def test_the_served_grammar_accepts_exactly_the_valid_instances(chains, tokenizer, entry, order):
    chain = chains(order)
    compiled = _compile(chain, entry.schema)
    backend = compiled.backend.name
    assert backend == (entry.served_by if order == "chain" else order), compiled.refused
    texts = Texts(entry.schema)
    for example in entry.examples:
        assert texts.valid(example), example
    sources = []
    if entry.generate:
        # NOTE: from_schema rewrites the schema it is given in place
        sources.append(hypothesis_jsonschema.from_schema(copy.deepcopy(entry.schema)))
    if entry.examples:
        sources.append(st.sampled_from(entry.examples))
    seen: Counter[bool] = Counter()

    def check(instance: Any) -> None:
        valid = texts.valid(instance)
        expected = valid and texts.writable(backend, instance)
        for separators in FORMS[backend]:
            text = texts.text(instance, backend, separators)
            got = accepts(chain, compiled, tokenizer, text)
            assert got == expected, f"{backend}: {text!r} (jsonschema: valid={valid})"
        seen[valid] += 1

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def run(data: Any) -> None:
        instance = data.draw(st.one_of(*sources))
        check(instance)
        check(data.draw(mutated(instance, entry.schema)))
        if texts.valid(instance) and texts.writable(backend, instance):
            spaced = texts.text(instance, backend, SPACED)
            broken = data.draw(raw_control(spaced))
            if broken is not None:
                assert not accepts(chain, compiled, tokenizer, broken), broken

    run()
    for example in entry.examples:
        check(example)
    for counter in entry.invalid:
        assert not texts.valid(counter), counter
        check(counter)
    # both verdicts were met (mutations make invalid instances, the generator valid ones)
    assert seen[True] >= 3 and seen[False] >= 3, seen


@pytest.mark.parametrize("entry", REFUSED, ids=[e.name for e in REFUSED])
def test_what_no_backend_enforces_is_refused_naming_the_keyword(chain, entry):
    with pytest.raises(GrammarError) as err:
        _compile(chain, entry.schema)
    message = str(err.value)
    assert message.startswith("cannot compile the json_schema: xgrammar: "), message
    reasons = message.removeprefix("cannot compile the json_schema: ").split("; llguidance: ")
    assert len(reasons) == 2, message
    xgrammar, rest = reasons[0], "llguidance: " + reasons[1]
    llguidance, outlines = rest.split("; outlines: ")
    for want, got in zip(
        entry.refusals, [xgrammar, llguidance, "outlines: " + outlines], strict=True
    ):
        assert got.startswith(want), (want, got)


@pytest.mark.parametrize("compact", [False, True], ids=["any-whitespace", "compact"])
@pytest.mark.parametrize("backend", DEFAULT_ORDER)
def test_json_whitespace_as_models_write_it(vocab, tokenizer, backend, compact):
    """Every backend reads JSON laid out as models write it (compact, spaced, indented), a
    whitespace run of at most JSON_WHITESPACE_MAX, no whitespace around the value; with
    --constrained-json-disable-any-whitespace, one line with ", " and ": " (outlines-core: a
    space or none)."""
    chain = GrammarManager(lambda: vocab, order=[backend], compact_json=compact)
    try:
        layout = {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age", "tags"],
            "additionalProperties": False,
        }
        compiled = _compile(chain, layout)
        instance = {"name": "Ann", "age": 31, "tags": ["red", "blue"]}
        run = " " * JSON_WHITESPACE_MAX
        texts = {
            "spaced": json.dumps(instance),
            "compact": json.dumps(instance, separators=(",", ":")),
            "indent 2": json.dumps(instance, indent=2),
            "indent 4": json.dumps(instance, indent=4),
            "tabs": json.dumps(instance, indent="\t"),
            "longest run": json.dumps(instance).replace(": 31", ":" + run + "31"),
            "too long a run": json.dumps(instance).replace(": 31", ": " + run + "31"),
            "leading": " " + json.dumps(instance),
            "trailing": json.dumps(instance) + "\n",
        }
        got = {name: accepts(chain, compiled, tokenizer, text) for name, text in texts.items()}
    finally:
        chain.shutdown()
    flexible = {"spaced", "compact", "indent 2", "indent 4", "tabs", "longest run"}
    if compact:
        flexible = {"spaced", "compact"} if backend == "outlines" else {"spaced"}
    assert {name for name, ok in got.items() if ok} == flexible
