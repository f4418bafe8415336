"""Kernel tests: Triton's interpreter on the CPU (tiny shapes), the compiled kernels on CUDA.

NOTE: TRITON_INTERPRET is read when a kernel is decorated (@triton.jit), i.e. when a kernel
module is imported: it must be set before any test here imports one, hence here, at collection.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    MISSING_TRITON = None
except ImportError as exc:
    MISSING_TRITON = (
        f"tests/test_kernels skipped: triton is not installed ({exc}); pip install triton"
    )
    # NOTE: the test modules import weft.kernels, which needs triton: do not even collect them
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config: pytest.Config) -> str | None:
    return MISSING_TRITON


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if MISSING_TRITON:
        terminalreporter.write_line(MISSING_TRITON, yellow=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    skip = pytest.mark.skip(
        reason="needs a CUDA device with compiled Triton (TRITON_INTERPRET unset)"
    )
    for item in items:
        mine = str(item.path).startswith(here)
        if mine and "cuda" in item.keywords and (not HAS_CUDA or interpreted):
            item.add_marker(skip)
