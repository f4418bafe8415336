"""Gemma 3 (text): the Llama decoder with Gemma's RMSNorm (x * (1 + w)), q/k norm, four norms a
layer, a GELU-tanh MLP and embeddings scaled by sqrt(hidden). ModelConfig carries the rest: local
(sliding-window) layers between global ones, each kind with its own RoPE base, the attention scale
query_pre_attn_scalar ** -0.5 and the optional final logit soft-cap.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from weft.runtime.attention import AttentionBackend
from weft.runtime.core import ForwardBatch
from weft.runtime.model_config import ModelConfig
from weft.runtime.models.layers import GemmaRMSNorm, RopeStep
from weft.runtime.models.llama import Attention, LlamaForCausalLM
from weft.runtime.parallel import SINGLE, TPGroup


class Gemma3DecoderLayer(nn.Module):
    """h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h))).

    As in Llama, a layer returns its branch output and the residual stream separately: the next
    norm adds them (the additions happen in the model dtype, where transformers does them).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        mlp: nn.Module,
        *,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        self.local_rope = cfg.layer_window(layer) is not None
        self.self_attn = Attention(cfg, layer, dtype, norm=GemmaRMSNorm, tp=tp)
        self.mlp = mlp
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = attn.fused_layers
        h, residual = self.input_layernorm(x, residual, fused)
        h, _ = self.post_attention_layernorm(self.self_attn(h, rope, batch, attn), None, fused)
        h, residual = self.pre_feedforward_layernorm(h, residual, fused)
        h, _ = self.post_feedforward_layernorm(self.mlp(h, fused), None, fused)
        return h, residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        # NOTE: transformers' Gemma 3 reads attn_logit_softcapping but never applies it (Gemma 2
        # did; the released Gemma 3 configs set it null, and llama.cpp has no such cap either):
        # weft follows, so a config that sets it gives transformers' logits, not the capped ones
        cfg = dataclasses.replace(cfg, qk_norm=True, attn_logit_cap=None)
        super().__init__(cfg, dtype, tp=tp)
        # NOTE: transformers rounds sqrt(hidden) to the model dtype before multiplying (33.94 is
        # 34.0 in bfloat16): a Python float would scale by the exact value instead
        self.embed_scale: torch.Tensor
        self.register_buffer(
            "embed_scale", torch.tensor(cfg.hidden_size**0.5, dtype=dtype), persistent=False
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale
