"""Mistral: the Llama decoder with config.json's sliding_window in every layer (null: none, as in
Mistral 7B v0.2 and later)."""

from __future__ import annotations

import dataclasses

import torch

from weft.runtime.model_config import ModelConfig
from weft.runtime.models.llama import LlamaForCausalLM
from weft.runtime.parallel import SINGLE, TPGroup


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        # NOTE: transformers' Mistral ignores layer_types: its window holds in every layer
        cfg = dataclasses.replace(cfg, full_attention_layers=frozenset())
        super().__init__(cfg, dtype, tp=tp)
