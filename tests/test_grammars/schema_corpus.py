"""The JSON-schema corpus in benchmarks/data/schemas.json, for tests and benchmarks.

Each entry: {"name", "description", "tier", "features", "schema", "example"}. Tier "core" uses
only widely supported JSON-schema features and has short minimal instances; "extended" uses the
rest (allOf, recursion, patternProperties, prefixItems, if/then/else, ...).

Benchmarks can put tests/test_grammars on sys.path and `from schema_corpus import load_schemas`, or
read the JSON file directly.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "schemas.json"
TIERS = ("core", "extended")


def load_schemas(tier: str | None = None) -> list[dict]:
    """All corpus entries, or those of one tier ("core" or "extended")."""
    if tier is not None and tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r} (known: {', '.join(TIERS)})")
    entries = json.loads(CORPUS_PATH.read_text(encoding="utf-8"))
    return [e for e in entries if tier is None or e["tier"] == tier]
