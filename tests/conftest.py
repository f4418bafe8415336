"""Shared fixtures: where the test data lives, and the KV-pool integrity audit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# NOTE: one setting locates the data that stays outside the repository.
FIXTURES = Path(os.environ.get("WEFT_FIXTURES", REPO_ROOT.parent / "shared" / "fixtures"))


def fixture_path(*parts: str) -> Path:
    """Path under the fixtures folder; skips the test with a clear message when it is missing."""
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"test data missing: {path} (set WEFT_FIXTURES to the fixtures folder)")
    return path


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return fixture_path("models", "stories260K-hf")
