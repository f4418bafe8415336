"""Convert a GGUF file (llama, qwen2, qwen3, qwen3moe, gemma3) into a Hugging Face-style model
folder, cached on disk.

The engine's HF loader then reads the folder like any checkpoint. Layout of the output:

    config.json  generation_config.json  tokenizer.json  tokenizer_config.json
    chat_template.jinja  model.safetensors (or model-0000k-of-0000n.safetensors + index)
    weft-converted.json   <- written last; its presence marks a complete conversion

Tensors are dequantized one at a time (large ones in row chunks) and streamed straight into
the safetensors files, so peak memory stays near one chunk, not one model.

quantized=True (the CPU's default, see loaders/source.py) keeps the linear weights (attention,
MLP, lm_head) in a weight-only int4 or int8 form instead (loaders/gguf_quant.py): each
`X.weight` becomes `X.qweight` + `X.qscale` (+ `X.qzero`), which runtime/models/layers.py loads
into a QuantWeight. Embeddings, norms, biases, the MoE router and experts stay dense. A weight of
a type neither form takes fails the conversion with its name and type.

Sliding windows: gemma3 files state theirs (`gemma3.attention.sliding_window`). NOTE: llama.cpp's
llama arch has no window (its converter writes none for Mistral, its loader reads none), so a
Mistral 7B v0.1 GGUF (window 4096) reads as Llama with full attention in every layer, which
differs from the model past 4096 tokens: the window must come from an HF config (serve the HF
folder). A llama file that does state `llama.attention.sliding_window` (the key of the arches
that have one) converts to Mistral with that window. Each load of a llama file logs which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from weft.runtime.loaders.cache_lock import cache_lock
from weft.runtime.loaders.end_tokens import END_TOKEN_TEXTS
from weft.runtime.loaders.gguf_quant import (
    GROUP,
    INT4_TYPES,
    INT8_TYPES,
    form_of,
    int4_from_rows,
    int4_groups,
    int8_rows,
    pack_nibbles,
)

logger = logging.getLogger("weft")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# config.json's model_type where transformers spells it differently from llama.cpp
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
_MOE_ARCHS = ("qwen3moe",)
MARKER = "weft-converted.json"
SHARD_BYTES = 2 * 1024**3
# Bump when the output layout changes, so older cache folders are rebuilt.
# 2: control and unused (padding) tokens are special in the saved tokenizer.
# 3: the tokenizer adds BOS exactly as the GGUF's add_bos_token says.
# 4: quantized folders (qweight / qscale / qzero tensors); the marker records `quantized`.
_FORMAT_VERSION = 4
_CHUNK_BYTES = 64 << 20
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_STORED_DTYPES = {**_SAFETENSORS_DTYPES, torch.uint8: "U8", torch.int8: "I8"}
# HF names (under model.layers.{i}.) of the linear weights quantized=True keeps quantized, and
# the groups the runtime merges into one matrix (qkv, gate_up), which must share one form
# NOTE: torch's int8 CPU matmul is slower than bf16 torch.mv for the lm_head's 151936 x 896 at
# one row (2-core Xeon, 1 thread: 22 vs 18 ms; int4: 9 ms), so an int8-type lm_head (Q8_0 in
# Q4_K_M files) is requantized to int4 groups of 32: perplexity measured in test_quantized.py
_LM_HEAD_INT4 = True
_QUANT_GROUPS = (
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ("self_attn.o_proj.weight",),
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ("mlp.down_proj.weight",),
)
# Token types that are no text: control tokens (<|im_end|>) and unused padding ("[PAD151665]").
_SPECIAL_TOKEN_TYPES = (gguf.TokenType.CONTROL, gguf.TokenType.UNUSED)

# GGUF per-layer tensor name -> HF name under model.layers.{i}.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
# qwen3moe: the router, and each expert's weights stacked [E, out, in] (HF order) in one tensor
_ROUTER = "ffn_gate_inp.weight"
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")  # qwen3(moe), gemma3: [head_dim] each
# Gemma 3's four norms a layer: llama.cpp's ffn_norm is the pre-feedforward norm there
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Gemma 3 as llama.cpp runs it (no metadata keys for these): every 6th layer global, the local
# layers' RoPE base 10000, and the attention scale 1/sqrt(head_dim) except in the 27B (62 layers),
# whose query_pre_attn_scalar is hidden / heads
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class _Entry:
    """One HF tensor to write: where it comes from and what to do to it."""

    name: str
    shape: tuple[int, ...]  # HF (PyTorch) order: [out, in]
    source: Any  # gguf ReaderTensor, or None for an all-zero tensor
    unpermute_heads: int = 0  # >0: undo llama.cpp's q/k row permutation over this many heads
    shift: float = 0.0  # added to every value (in float32, before the cast)
    expert: int | None = None  # the source stacks experts [E, out, in]: this one's [out, in]
    form: str = "dense"  # dense (in the folder's dtype) | int4 | int8 (loaders/gguf_quant.py)


def convert_gguf(
    gguf_path: str | Path,
    cache_root: Path,
    dtype: torch.dtype,
    *,
    quantized: bool = False,
    fallback: bool = False,
) -> Path:
    """The HF-style folder for `gguf_path` in `dtype` (quantized: linear weights in int4 / int8,
    see the module docstring), converting it on first use. fallback (quantization auto): a weight
    of a type neither form takes stays dense, with a warning naming it, instead of an error.

    Raises FileNotFoundError for a missing file and ValueError for anything this converter
    cannot read (not GGUF, truncated, unknown architecture or tensor type).
    """
    src = Path(gguf_path).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"cannot convert {src} to {dtype}: choose float32, float16 or bfloat16")
    stat = src.stat()
    marker = _marker_content(src, stat, dtype, quantized)
    suffix = "-q" if quantized else ""
    out = Path(cache_root) / f"{src.stem}-{_source_key(src, stat)}-{marker['dtype']}{suffix}"
    if _read_json(out / MARKER) != marker:
        with cache_lock(out):
            # NOTE: re-read under the lock: another process may have converted it meanwhile
            if _read_json(out / MARKER) != marker:
                _convert(src, out, dtype, marker, quantized, fallback)
                return out
    logger.info("using converted model cached at %s", out)
    config = _read_json(out / "config.json")
    _log_window(src, config)
    _log_dense_fallback(src, config)
    return out


def _convert(
    src: Path,
    out: Path,
    dtype: torch.dtype,
    marker: dict[str, Any],
    quantized: bool,
    fallback: bool,
) -> None:
    reader = _open_reader(src)
    config, entries = _plan(reader, src, dtype)
    if quantized:
        entries = _quantize_plan(entries, src, fallback)
        forms = [e.form for e in entries]
        config["quantization_config"] = {
            "quant_method": "weft-gguf",
            "int4": forms.count("int4"),
            "int8": forms.count("int8"),
            # linear weights of types neither form takes (fallback), as "name: TYPE"
            "dense": [
                f"{e.source.name}: {e.source.tensor_type.name}"
                for e in entries
                if e.form == "dense"
                and e.source is not None
                and form_of(e.source.tensor_type) is None
            ],
        }
    template = _meta(reader, "tokenizer.chat_template", src, None)
    add_bos = _meta(reader, "tokenizer.ggml.add_bos_token", src, None)
    specials = _special_tokens(reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        _write_weights(tmp, entries, dtype, desc=f"converting {src.name}")
        del reader, entries  # release the file mapping; the tokenizer step reads the file itself
        _save_tokenizer(src, tmp, template, specials, add_bos)
        _write_json(tmp / MARKER, marker)
        _publish(tmp, out, marker)
    finally:
        # NOTE: an interrupted conversion leaves no folder under the final name.
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s; cached at %s", src.name, out)
    _log_window(src, config)
    _log_dense_fallback(src, config)


def _log_dense_fallback(src: Path, config: dict[str, Any]) -> None:
    """Quantization auto: the linear weights left dense, said at every load."""
    dense = (config.get("quantization_config") or {}).get("dense") or []
    if dense:
        logger.warning(
            "%s: %d linear weight(s) of types weft cannot keep quantized run dequantized "
            "(slower decode): %s",
            src.name,
            len(dense),
            ", ".join(dense[:5]) + (" ..." if len(dense) > 5 else ""),
        )


def _log_window(src: Path, config: dict[str, Any]) -> None:
    """A llama file's attention at load: its window, or none (see the module docstring)."""
    arch = config["architectures"][0]
    if arch == "MistralForCausalLM":
        logger.info("%s: sliding window %d from the GGUF", src.name, config["sliding_window"])
    elif arch == "LlamaForCausalLM":
        logger.info(
            "%s: a llama GGUF carries no sliding window: full attention in every layer (a "
            "Mistral 7B v0.1 needs its window from an HF config.json: serve that folder)",
            src.name,
        )


