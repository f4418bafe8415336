"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before rope
(ModelConfig.qk_norm), no qkv bias unless config.json asks for one, head_dim from config.json."""

from __future__ import annotations

import dataclasses

import torch

from weft.runtime.model_config import ModelConfig
from weft.runtime.models.llama import LlamaForCausalLM
from weft.runtime.parallel import SINGLE, TPGroup


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        super().__init__(dataclasses.replace(cfg, qk_norm=True), dtype, tp=tp)
