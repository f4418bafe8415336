"""Llama (2, 3, 3.1) decoder; Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral (sliding window) and
Qwen3-MoE (experts in place of the MLP: `make_mlp`) and Gemma 3 (its own norms and layer) are
short subclasses."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from weft.runtime.attention import AttentionBackend, AttentionOptions
from weft.runtime.core import ForwardBatch
from weft.runtime.model_config import ModelConfig
from weft.runtime.models.fp8 import FP8_DTYPE
from weft.runtime.models.layers import (
    FP8_LEAVES,
    GATED_ACTIVATIONS,
    QUANT_LEAVES,
    ColumnLinear,
    QuantLoading,
    RMSNorm,
    RopeStep,
    Rotary,
    RowLinear,
    SlicedLoading,
    load_plain,
)
from weft.runtime.models.vocab_parallel import LMHead, VocabEmbedding
from weft.runtime.parallel import SINGLE, TPGroup

# HF checkpoint name -> (merged parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    """Over tensor-parallel ranks: this rank's q heads and the KV heads they read
    (TPGroup.split_kv_heads); num_heads and num_kv_heads are those local counts."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        norm: type[RMSNorm] = RMSNorm,
        *,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        self.layer = layer
        heads = tp.split(cfg.num_heads, what="num_attention_heads")
        kv_heads = tp.split_kv_heads(cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.size, kv_heads.size, cfg.head_dim
        q_rows, kv_rows = heads.scaled(cfg.head_dim), kv_heads.scaled(cfg.head_dim)
        self.splits = [q_rows.size, kv_rows.size, kv_rows.size]
        self.qkv_proj = ColumnLinear(
            cfg.hidden_size, [q_rows, kv_rows, kv_rows], cfg.attention_bias, dtype
        )
        self.o_proj = RowLinear(q_rows.total, cfg.hidden_size, dtype, tp=tp)
        # Qwen3: an RMSNorm over each q and k head, before rope
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        # the layer's window (Mistral, Gemma 3's local layers), cap and scale travel with each call
        self.options = AttentionOptions(
            sliding_window=cfg.layer_window(layer),
            logit_cap=cfg.attn_logit_cap,
            scale=cfg.attn_scale,
        )

    def forward(
        self, x: torch.Tensor, rope: RopeStep, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.splits
        heads = [self.num_heads, self.num_kv_heads]
        # one rotary pass over q and k together: [T, Hq + Hkv, D] (a strided view of qkv)
        qk = qkv[:, : q_size + kv_size].view(-1, sum(heads), self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split(heads, dim=1)
            fused = attn.fused_layers
            qk = torch.cat((self.q_norm.per_head(q, fused), self.k_norm.per_head(k, fused)), dim=1)
        q, k = Rotary.rotate(qk, rope).split(heads, dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(attn.forward(q, k, v, self.layer, batch, options=self.options))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        super().__init__()
        inter = tp.split(cfg.intermediate_size, what="intermediate_size")
        self.gate_up_proj = ColumnLinear(cfg.hidden_size, [inter, inter], False, dtype)
        self.down_proj = RowLinear(inter.total, cfg.hidden_size, dtype, tp=tp)
        if cfg.hidden_act not in GATED_ACTIVATIONS:
            known = ", ".join(GATED_ACTIVATIONS)
            raise ValueError(f"hidden activation {cfg.hidden_act!r} unsupported (known: {known})")
        self.act = GATED_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x), fused))


class DecoderLayer(nn.Module):
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
        self.local_rope = cfg.layer_window(layer) is not None  # a windowed layer's own RoPE
        self.self_attn = Attention(cfg, layer, dtype, tp=tp)
        self.mlp = mlp  # forward(x, fused) -> x's shape
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

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
        h = self.self_attn(h, rope, batch, attn)
        h, residual = self.post_attention_layernorm(h, residual, fused)
        return self.mlp(h, fused), residual


class LlamaForCausalLM(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = cfg
        self.tp = tp
        max_pos = cfg.max_position_embeddings
        self.rotary = Rotary(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3: the sliding-window layers rotate with their own base (and scaling)
        self.local_rotary = (
            None
            if cfg.local_rope_theta is None
            else Rotary(cfg.head_dim, max_pos, cfg.local_rope_theta, cfg.local_rope_scaling)
        )
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp=tp)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, dtype, self.make_mlp(cfg, i, dtype), tp=tp)
            for i in range(cfg.num_layers)
        )
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else LMHead(cfg.hidden_size, cfg.vocab_size, dtype, tp=tp)
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> nn.Module:
        """Layer `layer`'s MLP (a mixture-of-experts model overrides it), split over self.tp."""
        return MLP(cfg, dtype, tp=self.tp)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states [K, hidden] of the tokens in `batch.logits_indices`."""
        attn.prepare(batch)
        x = self.embed(batch.input_ids)
        rope = self.rotary.lookup(batch.positions, attn.fused_layers)
        local = rope
        if self.local_rotary is not None:
            local = self.local_rotary.lookup(batch.positions, attn.fused_layers)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, local if layer.local_rope else rope, batch, attn)
        x, _ = self.norm(x, residual, attn.fused_layers)
        return x[batch.logits_indices]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [K, H] -> logits [K, vocab] float32 (on every rank)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.logits(hidden).float()
        cap = self.config.final_logit_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of the parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards: dict[str, set[int]] = {}  # merged parameter -> shards seen
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the checkpoint repeats the embedding
            module_name, _, leaf = name.rpartition(".")  # leaf: weight | bias | *_LEAVES
            parent, _, proj = module_name.rpartition(".")
            fp8 = leaf in FP8_LEAVES or (leaf == "weight" and tensor.dtype == FP8_DTYPE)
            if leaf == "input_scale":
                continue  # static activation scales: weft quantizes per token (Fp8Checkpoint)
            if leaf in QUANT_LEAVES or fp8:  # a GGUF (loaders/gguf_quant.py) or FP8 weight
                if self.tp.size > 1:
                    raise ValueError(_unsplittable(name, fp8, self.tp.size))
                merged, shard = _STACKED.get(proj, (proj, 0))
                holder = self._quantized_linear(f"{parent}.{merged}" if parent else merged, name)
                n_shards = len(holder.shard_sizes) if isinstance(holder, ColumnLinear) else 1
                # NOTE: nothing to mark loaded: the dense weight Parameter goes once complete,
                # and stays (reported missing) if a shard never comes
                if not fp8:
                    holder.load_quant(leaf, shard, n_shards, tensor)
                elif self.config.fp8 is None:
                    raise ValueError(
                        f"{name}: an FP8 tensor, but config.json has no quantization_config"
                    )
                else:
                    holder.load_fp8(leaf, shard, n_shards, tensor, name=name, spec=self.config.fp8)
                continue
            if proj in _STACKED:
                merged, shard = _STACKED[proj]
                module = self.get_submodule(f"{parent}.{merged}")
                assert isinstance(module, ColumnLinear)
                module.load_shard(leaf, shard, tensor)
                target = f"{parent}.{merged}.{leaf}"
                shards.setdefault(target, set()).add(shard)
                # NOTE: a merged parameter counts as loaded only once every shard arrived
                if len(shards[target]) == len(module.shard_sizes):
                    loaded.add(target)
                continue
            if name not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            owner = self.get_submodule(module_name)
            if isinstance(owner, SlicedLoading):  # it keeps its rank's slice
                owner.load_param(leaf, tensor, name)
            else:
                load_plain(params[name], tensor, name)
            loaded.add(name)
        for module_name, module in self.named_modules():
            if isinstance(module, QuantLoading) and module.pending_quant():
                raise ValueError(
                    f"checkpoint ends part-way through the quantized weight of {module_name}: "
                    f"it has only {', '.join(module.pending_quant())}"
                )
        return loaded

    def _quantized_linear(self, path: str, name: str) -> QuantLoading:
        """The linear (or lm_head) a quantized checkpoint tensor `name` belongs to."""
        module: nn.Module | None
        try:
            module = self.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, QuantLoading):
            raise ValueError(f"unexpected tensor {name!r} in checkpoint: no linear layer {path}")
        return module


def _unsplittable(name: str, fp8: bool, tp_size: int) -> str:
    """Why a quantized checkpoint tensor cannot load under tensor parallelism (yet)."""
    if fp8:
        form, instead = "an FP8 (float8_e4m3fn) weight or scale", "a bfloat16 checkpoint"
    else:
        form, instead = "a GGUF-quantized (int4 / int8) weight", "quantization none"
    return (
        f"{name}: {form} cannot be split over {tp_size} tensor-parallel ranks yet; load "
        f"{instead}, or run on one rank"
    )
