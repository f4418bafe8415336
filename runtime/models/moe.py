"""The sparse mixture-of-experts MLP: a router (`gate`) and the experts' weights stacked [E, ...].

Expert weights load from either checkpoint layout:

    per expert (published checkpoints, what transformers 5 saves):
        mlp.experts.{e}.gate_proj.weight [I, H]   -> gate_up_proj[e, :I]
        mlp.experts.{e}.up_proj.weight   [I, H]   -> gate_up_proj[e, I:]
        mlp.experts.{e}.down_proj.weight [H, I]   -> down_proj[e]
    stacked (transformers 5's in-memory layout, which weft keeps):
        mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]
"""

from __future__ import annotations

import torch
from torch import nn

from weft.kernels.fused_moe_ref import fused_moe_ref
from weft.runtime.model_config import ModelConfig
from weft.runtime.models.layers import RowLinear, SlicedLoading, load_plain
from weft.runtime.parallel import SINGLE, TPGroup

_ROWS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


class Experts(SlicedLoading, nn.Module):
    """Over tensor-parallel ranks: each expert's gate and up rows and down columns of this rank's
    slice of moe_intermediate_size (the experts' sum is then partial: SparseMoE reduces it)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        *,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        self.rows = tp.split(inter, what="moe_intermediate_size")
        self.inter = self.rows.size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * self.inter, hidden, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, self.inter, dtype=dtype), requires_grad=False
        )

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> str:
        """One expert's gate_proj, up_proj or down_proj weight; returns the parameter's name."""
        name, half = _ROWS[proj]
        what = f"experts.{expert}.{proj}"
        if tensor.dtype == torch.float8_e4m3fn:
            raise ValueError(
                f"{what}: FP8 expert weights are not supported yet (weft's fused MoE kernel "
                "takes bfloat16 experts); load a bfloat16 checkpoint"
            )
        param: torch.Tensor = getattr(self, name)
        if not 0 <= expert < param.shape[0]:
            raise ValueError(f"expert {expert} out of range: the model has {param.shape[0]}")
        target = param[expert]
        if name == "gate_up_proj":  # [I, H] rows
            target = target[half * self.inter : (half + 1) * self.inter]
            tensor = self.rows.take(tensor, 0, what)
        else:  # [H, I] columns
            tensor = self.rows.take(tensor, 1, what)
        load_plain(target, tensor, what)
        return name

    def load_param(self, leaf: str, tensor: torch.Tensor, name: str) -> None:
        """The stacked layout: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj
        [E, H, I]."""
        if leaf == "down_proj":
            load_plain(self.down_proj, self.rows.take(tensor, 2, name), name)
            return
        if self.rows.size < self.rows.total:  # this rank's rows of the gate half and the up half
            if tensor.dim() != 3 or tensor.shape[1] != 2 * self.rows.total:
                raise ValueError(
                    f"{name}: expected {2 * self.rows.total} along dim 1, got shape "
                    f"{tuple(tensor.shape)}"
                )
            gate, up = tensor.chunk(2, dim=1)
            tensor = torch.cat((self.rows.take(gate, 1, name), self.rows.take(up, 1, name)), 1)
        load_plain(self.gate_up_proj, tensor, name)

    def expected_shards(self, name: str) -> int:
        """How many per-expert tensors fill parameter `name`."""
        return self.gate_up_proj.shape[0] * (2 if name == "gate_up_proj" else 1)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        # the router, no bias, replicated on every rank (each one routes every token alike);
        # kept dense under quantization 'fp8' (it picks the experts)
        self.gate = RowLinear(cfg.hidden_size, cfg.num_experts, dtype, quantize=False)
        inter = cfg.moe_intermediate_size
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, inter, dtype, tp=tp)

    def forward(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """x [T, H] -> [T, H]. fused: the Triton kernels (CUDA; no host sync, so CUDA graphs
        capture it), else the torch twin (reads the routing on the host)."""
        logits = self.gate(x)  # [T, E] in x's dtype, as transformers' router computes them
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        if fused:
            from weft.kernels.fused_moe import fused_moe  # NOTE: here: Triton may be missing

            out = fused_moe(x, logits, w13, w2, top_k=self.top_k, renormalize=self.renormalize)
        else:
            out = fused_moe_ref(x, logits, w13, w2, top_k=self.top_k, renormalize=self.renormalize)
        return self.tp.all_reduce(out)  # each rank's experts hold a slice of I: partial sums
