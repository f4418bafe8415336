"""GGUF -> HF folder conversion: synthetic llama files written here, and the real default model.

The synthetic files are written the way llama.cpp's converter writes them (q/k rows permuted to
interleaved-pair RoPE, rope_freqs for llama3 scaling), so converting them back and comparing with
the original transformers model checks the converter end to end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from weft.grammars.vocab import TokenVocab
from weft.runtime.loaders import gguf_convert
from weft.runtime.loaders.default_model import (
    DEFAULT_MODEL_SHA256,
    DEFAULT_MODEL_SIZE,
    default_cache_root,
    default_model_gguf,
    default_model_parts,
)
from weft.runtime.loaders.gguf_convert import (
    MARKER,
    convert_gguf,
    dequantize_tensor,
    llama3_rope_factors,
    llama3_rope_from_factors,
    unpermute_rows,
)
from weft.runtime.model_config import ModelConfig

from conftest import WRITTEN_GGUFS, fixture_path, gguf_reader, make_engine
from hf_models import hf_greedy

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.usefixtures("gguf_tokenizers_once")
SPM_VOCAB = ("llamacpp-vocab-tests", "ggml-vocab-llama-spm.gguf")
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# HF name suffix -> GGUF name suffix, as llama.cpp's converter names them.
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
GLOBAL_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# Gemma 3's four norms (llama.cpp: ffn_norm is the pre-feedforward norm there)
GEMMA3_HF_TO_GGUF = {
    **HF_TO_GGUF,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in GLOBAL_HF_TO_GGUF:
        return GLOBAL_HF_TO_GGUF[hf_name]
    layer, suffix = hf_name.removeprefix("model.layers.").split(".", 1)
    names = GEMMA3_HF_TO_GGUF if arch == "gemma3" else HF_TO_GGUF
    return f"blk.{layer}.{names[suffix]}"


# -- writing synthetic GGUF files like llama.cpp does -------------------------------------------


def llamacpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half rows -> ggml interleaved rows: GGUF row h*d + 2i + j = HF row h*d + j*d/2 + i.

    Written as an explicit index list, independently of the converter's reshape/transpose.
    """
    d = w.shape[0] // n_heads
    order = [
        h * d + j * (d // 2) + i for h in range(n_heads) for i in range(d // 2) for j in (0, 1)
    ]
    return w[order]


def tiny_llama(vocab_size: int, *, head_dim: int | None, scaling: dict | None, tied: bool):
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=16384,  # above llama3's original 8192
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=dict(scaling) if scaling else None,  # transformers edits it in place
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not all-ones, so a swapped norm would show
                p.add_(0.2 * torch.randn_like(p))
    return model


def tiny_qwen2(vocab_size: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):  # biases start at zero: make them count
                p.add_(0.2 * torch.randn_like(p))
    return model


def tiny_qwen3(vocab_size: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden / heads: the file must say it (attention.key_length)
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # q/k norms too: not all-ones, so a missing or swapped one shows
                p.add_(0.2 * torch.randn_like(p))
    return model


def tiny_qwen3_moe(vocab_size: int) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,  # what llama.cpp computes for qwen3moe
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if ".experts." in name or name.endswith("mlp.gate.weight"):
                p.mul_(5.0)  # decisive routing, experts that move the logits
    return model


def tiny_gemma3(vocab_size: int) -> Gemma3ForCausalLM:
    """6 layers: llama.cpp's fixed pattern makes the last one global; window 4, final soft-cap."""
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,  # llama.cpp's assumption below 27B: head_dim
        sliding_window=4,
        final_logit_softcapping=2.0,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # zero-initialised (the scale is 1 + w): make every one count
                p.add_(0.2 * torch.randn_like(p))
    return model


def copy_tokenizer_metadata(writer: gguf.GGUFWriter, vocab_gguf: Path) -> None:
    reader = gguf_reader(vocab_gguf)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def write_gguf(
    path: Path,
    model: LlamaForCausalLM
    | Qwen2ForCausalLM
    | Qwen3ForCausalLM
    | Qwen3MoeForCausalLM
    | Gemma3ForCausalLM,
    qtype: Callable[[str], gguf.GGMLQuantizationType],
    *,
    arch: str = "llama",
    vocab: Path | None = None,
    key_length: bool = False,
    window: int | None = None,
) -> None:
    """`model` as a GGUF file; `qtype(gguf_name)` picks each tensor's type; `window`: a llama
    file's `llama.attention.sliding_window` (llama.cpp writes none)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # gemma3: per layer kind
    w.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if window is not None:
        w.add_sliding_window(window)
    w.add_rope_dimension_count(head_dim)
    if key_length:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if vocab is not None:
        copy_tokenizer_metadata(w, vocab)
        w.add_chat_template(TEMPLATE)
    if getattr(cfg, "num_experts", None):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    def add(gname: str, tensor: torch.Tensor) -> None:
        arr = tensor.detach().float().numpy()
        if qtype(gname) == Q.F64:
            w.add_tensor(gname, arr.astype(np.float64))
            return
        w.add_tensor(gname, gguf.quants.quantize(arr, qtype(gname)), raw_dtype=qtype(gname))

    if cfg.rope_parameters.get("rope_type") == "llama3":
        factors = llama3_rope_factors(cfg.rope_parameters, 10000.0, head_dim).astype(np.float32)
        w.add_tensor("rope_freqs.weight", factors)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: llama.cpp stores two
            layer = name.removeprefix("model.layers.").split(".")[0]
            gate, up = tensor.chunk(2, dim=1)
            add(f"blk.{layer}.ffn_gate_exps.weight", gate)
            add(f"blk.{layer}.ffn_up_exps.weight", up)
            continue
        gname = gguf_name(name, arch)
        if arch == "gemma3" and gname.endswith("norm.weight"):
            tensor = tensor + 1  # as llama.cpp's converter stores Gemma norms
        if arch == "llama" and gname.endswith("attn_q.weight"):
            tensor = llamacpp_permute(tensor, cfg.num_attention_heads)
        if arch == "llama" and gname.endswith("attn_k.weight"):
            tensor = llamacpp_permute(tensor, cfg.num_key_value_heads)
        add(gname, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if vocab is not None:
        stat = path.stat()
        WRITTEN_GGUFS[path] = (vocab, arch, stat.st_size, stat.st_mtime_ns)


def roundtrip(t: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """What a tensor stored as `qtype` dequantizes to (row-wise blocks commute with row order)."""
    arr = t.detach().float().numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype))


def mixed_type(gname: str) -> gguf.GGMLQuantizationType:
    types = {
        "token_embd.weight": Q.F16,
        "blk.0.attn_q.weight": Q.F32,
        "blk.0.attn_k.weight": Q.Q8_0,
        "blk.0.attn_v.weight": Q.BF16,
        "blk.0.attn_output.weight": Q.Q4_0,
        "blk.0.ffn_gate.weight": Q.Q5_0,
        "blk.0.ffn_up.weight": Q.Q5_1,
        "blk.0.ffn_down.weight": Q.Q4_1,
        "blk.1.attn_q.weight": Q.Q8_0,
        "blk.1.attn_k.weight": Q.F16,
    }
    return types.get(gname, Q.F32 if "norm" in gname else Q.Q8_0)


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def logits(model_or_folder: torch.nn.Module | Path, ids: torch.Tensor) -> torch.Tensor:
    model = model_or_folder
    if isinstance(model_or_folder, Path):
        model = AutoModelForCausalLM.from_pretrained(model_or_folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(ids).logits


IDS = torch.tensor([[1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889]])
SMALL_IDS = IDS % 256  # for the 256-token model


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def spm_vocab() -> Path:
    return fixture_path(*SPM_VOCAB)


@pytest.fixture(scope="session")
def f32_case(tmp_path_factory, spm_vocab):
    """All-F32 llama with llama3 rope scaling and head_dim != hidden/heads; converted."""
    root = tmp_path_factory.mktemp("f32")
    model = tiny_llama(32000, head_dim=32, scaling=LLAMA3_SCALING, tied=False)
    path = root / "tiny-f32.gguf"
    write_gguf(path, model, lambda _: Q.F32, vocab=spm_vocab, key_length=True)
    return model, path, convert_gguf(path, root / "cache", torch.float32)


@pytest.fixture(scope="session")
def mixed_case(tmp_path_factory, spm_vocab):
    """Mixed tensor types, tied embeddings, sharded output (small shard limit)."""
    root = tmp_path_factory.mktemp("mixed")
    model = tiny_llama(32000, head_dim=None, scaling=None, tied=True)
    path = root / "tiny-mixed.gguf"
    write_gguf(path, model, mixed_type, vocab=spm_vocab)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_convert, "SHARD_BYTES", 1 << 20)
        folder = convert_gguf(path, root / "cache", torch.float32)
    return model, path, folder


@pytest.fixture(scope="session")
def qwen2_case(tmp_path_factory):
    """qwen2 architecture (q/k/v biases, no q/k permutation) with the GPT-2 vocabulary."""
    root = tmp_path_factory.mktemp("qwen2")
    model = tiny_qwen2(50257)
    path = root / "tiny-qwen2.gguf"
    vocab = fixture_path("llamacpp-vocab-tests", "ggml-vocab-gpt-2.gguf")
    write_gguf(path, model, lambda _: Q.F32, arch="qwen2", vocab=vocab)
    return model, path, convert_gguf(path, root / "cache", torch.float32)


@pytest.fixture(scope="session")
def qwen3_case(tmp_path_factory):
    """qwen3 architecture (q/k norms, head_dim from attention.key_length, no q/k permutation)."""
    root = tmp_path_factory.mktemp("qwen3")
    model = tiny_qwen3(50257)
    path = root / "tiny-qwen3.gguf"
    vocab = fixture_path("llamacpp-vocab-tests", "ggml-vocab-gpt-2.gguf")
    write_gguf(path, model, lambda _: Q.F32, arch="qwen3", vocab=vocab, key_length=True)
    return model, path, convert_gguf(path, root / "cache", torch.float32)


@pytest.fixture(scope="session")
def qwen3moe_case(tmp_path_factory):
    """qwen3moe architecture: the router and stacked experts (down_proj as Q8_0, so an expert's
    slice of a quantized 3-D tensor is read too); the model then holds the file's values.

    NOTE: no vocabulary: building a tokenizer from one costs ~20 s on CI's machine, and the
    other cases test that step already; the conversion's tokenizer step is skipped.
    """
    root = tmp_path_factory.mktemp("qwen3moe")
    model = tiny_qwen3_moe(256)
    path = root / "tiny-qwen3moe.gguf"

    def types(gname: str) -> gguf.GGMLQuantizationType:
        return Q.Q8_0 if gname.endswith("ffn_down_exps.weight") else Q.F32

    write_gguf(path, model, types, arch="qwen3moe", key_length=True)
    with torch.no_grad():
        for layer in model.model.layers:
            down = layer.mlp.experts.down_proj
            down.copy_(roundtrip(down, Q.Q8_0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_convert, "_save_tokenizer", lambda *args: None)
        folder = convert_gguf(path, root / "cache", torch.float32)
    return model, path, folder


@pytest.fixture(scope="session")
def gemma3_case(tmp_path_factory, spm_vocab):
    """gemma3 (four norms stored plus one, q/k norms, tied, a window, the final soft-cap)."""
    root = tmp_path_factory.mktemp("gemma3")
    model = tiny_gemma3(32000)
    path = root / "tiny-gemma3.gguf"
    write_gguf(path, model, lambda _: Q.F32, arch="gemma3", vocab=spm_vocab, key_length=True)
    return model, path, convert_gguf(path, root / "cache", torch.float32)


# -- the q/k permutation -----------------------------------------------------------------------


def test_permutation_turns_rotate_half_rope_into_interleaved_rope():
    """Why llama.cpp permutes: interleaved RoPE on permuted rows == permuted rotate-half RoPE."""
    n_heads, d = 3, 8
    torch.manual_seed(1)
    x = torch.randn(n_heads * d, dtype=torch.float64)
    pos = 5.0
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cos(pos * inv_freq), torch.sin(pos * inv_freq)

    def rope_rotate_half(v):  # HF: dim i pairs with dim i + d/2
        v = v.view(n_heads, d)
        a, b = v[:, : d // 2], v[:, d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=1).reshape(-1)

    def rope_interleaved(v):  # ggml: dim 2i pairs with dim 2i + 1
        v = v.view(n_heads, d // 2, 2)
        a, b = v[..., 0], v[..., 1]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).reshape(-1)

    gguf_rows = llamacpp_permute(x, n_heads)
    assert torch.allclose(
        rope_interleaved(gguf_rows), llamacpp_permute(rope_rotate_half(x), n_heads)
    )
    assert not torch.equal(gguf_rows, x)
    assert torch.equal(unpermute_rows(gguf_rows, n_heads), x)
    w = torch.randn(n_heads * d, 5)
    assert torch.equal(unpermute_rows(llamacpp_permute(w, n_heads), n_heads), w)


def test_f32_qk_weights_equal_originals_exactly(f32_case):
    model, path, folder = f32_case
    weights = hf_weights(folder)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, original in model.state_dict().items():
        assert torch.equal(weights[name], original), name
    # the file really held permuted rows, so equality above is the un-permutation at work
    raw_q = torch.from_numpy(np.array(stored["blk.0.attn_q.weight"].data))
    assert not torch.equal(raw_q, model.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_f32_logits_match_original(f32_case):
    model, _, folder = f32_case
    torch.testing.assert_close(logits(folder, IDS), logits(model, IDS), rtol=0, atol=1e-5)


def test_f32_config(f32_case):
    _, _, folder = f32_case
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["intermediate_size"]) == (
        32000,
        64,
        128,
    )
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (2, 4)
    assert (config["num_key_value_heads"], config["head_dim"]) == (2, 32)
    assert config["max_position_embeddings"] == 16384
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 10000.0
    assert config["rope_scaling"] == LLAMA3_SCALING
    assert config["tie_word_embeddings"] is False
    assert config["attention_bias"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, [2])
    assert config["torch_dtype"] == "float32"
    assert json.loads((folder / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": [2],
    }
    assert (folder / "model.safetensors").is_file()
    assert not (folder / "model.safetensors.index.json").exists()
    marker = json.loads((folder / MARKER).read_text())
    assert marker["dtype"] == "float32" and marker["source"].endswith("tiny-f32.gguf")


@pytest.mark.parametrize("window", [None, 4])
def test_a_llama_files_sliding_window_or_none(tmp_path, spm_vocab, caplog, window):
    """llama.cpp writes no window for Mistral: a llama file is full attention (logged at each
    load, cached too); one that states `llama.attention.sliding_window` is Mistral with it."""
    model = tiny_llama(32000, head_dim=None, scaling=None, tied=True)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, lambda _: Q.F32, vocab=spm_vocab, window=window)
    with caplog.at_level(logging.INFO, logger="weft"):
        folder = convert_gguf(path, tmp_path / "cache", torch.float32)
        assert convert_gguf(path, tmp_path / "cache", torch.float32) == folder  # cached
    config = json.loads((folder / "config.json").read_text())
    notes = [r.getMessage() for r in caplog.records if "sliding window" in r.getMessage()]
    cfg = ModelConfig.from_dict(config)
    if window is None:
        assert config["architectures"] == ["LlamaForCausalLM"] and "sliding_window" not in config
        assert (
            notes
            == [
                "tiny.gguf: a llama GGUF carries no sliding window: full attention in "
                "every layer (a Mistral 7B v0.1 needs its window from an HF config.json: "
                "serve that folder)"
            ]
            * 2
        )
        assert [cfg.layer_window(i) for i in range(2)] == [None, None]
    else:
        assert (config["architectures"], config["model_type"]) == (
            ["MistralForCausalLM"],
            "mistral",
        )
        assert config["sliding_window"] == 4
        assert notes == ["tiny.gguf: sliding window 4 from the GGUF"] * 2
        assert [cfg.layer_window(i) for i in range(2)] == [4, 4]


def test_mixed_weights_within_quantisation_error(mixed_case):
    model, _, folder = mixed_case
    weights = hf_weights(folder)
    sd = model.state_dict()
    assert "lm_head.weight" not in weights
    for name, original in sd.items():
        if name == "lm_head.weight":
            continue
        qtype = mixed_type(gguf_name(name))
        assert torch.equal(weights[name], roundtrip(original, qtype)), (name, qtype.name)
        # the round trip itself stays close: Q4_0 steps are absmax / 8 per 32-value block
        bound = {Q.Q4_0: 0.15, Q.Q4_1: 0.1, Q.Q5_0: 0.07, Q.Q5_1: 0.05}.get(qtype, 0.01)
        err = (weights[name] - original).abs().max() / original.abs().max()
        assert err <= bound, (name, qtype.name, float(err))


def test_mixed_logits(mixed_case):
    model, _, folder = mixed_case
    converted = logits(folder, IDS)
    # Exact pipeline check: the original model with every weight put through the same round trip.
    reference = tiny_llama(32000, head_dim=None, scaling=None, tied=True)
    weights = hf_weights(folder)
    reference.load_state_dict(weights, strict=False)
    reference.tie_weights()
    torch.testing.assert_close(converted, logits(reference, IDS), rtol=0, atol=1e-5)
    # Against the unquantized original the logits move by the quantisation noise (4-bit blocks
    # in layer 0): logits here have std 0.17, max 1.1; measured max diff 0.062, rms diff 6% of std.
    diff = converted - logits(model, IDS)
    assert diff.abs().max() < 0.1
    assert diff.pow(2).mean().sqrt() < 0.1 * converted.std()


def test_mixed_output_is_sharded_and_tied(mixed_case):
    _, _, folder = mixed_case
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["head_dim"] == 16


def test_tokenizer_and_chat_template(f32_case):
    """The SPM tokenizer built from GGUF metadata equals transformers' own Llama-2 tokenizer.

    NOTE: both differ from llama.cpp on the 15 test strings that start with a space (llama.cpp
    keeps the extra "▁" piece 29871, transformers' Metaspace(prepend_scheme="first") folds it).
    """
    _, _, folder = f32_case
    tok = AutoTokenizer.from_pretrained(folder)
    hf_llama2 = AutoTokenizer.from_pretrained(fixture_path("tokenizers", "llama2"))
    inputs = fixture_path("llamacpp-vocab-tests", "ggml-vocab-llama-spm.gguf.inp")
    texts = inputs.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    lines = inputs.with_suffix(".out").read_text(encoding="utf-8").split("\n")[:-1]
    expected = [[int(i) for i in line.split()] for line in lines]
    assert len(texts) == len(expected) == 46
    got = [tok.encode(t, add_special_tokens=False) for t in texts]
    hf = [hf_llama2.encode(t, add_special_tokens=False) for t in texts]
    plain = [i for i, t in enumerate(texts) if not t.startswith(" ")]
    assert len(plain) == 31
    assert [got[i] for i in plain] == [expected[i] for i in plain] == [hf[i] for i in plain]
    # NOTE: where a text starts with a space, transformers 5.17 loads the Llama-2 folder with a
    # Metaspace that folds the extra "▁" (29871) while the GGUF tokenizer keeps llama.cpp's
    # "▁▁" (259); transformers 5.24 builds both the same way. One reference for all of them.
    spaced = [i for i in range(len(texts)) if i not in plain]
    assert all(got[i] == hf[i] for i in spaced) or all(got[i] == expected[i] for i in spaced)
    assert tok.encode("Hello") == [1, 15043]  # add_bos_token from the GGUF metadata
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "[user] hi\n"


def test_qwen2_weights_and_logits(qwen2_case):
    model, _, folder = qwen2_case
    weights = hf_weights(folder)
    assert weights.keys() == model.state_dict().keys()
    for name, original in model.state_dict().items():
        assert torch.equal(weights[name], original), name
    torch.testing.assert_close(logits(folder, IDS), logits(model, IDS), rtol=0, atol=1e-5)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["attention_bias"] is True
    assert (config["rope_theta"], config["rms_norm_eps"], config["rope_scaling"]) == (
        1000000.0,
        1e-6,
        None,
    )
    assert (config["bos_token_id"], config["eos_token_id"]) == (50256, [50256])
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.encode("Hello world", add_special_tokens=False) == [15496, 995]


def test_qwen3_weights_and_logits(qwen3_case):
    model, _, folder = qwen3_case
    weights = hf_weights(folder)
    assert weights.keys() == model.state_dict().keys()
    assert "model.layers.1.self_attn.k_norm.weight" in weights
    for name, original in model.state_dict().items():
        assert torch.equal(weights[name], original), name
    torch.testing.assert_close(logits(folder, IDS), logits(model, IDS), rtol=0, atol=1e-5)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["attention_bias"], config["head_dim"], config["hidden_size"]) == (False, 32, 64)


def test_qwen3_gguf_through_weft(qwen3_case):
    """The converted folder served by weft: greedy tokens equal the original model's."""
    model, _, folder = qwen3_case
    engine = make_engine(folder, dtype="float32", max_total_tokens=512)
    prompt = IDS[0].tolist()
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == hf_greedy(
        model, prompt, 8
    )
    engine.shutdown()


def test_qwen3moe_config_and_per_expert_weights(qwen3moe_case):
    """The stacked GGUF experts become the per-expert tensors of published checkpoints, which
    transformers loads back into the original model's logits."""
    model, _, folder = qwen3moe_case
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe"
    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
    assert [config[k] for k in moe] == [4, 2, 32, True]
    weights = hf_weights(folder)
    state = model.state_dict()
    for i in range(2):
        prefix = f"model.layers.{i}.mlp"
        assert torch.equal(weights[f"{prefix}.gate.weight"], state[f"{prefix}.gate.weight"])
        gate_up, down = (
            state[f"{prefix}.experts.gate_up_proj"],
            state[f"{prefix}.experts.down_proj"],
        )
        for e in range(4):
            got = [weights[f"{prefix}.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")]
            assert torch.equal(torch.cat(got[:2]), gate_up[e]) and torch.equal(got[2], down[e])
    assert not any(".experts.gate_up_proj" in k or "mlp.gate_proj" in k for k in weights)
    torch.testing.assert_close(
        logits(folder, SMALL_IDS), logits(model, SMALL_IDS), rtol=0, atol=1e-5
    )


def test_qwen3moe_gguf_through_weft(qwen3moe_case):
    model, _, folder = qwen3moe_case
    engine = make_engine(folder, dtype="float32", max_total_tokens=512)
    prompt = SMALL_IDS[0].tolist()
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == hf_greedy(
        model, prompt, 8
    )
    engine.shutdown()


def test_gemma3_weights_config_and_logits(gemma3_case):
    """llama.cpp's +1 on each norm is undone (to float32 rounding); the folder's logits are the
    original's in transformers and in weft (a prompt longer than the window)."""
    model, _, folder = gemma3_case
    weights = hf_weights(folder)
    assert weights.keys() == model.state_dict().keys() - {"lm_head.weight"}
    for name, w in weights.items():
        original = model.state_dict()[name]
        if "norm" in name:
            torch.testing.assert_close(w, original, rtol=0, atol=1e-6, msg=name)
        else:
            assert torch.equal(w, original), name
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["final_logit_softcapping"]) == ("gemma3_text", 2.0)
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config["sliding_window"], config["query_pre_attn_scalar"]) == (4, 32)
    torch.testing.assert_close(logits(folder, IDS), logits(model, IDS), rtol=0, atol=1e-5)
    engine = make_engine(folder, dtype="float32", max_total_tokens=512)
    prompt = IDS[0].tolist()
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == hf_greedy(
        model, prompt, 8
    )
    engine.shutdown()


def test_qwen3_without_qk_norms_is_refused(tmp_path):
    model = tiny_llama(64, head_dim=None, scaling=None, tied=True)
    path = tmp_path / "no-norms.gguf"
    write_gguf(path, model, lambda _: Q.F32, arch="qwen3")
    with pytest.raises(ValueError, match=r"lacks the tensor 'blk\.0\.attn_q_norm\.weight'"):
        convert_gguf(path, tmp_path / "cache", torch.float32)


def test_bfloat16_conversion(f32_case, tmp_path):
    model, path, _ = f32_case
    folder = convert_gguf(path, tmp_path, torch.bfloat16)
    assert folder.name.endswith("-bfloat16")
    weights = hf_weights(folder)
    for name, original in model.state_dict().items():
        assert torch.equal(weights[name], original.to(torch.bfloat16)), name


# -- dequantization of each type -----------------------------------------------------------------

QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
# K-quants have no quantizer in gguf.quants: random blocks with finite f16 scales stand in.
# Byte offsets of the f16 super-block scales (d, dmin) in ggml's block structs.
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def test_dequantize_each_type(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    rows, cols = 8, 512
    data = rng.standard_normal((rows, cols)).astype(np.float32)
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    expected: dict[str, np.ndarray] = {}
    for qtype in QUANTIZABLE:
        q = gguf.quants.quantize(data, qtype)
        w.add_tensor(qtype.name, q, raw_dtype=qtype)
        expected[qtype.name] = gguf.quants.dequantize(q, qtype)
    for qtype, offsets in K_QUANT_SCALES.items():
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        blocks = rng.integers(0, 256, (rows * cols // 256, block_bytes), dtype=np.uint8)
        for off in offsets:
            scales = rng.uniform(0.001, 0.01, len(blocks)).astype(np.float16)
            blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
        q = blocks.reshape(rows, -1)
        w.add_tensor(qtype.name, q, raw_dtype=qtype)
        expected[qtype.name] = gguf.quants.dequantize(q, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # A tiny chunk forces the row-chunked path (3 rows at a time over 8 rows).
    monkeypatch.setattr(gguf_convert, "_CHUNK_BYTES", 3 * 4 * cols)
    for t in gguf.GGUFReader(path).tensors:
        got = dequantize_tensor(t, torch.float32)
        assert got.shape == (rows, cols), t.name
        assert torch.isfinite(got).all(), t.name
        assert torch.equal(got, torch.from_numpy(expected[t.name])), t.name
        if t.name in {q.name for q in QUANTIZABLE}:
            assert np.abs(got.numpy() - data).max() < 0.25 * np.abs(data).max(), t.name


# -- llama3 rope reconstruction -----------------------------------------------------------------


def test_llama3_rope_recovered_from_llama31_factors():
    factors = llama3_rope_factors(LLAMA3_SCALING, 500000.0, 128).astype(np.float32)
    assert llama3_rope_from_factors(factors.astype(np.float64), 500000.0, 128) == LLAMA3_SCALING
    assert llama3_rope_from_factors(np.ones(64), 500000.0, 128) is None


# -- caching -------------------------------------------------------------------------------------


def test_second_call_uses_cache_without_reading(f32_case, monkeypatch):
    _, path, folder = f32_case
    marker = (folder / MARKER).stat()

    def no_reading(*args, **kwargs):
        raise AssertionError("cache hit must not open the GGUF file")

    monkeypatch.setattr(gguf, "GGUFReader", no_reading)
    assert convert_gguf(path, folder.parent, torch.float32) == folder
    after = (folder / MARKER).stat()
    assert (after.st_ino, after.st_mtime_ns) == (marker.st_ino, marker.st_mtime_ns)


def test_interrupted_conversion_leaves_nothing(f32_case, tmp_path, monkeypatch):
    _, path, _ = f32_case

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, tmp_path, torch.float32)
    assert list(tmp_path.iterdir()) == []


def test_changed_file_gets_a_new_folder(tmp_path, f32_case, monkeypatch):
    _, path, _ = f32_case
    monkeypatch.setattr(gguf_convert, "_save_tokenizer", lambda *args: None)  # not under test
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    first = convert_gguf(copy, tmp_path / "cache", torch.float32)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = convert_gguf(copy, tmp_path / "cache", torch.float32)
    assert first != second and (second / MARKER).is_file() and first.name.startswith("tiny-f32-")


# -- errors --------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothere\.gguf"):
        convert_gguf(tmp_path / "nothere.gguf", tmp_path, torch.float32)


def test_text_file_renamed_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("just some text, not a model\n")
    with pytest.raises(ValueError, match=r"notes\.gguf is not a GGUF file"):
        convert_gguf(path, tmp_path, torch.float32)


@pytest.mark.parametrize("keep", [0.5, 40])
def test_truncated_gguf(tmp_path, f32_case, keep):
    _, path, _ = f32_case
    blob = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(blob[: int(len(blob) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match=r"cut\.gguf is truncated"):
        convert_gguf(cut, tmp_path / "cache", torch.float32)
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_unsupported_architecture(tmp_path):
    model = tiny_llama(64, head_dim=None, scaling=None, tied=True)
    path = tmp_path / "model.gguf"
    write_gguf(path, model, lambda _: Q.F32, arch="gemma")
    with pytest.raises(ValueError) as err:
        convert_gguf(path, tmp_path / "cache", torch.float32)
    assert (
        str(err.value)
        == f"unknown architecture 'gemma' in {path}: weft supports llama, qwen2, qwen3, qwen3moe, gemma3"
    )


def test_unsupported_tensor_type(tmp_path):
    model = tiny_llama(64, head_dim=None, scaling=None, tied=True)
    path = tmp_path / "f64.gguf"
    write_gguf(path, model, lambda g: Q.F64 if g == "blk.1.ffn_norm.weight" else Q.F32)
    with pytest.raises(ValueError) as err:
        convert_gguf(path, tmp_path / "cache", torch.float32)
    assert str(err.value) == (
        f"unsupported tensor type F64 (tensor 'blk.1.ffn_norm.weight') in {path}"
    )


# -- the real default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) --------------------------------


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    try:
        default_model_parts()
    except RuntimeError as e:
        pytest.skip(f"default-model wheels not installed: {e}")
    # NOTE: the real caches live under default_cache_root(), so later runs reuse them.
    return default_model_gguf(default_cache_root())


@pytest.fixture(scope="session")
def real_folder(real_gguf: Path) -> Path:
    # bfloat16: what the engine asks for by default, so this run warms the engine's cache too.
    return convert_gguf(real_gguf, default_cache_root(), torch.bfloat16)


@pytest.fixture(scope="session")
def real_reader(real_gguf: Path) -> gguf.GGUFReader:
    return gguf_reader(real_gguf)  # NOTE: parsing the header takes seconds; read it once


@pytest.mark.slow
def test_real_gguf_assembled(real_gguf):
    assert real_gguf.stat().st_size == DEFAULT_MODEL_SIZE
    digest = hashlib.sha256()
    with real_gguf.open("rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == DEFAULT_MODEL_SHA256


@pytest.mark.slow
def test_real_config(real_folder):
    config = json.loads((real_folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["num_hidden_layers"] == 24 and config["hidden_size"] == 896
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (14, 2)
    assert (config["vocab_size"], config["intermediate_size"]) == (151936, 4864)
    assert config["eos_token_id"] == [151645, 151643]
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is True
    assert (config["rope_theta"], config["rms_norm_eps"]) == (1000000.0, 1e-6)
    gen = json.loads((real_folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]


@pytest.mark.slow
def test_real_weights_match_gguf_dequantization(real_reader, real_folder):
    """One tensor of each type in the file (Q4_K, Q5_0, Q6_K, Q8_0, F32) against gguf.quants."""
    hf = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",  # Q5_0
        "blk.0.attn_q.bias": "model.layers.0.self_attn.q_proj.bias",  # F32
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q6_K
        "blk.2.ffn_down.weight": "model.layers.2.mlp.down_proj.weight",  # Q4_K
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",  # Q8_0
    }
    tensors = {t.name: t for t in real_reader.tensors}
    seen = set()
    with safe_open(str(real_folder / "model.safetensors"), framework="pt") as f:
        assert len(list(f.keys())) == 291 and "lm_head.weight" in f.keys()  # noqa: SIM118
        for gname, hname in hf.items():
            t = tensors[gname]
            seen.add(t.tensor_type)
            ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
            assert torch.equal(f.get_tensor(hname), ref.to(torch.bfloat16)), gname
    assert seen == {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0, Q.F32}


@pytest.mark.slow
def test_real_tokenizer_reproduces_llamacpp_vectors(real_folder):
    tok = AutoTokenizer.from_pretrained(real_folder)
    inputs = fixture_path("llamacpp-vocab-tests", "ggml-vocab-qwen2.gguf.inp")
    texts = inputs.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    expected = inputs.with_suffix(".out").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(texts) == len(expected) == 46
    got = [tok.encode(t, add_special_tokens=False) for t in texts]
    assert got == [[int(i) for i in line.split()] for line in expected]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n" in chat


@pytest.mark.slow
def test_real_tokenizer_control_and_unused_tokens_are_special(real_reader, real_folder):
    """The GGUF's 271 UNUSED "[PADn]" rows and 20 CONTROL tokens are special after conversion:
    no decoded text, no grammar bytes. USER_DEFINED <tool_call> and normal tokens keep text."""
    types = real_reader.get_field("tokenizer.ggml.token_type").contents()
    by_type: dict[int, list[int]] = {}
    for tid, kind in enumerate(types):
        by_type.setdefault(kind, []).append(tid)
    unused = by_type[gguf.TokenType.UNUSED]
    control = by_type[gguf.TokenType.CONTROL]
    assert unused == list(range(151665, 151936))
    assert control == [*range(151643, 151657), *range(151659, 151665)]
    assert by_type[gguf.TokenType.USER_DEFINED] == [151657, 151658]
    assert len(by_type[gguf.TokenType.NORMAL]) == 151643 and len(types) == 151936

    saved = json.loads((real_folder / "tokenizer.json").read_text())["added_tokens"]
    assert {t["id"] for t in saved if t["special"]} == set(control + unused)
    assert [(t["id"], t["content"]) for t in saved if not t["special"]] == [
        (151657, "<tool_call>"),
        (151658, "</tool_call>"),
    ]

    tok = AutoTokenizer.from_pretrained(real_folder)
    assert len(tok) == 151936
    assert set(tok.all_special_ids) == set(control + unused)
    decoder = tok.added_tokens_decoder
    assert all(decoder[i].special and decoder[i].content == f"[PAD{i}]" for i in unused)
    assert (decoder[151657].special, decoder[151658].special) == (False, False)
    hello = tok.encode("Hello", add_special_tokens=False)
    ids = [*hello, 151665, 151644, 151935, 151657, 151645]
    assert tok.decode(ids, skip_special_tokens=True) == "Hello<tool_call>"
    assert tok.decode(ids) == "Hello[PAD151665]<|im_start|>[PAD151935]<tool_call><|im_end|>"

    vocab = TokenVocab.from_tokenizer(tok, 151936, [151645, 151643])
    assert [i for i, b in enumerate(vocab.token_bytes) if b is None] == control + unused
    assert vocab.text_bytes(ids) == b"Hello<tool_call>"
    assert vocab.token_bytes[151657:151659] == [b"<tool_call>", b"</tool_call>"]
    assert vocab.token_bytes[hello[0]] == b"Hello" and vocab.token_bytes[151642] is not None


@pytest.mark.slow
def test_real_second_call_reuses_marker(real_gguf, real_folder, monkeypatch):
    before = (real_folder / MARKER).stat()
    monkeypatch.setattr(gguf, "GGUFReader", None)  # any read of the GGUF would fail
    assert convert_gguf(real_gguf, default_cache_root(), torch.bfloat16) == real_folder
    after = (real_folder / MARKER).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    size = sum(p.stat().st_size for p in real_folder.iterdir())
    assert math.isclose(size, 1.27e9, rel_tol=0.05)
