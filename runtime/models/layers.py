"""Shared model layers. Each parameter that is stored merged (qkv, gate_up) knows how to load its
shards, so architecture files stay short.

Tensor parallelism (runtime/parallel.py has the table): a ColumnLinear holds its rank's rows of
each merged shard, a RowLinear its rank's columns, and sums the ranks' outputs; a layer that
holds a slice of a checkpoint tensor loads it itself (`SlicedLoading`), so a new architecture on
these layers is split over ranks without code of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.kernels import cpu_gemv, cpu_native
from weft.runtime.model_config import Fp8Checkpoint
from weft.runtime.models.cpu_gemm import f32_linear, wants_f32
from weft.runtime.models.fp8 import FP8_DTYPE, FP8Weight, merge_shards, quantize_weight
from weft.runtime.parallel import SINGLE, RankSlice, TPGroup

HAS_TRITON = importlib.util.find_spec("triton") is not None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantWeight | FP8Weight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, in] @ weight[out, in]^T (+ bias); a QuantWeight or FP8Weight runs its own kernels.

    NOTE: a single row goes through a matrix-vector product: on CUDA the Triton GEMV, which
    streams an 8B model's weights ~10% faster than cuBLAS's M = 1 tiles on an H100 (RESULTS.md);
    on CPUs torch.mv, which streams bf16 weights at ~23 GB/s where F.linear manages ~15 GB/s
    (2-core AVX-512 machine).
    """
    if isinstance(weight, (QuantWeight, FP8Weight)):
        return weight.matmul(x, bias)
    if x.shape[0] == 1:
        if x.is_cuda and HAS_TRITON and x.stride(-1) == 1 and weight.stride(-1) == 1:
            from weft.kernels.gemv import gemv  # NOTE: imported here: Triton may be missing

            return gemv(x, weight, bias)
        if x.device.type == "cpu":
            out = torch.mv(weight, x[0]).unsqueeze(0)
            return out if bias is None else out + bias
    if wants_f32(x):
        return f32_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# Stored leaves of a quantized linear weight (loaders/gguf_quant.py has the layout)
QUANT_LEAVES = ("qweight", "qscale", "qzero")
# An FP8 checkpoint's scale leaves beside each e4m3 `weight` (input_scale: static activations)
FP8_LEAVES = ("weight_scale_inv", "weight_scale", "input_scale")
_FORM_LEAVES = {"int4": QUANT_LEAVES, "int8": QUANT_LEAVES[:2]}
INT4_GROUP = 32
# NOTE: torch's int4/int8 CPU matmuls cost about linearly in M (they dequantize per row): from
# 8 rows on, bf16 GEMM over a dequantized copy is faster (2-core Xeon: int4 0.58 ms vs bf16
# 0.83 ms at M = 1 for 9728 x 896, 33 vs 4.4 ms at M = 128); steps of up to this many rows
# use the quantized kernels (RESULTS.md, issue 21); weft's own do so from 6 rows on
QUANT_MAX_ROWS = 4


@dataclass(frozen=True)
class QuantRows:
    """The rows of a step's [T, in] inputs that QuantWeights multiply with their quantized
    kernels, the others with the dense copy: `rows` None for all of them.

    NOTE: weft's CPU kernels give each row the same bits whatever rows come with it. The model
    runner sends output tokens (decode steps, drafts to verify, a grammar's forced tokens)
    through them whatever their count, so that a greedy token does not depend on the batch it
    decodes in, nor on whether its request speculates (a verify step of 8 rows must compute what
    8 decode steps would); and prompt tokens through the dense copy whatever their count
    (prefill speed), whose GEMM gives a row the same bits in any product of 2 rows or more here
    (a single row is multiplied as two: `_prompt`), or without the copy through weft's float32
    product (row-invariant), so a prompt computes alike whole, in chunks, or after a cached
    prefix (tests/test_speculative.py checks the repeat).
    """

    total: int  # T: a linear of another row count (none in the models now) keeps the default
    rows: torch.Tensor | None = None  # empty: every row is a prompt's (the dense copy's)


_QUANT_ROWS: contextvars.ContextVar[QuantRows | None] = contextvars.ContextVar(
    "quant_rows", default=None
)