# -- cache ---------------------------------------------------------------------------------------


def _source_key(src: Path, stat: os.stat_result) -> str:
    # Cheap identity: path + size + mtime, never the contents (hashing 500 MB per load is slow).
    ident = f"{src}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _marker_content(
    src: Path, stat: os.stat_result, dtype: torch.dtype, quantized: bool
) -> dict[str, Any]:
    return {
        "quantized": quantized,
        "source": str(src),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": str(dtype).removeprefix("torch."),
        "format": _FORMAT_VERSION,
        "weft_version": _weft_version(),
    }


def _weft_version() -> str:
    try:
        return importlib.metadata.version("weft")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _publish(tmp: Path, out: Path, marker: dict[str, Any]) -> None:
    """Move the finished temp folder to `out` in one rename."""
    if out.exists():
        if _read_json(out / MARKER) == marker:
            return  # another process finished the same conversion first
        shutil.rmtree(out)  # stale: no marker (older layout) or a different marker
    os.rename(tmp, out)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# -- reading the GGUF ----------------------------------------------------------------------------


def _open_reader(src: Path) -> gguf.GGUFReader:
    with src.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{src} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(src)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:
        raise ValueError(f"{src} is truncated or corrupt: cannot read its GGUF header ({e})") from e
    if reader.byte_order != "I":
        raise ValueError(f"{src} is a big-endian GGUF file; weft reads little-endian files only")
    size = src.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(
                f"{src} is truncated: tensor {t.name!r} needs bytes up to "
                f"{t.data_offset + t.n_bytes}, the file has {size}"
            )
    return reader


def _meta(reader: gguf.GGUFReader, key: str, src: Path, default: Any = ...) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise ValueError(f"{src} lacks the metadata field {key!r}")
        return default
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # keep the float32's shortest decimal form (1e-06, not 9.99999997e-07)
        value = float(str(np.float32(value)))
    return value


def _check_dequantizable(reader: gguf.GGUFReader, src: Path) -> None:
    """Fail before any work when a tensor type has no dequantizer in `gguf.quants`."""
    by_type: dict[gguf.GGMLQuantizationType, str] = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type, t.name)
    for qtype, name in by_type.items():
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        try:
            gguf.quants.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
        except NotImplementedError:
            raise ValueError(
                f"unsupported tensor type {qtype.name} (tensor {name!r}) in {src}"
            ) from None


# -- the plan: config + tensor list --------------------------------------------------------------


def _plan(
    reader: gguf.GGUFReader, src: Path, dtype: torch.dtype
) -> tuple[dict[str, Any], list[_Entry]]:
    arch = _meta(reader, "general.architecture", src)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unknown architecture {arch!r} in {src}: weft supports {', '.join(ARCHITECTURES)}"
        )
    _check_dequantizable(reader, src)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{src} has no token_embd.weight tensor")
    config = _hf_config(reader, src, arch, tensors, dtype)
    return config, _entries(tensors, config, arch, src)


def _hf_config(
    reader: gguf.GGUFReader, src: Path, arch: str, tensors: dict[str, Any], dtype: torch.dtype
) -> dict[str, Any]:
    hidden = int(_meta(reader, f"{arch}.embedding_length", src))
    heads = int(_meta(reader, f"{arch}.attention.head_count", src))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", src, hidden // heads))
    theta = float(_meta(reader, f"{arch}.rope.freq_base", src, 10000.0))
    rope_dims = int(_meta(reader, f"{arch}.rope.dimension_count", src, head_dim))
    if rope_dims != head_dim:
        raise ValueError(
            f"{src}: partial rotary embeddings ({rope_dims} of {head_dim}) unsupported"
        )
    bos = _meta(reader, "tokenizer.ggml.bos_token_id", src, None)
    moe = _moe_config(reader, src, arch)
    # NOTE: a qwen3moe file's layers are all sparse: its dense size, when absent, is unread
    ffn_default = moe["moe_intermediate_size"] if moe else ...
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        # GGUF shapes are reversed: token_embd is [hidden, vocab] in the file.
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(_meta(reader, f"{arch}.feed_forward_length", src, ffn_default)),
        "num_hidden_layers": int(_meta(reader, f"{arch}.block_count", src)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(reader, f"{arch}.attention.head_count_kv", src, heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_meta(reader, f"{arch}.context_length", src)),
        "rms_norm_eps": float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", src)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, src, arch, tensors, theta, head_dim),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        "bos_token_id": bos,
        "eos_token_id": _end_token_ids(reader, src),
        # transformers 5 reads `dtype`; older readers (and the brief) use `torch_dtype`.
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }
    pad = _meta(reader, "tokenizer.ggml.padding_token_id", src, None)
    if pad is not None:
        config["pad_token_id"] = pad
    if arch == "gemma3":
        config.update(_gemma3_config(reader, src, config))
    window = _meta(reader, f"{arch}.attention.sliding_window", src, None)
    if arch == "llama" and window:  # (0: none)
        config.update(
            architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=int(window)
        )
    return config | moe


