"""Where a model loads from: an HF folder as given, or one built from a GGUF file (the
embedded default model is one), resolved once, before any process loads it.

NOTE: imported by the server's launcher before it starts the model's processes: no torch or
transformers at import time (the children import them meanwhile).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weft.runtime.config import EngineConfig
from weft.runtime.hardware import cpu_bf16_flags

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("weft")


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

        dtype = _gguf_dtype(config)
        quantized = gguf_quantized(config, dtype)
        fallback = config.quantization == "auto"
        folder = convert_gguf(path, cache_root, dtype, quantized=quantized, fallback=fallback)
        fmt = "safetensors"
    else:
        folder = path
        fmt = "safetensors" if fmt == "auto" else fmt
    tok = Path(config.tokenizer_path).expanduser() if config.tokenizer_path else folder
    has_tokenizer = (tok / "tokenizer.json").is_file() or (tok / "tokenizer_config.json").is_file()
    return ModelSource(folder, tok if has_tokenizer else None, fmt, display)


def _on_cuda(config: EngineConfig) -> bool:
    import torch

    if config.device == "auto":
        return torch.cuda.is_available()
    return config.device.startswith("cuda")


def _gguf_dtype(config: EngineConfig) -> torch.dtype:
    """The converted folder's dtype: the configured one; auto: bfloat16 (as model_runner's
    resolve_dtype: on every CPU, see there)."""
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return dtypes.get(config.dtype, torch.bfloat16)


def _weft_cpu_kernels(config: EngineConfig) -> bool:
    """Whether weft's CPU kernels for quantized products (kernels/cpu_native.py) run here."""
    from weft.kernels import cpu_native

    return config.cpu_kernels == "auto" and cpu_native.native() is not None


def gguf_quantized(config: EngineConfig, dtype: torch.dtype) -> bool:
    """Whether a GGUF's linear weights stay quantized (config.quantization, resolved once here).

    NOTE: CUDA loads dequantize (weft has no GPU kernels for these forms yet), and the CPU
    kernels take bfloat16 activations only (float32 ones run ~30x slower in torch 2.13).
    """
    import torch

    choice, cuda = config.quantization, _on_cuda(config)
    if choice == "fp8":
        raise ValueError(
            "quantization 'fp8' quantizes an HF safetensors folder (or dummy weights); a GGUF "
            "file's weights are GGUF-quantized already: use quantization gguf or none"
        )
    if choice == "gguf" and cuda:
        raise ValueError("quantization 'gguf' runs on the CPU only; on CUDA use 'none'")
    if choice == "gguf" and dtype != torch.bfloat16:
        raise ValueError(f"quantization 'gguf' computes in bfloat16, dtype is {dtype}")
    if choice == "gguf" and config.tp_size > 1:
        raise ValueError(
            "quantization 'gguf' keeps the weights quantized, which cannot be split over "
            "tensor-parallel ranks yet: use quantization none (or auto), or tp_size 1"
        )
    hardware = bool(cpu_bf16_flags())
    # NOTE: weft's own kernels widen bfloat16 in registers, so a CPU without bf16 in hardware
    # (AVX2) decodes quantized weights as fast; torch's packed kernels do not there
    native = choice == "auto" and not cuda and _weft_cpu_kernels(config)
    auto = not cuda and (hardware or native) and dtype == torch.bfloat16 and config.tp_size == 1
    quantized = choice == "gguf" or (choice == "auto" and auto)
    why = {
        "gguf": "as configured",
        "none": "as configured",
        "auto": (
            "auto: a CPU with bf16 in hardware"
            if hardware
            else "auto: weft's CPU kernels, no bf16 in hardware needed"
        )
        if quantized
        else (
            "auto: CUDA"
            if cuda
            else "auto: no bf16 in hardware"
            if not (hardware or native)
            else "auto: tensor parallelism"
            if config.tp_size > 1
            else "auto: dtype"
        ),
    }[choice]
    state = "kept quantized (int4 / int8)" if quantized else f"dequantized to {dtype}"
    logger.info("GGUF linear weights %s (%s)", state, why)
    return quantized
