"""Walking a JSON schema: the keywords that constrain an instance, every subschema an instance can
meet (with its JSON pointer, through local $refs), and a copy with each subschema rewritten.
The analyses in schema_rules and schema_keywords stand on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from weft.grammars.spec import resolve_pointer

# Keywords that never constrain an instance.
# fmt: off
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$anchor",
    "$dynamicAnchor", "$comment", "$vocabulary", "deprecated", "readOnly", "writeOnly",
    "$defs", "definitions", "contentMediaType", "contentEncoding", "contentSchema",
})
# The keywords that constrain an instance (draft 2020-12, plus the draft 7 ones its validators
# read under their $schema); anything else in a schema is an unknown keyword, which JSON Schema
# ignores, as every backend does.
VALIDATION_KEYWORDS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties", "required",
    "dependentRequired", "properties", "patternProperties", "additionalProperties",
    "propertyNames", "dependentSchemas", "items", "prefixItems", "contains", "allOf", "anyOf",
    "oneOf", "not", "if", "then", "else", "unevaluatedItems", "unevaluatedProperties", "$ref",
    "$dynamicRef", "$recursiveRef", "additionalItems", "dependencies",
})
# fmt: on
STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")

# Where a schema keeps its subschemas, and whether they describe the same instance (True) or a
# value inside it (False).
_SCHEMA_VALUES = {
    **dict.fromkeys(("not", "if", "then", "else"), True),
    **dict.fromkeys(("items", "additionalProperties", "contains", "propertyNames"), False),
    **dict.fromkeys(("unevaluatedProperties", "unevaluatedItems", "additionalItems"), False),
}
_SCHEMA_LISTS = {"anyOf": True, "oneOf": True, "allOf": True, "prefixItems": False, "items": False}
_SCHEMA_MAPS = {"properties": False, "patternProperties": False, "dependentSchemas": True}


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
    anchors = find_anchors(root)
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
        return (anchors if anchors is not None else find_anchors(root)).get(fragment)
    node = resolve_pointer(root, fragment)
    return None if node is None else (fragment, node)


def find_anchors(root: Any) -> dict[str, tuple[str, Any]]:
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


def types_of(node: dict[str, Any]) -> set[str] | None:
    """The types a schema allows by its "type" keyword, or None (any)."""
    value = node.get("type")
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return {t for t in value if isinstance(t, str)}
    return None


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