def _moe_config(reader: gguf.GGUFReader, src: Path, arch: str) -> dict[str, Any]:
    """config.json's expert fields of a qwen3moe file (empty for a dense architecture)."""
    if arch not in _MOE_ARCHS:
        return {}
    return {
        "num_experts": int(_meta(reader, f"{arch}.expert_count", src)),
        "num_experts_per_tok": int(_meta(reader, f"{arch}.expert_used_count", src)),
        "moe_intermediate_size": int(_meta(reader, f"{arch}.expert_feed_forward_length", src)),
        # NOTE: llama.cpp renormalises qwen3moe's top-k weights unless the file says otherwise
        "norm_topk_prob": bool(_meta(reader, f"{arch}.expert_weights_norm", src, True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _gemma3_config(reader: gguf.GGUFReader, src: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's own config.json keys, in the layout of its released checkpoints (transformers 5
    turns rope_theta / rope_scaling / rope_local_base_freq into per-layer-type rope_parameters)."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    big = layers == _GEMMA3_27B_LAYERS
    types = [
        "full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention"
        for i in range(layers)
    ]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // heads if big else config["head_dim"],
        "sliding_window": int(_meta(reader, "gemma3.attention.sliding_window", src)),
        "layer_types": types,
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_THETA,
        "final_logit_softcapping": _meta(reader, "gemma3.final_logit_softcapping", src, None),
        "attn_logit_softcapping": None,
    }


def _end_token_ids(reader: gguf.GGUFReader, src: Path) -> list[int]:
    """Every end-of-generation id: the metadata's eos/eot/eom, then known end-token texts."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _meta(reader, f"tokenizer.ggml.{key}", src, None)
        if value is not None and value not in ids:
            ids.append(int(value))
    # NOTE: only control tokens count: a vocabulary may also hold "<EOT>" as ordinary text.
    for i, (text, kind) in enumerate(_token_table(reader)):
        if kind in (None, gguf.TokenType.CONTROL) and text in END_TOKEN_TEXTS and i not in ids:
            ids.append(i)
    return ids


def _special_tokens(reader: gguf.GGUFReader) -> dict[int, str]:
    """Id -> text of every token the GGUF types CONTROL or UNUSED."""
    table = _token_table(reader)
    return {i: text for i, (text, kind) in enumerate(table) if kind in _SPECIAL_TOKEN_TYPES}


def _token_table(reader: gguf.GGUFReader) -> list[tuple[str, int | None]]:
    """(text, GGUF token type) of each token id; the type is None when the file has none."""
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        return []
    types = reader.get_field("tokenizer.ggml.token_type")
    kinds = types.contents() if types is not None else [None] * len(tokens.data)
    texts = (bytes(tokens.parts[idx]).decode("utf-8", "replace") for idx in tokens.data)
    return list(zip(texts, kinds, strict=True))


def _rope_scaling(
    reader: gguf.GGUFReader,
    src: Path,
    arch: str,
    tensors: dict[str, Any],
    theta: float,
    head_dim: int,
) -> dict[str, Any] | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type", src, None)
    factor = _meta(reader, f"{arch}.rope.scaling.factor", src, None)
    orig_ctx = _meta(reader, f"{arch}.rope.scaling.original_context_length", src, None)
    if "rope_freqs.weight" in tensors:
        # Llama-3.1-style files bake the llama3 scaling into per-frequency divisors.
        freqs = gguf.quants.dequantize(
            tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type
        )
        return llama3_rope_from_factors(np.asarray(freqs, np.float64), theta, head_dim, orig_ctx)
    if kind in (None, "none"):
        return None
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor is not None:
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        if orig_ctx is not None:
            scaling["original_max_position_embeddings"] = int(orig_ctx)
        return scaling
    raise ValueError(f"unsupported rope scaling {kind!r} (factor {factor}) in {src}")


def llama3_rope_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, original_ctx: int | None = None
) -> dict[str, Any] | None:
    """Recover HF's llama3 `rope_scaling` from llama.cpp's `rope_freqs` divisors.

    Per frequency with wavelength w, llama3 scaling divides the frequency by
        1                       if w < L / high_freq_factor
        factor                  if w > L / low_freq_factor
        1 / ((1 - s) / factor + s),  s = (L / w - low) / (high - low)   in between.
    So `factor` is the largest divisor, and s is linear in 1/w with slope L / (high - low) and
    intercept -low / (high - low): two or more in-between points determine low and high given L.
    Only the ratios L/low and L/high matter to the math, so L is the file's
    original_context_length when present, else 8192 (Llama 3's pre-training context).
    """
    n = head_dim // 2
    if factors.shape != (n,):
        raise ValueError(f"rope_freqs has shape {factors.shape}, expected ({n},)")
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    mid = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if int(mid.sum()) < 2:
        raise ValueError(
            f"rope_freqs has {int(mid.sum())} transitional factors; need 2 to recover llama3 "
            "rope scaling (low/high_freq_factor)"
        )
    smooth = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelen[mid], smooth, 1)
    ctx = int(original_ctx) if original_ctx else 8192
    low = -intercept * ctx / slope
    high = low + ctx / slope
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": round(float(low), 4),
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": ctx,
    }
    rebuilt = llama3_rope_factors(scaling, theta, head_dim)
    if not np.allclose(rebuilt, factors, rtol=1e-4, atol=0):
        raise ValueError("rope_freqs does not follow llama3 rope scaling; cannot convert it")
    return scaling


def llama3_rope_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama3 scaling implies (what llama.cpp stores as rope_freqs)."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    ctx, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < ctx / high, 1.0, np.where(wavelen > ctx / low, factor, mid))


def _entries(tensors: dict[str, Any], config: dict[str, Any], arch: str, src: Path) -> list[_Entry]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, hd = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    shapes = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "pre_feedforward_layernorm.weight": (hidden,),
        "post_feedforward_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * hd, hidden),
        "self_attn.k_proj.weight": (kv_heads * hd, hidden),
        "self_attn.v_proj.weight": (kv_heads * hd, hidden),
        "self_attn.o_proj.weight": (hidden, heads * hd),
        "self_attn.q_proj.bias": (heads * hd,),
        "self_attn.k_proj.bias": (kv_heads * hd,),
        "self_attn.v_proj.bias": (kv_heads * hd,),
        "self_attn.o_proj.bias": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
    }
    vocab = config["vocab_size"]
    global_shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    # llama.cpp permutes q/k rows for `llama` only; which heads count differs for q and k.
    permuted = {"attn_q": heads, "attn_k": kv_heads} if arch == "llama" else {}
    moe = arch in _MOE_ARCHS
    skip = _QK_NORMS + (_DENSE_FFN if moe else ())
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    wanted = [g for g in names if g.endswith(".weight") and g not in skip]
    wanted += list(_QK_NORMS) if arch in ("qwen3", "qwen3moe", "gemma3") else []
    # NOTE: llama.cpp's converter stores each Gemma 3 norm weight plus one (its RMSNorm multiplies
    # by the weight itself, HF's by 1 + weight); subtracting it restores HF's weights
    shift = -1.0 if arch == "gemma3" else 0.0
    if config["attention_bias"]:
        # HF Qwen2 has q/k/v biases; HF Llama's attention_bias also puts one on o_proj.
        wanted += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        wanted += ["attn_output.bias"] if arch == "llama" else []

    entries: list[_Entry] = []
    used = {"rope_freqs.weight"}
    for gname, hname in _GLOBAL_NAMES.items():
        if gname in tensors:
            norm_shift = shift if gname == "output_norm.weight" else 0.0
            entries.append(_Entry(hname, global_shapes[hname], tensors[gname], shift=norm_shift))
            used.add(gname)
        elif gname != "output.weight":
            raise ValueError(f"{src} lacks the tensor {gname!r}")
    for i in range(config["num_hidden_layers"]):
        for gsuffix in wanted:
            gname, hsuffix = f"blk.{i}.{gsuffix}", names[gsuffix]
            source = tensors.get(gname)
            if source is None and not gsuffix.endswith(".bias"):
                raise ValueError(f"{src} lacks the tensor {gname!r}")
            if source is None and arch == "qwen2":
                raise ValueError(f"{src} lacks the tensor {gname!r} (qwen2 has q/k/v biases)")
            # A llama file with q/k/v biases but none on the output gets a zero o_proj bias.
            heads_here = permuted.get(gsuffix.split(".")[0], 0)
            norm_shift = shift if gsuffix.endswith("norm.weight") else 0.0
            entries.append(
                _Entry(
                    f"model.layers.{i}.{hsuffix}", shapes[hsuffix], source, heads_here, norm_shift
                )
            )
            used.add(gname)
        if moe:
            entries += _expert_entries(tensors, config, i, src)
            used.update(f"blk.{i}.{g}" for g in (_ROUTER, *_EXPERT_NAMES))
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{src} has tensors weft does not know for {arch}: {extra[:5]}")
    for e in entries:
        file_shape = () if e.source is None else tuple(reversed(e.source.shape.tolist()))
        if e.expert is not None and file_shape[1:] == e.shape and e.expert < file_shape[0]:
            continue  # one expert's slice of a stacked tensor
        if e.source is not None and file_shape != e.shape:
            raise ValueError(
                f"{src}: tensor {e.source.name!r} has shape {file_shape}, "
                f"the metadata implies {e.shape}"
            )
    return entries


def _expert_entries(
    tensors: dict[str, Any], config: dict[str, Any], layer: int, src: Path
) -> list[_Entry]:
    """Layer `layer`'s router and per-expert HF tensors (the layout of published checkpoints),
    each expert a slice of the file's stacked tensor."""
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    shapes = {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    prefix = f"model.layers.{layer}.mlp"
    for gsuffix in (_ROUTER, *_EXPERT_NAMES):
        if f"blk.{layer}.{gsuffix}" not in tensors:
            raise ValueError(f"{src} lacks the tensor 'blk.{layer}.{gsuffix}'")
    router = tensors[f"blk.{layer}.{_ROUTER}"]
    entries = [_Entry(f"{prefix}.gate.weight", (config["num_experts"], hidden), router)]
    for e in range(config["num_experts"]):
        for gsuffix, proj in _EXPERT_NAMES.items():
            source = tensors[f"blk.{layer}.{gsuffix}"]
            name = f"{prefix}.experts.{e}.{proj}.weight"
            entries.append(_Entry(name, shapes[proj], source, expert=e))
    return entries


def _quantize_plan(entries: list[_Entry], src: Path, fallback: bool) -> list[_Entry]:
    """Each linear weight's form (gguf_quant.form_of); a merged group (q/k/v, gate/up) takes
    one: int4 if all its members are int4 types, else int8 (dense if any member is a float)."""
    suffix_group = {name: gi for gi, group in enumerate(_QUANT_GROUPS) for name in group}
    groups: dict[tuple[str, int], list[int]] = {}
    for idx, e in enumerate(entries):
        if e.source is None or e.expert is not None:
            continue
        if e.name == "lm_head.weight":
            groups[("lm_head", 0)] = [idx]
        elif e.name.startswith("model.layers."):
            layer, _, rest = e.name.removeprefix("model.layers.").partition(".")
            if rest in suffix_group:
                groups.setdefault((layer, suffix_group[rest]), []).append(idx)
    out = list(entries)
    for members in groups.values():
        forms = []
        for idx in members:
            t = entries[idx].source
            form = form_of(t.tensor_type)
            if form is None and fallback:
                form = "dense"  # NOTE: logged at every load (_log_dense_fallback)
            if form is None:
                raise ValueError(
                    f"{src}: tensor {t.name!r} is {t.tensor_type.name}, a type weft cannot keep "
                    f"quantized (int4 from {', '.join(q.name for q in INT4_TYPES)}; int8 from "
                    f"{', '.join(q.name for q in INT8_TYPES)}): load it with quantization "
                    f"'none' to dequantize it"
                )
            forms.append(form)
        form = forms[0] if len(set(forms)) == 1 else "dense" if "dense" in forms else "int8"
        if form == "int8" and entries[members[0]].name == "lm_head.weight" and _LM_HEAD_INT4:
            form = "int4"
        rows = sum(entries[idx].shape[0] for idx in members)
        if form == "int4" and rows % 16:
            names = ", ".join(repr(entries[idx].source.name) for idx in members)
            raise ValueError(
                f"{src}: tensor(s) {names} ({forms[0]} from "
                f"{entries[members[0]].source.tensor_type.name}): {rows} output rows, not a "
                "multiple of 16 as torch's int4 CPU kernel tiles them; load with quantization "
                "'none'"
            )
        for idx in members:
            out[idx] = dataclasses.replace(entries[idx], form=form)
    return out


# -- writing -------------------------------------------------------------------------------------


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: GGUF interleaved pairs -> HF rotate-half halves.

    Within each head of size d, HF's rotate_half pairs dim i with dim i + d/2; ggml's RoPE pairs
    2i with 2i + 1. llama.cpp therefore moved HF row (j * d/2 + i) to row (2i + j), j in {0, 1}.
    Reading GGUF rows as [head, i, j] and swapping i and j gives HF's [head, j, i].
    """
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: Any, dtype: torch.dtype, unpermute_heads: int = 0) -> torch.Tensor:
    """One GGUF `ReaderTensor` as a torch tensor in PyTorch order (GGUF dims reversed)."""
    entry = _Entry(tensor.name, tuple(reversed(tensor.shape.tolist())), tensor, unpermute_heads)
    flat = [chunk.reshape(-1) for chunk in _tensor_chunks(entry, dtype)]
    return torch.cat(flat).reshape(entry.shape)


def _row_chunks(entry: _Entry) -> Iterator[np.ndarray]:
    """Dequantized float32 rows of `entry`, a chunk at a time, as a flat sequence of arrays."""
    t = entry.source
    data = t.data if entry.expert is None else t.data[entry.expert]
    if data.ndim < 2 or entry.unpermute_heads:
        yield gguf.quants.dequantize(data, t.tensor_type).reshape(entry.shape)
        return
    rows_per_chunk = max(1, _CHUNK_BYTES // (4 * entry.shape[-1]))
    for start in range(0, data.shape[0], rows_per_chunk):
        yield gguf.quants.dequantize(data[start : start + rows_per_chunk], t.tensor_type)


def _tensor_chunks(entry: _Entry, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    if entry.source is None:
        yield torch.zeros(entry.shape, dtype=dtype)
        return
    for rows in _row_chunks(entry):
        if not rows.flags.writeable:
            rows = rows.copy()  # F32 data is a read-only view of the file's memmap
        chunk = torch.from_numpy(rows)
        if entry.unpermute_heads:
            chunk = unpermute_rows(chunk, entry.unpermute_heads)
        if entry.shift:
            chunk = chunk.float() + entry.shift
        yield chunk.to(dtype).contiguous()


def _outputs(e: _Entry, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The stored tensors (name, dtype, shape) of one entry, in the order _entry_data yields."""
    if e.form == "dense":
        return [(e.name, dtype, e.shape)]
    n, k = e.shape
    base = e.name.removesuffix(".weight")
    if e.form == "int4":
        groups = (n, k // GROUP)
        return [
            (f"{base}.qweight", torch.uint8, (n, k // 2)),
            (f"{base}.qscale", torch.float32, groups),
            (f"{base}.qzero", torch.float32, groups),
        ]
    return [(f"{base}.qweight", torch.int8, (n, k)), (f"{base}.qscale", torch.float32, (n,))]


def _nbytes(e: _Entry, dtype: torch.dtype) -> int:
    return sum(math.prod(shape) * dt.itemsize for _, dt, shape in _outputs(e, dtype))


def _entry_data(e: _Entry, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The bytes of _outputs(e), in order, as tensors (a dense weight in row chunks)."""
    if e.form == "dense":
        yield from _tensor_chunks(e, dtype)
        return
    if e.form == "int4":
        if e.source.tensor_type in INT4_TYPES:  # exact (gguf_quant.int4_groups)
            groups = int4_groups(e.source.data, e.source.tensor_type)
        else:  # the lm_head, requantized (_LM_HEAD_INT4)
            groups = int4_from_rows(gguf.quants.dequantize(e.source.data, e.source.tensor_type))
        q, scale, zero = (torch.from_numpy(a) for a in groups)
        if e.unpermute_heads:
            q, scale, zero = (unpermute_rows(t, e.unpermute_heads) for t in (q, scale, zero))
        yield torch.from_numpy(pack_nibbles(q.numpy()))
        yield scale.contiguous()
        yield zero.contiguous()
        return
    scales = []  # int8: dequantized and requantized per row, a chunk of rows at a time
    for rows in _tensor_chunks(e, torch.float32):
        q8, row_scale = int8_rows(rows.reshape(-1, e.shape[1]).numpy())
        yield torch.from_numpy(q8)
        scales.append(row_scale)
    yield torch.from_numpy(np.concatenate(scales))


def _shards(entries: list[_Entry], dtype: torch.dtype) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        nbytes = _nbytes(e, dtype)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    return shards


def _write_weights(folder: Path, entries: list[_Entry], dtype: torch.dtype, desc: str) -> None:
    shards = _shards(entries, dtype)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    with tqdm(total=len(entries), desc=desc, unit="tensor") as bar:
        for name, shard in zip(names, shards, strict=True):
            _write_safetensors(folder / name, shard, dtype, bar)
    if len(shards) > 1:
        total = sum(_nbytes(e, dtype) for e in entries)
        weight_map = {
            out[0]: n
            for n, shard in zip(names, shards, strict=True)
            for e in shard
            for out in _outputs(e, dtype)
        }
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(folder / "model.safetensors.index.json", index)


def _write_safetensors(path: Path, entries: list[_Entry], dtype: torch.dtype, bar: tqdm) -> None:
    """Stream tensors into one safetensors file: the header is known before any data exists.

    Format: u64 little-endian header length, JSON header (padded to 8 bytes), raw data.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        for name, out_dtype, shape in _outputs(e, dtype):
            nbytes = math.prod(shape) * out_dtype.itemsize
            header[name] = {
                "dtype": _STORED_DTYPES[out_dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for e in entries:
            written = 0
            for chunk in _entry_data(e, dtype):
                # NOTE: byte view of a contiguous tensor; numpy has no bfloat16, uint8 is exact.
                raw = chunk.reshape(-1).view(torch.uint8).numpy()
                f.write(raw.data)
                written += raw.nbytes
            if written != _nbytes(e, dtype):
                raise AssertionError(f"{e.name}: wrote {written} bytes for shape {e.shape}")
            bar.update(1)


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if "pad_token_id" in config:
        gen["pad_token_id"] = config["pad_token_id"]
    return gen


def _save_tokenizer(
    src: Path,
    folder: Path,
    template: str | None,
    specials: dict[int, str],
    add_bos: bool | None = None,
) -> None:
    """Build the tokenizer from the GGUF through transformers and save it to `folder`.

    specials: id -> text of the GGUF's CONTROL and UNUSED tokens. transformers keeps UNUSED
    ones (Qwen's 271 "[PADn]" rows) as plain vocabulary, so they would decode as text and a
    grammar could emit them; here each becomes a special added token (same id) and an extra
    special token, so `all_special_ids` lists it and skip_special_tokens drops it.
    """
    from transformers import AddedToken, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:  # transformers raises many types for a vocabulary it cannot build
        raise ValueError(f"cannot build a tokenizer from {src}: {e}") from e
    named = set(tok.all_special_tokens)
    # NOTE: an added token whose text is in the vocabulary keeps that id; a text that maps to
    # another id (a duplicate spelling) would mark the wrong token, so it is left alone.
    extra = [
        AddedToken(text, special=True, normalized=False)
        for tid, text in sorted(specials.items())
        if text not in named and tok.convert_tokens_to_ids(text) == tid
    ]
    if extra:
        # "additional_special_tokens" is read by transformers 4 and 5 (as extra_special_tokens);
        # the positional False extends the list instead of replacing it (renamed across versions).
        tok.add_special_tokens({"additional_special_tokens": extra}, False)
    if template:
        # transformers maps it already; set it again so a mapping change cannot drop it.
        tok.chat_template = template  # saved as chat_template.jinja
    if add_bos is not None:
        _pin_bos(tok, bool(add_bos), src)
    tok.save_pretrained(str(folder))


def _pin_bos(tok: Any, add_bos: bool, src: Path) -> None:
    """Make the tokenizer add BOS exactly as the GGUF says.

    NOTE: transformers 5.17 built a Llama GGUF's tokenizer without BOS although the file says
    add_bos_token (5.24 adds it): prompts then lacked the BOS the model was trained with.
    """
    bos, bos_id = tok.bos_token, tok.bos_token_id
    if not add_bos or bos is None or bos_id is None:
        return
    if _adds_bos(tok, bos_id):
        return
    with contextlib.suppress(AttributeError, ValueError):
        tok.add_bos_token = True  # transformers' own switch (it rebuilds the post-processor)
    if not _adds_bos(tok, bos_id):
        from tokenizers import processors

        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    if not _adds_bos(tok, bos_id):
        raise ValueError(f"cannot make the tokenizer of {src} add its BOS token {bos!r}")


def _adds_bos(tok: Any, bos_id: int) -> bool:
    ids = tok.encode("a")
    return bool(ids) and ids[0] == bos_id
