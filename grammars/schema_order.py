"""Optional properties where the model puts them: at their place in `properties`, or last.

Every backend writes an object's properties in the order `properties` lists them (JSON Schema
itself has no order). Models asked for an object with optional fields tend to write the optional
ones last, after the required ones: forced into schema order, such a model writes the next
required key where it would have written the optional one, and never comes back to it (the
extraction benchmark lost `employer` so). `optional_keys_last` offers both places: an object with
required keys after optional ones becomes an `anyOf` of the same object with some of those
optional keys moved behind the rest. Every variant has the same keywords, so the instances
accepted are exactly the schema's: nothing is weakened, only more key orders are allowed.

xgrammar and llguidance take the rewritten schema; outlines-core keeps the schema's order: its
regex grows with every variant (a 2x2-variant object compiled in 19.5 s instead of 7.3 s).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from weft.grammars.schema_keywords import map_subschemas

# Objects with more movable keys get one variant (all of them last), not every subset of them.
MAX_SUBSETS_OF = 3
# Keywords that describe an object's members; they go into every variant, the rest stays outside.
_OBJECT_KEYWORDS = frozenset(
    (
        "type",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
    )
)
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
    changed = False

    def rewrite(original: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
        nonlocal changed
        orders = _orders(node)
        if len(orders) < 2:
            return node
        changed = True
        members = {k: v for k, v in node.items() if k in _OBJECT_KEYWORDS}
        outside = {k: v for k, v in node.items() if k not in _OBJECT_KEYWORDS}
        properties = node["properties"]
        variants = [
            {**members, "properties": {k: properties[k] for k in order}, ORDER_KEYWORD: order}
            for order in orders
        ]
        return {**outside, "anyOf": variants}

    rewritten = map_subschemas(schema, rewrite)
    return rewritten if changed else schema


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
