"""Optional properties where the model puts them: at their place in `properties`, or last.

Every backend writes an object's properties in the order `properties` lists them (JSON Schema
itself has no order). Models asked for an object with optional fields tend to write the optional
ones last, after the required ones: forced into schema order, such a model writes the next
required key where it would have written the optional one, and never comes back to it (the
extraction benchmark lost `employer` so). `optional_keys_last` offers both places: an object with
required keys after optional ones becomes an `anyOf` of the same object with some of those
optional keys moved behind the rest. Every variant has the same keywords, so the instances
accepted are exactly the schema's: nothing is weakened, only more key orders are allowed.

Each rewritten object below the root moves into the root's `$defs` and is referred to, so a
parent's variants share one copy of it (inline, the text grows by the variant count at every
level: 500 MB for six levels). An object some `$ref` reaches into (`#/properties/a`) keeps its
layout, and a schema that would need more than MAX_VARIANTS variants in all is left as it is.

xgrammar and llguidance take the rewritten schema; outlines-core keeps the schema's order: its
regex grows with every variant (a 2x2-variant object compiled in 19.5 s instead of 7.3 s).
"""

from __future__ import annotations

import itertools
import json
from typing import Any
from urllib.parse import unquote

from weft.grammars.schema_walk import map_subschemas

# Objects with more movable keys get one variant (all of them last), not every subset of them.
MAX_SUBSETS_OF = 2
# The most variants in one schema (all its objects together); beyond, no rewrite at all.
MAX_VARIANTS = 32
DEFS_PREFIX = "weft-order-"
# Keywords that describe an object's members; they go into every variant, the rest stays outside.
# fmt: off
_OBJECT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "dependentRequired",
    "dependentSchemas", "unevaluatedProperties",
})
# fmt: on
_APPLICATORS = ("anyOf", "oneOf", "allOf", "not", "if", "$ref", "$dynamicRef")
# NOTE: xgrammar keys its converted subschemas by their JSON with sorted keys, so two variants
# differing only in property order collapse into the first (the second order is then refused).
# A keyword it ignores, naming the order, keeps them apart.
ORDER_KEYWORD = "x-weft-order"


def optional_keys_last(schema: Any) -> Any:
    """The schema with each object that has an optional property before a required one as an
    `anyOf` of its key orders (the module docstring); the schema itself when there is none."""
    if not isinstance(schema, dict):
        return schema
    pinned = _reached_into(schema)
    hoisted: dict[str, Any] = {}
    variants_made = 0

    def rewrite(original: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
        nonlocal variants_made
        orders = _orders(node)
        if len(orders) < 2 or id(original) in pinned:
            return node
        variants_made += len(orders)
        members = {k: v for k, v in node.items() if k in _OBJECT_KEYWORDS}
        outside = {k: v for k, v in node.items() if k not in _OBJECT_KEYWORDS}
        properties = {k: _shared(v) for k, v in node["properties"].items()}
        variants = [
            {**members, "properties": {k: properties[k] for k in order}, ORDER_KEYWORD: order}
            for order in orders
        ]
        if original is schema:
            return {**outside, "anyOf": variants}
        name = f"{DEFS_PREFIX}{len(hoisted)}"
        hoisted[name] = {**outside, "anyOf": variants}
        return {"$ref": f"#/$defs/{name}"}

    def _shared(value: Any) -> Any:
        """A property's schema, once in $defs for every variant to refer to (xgrammar compiles
        each copy again: 4 variants compiled 3.8x slower inline)."""
        if not isinstance(value, dict) or set(value) <= {"type"} or "$ref" in value:
            return value
        name = f"{DEFS_PREFIX}{len(hoisted)}"
        hoisted[name] = value
        return {"$ref": f"#/$defs/{name}"}

    rewritten = map_subschemas(schema, rewrite)
    if variants_made == 0 or variants_made > MAX_VARIANTS:
        return schema
    if hoisted:
        defs = rewritten.get("$defs")
        if defs is not None and not isinstance(defs, dict):
            return schema
        clash = set(hoisted) & set(defs or {})
        if clash:
            return schema
        rewritten = {**rewritten, "$defs": {**(defs or {}), **hoisted}}
    return rewritten


def _reached_into(schema: dict[str, Any]) -> set[int]:
    """ids of the subschemas some local `$ref` goes through to a node inside them: their layout
    must stay, or the pointer would lead nowhere."""
    passed: set[int] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                passed |= _through(schema, ref[2:].split("/"))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return passed


def _through(root: dict[str, Any], tokens: list[str]) -> set[int]:
    """ids of the nodes a JSON pointer goes into by a keyword the rewrite moves into variants
    (`properties`, ...)."""
    seen: set[int] = set()
    node: Any = root
    for token in tokens:
        key = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in _OBJECT_KEYWORDS:
            seen.add(id(node))
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            break
    return seen


def optional_keys_last_text(text: str, schema: Any) -> str:
    """`optional_keys_last` on a schema given both as text and parsed (the text when unchanged)."""
    rewritten = optional_keys_last(schema)
    return text if rewritten is schema else json.dumps(rewritten)


def _orders(node: dict[str, Any]) -> list[list[str]]:
    """The key orders to offer for an object node: its own first, then one per set of movable
    keys put last (every subset up to MAX_SUBSETS_OF movable keys, else all of them at once)."""
    properties = node.get("properties")
    required = node.get("required", [])
    if (
        node.get("type") != "object"
        or not isinstance(properties, dict)
        or not isinstance(required, list)
        or any(k in node for k in _APPLICATORS)
    ):
        return []
    keys = list(properties)
    last_required = max((i for i, k in enumerate(keys) if k in required), default=0)
    movable = [k for k in keys[:last_required] if k not in required]
    if len(movable) <= MAX_SUBSETS_OF:
        subsets = [
            s for n in range(1, len(movable) + 1) for s in itertools.combinations(movable, n)
        ]
    else:
        subsets = [tuple(movable)]
    orders = [keys]
    for moved in subsets:
        order = [k for k in keys if k not in moved] + [k for k in keys if k in moved]
        if order not in orders:
            orders.append(order)
    return orders
