"""What a backend would not enforce in a JSON schema, found before it compiles, so that it refuses
the schema (and the chain passes it on) instead of letting invalid output through.

A backend refuses a schema for a keyword it does not enforce (each `Profile` has an allow-list),
for a combination of keywords it enforces one by one but not together (its rules), and every
backend refuses what none can serve: a remote $ref, a $ref cycle with no base case. A refusal
names the keyword and its JSON pointer: "minLength at /properties/name/minLength". xgrammar
also refuses a spec it warns about while converting it (xgrammar_backend.with_warnings), and
llguidance one it warns about or does not implement.

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
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from weft.grammars.spec import resolve_pointer

# Keywords that never constrain an instance.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$anchor",
        "$dynamicAnchor",
        "$comment",
        "$vocabulary",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$defs",
        "definitions",
        "contentMediaType",
        "contentEncoding",
        "contentSchema",
    }
)
# The keywords that constrain an instance (draft 2020-12, plus the draft 7 ones its validators
# read under their $schema); anything else in a schema is an unknown keyword, which JSON Schema
# ignores, as every backend does.
VALIDATION_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "multipleOf",
        "maximum",
        "exclusiveMaximum",
        "minimum",
        "exclusiveMinimum",
        "maxLength",
        "minLength",
        "pattern",
        "format",
        "maxItems",
        "minItems",
        "uniqueItems",
        "maxContains",
        "minContains",
        "maxProperties",
        "minProperties",
        "required",
        "dependentRequired",
        "properties",
        "patternProperties",
        "additionalProperties",
        "propertyNames",
        "dependentSchemas",
        "items",
        "prefixItems",
        "contains",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "unevaluatedItems",
        "unevaluatedProperties",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "additionalItems",
        "dependencies",
    }
)
STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")

# Where a schema keeps its subschemas, and whether they describe the same instance (True) or a
# value inside it (False).
_SCHEMA_VALUES = {
    "not": True,
    "if": True,
    "then": True,
    "else": True,
    "items": False,
    "additionalProperties": False,
    "contains": False,
    "propertyNames": False,
    "unevaluatedProperties": False,
    "unevaluatedItems": False,
    "additionalItems": False,
}
_SCHEMA_LISTS = {"anyOf": True, "oneOf": True, "allOf": True, "prefixItems": False, "items": False}
_SCHEMA_MAPS = {"properties": False, "patternProperties": False, "dependentSchemas": True}


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


@dataclass(frozen=True)
class Site:
    """One subschema an instance can meet."""

    pointer: str  # "" for the root
    node: dict[str, Any]
    names: bool  # it describes property names (propertyNames), always strings

    def at(self, keyword: str) -> str:
        return f"{self.pointer}/{escape(keyword)}"


def escape(token: str) -> str:
    """A JSON-pointer reference token."""
    return token.replace("~", "~0").replace("/", "~1")


def subschemas(root: Any, base: str = "") -> list[Site]:
    """Every object subschema an instance of `root` can meet, each once, with its JSON pointer
    (prefixed with `base`): the applicators are followed, and each local $ref to its target
    (at the target's own pointer); $defs nobody refers to are not."""
    anchors = _anchors(root)
    seen: set[tuple[int, bool]] = set()
    sites: list[Site] = []
    stack: list[tuple[str, Any, bool]] = [(base, root, False)]
    while stack:
        pointer, node, names = stack.pop()
        if not isinstance(node, dict) or (id(node), names) in seen:
            continue
        seen.add((id(node), names))
        site = Site(pointer, node, names)
        sites.append(site)
        children: list[tuple[str, Any, bool]] = []
        for key, same in _SCHEMA_VALUES.items():
            value = node.get(key)
            if isinstance(value, dict):
                children.append((site.at(key), value, key == "propertyNames" or (names and same)))
        for key, same in _SCHEMA_LISTS.items():
            value = node.get(key)
            if isinstance(value, list):
                at = site.at(key)
                children.extend((f"{at}/{i}", v, names and same) for i, v in enumerate(value))
        for key, same in _SCHEMA_MAPS.items():
            value = node.get(key)
            if isinstance(value, dict):
                at = site.at(key)
                children.extend((f"{at}/{escape(k)}", v, names and same) for k, v in value.items())
        dependencies = node.get("dependencies")
        if isinstance(dependencies, dict):
            at = site.at("dependencies")
            children.extend((f"{at}/{escape(k)}", v, names) for k, v in dependencies.items())
        target = resolve_ref(root, node.get("$ref"), anchors)
        if target is not None:
            children.append((base + target[0], target[1], names))
        stack.extend(reversed(children))
    return sites


def map_subschemas(node: Any, fn: Callable[[dict[str, Any], dict[str, Any]], Any]) -> Any:
    """A copy of a schema with fn(original, copy) in place of every object subschema, innermost
    first (`copy` has its subschemas replaced already; data such as enum values is kept)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA_VALUES:
        if isinstance(node.get(key), dict):
            out[key] = map_subschemas(node[key], fn)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [map_subschemas(v, fn) for v in node[key]]
    for key in (*_SCHEMA_MAPS, "$defs", "definitions", "dependencies"):
        if isinstance(node.get(key), dict):
            out[key] = {k: map_subschemas(v, fn) for k, v in node[key].items()}
    return fn(node, out)


def resolve_ref(
    root: Any, ref: Any, anchors: dict[str, tuple[str, Any]] | None = None
) -> tuple[str, Any] | None:
    """(pointer, target) of a local $ref ("#", "#/$defs/a", "#name"), or None (not local, or
    dangling: backends refuse a dangling one themselves)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    fragment = unquote(ref[1:])
    if fragment and not fragment.startswith("/"):
        return (anchors if anchors is not None else _anchors(root)).get(fragment)
    node = resolve_pointer(root, fragment)
    return None if node is None else (fragment, node)


def _anchors(root: Any) -> dict[str, tuple[str, Any]]:
    """$anchor name -> (pointer, subschema), over the whole document."""
    found: dict[str, tuple[str, Any]] = {}
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        pointer, node = stack.pop()
        if isinstance(node, dict):
            name = node.get("$anchor")
            if isinstance(name, str):
                found.setdefault(name, (pointer, node))
            stack.extend((f"{pointer}/{escape(k)}", v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((f"{pointer}/{i}", v) for i, v in enumerate(node))
    return found


def locate(root: Any, keyword: str, base: str = "") -> list[str]:
    """The pointers where `keyword` is used."""
    return [site.at(keyword) for site in subschemas(root, base) if keyword in site.node]


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
    anchors = _anchors(root)
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
        if not all(is_founded(s) for s in _list(node.get("allOf"))):
            return False
        for key in ("anyOf", "oneOf"):
            branches = _list(node.get(key))
            if branches and not any(is_founded(s) for s in branches):
                return False
        types = types_of(node)
        if types == {"object"}:
            properties = _dict(node.get("properties"))
            extra = node.get("additionalProperties")
            for name in _list(node.get("required")):
                if not is_founded(properties.get(name, extra)):
                    return False
        if types == {"array"}:
            count = node.get("minItems", 0)
            count = count if isinstance(count, int) else 0
            prefix = _list(node.get("prefixItems"))
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
    anchors = _anchors(root)

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
            pa, pb = _dict(a.get("properties")), _dict(b.get("properties"))
            both = set(_list(a.get("required"))) & set(_list(b.get("required")))
            return any(
                disjoint(pa[n], pb[n], depth + 1) for n in sorted(both) if n in pa and n in pb
            )
        return False

    for site in subschemas(root, base):
        branches = _list(site.node.get("oneOf"))
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


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def types_of(node: dict[str, Any]) -> set[str] | None:
    """The types a schema allows by its "type" keyword, or None (any)."""
    value = node.get("type")
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return {t for t in value if isinstance(t, str)}
    return None


# ---- combinations a backend compiles but does not enforce ---------------------------------

# A rule: (site, root) -> (keyword, why) for each problem at that site.
Rule = Callable[[Site, Any], Iterable[tuple[str, str]]]


def lengths_beside(*keywords: str) -> Rule:
    def rule(site: Site, root: Any) -> Iterable[tuple[str, str]]:
        beside = [k for k in keywords if k in site.node]
        if beside:
            for length in ("minLength", "maxLength"):
                if length in site.node:
                    yield length, f"it drops minLength/maxLength beside {beside[0]}"

    return rule


def pattern_beside_format(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    if "pattern" in site.node and "format" in site.node:
        yield "pattern", "it checks the format and drops the pattern beside it"


def pattern_features(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    pattern = site.node.get("pattern")
    if isinstance(pattern, str):
        for feature in sorted(regex_features(pattern)):
            yield "pattern", f"it ignores the {feature} in {pattern!r}"


def wide_lengths(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    """A string length range wider than WIDEST_EXACT_REPEAT (xgrammar_backend.exact_lengths
    writes it as a repetition): exact in xgrammar, but each token mask inside such a string took
    ~80 ms (H200 host, Qwen2 vocabulary, xgrammar 0.2.8; 0.2-0.5 ms up to 127 wide; llguidance
    under 1 ms at any width)."""
    node = site.node
    if "pattern" in node or "format" in node or not {"minLength", "maxLength"} & node.keys():
        return  # (lengths beside a pattern or format: lengths_beside's case)
    low, high = node.get("minLength", 0), node.get("maxLength")
    if not isinstance(low, int) or not isinstance(high, int | None):
        return
    if low > WIDEST_EXACT_REPEAT or (high is not None and high - low > WIDEST_EXACT_REPEAT):
        key = "maxLength" if high is not None else "minLength"
        shown = f"{{{low},{'' if high is None else high}}}"
        yield key, f"a length range {shown} wider than {WIDEST_EXACT_REPEAT} costs it ~80 ms a mask"


def multiple_of_integers(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    value = site.node.get("multipleOf")
    if value is None:
        return
    if types_of(site.node) != {"integer"} or not isinstance(value, int):
        yield "multipleOf", "it drops multipleOf unless the type is integer and it is an integer"


def ref_siblings(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    if "$ref" in site.node:
        for key in site.node:
            if key in VALIDATION_KEYWORDS and key != "$ref":
                yield key, "it drops the keywords beside a $ref"


def pointer_refs(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    ref = site.node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref != "#" and not ref.startswith("#/"):
        yield "$ref", f"it ignores a reference to an anchor ({ref!r})"


def composition_siblings(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    for composed in ("anyOf", "oneOf"):
        if composed in site.node:
            for key in site.node:
                if key in VALIDATION_KEYWORDS and key != composed:
                    yield key, f"it drops the keywords beside {composed}"
            return


def required_declared(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    properties = _dict(site.node.get("properties"))
    missing = [n for n in _list(site.node.get("required")) if n not in properties]
    if missing:
        yield "required", f"it does not require {missing[0]!r}, which properties does not declare"


def typed(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    """String and number keywords in a schema without a type (property names are strings: a
    propertyNames schema needs none)."""
    node = site.node
    if site.names or "type" in node or "enum" in node or "const" in node:
        return
    for key in (*STRING_KEYWORDS, *NUMBER_KEYWORDS):
        if key in node:
            yield key, "it ignores it in a schema without a type"


def enum_siblings(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    """enum/const beside keywords that some of its values violate (the backend keeps the
    values and drops the keywords)."""
    node = site.node
    key = "const" if "const" in node else "enum" if "enum" in node else None
    if key is None:
        return
    siblings = {
        k: v for k, v in node.items() if k in VALIDATION_KEYWORDS and k not in ("enum", "const")
    }
    if not siblings:
        return
    values = [node["const"]] if key == "const" else _list(node.get("enum"))
    bad = _failing(root, siblings, values)
    if bad:
        yield key, f"it keeps the value {bad[0]!r}, which the keywords beside {key} refuse"


def declared_names(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    """propertyNames that refuses a name properties declares (the backend lets it through)."""
    names = site.node.get("propertyNames")
    declared = list(_dict(site.node.get("properties")))
    if isinstance(names, dict) and declared:
        bad = _failing(root, names, declared)
        if bad:
            yield "propertyNames", f"it lets the declared property {bad[0]!r} through"


def _failing(root: Any, schema: dict[str, Any], values: list[Any]) -> list[Any]:
    """The values that do not validate against `schema` (a subschema of `root`: its $refs
    resolve there); all of them where that cannot be told."""
    from jsonschema import Draft202012Validator, validators

    cls = validators.validator_for(root, default=Draft202012Validator)
    try:
        check = cls(root, format_checker=cls.FORMAT_CHECKER).evolve(schema=schema)
        return [v for v in values if not check.is_valid(v)]
    except Exception:  # a reference it cannot resolve, a cycle: no proof the values pass
        return values


_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_BOUNDED = re.compile(r"\{(\d+),(\d+)\}")
# NOTE: xgrammar 0.2.8 compiles a repetition {m,n} with n - m >= 128 inside a JSON string's
# pattern without the string's escaping: '"', '\\' and control characters pass raw through a
# "." or a negated class repeated so, and the output is not JSON ({"q": "a"b"}). Measured: the
# widest width that stays exact is 127.
WIDEST_EXACT_REPEAT = 127


def regex_features(pattern: str) -> set[str]:
    """The features of a pattern xgrammar ignores: "lookaround", "inner anchor" (a ^ or $ not
    at the start or the end of the whole pattern), "JSON escaping of the repetition {m,n}"
    (n - m > WIDEST_EXACT_REPEAT, see above)."""
    found: set[str] = set()
    i, end = 0, len(pattern)
    while i < end:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = _skip_class(pattern, i + 1)
            continue
        if c == "(" and _LOOKAROUND.match(pattern, i):
            found.add("lookaround")
        elif (c == "^" and i != 0) or (c == "$" and i != end - 1):
            found.add("inner anchor")
        elif c == "{" and (bounded := _BOUNDED.match(pattern, i)):
            low, high = int(bounded[1]), int(bounded[2])
            if high - low > WIDEST_EXACT_REPEAT:
                found.add(f"JSON escaping of the repetition {bounded[0]}")
        i += 1
    return found


def _skip_class(text: str, i: int) -> int:
    """The index after the `]` closing a character class whose content starts at `i`."""
    if text.startswith("^", i):
        i += 1
    if text.startswith("]", i):
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


# ---- the backends ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """What one backend enforces: its keywords (None: every one it compiles; it refuses the rest
    itself) and the combinations it weakens."""

    backend: str
    enforced: frozenset[str] | None
    rules: tuple[Rule, ...] = ()
    slow: tuple[Rule, ...] = ()  # what it enforces too slowly to serve


XGRAMMAR = Profile(
    "xgrammar",
    frozenset(
        {
            "type",
            "enum",
            "const",
            "properties",
            "required",
            "additionalProperties",
            "items",
            "prefixItems",
            "minItems",
            "maxItems",
            "minProperties",
            "maxProperties",
            "propertyNames",
            "minLength",
            "maxLength",
            "pattern",
            "format",
            *NUMBER_KEYWORDS,
            "anyOf",
            "oneOf",
            "$ref",
        }
    ),
    (
        lengths_beside("pattern", "format"),
        pattern_beside_format,
        pattern_features,
        multiple_of_integers,
        ref_siblings,
        pointer_refs,
        composition_siblings,
        required_declared,
        typed,
        enum_siblings,
        declared_names,
    ),
    slow=(wide_lengths,),
)
LLGUIDANCE = Profile("llguidance", None)
OUTLINES = Profile(
    "outlines-core",
    frozenset(
        {
            "type",
            "enum",
            "const",
            "properties",
            "required",
            "additionalProperties",
            "items",
            "prefixItems",
            "minItems",
            "maxItems",
            "minLength",
            "maxLength",
            "format",
            "anyOf",
            "$ref",
        }
    ),
    (
        lengths_beside("format"),
        ref_siblings,
        composition_siblings,
        required_declared,
        typed,
        enum_siblings,
    ),
)


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
