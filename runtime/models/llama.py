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
    RMSNorm,
    RopeStep,
    Rotary,
    RowLinear,
    linear,
    load_plain,
)

# HF checkpoint name -> (merged parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, dtype: torch.dtype, norm: type[RMSNorm] = RMSNorm
    ):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.splits = [q_size, kv_size, kv_size]
        self.qkv_proj = ColumnLinear(cfg.hidden_size, self.splits, cfg.attention_bias, dtype)
        self.o_proj = RowLinear(q_size, cfg.hidden_size, dtype)
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
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnLinear(cfg.hidden_size, [inter, inter], False, dtype)
        self.down_proj = RowLinear(inter, cfg.hidden_size, dtype)
        if cfg.hidden_act not in GATED_ACTIVATIONS:
            known = ", ".join(GATED_ACTIVATIONS)
            raise ValueError(f"hidden activation {cfg.hidden_act!r} unsupported (known: {known})")
        self.act = GATED_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x), fused))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, mlp: nn.Module):
        super().__init__()
        self.local_rope = cfg.layer_window(layer) is not None  # a windowed layer's own RoPE
        self.self_attn = Attention(cfg, layer, dtype)
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

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        max_pos = cfg.max_position_embeddings
        self.rotary = Rotary(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3: the sliding-window layers rotate with their own base (and scaling)
        self.local_rotary = (
            None
            if cfg.local_rope_theta is None
            else Rotary(cfg.head_dim, max_pos, cfg.local_rope_theta, cfg.local_rope_scaling)
        )
        # NOTE: no random init (nn.Embedding's normal_ over Qwen's 151936 x 896 table takes
        # 1-2 s of every load on a small CPU): every weight is loaded, or drawn by init_dummy
        table = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, dtype, self.make_mlp(cfg, i, dtype))
            for i in range(cfg.num_layers)
        )
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else RowLinear(cfg.hidden_size, cfg.vocab_size, dtype, quantize=False)
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> nn.Module:
        """Layer `layer`'s MLP (a mixture-of-experts model overrides it)."""
        return MLP(cfg, dtype)

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
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight).float()
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
            load_plain(params[name], tensor, name)
            loaded.add(name)
        for module_name, module in self.named_modules():
            if isinstance(module, (ColumnLinear, RowLinear)) and module.pending_quant():
                raise ValueError(
                    f"checkpoint ends part-way through the quantized weight of {module_name}: "
                    f"it has only {', '.join(module.pending_quant())}"
                )
        return loaded

    def _quantized_linear(self, path: str, name: str) -> ColumnLinear | RowLinear:
        """The linear a quantized checkpoint tensor `name` belongs to."""
        module: nn.Module | None
        try:
            module = self.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, (ColumnLinear, RowLinear)):
            raise ValueError(f"unexpected tensor {name!r} in checkpoint: no linear layer {path}")
        return module
