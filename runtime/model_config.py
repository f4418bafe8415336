"""The model's shape, read from config.json (both the classic and the transformers-5 layout)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Defaults that differ by architecture, as transformers' config classes set them.
_GEMMA3 = "Gemma3ForCausalLM"
_HEAD_DIM = {"Qwen3ForCausalLM": 128, _GEMMA3: 256}
_WINDOW = {"MistralForCausalLM": 4096, _GEMMA3: 4096}
_ROPE_THETA = {_GEMMA3: 1_000_000.0}
_LOCAL_ROPE_THETA = {_GEMMA3: 10_000.0}  # Gemma 3's sliding layers: rope_local_base_freq
_ACT = {_GEMMA3: "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class Fp8Checkpoint:
    """An FP8 checkpoint's quantization_config: its linear weights are stored float8_e4m3fn,
    each with a float32 scale tensor named `scale_name` beside it."""

    method: str  # quant_method: fp8 | fbgemm_fp8 | compressed-tensors
    block: tuple[int, int] | None  # scales per block of rows x columns; None: per tensor or row
    scale_name: str  # weight_scale_inv (fp8 with weight_block_size) | weight_scale
    # dynamic | static; NOTE: static checkpoints' input_scale are not read: weft quantizes the
    # activations per token at run time either way (no less accurate than one static scale)
    activation_scheme: str


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool = False  # an RMSNorm over each q and k head before rope (Qwen3)
    # a query at position p sees keys in (p - W, p] (None: every earlier key), in every layer but
    # `full_attention_layers` (config.json's layer_types, or Qwen's max_window_layers)
    sliding_window: int | None = None
    full_attention_layers: frozenset[int] = frozenset()
    rope_scaling: dict[str, Any] | None = None
    # mixture of experts (Qwen3-MoE); num_experts 0: a dense model. A sparse layer's MLP is
    # num_experts experts of moe_intermediate_size, num_experts_per_tok of them per token
    # (their weights renormalised to sum to one with norm_topk_prob); `dense_mlp_layers` keep a
    # dense MLP of intermediate_size (config.json's mlp_only_layers and decoder_sparse_step)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_mlp_layers: frozenset[int] = frozenset()
    # the sliding-window layers' own RoPE (Gemma 3: rope_local_base_freq); None: the one above
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"  # the gated MLP's activation (Gemma: gelu_pytorch_tanh)
    # q.k multiplier before the softmax (None: 1 / sqrt(head_dim); Gemma: query_pre_attn_scalar)
    attn_scale: float | None = None
    attn_logit_cap: float | None = None  # scores -> c * tanh(score / c) (attn_logit_softcapping)
    final_logit_cap: float | None = None  # logits -> c * tanh(logit / c) (final_logit_softcapping)
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    fp8: Fp8Checkpoint | None = None  # config.json's quantization_config (FP8 checkpoints)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"{source}: missing 'architectures'")
        arch = archs[0]
        if arch == "Gemma3ForConditionalGeneration":
            raise ValueError(
                f"{source}: Gemma 3 with its vision tower is not supported; weft runs the text "
                "model only (a config.json of architecture Gemma3ForCausalLM, model_type "
                "gemma3_text)"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            theta, scaling, local = _rope(raw, arch)
            if raw.get("use_bidirectional_attention"):
                raise ValueError("use_bidirectional_attention (an encoder) is not supported")
            scalar = raw.get("query_pre_attn_scalar", 256 if arch == _GEMMA3 else None)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                # NOTE: transformers' Qwen3Config defaults head_dim to 128, not hidden / heads
                head_dim=int(raw.get("head_dim") or _HEAD_DIM.get(arch, hidden // heads)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == _GEMMA3)),
                attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
                sliding_window=_sliding_window(raw),
                full_attention_layers=_full_attention_layers(raw),
                rope_scaling=scaling,
                **_experts(raw),
                local_rope_theta=local[0] if local else None,
                local_rope_scaling=local[1] if local else None,
                hidden_act=str(
                    raw.get("hidden_activation") or raw.get("hidden_act") or _ACT.get(arch, "silu")
                ),
                attn_scale=None if scalar is None else float(scalar) ** -0.5,
                attn_logit_cap=_optional_float(raw.get("attn_logit_softcapping")),
                final_logit_cap=_optional_float(raw.get("final_logit_softcapping")),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_ids(raw.get("eos_token_id")),
                fp8=fp8_checkpoint(raw.get("quantization_config")),
            )
        except KeyError as exc:
            raise ValueError(f"{source}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: invalid value: {exc}") from None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or null, got {self.sliding_window}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..{self.num_experts}, "
                f"got {self.num_experts_per_tok}"
            )

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full causal attention)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw, source=str(path))


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """config.json's sliding_window (null: none). Qwen2/3 configs state one that applies
    only with use_sliding_window (false in the released checkpoints), as transformers reads them.
    """
    arch = (raw.get("architectures") or [""])[0]
    # NOTE: the defaults are transformers' own: MistralConfig's sliding_window is 4096 when the
    # key is absent, and Qwen2/3 configs use their window only when use_sliding_window says so
    window = raw.get("sliding_window", _WINDOW.get(arch))
    qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if window is None or not raw.get("use_sliding_window", not qwen):
        return None
    return int(window)


def _experts(raw: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields, as transformers' Qwen3MoeConfig reads them: a layer is
    sparse unless listed in mlp_only_layers or off every decoder_sparse_step-th layer."""
    # NOTE: transformers 5 saves num_experts as num_local_experts (its attribute_map)
    experts = int(raw.get("num_experts", raw.get("num_local_experts")) or 0)
    if experts == 0:
        return {}
    step = int(raw.get("decoder_sparse_step") or 1)
    layers = int(raw["num_hidden_layers"])
    dense = set(raw.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step}
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "dense_mlp_layers": frozenset(dense),
    }


