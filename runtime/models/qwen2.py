"""Qwen2: the Llama decoder with biases on q, k and v (ModelConfig.attention_bias)."""

from __future__ import annotations

import dataclasses

import torch

from weft.runtime.model_config import ModelConfig
from weft.runtime.models.llama import LlamaForCausalLM
from weft.runtime.parallel import SINGLE, TPGroup


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        super().__init__(dataclasses.replace(cfg, attention_bias=True), dtype, tp=tp)
