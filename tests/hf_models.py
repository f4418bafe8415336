"""Random small HF checkpoints (saved as real model folders) to compare weft against."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

CONFIGS = {
    "llama-gqa-untied": dict(
        arch="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "llama31-scaled-tied": dict(
        arch="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2-bias": dict(
        arch="qwen2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    # Qwen3: q/k norm, no qkv bias; head_dim 32 != hidden / heads (16)
    "qwen3-gqa-headdim-untied": dict(
        arch="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    "qwen3-tied": dict(
        arch="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,  # NOTE: stated: transformers' Qwen3Config defaults it to 128
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    # Mistral: sliding windows shorter than the longer prompts (up to 64 tokens, chunks of 16)
    "mistral-gqa-window8-untied": dict(
        arch="mistral",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        sliding_window=8,
        tie_word_embeddings=False,
    ),
    "mistral-gqa-window24-tied": dict(
        arch="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=24,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    # Qwen3-MoE: 8 experts, top-2 renormalised, layer 1 dense (mlp_only_layers), GQA
    "qwen3-moe-8x2-norm-dense1": dict(
        arch="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    # 4 experts, top-3 weights as the softmax gives them (norm_topk_prob off), tied
    "qwen3-moe-4x3-tied": dict(
        arch="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    # Gemma 3: local (window 8) and global layers with their own RoPE bases, tied, GQA, a
    # query_pre_attn_scalar (24) that is not head_dim (16)
    "gemma3-gqa-window8-tied": dict(
        arch="gemma3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        sliding_window_pattern=2,  # local, global, local
        rope_theta=100000.0,
        rope_local_base_freq=1000.0,
        tie_word_embeddings=True,
    ),
    # Gemma 3 with the final soft-cap, one KV head, linear RoPE scaling on the global layer;
    # attn_logit_softcapping is set but, as in transformers' Gemma 3, never applied
    "gemma3-softcap-window24-mqa": dict(
        arch="gemma3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=20,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=2.0,
        final_logit_softcapping=1.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=True,
    ),
}
# arch -> (config class, model class)
HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}

VOCAB = 160


def save_random_model(name: str, folder: Path, seed: int = 0) -> transformers.PreTrainedModel:
    spec = dict(CONFIGS[name])
    arch = spec.pop("arch")
    cls_cfg, cls = HF_CLASSES[arch]
    config = cls_cfg(
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **spec,
    )
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    # HF initialises biases to zero and norms (q/k norms too) to one: make them matter
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
            # experts at HF's 0.02 add little to the residual, and a router at 0.02 gives
            # near-even routing: larger, a wrong expert or weight shows in the logits
            if ".mlp.experts." in pname or pname.endswith(".mlp.gate.weight"):
                param.mul_(5.0)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model: transformers.PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] log-softmax of the logits at every position (float64)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)
