"""The combinations of keywords a backend compiles but does not enforce (or too slowly to serve),
one rule each: a `Rule` yields (keyword, why) for each problem at one subschema. schema_keywords
lists each backend's rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from weft.grammars.schema_walk import (
    NUMBER_KEYWORDS,
    STRING_KEYWORDS,
    VALIDATION_KEYWORDS,
    Site,
    as_dict,
    as_list,
    types_of,
)
from weft.grammars.spec import skip_class

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
    properties = as_dict(site.node.get("properties"))
    missing = [n for n in as_list(site.node.get("required")) if n not in properties]
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
    values = [node["const"]] if key == "const" else as_list(node.get("enum"))
    bad = _failing(root, siblings, values)
    if bad:
        yield key, f"it keeps the value {bad[0]!r}, which the keywords beside {key} refuse"


def declared_names(site: Site, root: Any) -> Iterable[tuple[str, str]]:
    """propertyNames that refuses a name properties declares (the backend lets it through)."""
    names = site.node.get("propertyNames")
    declared = list(as_dict(site.node.get("properties")))
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
            i = skip_class(pattern, i + 1)
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
