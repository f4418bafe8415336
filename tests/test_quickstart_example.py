"""Every example runs against the embedded default model (the README's main job)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO_ROOT, require_default_model

pytestmark = pytest.mark.slow


def test_quickstart_launches_the_server_and_gets_an_answer():
    require_default_model()
    done = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "examples" / "quickstart.py"),
            "--launch",
            "--max-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Q: Write a Python function" in done.stdout
    assert "[24 tokens in" in done.stdout and "finish_reason=length" in done.stdout