@contextlib.contextmanager
def quant_rows(choice: QuantRows | None) -> Iterator[None]:
    """QuantWeights multiply these rows with their quantized kernels within the block (None:
    those of steps of up to QUANT_MAX_ROWS rows)."""
    token = _QUANT_ROWS.set(choice)
    try:
        yield
    finally:
        _QUANT_ROWS.reset(token)


class QuantWeight(nn.Module):
    """A linear weight [out, in] kept in a GGUF-derived weight-only form: int4 (groups of 32
    along `in`, a scale and zero per group, w = (q - 8) * scale + zero) or int8 (one scale per
    output row, w = q * scale). Steps of a few rows multiply it as it is stored: with weft's own
    CPU kernels (kernels/cpu_gemv.py) where they built for this CPU, else with torch's packed
    ones; each holds its own packing of the same values (`kernel` says which).

    Steps of more than QUANT_MAX_ROWS rows (prefill) use `dense`, a bf16 copy dequantized from the
    same values at load. Where it was dropped (quantized_prefill), weft's kernels multiply them in
    float32 over the weight dequantized a panel at a time (kernels/csrc/quant_gemm.c), or torch's
    packed kernels do where weft's do not run.
    """

    def __init__(self, form: str, parts: dict[str, torch.Tensor], dtype: torch.dtype):
        super().__init__()
        if dtype != torch.bfloat16:
            raise ValueError(f"quantized weights compute in bfloat16 activations, not {dtype}")
        self.form = form
        qweight = parts["qweight"]
        if qweight.device.type != "cpu":
            raise ValueError(
                "quantized GGUF weights run on the CPU only (load with quantization none)"
            )
        self.out_features = qweight.shape[0]
        self.native = cpu_native.native()
        self.kernel = "weft" if self.native else "torch"
        self.packed: torch.Tensor
        self.scales: torch.Tensor
        self.dense: torch.Tensor | None
        if form == "int4":
            # qweight u8 [N, K/2]: even k in the low nibble, odd k in the high one
            q = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)
            n, k = q.shape
            scale, zero = parts["qscale"], parts["qzero"]  # [N, K/32]
            if n % 16 or k % INT4_GROUP or tuple(scale.shape) != (n, k // INT4_GROUP):
                raise ValueError(f"int4 weight [{n}, {k}]: needs out % 16 == 0 and in % 32 == 0")
            if self.native:
                packed, sz = cpu_gemv.pack_int4(q, scale, zero)
            else:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
                # [K/32, N, 2]: the kernel's scales_and_zeros
                sz = torch.stack((scale.to(dtype), zero.to(dtype)), dim=-1).transpose(0, 1)
            self.register_buffer("packed", packed)
            self.register_buffer("scales", sz.contiguous())
            scale, zero = scale.to(dtype).float(), zero.to(dtype).float()
            w = (q.float() - 8).view(n, -1, INT4_GROUP) * scale[..., None]
            dense = (w + zero[..., None]).view(n, k)
            self._in_features = k
        elif form == "int8":
            scale = parts["qscale"].to(dtype)  # [N]
            self.register_buffer("packed", qweight.contiguous())
            self.register_buffer("scales", scale)
            dense = qweight.float() * scale.float()[:, None]
            self._in_features = qweight.shape[1]
        else:
            raise ValueError(f"unknown quantized form {form!r}")
        self.register_buffer("dense", dense.to(dtype))

    @property
    def in_features(self) -> int:
        return self._in_features

    def drop_dense(self) -> None:
        self.dense = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, in] bf16 -> [M, out] bf16."""
        if self.native is None and self.dense is None:
            return self._quantized(x, bias)  # torch's packed kernels: no other product
        choice = _QUANT_ROWS.get() if self.native is not None else None
        if choice is None or choice.total != x.shape[0]:
            # a step nobody described: its row count decides
            if x.shape[0] <= QUANT_MAX_ROWS:
                return self._quantized(x, bias)
            return self._prompt(x, bias)
        if choice.rows is None:
            return self._quantized(x, bias)
        out = self._prompt(x, bias)
        if len(choice.rows):  # NOTE: a mixed step: decode rows beside prompt tokens
            out[choice.rows] = self._quantized(x[choice.rows], bias)
        return out

    def _prompt(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Prompt rows: the dense copy's GEMM, or without it weft's float32 product of the
        quantized weight, which gives a row the same bits in any product (one row included)."""
        if self.dense is None:
            assert self.native is not None
            run = self.native.prompt_int4 if self.form == "int4" else self.native.prompt_int8
            out = run(x, self.packed, self.scales)
            return out if bias is None else out + bias
        if wants_f32(x):
            return f32_linear(x, self.dense, bias)
        if x.shape[0] == 1:
            # NOTE: torch multiplies a single row by another kernel, which rounds apart from that
            # row in a product of several (2 or more agree, wherever the row sits): a prompt's
            # last token recomputed after a cached prefix must get the bits of the whole prompt
            return F.linear(x.expand(2, -1), self.dense, bias)[:1]
        return F.linear(x, self.dense, bias)

    def _quantized(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.native is not None:
            run = self.native.int4 if self.form == "int4" else self.native.int8
            out = run(x, self.packed, self.scales)
        elif self.form == "int4":
            x = x.contiguous()  # NOTE: both torch kernels read x as a dense [M, K] matrix
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, INT4_GROUP, self.scales
            )
        else:
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.packed, self.scales)
        return out if bias is None else out + bias