def _full_attention_layers(raw: dict[str, Any]) -> frozenset[int]:
    """Layers without the window: "full_attention" in layer_types (transformers 5 writes them),
    else Qwen's first max_window_layers layers, else none (unread without a window)."""
    types = raw.get("layer_types")
    if types:
        return frozenset(i for i, kind in enumerate(types) if kind != "sliding_attention")
    if (raw.get("architectures") or [""])[0] == _GEMMA3:
        # NOTE: transformers writes the pattern as "_sliding_window_pattern"; every pattern-th
        # layer (1-based) is global
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return frozenset(i for i in range(int(raw["num_hidden_layers"])) if (i + 1) % pattern == 0)
    if "use_sliding_window" in raw and raw.get("max_window_layers") is not None:
        return frozenset(range(int(raw["max_window_layers"])))
    return frozenset()


RopeSpec = tuple[float, dict[str, Any] | None]  # theta, scaling (None: plain RoPE)


def _rope(raw: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None, RopeSpec | None]:
    """(theta, scaling) of the full-attention layers, and the sliding layers' own where they
    have one: transformers 5 writes `rope_parameters` per layer type for Gemma 3, older files
    `rope_theta` / `rope_scaling` (the global layers) and `rope_local_base_freq`."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = _rope_spec(params.get("full_attention") or {}, _ROPE_THETA.get(arch, 10000.0))
        local = _rope_spec(params.get("sliding_attention") or {}, _LOCAL_ROPE_THETA.get(arch, 1e4))
        return full[0], full[1], local
    theta, scaling = _rope_spec(
        params or raw.get("rope_scaling") or {},
        raw.get("rope_theta", _ROPE_THETA.get(arch, 10000.0)),
    )
    if arch not in _LOCAL_ROPE_THETA:
        return theta, scaling, None
    return theta, scaling, (float(raw.get("rope_local_base_freq", _LOCAL_ROPE_THETA[arch])), None)


def _rope_spec(rope: dict[str, Any], default_theta: float) -> RopeSpec:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", default_theta))
    if rope_type == "default":
        return theta, None
    scaling = {**rope, "rope_type": rope_type}
    scaling.pop("rope_theta", None)
    scaling.pop("type", None)
    return theta, scaling


def fp8_checkpoint(qc: dict[str, Any] | None) -> Fp8Checkpoint | None:
    """config.json's quantization_config -> the FP8 form it describes (None: none); forms weft
    cannot load are refused here, naming the field."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "weft-gguf":  # weft's own GGUF conversion (loaders/gguf_convert.py)
        return None
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt {qc['fmt']!r}: weft loads e4m3 FP8 only")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization_config.activation_scheme {scheme!r} is unknown")
        size = qc.get("weight_block_size")
        if size is None:
            return Fp8Checkpoint("fp8", None, "weight_scale", scheme)
        if not (isinstance(size, list) and len(size) == 2 and all(int(v) > 0 for v in size)):
            raise ValueError(
                f"quantization_config.weight_block_size {size!r}: expected [rows, cols]"
            )
        return Fp8Checkpoint("fp8", (int(size[0]), int(size[1])), "weight_scale_inv", scheme)
    if method == "fbgemm_fp8":  # e4m3 weights, a scale per row, activations per token
        return Fp8Checkpoint("fbgemm_fp8", None, "weight_scale", "dynamic")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported: weft loads FP8 "
        "checkpoints (fp8, fbgemm_fp8, compressed-tensors float8), or dense ones"
    )


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Checkpoint:
    """compressed-tensors' float-quantized form: one config group of 8-bit float weights (per
    tensor, channel or block), activations dynamic per token, static, or left dense."""
    where = "quantization_config (compressed-tensors)"
    groups = qc.get("config_groups") or {}
    if qc.get("format") != "float-quantized" or len(groups) != 1:
        raise ValueError(
            f"{where}: format {qc.get('format')!r} with {len(groups)} config group(s); weft "
            "loads one float-quantized group (FP8 weights)"
        )
    group = next(iter(groups.values()))
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    strategy = weights.get("strategy")
    if (weights.get("num_bits"), weights.get("type")) != (8, "float") or strategy not in (
        "tensor",
        "channel",
        "block",
    ):
        raise ValueError(
            f"{where}: weights {weights.get('num_bits')}-bit {weights.get('type')} by "
            f"{strategy}; weft loads 8-bit float weights by tensor, channel or block"
        )
    if acts is not None and (acts.get("num_bits"), acts.get("type")) != (8, "float"):
        raise ValueError(f"{where}: input_activations {acts}: weft quantizes them to e4m3")
    scheme = "dynamic" if acts is None or acts.get("dynamic") else "static"
    block = None
    if strategy == "block":
        size = weights.get("block_structure")
        if not (isinstance(size, list) and len(size) == 2):
            raise ValueError(f"{where}: block_structure {size!r}: expected [rows, cols]")
        block = (int(size[0]), int(size[1]))
    return Fp8Checkpoint("compressed-tensors", block, "weight_scale", scheme)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
