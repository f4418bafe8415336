"""What happens to the linear weights around FP8 (config.quantization with the checkpoint's own
quantization_config), resolved once before the model loads, applied once after.

    checkpoint  quantization     device / load_format   action
    dense       fp8              any                    quantize: e4m3 per output row, at load
    dense       auto/none/gguf   any                    none (as before: dense weights)
    FP8         auto/fp8/gguf    CUDA, safetensors      keep: the published e4m3 weights, scales
    FP8         auto/fp8/gguf    CUDA, dummy            quantize: the random weights in the
                                                        checkpoint's form (blocks or rows), so a
                                                        benchmark reads what the real one would
    FP8         fp8 (or gguf)    CPU                    keep / quantize as on CUDA (tests)
    FP8         auto             CPU                    dequantize to the dtype after loading
    FP8         none             any                    dequantize to the dtype after loading

Quantized: the attention's qkv and o, the MLP's gate_up and down (dense layers of a MoE model
too); not the embeddings, the lm_head, norms, a MoE router or the experts (the fused MoE kernel
takes bfloat16 experts). GGUF files refuse 'fp8' (loaders/source.gguf_quantized).

NOTE: the CPU runs FP8 weights only when asked (quantization fp8), for tests and for memory:
torch 2.13's CPU _scaled_mm takes rowwise e4m3, but as a reference kernel: a 4096 x 4096 layer
at one row took 435 ms there against 13 ms in bfloat16 (2-core AVX-512 Xeon), and dequantizing
per call (the block form) 770 ms. So auto dequantizes an FP8 checkpoint on a CPU, and
quantization fp8 there logs a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from weft.runtime.config import EngineConfig
from weft.runtime.model_config import ModelConfig
from weft.runtime.models.fp8 import FP8_GEMV_ONE_ROW, FP8Weight
from weft.runtime.models.layers import ColumnLinear, RowLinear

logger = logging.getLogger("weft")


@dataclass(frozen=True)
class Fp8Plan:
    action: str  # none | quantize | keep | dequantize
    block: tuple[int, int] | None = None  # quantize: the scale blocks (None: per output row)
    why: str = ""  # for the start log


CPU_SLOW = (
    "FP8 weights on a CPU run torch's reference e4m3 kernels, ~30x slower than bfloat16: for "
    "tests and memory only"
)


def resolve_fp8(
    config: EngineConfig,
    model: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
) -> Fp8Plan:
    """The plan for this model (see the module's table); refuses what cannot apply."""
    choice, published = config.quantization, model.fp8
    cpu = device.type == "cpu"
    if published is not None and choice == "none":
        return Fp8Plan("dequantize", why=f"the {published.method} checkpoint dequantized (none)")
    if published is not None and choice == "auto" and cpu:
        why = f"the {published.method} checkpoint dequantized (auto on a CPU: {CPU_SLOW})"
        return Fp8Plan("dequantize", why=why)
    if published is None and choice != "fp8":
        return Fp8Plan("none")
    if dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        what = "quantization 'fp8'" if published is None else f"the {published.method} checkpoint"
        raise ValueError(
            f"{what}: FP8 weights compute with bfloat16 activations, dtype is {name} (set "
            "dtype bfloat16" + (", or quantization none to dequantize)" if published else ")")
        )
    if cpu:
        logger.warning("quantization fp8 on the CPU: %s", CPU_SLOW)
    if published is None:
        return Fp8Plan("quantize", why="quantization fp8: e4m3 per output channel at load")
    if load_format == "dummy":
        why = f"dummy weights quantized in the {published.method} checkpoint's form"
        return Fp8Plan("quantize", published.block, why)
    return Fp8Plan("keep", why=f"the {published.method} checkpoint as published")


@torch.no_grad()
def apply_fp8(model: nn.Module, plan: Fp8Plan) -> None:
    """Quantize or dequantize the model's linear weights as the plan says, one at a time (the
    peak is one weight's float32 copy above the model)."""
    for module in model.modules():
        if not isinstance(module, (ColumnLinear, RowLinear)):
            continue
        if (
            plan.action == "quantize"
            and module.quantize
            and isinstance(module.weight, nn.Parameter)
        ):
            module.quantize_fp8(plan.block)
        elif plan.action == "dequantize" and isinstance(module.weight, FP8Weight):
            module.dequantize_fp8()


def fp8_text(weights: list[FP8Weight]) -> str:
    """The start log's account of the FP8 weights: how many of each form, where they came from
    and which matmul runs them."""
    kinds: dict[tuple[str, str, str, bool], int] = {}
    for w in weights:
        form = "per channel" if w.form == "channel" else f"{w.group[0]} x {w.group[1]} blocks"
        key = (form, w.origin, w.why, w.gemv and FP8_GEMV_ONE_ROW)
        kinds[key] = kinds.get(key, 0) + 1
    parts = []
    for (form, origin, why, gemv), count in kinds.items():
        source = "from the checkpoint" if origin == "checkpoint" else "quantized at load"
        batch1 = ", batch 1 through the Triton FP8 GEMV" if gemv else ""
        parts.append(f"{count} fp8 e4m3 ({form}, {source}; matmul: {why}{batch1})")
    return "; ".join(parts)
