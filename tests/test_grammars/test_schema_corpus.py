"""The JSON-schema corpus (benchmarks/data/schemas.json): well-formed, valid examples, and
feature tags that match what each schema really uses."""

from __future__ import annotations

import copy
import datetime
import json
import re
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from .schema_corpus import CORPUS_PATH, TIERS, load_schemas

jsonschema = pytest.importorskip("jsonschema", minversion="4.18")
from jsonschema import Draft202012Validator  # noqa: E402

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "schemas.json"
ENTRIES: list[dict] = json.loads(PATH.read_text(encoding="utf-8"))
CORE_ENTRIES = [e for e in ENTRIES if e.get("tier") == "core"]

VOCABULARY = (
    "nested-object",
    "array",
    "min-max-items",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "ref-defs",
    "recursive-ref",
    "string-format",
    "pattern",
    "min-max-length",
    "number-bounds",
    "integer",
    "boolean",
    "null",
    "required-optional",
    "additionalProperties-false",
    "additionalProperties-schema",
    "patternProperties",
    "type-array",
    "prefixItems",
    "uniqueItems",
    "min-max-properties",
    "not",
    "if-then-else",
    "dependentRequired",
    "default-description-title",
)
CORE_FEATURES = frozenset(
    {
        "nested-object",
        "array",
        "min-max-items",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "ref-defs",
        "string-format",
        "pattern",
        "min-max-length",
        "number-bounds",
        "integer",
        "boolean",
        "null",
        "required-optional",
        "additionalProperties-false",
    }
)
FORMATS = frozenset({"date", "date-time", "email", "uri", "uuid", "ipv4", "time"})
ENTRY_KEYS = {"name", "description", "tier", "features", "schema", "example"}
MIN_CORE = 30
CORE_MINIMAL_CHARS = 300

# ---- a walker over the subschemas of a schema ----------------------------------------------

SCHEMA_MAPS = ("properties", "patternProperties", "$defs")  # name -> subschema
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")  # [subschema, ...]
SCHEMA_VALUES = ("additionalProperties", "items", "not", "if", "then", "else")  # subschema
# Keywords whose subschemas describe a value one level down in the instance. $defs counts as
# one: every definition in this corpus is used as a property or item value (or is a tree node).
DATA_STEPS = frozenset(
    {"properties", "patternProperties", "additionalProperties", "items", "prefixItems", "$defs"}
)
# Every keyword the corpus may use; the walker knows where each one keeps its subschemas.
KNOWN_KEYWORDS = frozenset(
    {
        *SCHEMA_MAPS,
        *SCHEMA_LISTS,
        *SCHEMA_VALUES,
        "$ref",
        "type",
        "required",
        "enum",
        "const",
        "format",
        "pattern",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minItems",
        "maxItems",
        "uniqueItems",
        "minProperties",
        "maxProperties",
        "dependentRequired",
        "default",
        "description",
        "title",
    }
)

# feature -> keywords whose presence in any subschema marks it
KEYWORD_FEATURES = {
    "min-max-items": {"minItems", "maxItems"},
    "enum": {"enum"},
    "const": {"const"},
    "anyOf": {"anyOf"},
    "oneOf": {"oneOf"},
    "allOf": {"allOf"},
    "ref-defs": {"$ref"},
    "string-format": {"format"},
    "pattern": {"pattern"},
    "min-max-length": {"minLength", "maxLength"},
    "number-bounds": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "patternProperties": {"patternProperties"},
    "prefixItems": {"prefixItems"},
    "uniqueItems": {"uniqueItems"},
    "min-max-properties": {"minProperties", "maxProperties"},
    "not": {"not"},
    "if-then-else": {"if"},
    "dependentRequired": {"dependentRequired"},
    "default-description-title": {"default", "description", "title"},
}
TYPE_FEATURES = {"array": "array", "integer": "integer", "boolean": "boolean", "null": "null"}


