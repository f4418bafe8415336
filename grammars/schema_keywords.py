"""Which JSON-schema keywords a schema uses, so a backend that would silently ignore one (and
let invalid output through) refuses the schema instead and the chain passes it on."""

from __future__ import annotations

from typing import Any

# Keywords that never constrain an instance.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$defs",
        "definitions",
        "contentMediaType",
        "contentEncoding",
    }
)
# Keywords whose value is a map of name -> subschema, a subschema, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def schema_keywords(schema: Any) -> set[str]:
    """Every keyword used anywhere in the schema, annotations excluded."""
    used: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        used.update(k for k in node if k not in ANNOTATIONS)
        for key in _SCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                stack.extend(value.values())
        for key in _SCHEMA_VALUES:
            value = node.get(key)
            if isinstance(value, (dict, list)):
                stack.extend(value if isinstance(value, list) else [value])
        for key in _SCHEMA_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                stack.extend(value)
    return used


# Keywords a backend compiles but does not enforce (measured: an instance that violates the
# keyword passes the backend's masks). llguidance refuses what it cannot enforce by itself.
_NEVER_ENFORCED = frozenset(
    {
        "uniqueItems",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "contains",
        "minContains",
        "maxContains",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
XGRAMMAR_UNENFORCED = _NEVER_ENFORCED | {"allOf"}
OUTLINES_UNENFORCED = _NEVER_ENFORCED | {
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "propertyNames",
    "oneOf",
}


def unenforced(schema: Any, backend: str, keywords: frozenset[str]) -> str | None:
    """The refusal message if the schema uses keywords the backend would not enforce."""
    found = sorted(schema_keywords(schema) & keywords)
    if not found:
        return None
    return f"{backend} does not enforce {', '.join(found)}"
