"""Qwen3-MoE: Qwen3's attention (q/k norm) with a sparse mixture-of-experts MLP in the layers
config.json makes sparse (runtime/models/moe.py); the others keep Qwen3's dense MLP."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from weft.runtime.model_config import ModelConfig
from weft.runtime.models.llama import MLP, LlamaForCausalLM
from weft.runtime.models.moe import Experts, SparseMoE
from weft.runtime.parallel import SINGLE, TPGroup

_PER_EXPERT = re.compile(
    r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale_inv|weight_scale|input_scale)"
)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        # NOTE: transformers' Qwen3-MoE applies a sliding window (use_sliding_window) in every
        # layer: max_window_layers is not read
        cfg = dataclasses.replace(cfg, qk_norm=True, full_attention_layers=frozenset())
        super().__init__(cfg, dtype, tp=tp)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> nn.Module:
        if cfg.is_sparse_layer(layer):
            return SparseMoE(cfg, dtype, tp=self.tp)
        return MLP(cfg, dtype, tp=self.tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert tensors go into the stacked expert parameters; the rest load as in Llama."""
        shards: dict[str, set[tuple[int, str]]] = {}  # stacked parameter -> (expert, proj) seen

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                match = _PER_EXPERT.fullmatch(name)
                if match is None:
                    yield name, tensor
                    continue
                layer, expert, proj = int(match[1]), int(match[2]), match[3]
                if match[4] != "weight":
                    raise ValueError(
                        f"{name}: FP8 expert weights are not supported yet (weft's fused MoE "
                        "kernel takes bfloat16 experts); load a bfloat16 checkpoint"
                    )
                experts = self._experts(layer, name)
                param = experts.load_expert(expert, proj, tensor)
                shards.setdefault(f"layers.{layer}.mlp.experts.{param}", set()).add((expert, proj))

        loaded = super().load_weights(others())
        for target, seen in shards.items():
            # NOTE: a stacked parameter counts as loaded only once every expert's tensor arrived
            experts = self.get_submodule(target.rpartition(".")[0])
            assert isinstance(experts, Experts)
            if len(seen) == experts.expected_shards(target.rpartition(".")[2]):
                loaded.add(target)
        return loaded

    def _experts(self, layer: int, name: str) -> Experts:
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        mlp = self.layers[layer].mlp
        if not isinstance(mlp, SparseMoE):
            raise ValueError(f"unexpected tensor {name!r} in checkpoint: layer {layer} is dense")
        return mlp.experts