def iter_subschemas(schema: dict, depth: int = 0, *, into_defs: bool = True):
    """(subschema, instance depth) for the schema and every object subschema inside it."""
    yield schema, depth
    for key, value in schema.items():
        if key in SCHEMA_MAPS:
            if key == "$defs" and not into_defs:
                continue
            children = list(value.values())
        elif key in SCHEMA_LISTS:
            children = value
        elif key in SCHEMA_VALUES:
            children = [value]
        else:
            continue
        step = depth + (key in DATA_STEPS)
        for child in children:
            if isinstance(child, dict):  # boolean schemas have no keywords
                yield from iter_subschemas(child, step, into_defs=into_defs)


def _types(schema: dict) -> list[str]:
    t = schema.get("type", [])
    return [t] if isinstance(t, str) else list(t)


def ref_graph(schema: dict) -> dict[str, set[str]]:
    """Definition name -> names of the definitions its body refers to."""
    graph = {}
    for name, body in schema.get("$defs", {}).items():
        graph[name] = {
            sub["$ref"].removeprefix("#/$defs/")
            for sub, _ in iter_subschemas(body)
            if "$ref" in sub
        }
    return graph


def has_ref_cycle(schema: dict) -> bool:
    graph = ref_graph(schema)
    state: dict[str, int] = {}  # 1 on the DFS stack, 2 done

    def visit(node: str) -> bool:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1 or (nxt not in state and visit(nxt)):
                return True
        state[node] = 2
        return False

    return any(node not in state and visit(node) for node in graph)


def detect_features(schema: dict) -> set[str]:
    found = set()
    for sub, depth in iter_subschemas(schema):
        for feature, keywords in KEYWORD_FEATURES.items():
            if keywords & sub.keys():
                found.add(feature)
        types = _types(sub)
        found.update(feature for t, feature in TYPE_FEATURES.items() if t in types)
        if len([t for t in types if t != "null"]) >= 2:
            found.add("type-array")
        props = sub.get("properties", {})
        if props and depth > 0:
            found.add("nested-object")
        required = set(sub.get("required", ())) & props.keys()
        if required and required != props.keys():
            found.add("required-optional")
        additional = sub.get("additionalProperties")
        if additional is False:
            found.add("additionalProperties-false")
        elif isinstance(additional, dict):
            found.add("additionalProperties-schema")
    if has_ref_cycle(schema):
        found.add("recursive-ref")
    return found


# ---- format checking: the draft's checker, plus fallbacks for optional libraries ----------

_DATE_TIME = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))$"
)


def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    m = _DATE_TIME.match(value)
    if m is None:
        return False
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    try:
        datetime.datetime(year, month, day, hour, minute, min(second, 59))
    except ValueError:
        return False
    return m.group(9) is None or (int(m.group(9)) <= 23 and int(m.group(10)) <= 59)


def _is_time(value: object) -> bool:
    return not isinstance(value, str) or _is_date_time("1970-01-01T" + value)


def _is_uri(value: object) -> bool:
    """Absolute URLs (all URIs in this corpus are): scheme, authority, no whitespace."""
    if not isinstance(value, str):
        return True
    parts = urlsplit(value)
    return (
        bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*$", parts.scheme))
        and bool(parts.netloc)
        and (not re.search(r"\s", value))
    )


def strict_format_checker():
    """Draft 2020-12's format checker; formats whose checker needs a library that is not
    installed (rfc3987 for uri, rfc3339-validator for date-time/time) get a local one, so every
    format in FORMATS is really checked."""
    checker = copy.deepcopy(Draft202012Validator.FORMAT_CHECKER)
    for name, func in (("uri", _is_uri), ("date-time", _is_date_time), ("time", _is_time)):
        if name not in checker.checkers:
            checker.checks(name)(func)
    return checker


def validator(schema: dict, format_checker=None):
    return Draft202012Validator(
        schema, format_checker=format_checker or Draft202012Validator.FORMAT_CHECKER
    )


def errors(schema: dict, instance: object, format_checker=None) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator(schema, format_checker).iter_errors(instance)
    ]


# ---- the corpus as a whole -----------------------------------------------------------------