class QuantLoading:
    """Linear modules whose weight may arrive quantized, one shard (row block) at a time: GGUF
    leaves (QUANT_LEAVES) or an FP8 checkpoint's e4m3 weight and its scales (FP8_LEAVES)."""

    weight: torch.Tensor | QuantWeight | FP8Weight
    quantize: bool  # whether quantization 'fp8' may quantize this dense weight at load
    _quant_parts: dict[tuple[int, str], torch.Tensor]

    def load_quant(self, leaf: str, shard: int, n_shards: int, tensor: torch.Tensor) -> bool:
        """Keep one stored leaf of one shard; once all arrived, swap the dense weight for a
        QuantWeight. Returns True when the weight is complete."""
        parts = self.__dict__.setdefault("_quant_parts", {})
        parts[(shard, leaf)] = tensor
        form = "int4" if parts.get((0, "qweight"), tensor).dtype == torch.uint8 else "int8"
        leaves = _FORM_LEAVES[form]
        if any((s, name) not in parts for s in range(n_shards) for name in leaves):
            return False
        merged = {name: torch.cat([parts[(s, name)] for s in range(n_shards)]) for name in leaves}
        target = self.weight
        assert isinstance(target, torch.Tensor)
        quant = QuantWeight(form, merged, target.dtype)
        self._swap_weight(quant, quant.out_features, quant.in_features)
        parts.clear()
        return True

    def load_fp8(
        self,
        leaf: str,
        shard: int,
        n_shards: int,
        tensor: torch.Tensor,
        *,
        name: str,
        spec: Fp8Checkpoint,
    ) -> bool:
        """Keep one shard's e4m3 `weight` or its scale (spec.scale_name); once every shard has
        both, swap the dense weight for an FP8Weight. Returns True when the weight is complete."""
        want = spec.scale_name
        if leaf not in ("weight", want):
            raise ValueError(f"{name}: unexpected in a {spec.method} checkpoint (scales: {want})")
        if leaf == "weight" and tensor.dtype != FP8_DTYPE:
            raise ValueError(f"{name}: dtype {tensor.dtype} among float8_e4m3fn shards")
        parts = self.__dict__.setdefault("_quant_parts", {})
        parts[(shard, leaf)] = tensor
        names = self.__dict__.setdefault("_fp8_names", {})
        names[shard] = name.removesuffix("." + leaf)
        if any((s, x) not in parts for s in range(n_shards) for x in ("weight", want)):
            return False
        weight, scale, group = merge_shards(
            [parts[(s, "weight")] for s in range(n_shards)],
            [parts[(s, want)] for s in range(n_shards)],
            spec.block,
            [names[s] for s in range(n_shards)],
            scale_name=want,
        )
        target = self.weight
        assert isinstance(target, torch.Tensor)
        fp8 = FP8Weight(weight, scale, group, dtype=target.dtype, origin="checkpoint")
        what = " + ".join(names[s] for s in range(n_shards))
        self._swap_weight(fp8, fp8.out_features, fp8.in_features, what)
        parts.clear()
        names.clear()
        return True

    def pending_quant(self) -> list[str]:
        """The leaves of shards that arrived without the rest of their weight."""
        parts = self.__dict__.get("_quant_parts", {})
        return [f"shard {shard} {leaf}" for shard, leaf in sorted(parts)]

    def quantize_fp8(self, block: tuple[int, int] | None = None) -> FP8Weight:
        """Replace the loaded dense weight by its e4m3 form (per row, or per block)."""
        target = self.weight
        assert isinstance(target, torch.Tensor)
        qweight, scale = quantize_weight(target.data, block)
        group = (1, target.shape[1]) if block is None else block
        fp8 = FP8Weight(qweight, scale, group, dtype=target.dtype, origin="load")
        self._swap_weight(fp8, fp8.out_features, fp8.in_features)
        return fp8

    def dequantize_fp8(self) -> None:
        """Replace an FP8Weight by the dense weight it holds (quantization 'none')."""
        fp8 = self.weight
        assert isinstance(fp8, FP8Weight)
        del self.weight  # type: ignore[misc]  # the FP8Weight submodule
        self.weight = nn.Parameter(fp8.dense(), requires_grad=False)

    def _swap_weight(
        self, quant: QuantWeight | FP8Weight, out: int, inp: int, what: str = "quantized weight"
    ) -> None:
        target = self.weight
        assert isinstance(target, torch.Tensor)
        if (out, inp) != tuple(target.shape):
            raise ValueError(f"{what} is [{out}, {inp}], expected {list(target.shape)}")
        del self.weight  # type: ignore[misc]  # the dense Parameter: never filled
        self.weight = quant


