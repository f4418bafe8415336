"""Where a model loads from: an HF folder as given, or one built from a GGUF file (the
embedded default model is one), resolved once, before any process loads it.

NOTE: imported by the server's launcher before it starts the model's processes: no torch or
transformers at import time (the children import them meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weft.runtime.config import EngineConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelSource:
    folder: Path  # HF-layout folder: config.json, weights, tokenizer files
    tokenizer_folder: Path | None
    load_format: str  # safetensors | dummy
    display_path: str  # what the user asked for


def resolve_source(config: EngineConfig) -> ModelSource:
    """Find (or build, for GGUF) the HF-layout folder the model loads from."""
    from weft.runtime.loaders.default_model import default_cache_root, default_model_gguf

    cache_root = Path(config.cache_dir) if config.cache_dir else default_cache_root()
    if config.model_path is None:
        path = default_model_gguf(cache_root)
        display = "default:Qwen2.5-Coder-0.5B-Instruct"
    else:
        path = Path(config.model_path).expanduser()
        display = config.model_path
        if not path.exists():
            raise FileNotFoundError(f"model_path {config.model_path!r} does not exist")
    fmt = config.load_format
    if path.is_file() or fmt == "gguf":
        if fmt not in ("auto", "gguf"):
            raise ValueError(f"load_format {fmt!r} needs a model folder, got the file {path}")
        from weft.runtime.loaders.gguf_convert import convert_gguf

        folder = convert_gguf(path, cache_root, _gguf_dtype(config))
        fmt = "safetensors"
    else:
        folder = path
        fmt = "safetensors" if fmt == "auto" else fmt
    tok = Path(config.tokenizer_path).expanduser() if config.tokenizer_path else folder
    has_tokenizer = (tok / "tokenizer.json").is_file() or (tok / "tokenizer_config.json").is_file()
    return ModelSource(folder, tok if has_tokenizer else None, fmt, display)


def _gguf_dtype(config: EngineConfig) -> torch.dtype:
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return dtypes.get(config.dtype, torch.bfloat16)
