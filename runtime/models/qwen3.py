"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before rope
(ModelConfig.qk_norm), no qkv bias unless config.json asks for one, head_dim from config.json."""

from __future__ import annotations

import dataclasses

import torch

from weft.runtime.model_config import ModelConfig
from weft.runtime.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__(dataclasses.replace(cfg, qk_norm=True), dtype)