class SlicedLoading(ABC):
    """A layer whose parameters hold its rank's slice of the checkpoint's full tensors: it loads
    each of them itself (LlamaForCausalLM.load_weights hands them over by leaf name)."""

    @abstractmethod
    def load_param(self, leaf: str, tensor: torch.Tensor, name: str) -> None:
        """Keep this rank's part of `tensor`, the checkpoint's full parameter `leaf` (its
        checkpoint name: `name`)."""


class ColumnLinear(QuantLoading, nn.Module):
    """y = x W^T (+ b), W stored as several row blocks (shards) loaded one at a time.

    A shard given as a RankSlice (tensor parallelism) keeps only those rows of the checkpoint's
    shard, its bias too: y holds this rank's slice of each shard's outputs, side by side.
    """

    def __init__(
        self,
        in_features: int,
        shards: Sequence[int | RankSlice],
        bias: bool,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.quantize = True
        self.shards = [s if isinstance(s, RankSlice) else RankSlice.whole(s) for s in shards]
        self.shard_sizes = [s.size for s in self.shards]
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shards))]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None
        )

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        target = self.weight if param_name == "weight" else self.bias
        if not isinstance(target, torch.Tensor):  # None, or a weight already quantized
            raise ValueError(f"unexpected {param_name} for a linear without a dense one")
        what = f"{param_name} shard {shard}"
        rows = self.shards[shard].take(tensor, 0, what)
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        _copy_checked(target.data[start : start + size], rows, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowLinear(QuantLoading, SlicedLoading, nn.Module):
    """y = x W^T (+ b), row-parallel over `tp`: x arrives split along `in` (a ColumnLinear's
    slice of outputs, through per-row ops), each rank multiplies its columns of W, and the
    partial products are summed over the ranks; the bias is added once, after the sum.

    tp SINGLE: a plain linear (a MoE router, replicated on every rank). quantize False: a weight
    quantization 'fp8' leaves dense (a MoE router).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        *,
        quantize: bool = True,
        bias: bool = False,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        self.quantize = quantize
        self.tp = tp
        self.inputs = tp.split(in_features, what="a row-parallel linear's in_features")
        self.weight = nn.Parameter(
            torch.empty(out_features, self.inputs.size, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def load_param(self, leaf: str, tensor: torch.Tensor, name: str) -> None:
        target = self.weight if leaf == "weight" else self.bias
        if not isinstance(target, torch.Tensor):  # a weight already quantized
            raise ValueError(f"unexpected {name!r} for a linear without a dense {leaf}")
        if leaf == "weight":
            tensor = self.inputs.take(tensor, 1, name)
        _copy_checked(target.data, tensor, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    # Gemma: the scale is 1 + weight, applied in float32 before the cast back (GemmaRMSNorm)
    unit_offset = False

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); the sum is the next residual.
        fused: one Triton kernel (CUDA) instead of the torch ops below."""
        if fused:
            from weft.kernels.rmsnorm import rmsnorm

            return rmsnorm(x, self.weight, self.eps, residual, unit_offset=self.unit_offset)
        if residual is not None:
            x = x + residual
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype), x
        return self.weight * normed.to(x.dtype), x

    def per_head(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """x [T, heads, head_dim] (a strided view is fine) -> each head normed, a new tensor of
        the same shape (Qwen3's q/k norm; the weight is [head_dim])."""
        # NOTE: reshape copies a strided view of qkv: the fused kernel takes rows of one stride
        normed, _ = self(x.reshape(-1, x.shape[-1]), None, fused)
        return normed.view(x.shape)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: norm(x) * (1 + weight), the product taken in float32 before the cast back
    (Llama casts first, then multiplies by the weight itself). Checkpoints store weight - 1
    (zero-initialised), so the weight alone is not the scale; fused: the Triton RMSNorm's
    unit_offset variant.
    """

    unit_offset = True


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float64), with Llama-3.1 or linear scaling."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_ctx / low, inv / factor, blended)
        return torch.where(wavelen < old_ctx / high, inv, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, linear)")


@dataclass(frozen=True)
class RopeStep:
    """Either cos, sin [T, 1, head_dim] gathered for the step's positions and laid out for a
    whole head, (cos, cos) and (-sin, sin) (torch path), or the whole tables
    [max_pos, head_dim / 2] plus the positions (the fused Triton kernel)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None


def silu_and_mul(x: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    if fused:
        from weft.kernels.activation import silu_and_mul as fused_silu_and_mul

        return fused_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> gelu_tanh(gate) * up [T, I] (Gemma's gelu_pytorch_tanh).
    fused: the Triton activation kernel's GELU variant (CUDA)."""
    if fused:
        from weft.kernels.activation import silu_and_mul as fused_act_and_mul

        return fused_act_and_mul(x, gelu_tanh=True)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# config.json's hidden_act / hidden_activation -> the gated MLP's activation
GATED_ACTIVATIONS = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
}


class Rotary(nn.Module):
    """Rotate-half RoPE (the HF layout) over precomputed cos/sin tables."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.head_dim = head_dim

    def lookup(self, positions: torch.Tensor, fused: bool = False) -> RopeStep:
        """A step's angles (looked up once, used by every layer)."""
        if fused:
            return RopeStep(self.cos, self.sin, positions)
        cos, sin = self.cos[positions], self.sin[positions]  # [T, head_dim / 2]
        whole = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return RopeStep(whole[0].unsqueeze(1), whole[1].unsqueeze(1), None)

    @staticmethod
    def rotate(x: torch.Tensor, step: RopeStep) -> torch.Tensor:
        """x: [T, heads, head_dim] -> same shape and dtype (fused: rotated in place)."""
        if step.positions is not None:
            from weft.kernels.rotary import apply_rotary

            return apply_rotary(x, step.cos, step.sin, step.positions, out=x)
        # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) as x * (cos, cos) + (x2, x1) * (-sin, sin):
        # the same roundings as the halves apart, in six ops instead of ten
        x32 = x.float()
        half = x.shape[-1] // 2
        out = (x32 * step.cos).add_(x32.roll(half, dims=-1).mul_(step.sin))
        return out.to(x.dtype)


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype == FP8_DTYPE and target.dtype != FP8_DTYPE:
        # NOTE: copy_ would widen the e4m3 values without their scales: wrong weights, silently
        raise ValueError(f"{what}: a float8_e4m3fn tensor where weft holds no FP8 weight")
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"{what}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
    target.copy_(tensor)


def load_plain(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy `tensor` into a parameter (or a view of one, such as an expert's rows)."""
    _copy_checked(param.data, tensor, name)
