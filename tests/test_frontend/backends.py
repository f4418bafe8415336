"""The default Qwen model, loaded once for all frontend test modules (it takes seconds)."""

from __future__ import annotations

import functools

import weft

from conftest import _LIVE_ENGINES, require_default_model


@functools.cache
def _qwen():
    engine = weft.Engine(max_total_tokens=4096, show_progress=False, log_level="warning")
    _LIVE_ENGINES.append(engine)  # audited after each test; shut down at session end
    return engine


def qwen_engine():
    """The shared default-model Engine; skips when the model is not installed."""
    require_default_model()
    return _qwen()