def test_eighty_unique_names():
    names = [e["name"] for e in ENTRIES]
    assert len(names) == 80
    duplicates = [n for n, c in Counter(names).items() if c > 1]
    assert not duplicates
    bad = [n for n in names if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", n)]
    assert not bad, f"names must be lowercase with dashes: {bad}"


def test_entry_shape():
    for e in ENTRIES:
        assert set(e) == ENTRY_KEYS, e["name"]
        assert isinstance(e["description"], str) and e["description"].strip(), e["name"]
        assert e["tier"] in TIERS, e["name"]
        assert isinstance(e["schema"], dict), e["name"]
        assert len(set(e["features"])) == len(e["features"]), f"{e['name']}: repeated feature"
        unknown = set(e["features"]) - set(VOCABULARY)
        assert not unknown, f"{e['name']}: features outside the vocabulary: {unknown}"


def test_tiers():
    assert len(CORE_ENTRIES) >= MIN_CORE
    for e in ENTRIES:
        only_core = set(e["features"]) <= CORE_FEATURES
        assert (e["tier"] == "core") == only_core, (
            f"{e['name']}: tier {e['tier']!r} but features "
            f"{sorted(set(e['features']) - CORE_FEATURES) or 'all core'}"
        )


def test_features_cover_the_vocabulary():
    covered = {f for e in ENTRIES for f in e["features"]}
    assert covered == set(VOCABULARY), f"not covered: {set(VOCABULARY) - covered}"


def test_sizes_vary():
    def property_count(schema):
        return sum(len(sub.get("properties", {})) for sub, _ in iter_subschemas(schema))

    def depth(value):
        if isinstance(value, dict):
            return 1 + max((depth(v) for v in value.values()), default=0)
        if isinstance(value, list):
            return 1 + max((depth(v) for v in value), default=0)
        return 0

    counts = {e["name"]: property_count(e["schema"]) for e in ENTRIES}
    assert min(counts.values()) <= 2
    assert sum(c >= 30 for c in counts.values()) >= 3, counts
    assert max(depth(e["example"]) for e in ENTRIES) >= 6


def test_load_schemas():
    assert CORPUS_PATH == PATH
    assert load_schemas() == ENTRIES
    core, extended = load_schemas("core"), load_schemas("extended")
    assert core == CORE_ENTRIES
    assert len(core) + len(extended) == len(ENTRIES)
    assert all(e["tier"] == "extended" for e in extended)
    with pytest.raises(ValueError, match="unknown tier"):
        load_schemas("basic")


# ---- the walker itself ---------------------------------------------------------------------


def test_detector_reads_keywords_not_property_names():
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "string"},
            "enum": {"type": "string"},
            "if": {"type": "string"},
            "description": {"type": "string"},
            "items": {"type": "object", "properties": {"x": {"type": "number"}}},
        },
        "required": ["not", "enum", "if", "description", "items"],
    }
    assert detect_features(schema) == {"nested-object"}


def test_detector_on_a_recursive_schema():
    schema = {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": ["integer", "null"], "minimum": 0},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["value"],
                "additionalProperties": {"type": "string"},
            }
        },
    }
    assert detect_features(schema) == {
        "nested-object",
        "array",
        "ref-defs",
        "recursive-ref",
        "number-bounds",
        "integer",
        "null",
        "required-optional",
        "additionalProperties-schema",
    }
    acyclic = copy.deepcopy(schema)
    acyclic["$defs"]["node"]["properties"]["children"]["items"] = {"type": ["string", "number"]}
    del acyclic["$defs"]["node"]["required"]
    assert detect_features(acyclic) == {
        "nested-object",
        "array",
        "ref-defs",
        "number-bounds",
        "integer",
        "null",
        "type-array",
        "additionalProperties-schema",
    }


# ---- each entry ----------------------------------------------------------------------------

entry_params = pytest.mark.parametrize("entry", ENTRIES, ids=[e["name"] for e in ENTRIES])
core_params = pytest.mark.parametrize("entry", CORE_ENTRIES, ids=[e["name"] for e in CORE_ENTRIES])


@entry_params
def test_schema_is_valid_2020_12(entry):
    Draft202012Validator.check_schema(entry["schema"])


@entry_params
def test_example_validates(entry):
    schema, example = entry["schema"], entry["example"]
    assert errors(schema, example) == []
    assert errors(schema, example, strict_format_checker()) == []
    # not vacuous: the schema rejects values of the wrong shape
    assert errors(schema, "not an instance")
    assert errors(schema, None)


