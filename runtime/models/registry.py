"""Architectures by their HF `architectures` name."""

from __future__ import annotations

from torch import nn

from weft.runtime.models.gemma3 import Gemma3ForCausalLM
from weft.runtime.models.llama import LlamaForCausalLM
from weft.runtime.models.mistral import MistralForCausalLM
from weft.runtime.models.qwen2 import Qwen2ForCausalLM
from weft.runtime.models.qwen3 import Qwen3ForCausalLM
from weft.runtime.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(
            f"unknown architecture {architecture!r} in config.json: weft supports {known}"
        ) from None
