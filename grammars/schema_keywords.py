"""What a backend would not enforce in a JSON schema, found before it compiles, so that it refuses
the schema (and the chain passes it on) instead of letting invalid output through.

A backend refuses a schema for a keyword it does not enforce (each `Profile` has an allow-list),
for a combination of keywords it enforces one by one but not together (its rules), and every
backend refuses what none can serve: a remote $ref, a $ref cycle with no base case. A refusal
names the keyword and its JSON pointer: "minLength at /properties/name/minLength". xgrammar
also refuses a spec it warns about while converting it (xgrammar_backend.with_warnings), and
llguidance one it warns about or does not implement.

Here: the profiles, the $ref and oneOf analyses of the whole document, and `refusals`, which
runs them over `schema_walk.subschemas`; the rules of each profile are in schema_rules.

The audit behind the tables: each case compiled by each backend on its own (xgrammar 0.2.8,
llguidance 1.9.1, outlines-core 0.2.14; Qwen2's vocabulary), valid and invalid instances walked
token by token through its matcher (tests/test_grammars/test_schema_differential.py keeps the routing
exact). weakened: compiles, and lets an invalid instance through. stricter: refuses some valid
ones (not a weakening: left alone). refused: raises. The last column is what weft does now: the
backend that serves it in the default chain (xgr, llg), or a 400 (every backend refuses it).

| keyword or combination            | xgrammar           | llguidance  | outlines-core  | weft     |
|-----------------------------------|--------------------|-------------|----------------|----------|
| pattern + minLength/maxLength     | weakened (lengths  | enforced    | weakened       | llg      |
|                                   | dropped; warns)    |             | (pattern)      |          |
| format + pattern                  | weakened (pattern) | enforced    | refused        | llg      |
| format + minLength/maxLength      | weakened (warns)   | enforced    | weakened (fmt) | llg      |
| minLength/maxLength alone         | weakened: raw      | enforced    | enforced       | xgr, as  |
|                                   | control characters |             |                | pattern  |
| ... a range wider than 127        | enforced as a      | enforced    | enforced       | llg      |
|                                   | pattern, ~80 ms a  | (< 1 ms)    |                | (speed)  |
|                                   | mask               |             |                |          |
| pattern repeating {m,n}, n-m>127  | weakened: raw '"', | enforced    | refused        | llg      |
|                                   | '\\' in the string |             |                |          |
| lookahead in a pattern            | weakened (warns)   | refused     | refused        | 400      |
| lookbehind, backreference, \\b    | refused            | refused     | refused        | 400      |
| ^ or $ inside a pattern or regex  | weakened (warns)   | refused     | refused        | 400      |
| pattern: raw control characters   | enforced           | enforced    | weakened       | xgr      |
| unanchored pattern ("b")          | stricter (whole)   | enforced    | stricter       | xgr      |
| minimum/maximum, exclusive bounds | enforced           | enforced    | weakened       | xgr      |
| multipleOf, integer               | enforced           | enforced    | weakened       | xgr      |
| multipleOf, number                | weakened (warns)   | enforced    | weakened       | llg      |
| uniqueItems                       | weakened           | refused     | weakened       | 400      |
| propertyNames                     | enforced           | refused     | weakened       | xgr      |
| patternProperties                 | weakened (beside   | enforced    | weakened /     | llg      |
|                                   | properties, open)  |             | refused        |          |
| prefixItems                       | enforced           | enforced    | stricter       | xgr      |
| contains, minContains, maxContains| weakened           | refused     | weakened       | 400      |
| dependentRequired/Schemas         | weakened           | refused     | weakened       | 400      |
| dependencies (draft 7)            | weakened           | refused     | weakened       | 400      |
| if / then / else, not             | weakened           | refused     | weakened       | 400      |
| allOf                             | weakened (warns)   | enforced    | refused        | llg      |
| keywords beside anyOf/oneOf       | weakened (dropped) | enforced    | weakened       | llg      |
| additionalProperties beside anyOf | weakened           | enforced    | enforced       | llg      |
| oneOf, overlapping branches       | weakened (anyOf;   | refused     | weakened       | 400      |
|                                   | warns)             |             |                |          |
| oneOf, disjoint by type or value  | enforced           | enforced    | enforced       | xgr      |
| oneOf, a tagged union via $refs   | enforced (warns)   | refused     | refused        | xgr; llg |
|                                   |                    |             |                | as anyOf |
| keywords beside $ref              | weakened (dropped) | enforced    | weakened       | llg      |
| $ref to an anchor ("#name")       | weakened (warns)   | enforced    | refused        | llg      |
| remote $ref ("http://", "a.json") | weakened (warns)   | refused     | refused        | 400      |
| $ref cycle with no base case      | no output can end  | same        | refused / same | 400      |
| recursive $ref with a base case   | enforced           | enforced    | stricter (4    | xgr      |
|                                   |                    |             | levels)        |          |
| required name not in properties   | weakened           | enforced    | weakened       | llg      |
| minLength, minimum... no "type"   | weakened (dropped) | enforced    | refused        | llg      |
| enum/const + keywords refusing a  | weakened (values   | enforced    | weakened       | llg      |
| value of it                       | kept)              |             |                |          |
| min/maxProperties                 | enforced           | refused if  | weakened       | xgr      |
|                                   |                    | optional    |                |          |
| unevaluatedProperties/Items       | weakened           | refused     | enforced       | 400      |
| format (date, date-time, ...)     | regex: 2023-02-29  | same        | same           | as is    |

Stricter, and left so: every backend writes properties in the schema's order; xgrammar allows
no escape in a pattern, format or length-bounded string, at most 6 decimals in a bounded number
and writes object or array constants compactly; llguidance writes a multiple of 0.25 with two
decimals and DEL escaped; outlines-core closes every object and writes no \\uXXXX escape. Format
is an annotation in draft 2020-12 unless a validator opts in: the regexes are left as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from weft.grammars import schema_rules
from weft.grammars.schema_walk import (
    ANNOTATIONS,
    NUMBER_KEYWORDS,
    VALIDATION_KEYWORDS,
    Site,
    as_dict,
    as_list,
    find_anchors,
    resolve_ref,
    subschemas,
    types_of,
)


@dataclass(frozen=True)
class Refusal:
    """A keyword a backend would not enforce where the schema uses it."""

    backend: str
    keyword: str
    pointer: str  # JSON pointer of the keyword: "/properties/name/minLength"
    why: str = ""
    slow: bool = False  # enforced, but too slowly to serve (the next backend serves it)

    def __str__(self) -> str:
        verb = "passes on" if self.slow else "does not enforce"
        where = f"{self.backend} {verb} {self.keyword} at {self.pointer}"
        return f"{where}: {self.why}" if self.why else where


# ---- what every backend refuses ----------------------------------------------------------


def remote_refs(sites: list[Site], backend: str) -> Iterator[Refusal]:
    for site in sites:
        ref = site.node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            yield Refusal(
                backend,
                "$ref",
                site.at("$ref"),
                f"{ref!r} refers to another document; weft resolves references inside the "
                "schema only ('#...') and fetches nothing",
            )


def unfounded_refs(root: Any, sites: list[Site], backend: str) -> Iterator[Refusal]:
    """The $refs whose target no finite JSON value matches: a cycle of references with no way
    out (`{"$ref": "#"}`, a -> b -> a, an object that requires a property of its own type).

    NOTE: a backend compiles such a schema into a grammar that no output can finish (measured:
    the request ran to its token limit or aborted with empty text). The analysis is a least
    fixpoint: a subschema is founded once what it requires of the instance is founded (its
    $ref, each allOf, one anyOf/oneOf branch, a required property of an object-only schema, the
    first minItems items of an array-only one). Only references can make a subschema unfounded
    here; other unsatisfiable keywords are the backends' to refuse.
    """
    anchors = find_anchors(root)
    targets: dict[int, Any] = {}
    for site in sites:
        target = resolve_ref(root, site.node.get("$ref"), anchors)
        if target is not None:
            targets[id(site.node)] = target[1]
    if not targets:
        return
    founded: set[int] = set()

    def is_founded(schema: Any) -> bool:
        return not isinstance(schema, dict) or id(schema) in founded

    def holds(node: dict[str, Any]) -> bool:
        if "enum" in node or "const" in node:
            return True
        if id(node) in targets and not is_founded(targets[id(node)]):
            return False
        if not all(is_founded(s) for s in as_list(node.get("allOf"))):
            return False
        for key in ("anyOf", "oneOf"):
            branches = as_list(node.get(key))
            if branches and not any(is_founded(s) for s in branches):
                return False
        types = types_of(node)
        if types == {"object"}:
            properties = as_dict(node.get("properties"))
            extra = node.get("additionalProperties")
            for name in as_list(node.get("required")):
                if not is_founded(properties.get(name, extra)):
                    return False
        if types == {"array"}:
            count = node.get("minItems", 0)
            count = count if isinstance(count, int) else 0
            prefix = as_list(node.get("prefixItems"))
            if not all(is_founded(s) for s in prefix[:count]):
                return False
            if count > len(prefix) and not is_founded(node.get("items")):
                return False
        return True

    changed = True
    while changed:  # NOTE: children come after parents in `sites`: scan them first
        changed = False
        for site in reversed(sites):
            if id(site.node) not in founded and holds(site.node):
                founded.add(id(site.node))
                changed = True
    for site in sites:
        target = targets.get(id(site.node))
        if target is not None and not is_founded(target):
            yield Refusal(
                backend,
                "$ref",
                site.at("$ref"),
                f"the references through {site.node['$ref']!r} form a cycle with no base case: "
                "no finite JSON value matches it",
            )


def oneof_disjoint(root: Any, base: str = "") -> bool:
    """Whether every oneOf in the schema has branches no value matches two of (then oneOf is
    anyOf: xgrammar's fallback, which it warns about, loses nothing). A sufficient test: two
    branches allow no common type, or no common const/enum value, or are objects that require
    one property whose values are disjoint so (a tagged union: {"type": {"const": "file"}})."""
    anchors = find_anchors(root)

    def target(node: Any) -> Any:
        for _ in range(MAX_REF_HOPS):  # a pure $ref: its target
            if not isinstance(node, dict) or set(node) - ANNOTATIONS != {"$ref"}:
                return node
            found = resolve_ref(root, node["$ref"], anchors)
            if found is None:
                return node
            node = found[1]
        return node

    def disjoint(a: Any, b: Any, depth: int = 0) -> bool:
        a, b = target(a), target(b)
        if not isinstance(a, dict) or not isinstance(b, dict) or depth > MAX_REF_HOPS:
            return False
        ta, tb = _json_types(a), _json_types(b)
        if ta is not None and tb is not None and not ta & tb:
            return True
        va, vb = _values(a), _values(b)
        if va is not None and vb is not None and not va & vb:
            return True
        if ta == tb == {"object"}:
            pa, pb = as_dict(a.get("properties")), as_dict(b.get("properties"))
            both = set(as_list(a.get("required"))) & set(as_list(b.get("required")))
            return any(
                disjoint(pa[n], pb[n], depth + 1) for n in sorted(both) if n in pa and n in pb
            )
        return False

    for site in subschemas(root, base):
        branches = as_list(site.node.get("oneOf"))
        pairs = [(x, y) for i, x in enumerate(branches) for y in branches[i + 1 :]]
        if not all(disjoint(x, y) for x, y in pairs):
            return False
    return True


MAX_REF_HOPS = 16  # references followed to a oneOf branch's schema


def _json_types(node: dict[str, Any]) -> set[str] | None:
    """The JSON types a schema allows by "type" (integer is a number), or None (any)."""
    types = types_of(node)
    return None if types is None else {"number" if t == "integer" else t for t in types}


def _values(node: dict[str, Any]) -> set[str] | None:
    """The values a const/enum allows, as canonical JSON (1 and 1.0 alike), or None (any)."""
    if "const" in node:
        values = [node["const"]]
    elif isinstance(node.get("enum"), list):
        values = node["enum"]
    else:
        return None
    return {json.dumps(_canonical(v), sort_keys=True) for v in values}


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


# ---- the backends ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """What one backend enforces: its keywords (None: every one it compiles; it refuses the rest
    itself) and the combinations it weakens."""

    backend: str
    enforced: frozenset[str] | None
    rules: tuple[schema_rules.Rule, ...] = ()
    slow: tuple[schema_rules.Rule, ...] = ()  # what it enforces too slowly to serve


# fmt: off
XGRAMMAR = Profile(
    "xgrammar",
    frozenset({
        "type", "enum", "const", "properties", "required", "additionalProperties", "items",
        "prefixItems", "minItems", "maxItems", "minProperties", "maxProperties", "propertyNames",
        "minLength", "maxLength", "pattern", "format", *NUMBER_KEYWORDS, "anyOf", "oneOf", "$ref",
    }),
    (
        schema_rules.lengths_beside("pattern", "format"),
        schema_rules.pattern_beside_format,
        schema_rules.pattern_features,
        schema_rules.multiple_of_integers,
        schema_rules.ref_siblings,
        schema_rules.pointer_refs,
        schema_rules.composition_siblings,
        schema_rules.required_declared,
        schema_rules.typed,
        schema_rules.enum_siblings,
        schema_rules.declared_names,
    ),
    slow=(schema_rules.wide_lengths,),
)
LLGUIDANCE = Profile("llguidance", None)
OUTLINES = Profile(
    "outlines-core",
    frozenset({
        "type", "enum", "const", "properties", "required", "additionalProperties", "items",
        "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "format", "anyOf", "$ref",
    }),
    (
        schema_rules.lengths_beside("format"),
        schema_rules.ref_siblings,
        schema_rules.composition_siblings,
        schema_rules.required_declared,
        schema_rules.typed,
        schema_rules.enum_siblings,
    ),
)
# fmt: on


def refusals(root: Any, profile: Profile, base: str = "") -> list[Refusal]:
    """Everything `profile`'s backend would not enforce in the schema, in schema order."""
    if not isinstance(root, dict):
        return []
    sites = subschemas(root, base)
    found = [*remote_refs(sites, profile.backend), *unfounded_refs(root, sites, profile.backend)]
    for site in sites:
        if profile.enforced is not None:
            found.extend(
                Refusal(profile.backend, key, site.at(key))
                for key in site.node
                if key in VALIDATION_KEYWORDS and key not in profile.enforced
            )
        for rule in profile.rules:
            found.extend(
                Refusal(profile.backend, key, site.at(key), why) for key, why in rule(site, root)
            )
        for rule in profile.slow:
            found.extend(
                Refusal(profile.backend, key, site.at(key), why, slow=True)
                for key, why in rule(site, root)
            )
    unique = {(r.keyword, r.pointer): r for r in reversed(found)}  # the first of each
    return [r for r in found if unique[(r.keyword, r.pointer)] is r]


MAX_LISTED = 3  # refusals named in one message


def describe(found: list[Refusal]) -> str:
    """One message for a list of refusals (the first few)."""
    text = "; ".join(str(r) for r in found[:MAX_LISTED])
    more = len(found) - MAX_LISTED
    return text + (f" (and {more} more)" if more > 0 else "")


def spec_schemas(kind: str, value: Any) -> list[tuple[str, Any]]:
    """(pointer base, schema) of each JSON schema in a spec's parsed value."""
    if kind == "json_schema":
        return [("", value)]
    if kind == "structural_tag":
        return [(f"/structures/{i}/schema", s["schema"]) for i, s in enumerate(value["structures"])]
    return []


def spec_oneofs_disjoint(kind: str, value: Any) -> bool:
    """Every oneOf of the spec's schemas proven disjoint (`oneof_disjoint`)."""
    return all(oneof_disjoint(schema, base) for base, schema in spec_schemas(kind, value))


def spec_refusals(kind: str, value: Any, profile: Profile) -> list[Refusal]:
    return [
        r for base, schema in spec_schemas(kind, value) for r in refusals(schema, profile, base)
    ]