@entry_params
def test_schema_uses_known_keywords(entry):
    for sub, _ in iter_subschemas(entry["schema"]):
        unknown = sub.keys() - KNOWN_KEYWORDS
        assert not unknown, f"keywords the walker does not know: {unknown}"


@entry_params
def test_declared_features_are_the_used_ones(entry):
    declared, detected = set(entry["features"]), detect_features(entry["schema"])
    assert declared == detected, (
        f"tagged but not used: {sorted(declared - detected)}; "
        f"used but not tagged: {sorted(detected - declared)}"
    )


@entry_params
def test_refs_point_into_defs(entry):
    schema = entry["schema"]
    defs = schema.get("$defs", {})
    for name, body in defs.items():
        for sub, _ in iter_subschemas(body):
            assert "$defs" not in sub, f"nested $defs under {name}"
    refs = [sub["$ref"] for sub, _ in iter_subschemas(schema) if "$ref" in sub]
    for ref in refs:
        assert ref.startswith("#/$defs/") and ref.removeprefix("#/$defs/") in defs, ref
    # every definition is reachable from the root
    reachable, todo = (
        set(),
        [
            sub["$ref"].removeprefix("#/$defs/")
            for sub, _ in iter_subschemas(schema, into_defs=False)
            if "$ref" in sub
        ],
    )
    graph = ref_graph(schema)
    while todo:
        name = todo.pop()
        if name not in reachable:
            reachable.add(name)
            todo.extend(graph[name])
    assert reachable == defs.keys(), f"unused definitions: {set(defs) - reachable}"


@entry_params
def test_formats_and_patterns(entry):
    for sub, _ in iter_subschemas(entry["schema"]):
        if "format" in sub:
            assert sub["format"] in FORMATS, sub["format"]
        patterns = [sub["pattern"]] if "pattern" in sub else []
        patterns += list(sub.get("patternProperties", {}))
        for pattern in patterns:
            re.compile(pattern)
            # portable across regex engines: no escapes (use [.] for a dot), no (?...) groups
            assert "\\" not in pattern and "(?" not in pattern, pattern


# ---- core entries: small enough for a small model ------------------------------------------


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        target = root["$defs"][schema["$ref"].removeprefix("#/$defs/")]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _matches(instance: object, branch: dict, root: dict) -> bool:
    return validator({**branch, "$defs": root.get("$defs", {})}).is_valid(instance)


def minimal_from_example(value: object, schema: dict, root: dict) -> object:
    """The example with every optional property dropped and every array cut to minItems."""
    schema = _resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            branch = next(b for b in schema[key] if _matches(value, b, root))
            return minimal_from_example(value, branch, root)
    if isinstance(value, dict) and "properties" in schema:
        required = schema.get("required", [])
        return {
            k: minimal_from_example(v, schema["properties"].get(k, {}), root)
            for k, v in value.items()
            if k in required
        }
    if isinstance(value, list) and "items" in schema:
        return [
            minimal_from_example(v, schema["items"], root)
            for v in value[: schema.get("minItems", 0)]
        ]
    return value


@core_params
def test_core_minimal_instance_is_short(entry):
    schema = entry["schema"]
    minimal = minimal_from_example(entry["example"], schema, schema)
    assert errors(schema, minimal) == []
    text = json.dumps(minimal, separators=(",", ":"), ensure_ascii=False)
    assert len(text) < CORE_MINIMAL_CHARS, text


@core_params
def test_core_one_of_branches_are_disjoint(entry):
    """oneOf in core schemas: branches differ in type, or in a required const discriminator."""
    root = entry["schema"]
    for sub, _ in iter_subschemas(root):
        if "oneOf" not in sub:
            continue
        branches = [_resolve(b, root) for b in sub["oneOf"]]
        types = [b.get("type") for b in branches]
        if all(isinstance(t, str) for t in types) and len(set(types)) == len(types):
            continue
        shared = set.intersection(*(set(b.get("required", ())) for b in branches))
        discriminators = [
            p
            for p in sorted(shared)
            if all("const" in b.get("properties", {}).get(p, {}) for b in branches)
        ]
        assert discriminators, f"oneOf without a discriminator in {entry['name']}"
        consts = [json.dumps(b["properties"][discriminators[0]]["const"]) for b in branches]
        assert len(set(consts)) == len(consts), consts
