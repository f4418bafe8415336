"""Mistral: the Llama decoder with config.json's sliding_window in every layer (null: none, as in
Mistral 7B v0.2 and later)."""

from __future__ import annotations

import dataclasses

import torch

from weft.runtime.model_config import ModelConfig
from weft.runtime.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        # NOTE: transformers' Mistral ignores layer_types: its window holds in every layer
        super().__init__(dataclasses.replace(cfg, full_attention_layers=frozenset()), dtype)
