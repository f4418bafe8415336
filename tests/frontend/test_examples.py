"""Every DSL example runs against the embedded default model (slow)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import backends
import pytest

from conftest import REPO_ROOT, require_default_model

pytestmark = pytest.mark.slow
EXAMPLES = REPO_ROOT / "examples"


@pytest.fixture
def qwen():
    return backends.qwen_engine()


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


def test_quickstart(example, qwen, capsys):
    s = example("dsl_quickstart").main(qwen, max_tokens=16)
    assert s.text().startswith("# A Python function named fibonacci\ndef fibonacci(")
    assert "gen('signature')" in capsys.readouterr().out


def test_classification(example, qwen):
    answers = example("dsl_classification").main(qwen)
    assert answers == ["rust", "python", "javascript"]


def test_chat(example, qwen):
    msgs = example("dsl_chat").main(qwen, max_tokens=16)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"] for m in msgs)


def test_fork(example, qwen):
    s = example("dsl_fork").main(qwen, max_tokens=12)
    assert s.text().count("\n- ") == 3


def test_batch(example, qwen, capsys):
    codes = example("dsl_batch").main(qwen, max_tokens=12)
    assert len(codes) == 4 and all(codes)
    assert "4/4" in capsys.readouterr().err  # the progress bar


def test_an_example_runs_standalone():
    require_default_model()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "dsl_quickstart.py"), "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finish_reason:" in done.stdout
