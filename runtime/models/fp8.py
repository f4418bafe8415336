"""FP8 (e4m3) linear weights: the weight [out, in] in float8_e4m3fn, float32 scales, and the
matmuls that read it.

    form     scale shape                      groups (rows x cols a scale covers)
    channel  [out, 1]                         1 x in   (one scale per output row)
    block    [ceil(out/bn), ceil(in/bk)]      bn x bk  (DeepSeek / Qwen3 checkpoints: 128 x 128)

w = qweight.float() * scale[row // group_n, col // group_k]. A per-tensor checkpoint scale is
held as the channel form (each row the tensor's scale); a block form whose merged shards do not
start on a block boundary as blocks of 1 x bk (each row its own copy of its block's scales).

How a step of M rows multiplies (`FP8Weight.path` picks once, at construction):

    path       where                           activations (CUDA: kernels/fp8_quant.py)
    scaled_mm  channel form, torch._scaled_mm  quantized per row (amax / 448) to e4m3, rowwise
               takes e4m3 rowwise (CUDA sm89+, scales [M, 1] x [1, out] on cuBLAS (CPU: torch's
               torch 2.13's CPU)                reference kernel)
    triton     block form (or channel where    quantized per row and 128-column group; the
               scaled_mm is missing), CUDA     Triton kernel (kernels/fp8_matmul.py) applies both
               sm89+ with Triton               scales per K block
    dequant    anywhere else                   none: the weight is dequantized to the activation
                                               dtype on every call, then F.linear (slow, correct)

and on CUDA with Triton, whatever the path: one-row steps go through the weight-only GEMV (bf16
activations x e4m3 weights widened in registers) unless FP8_GEMV_ONE_ROW is off, and steps of 2
to FP8_ROWS_MAX_ROWS rows (decode batches, bf16 / fp16 activations) through the weight-only
split-K matmul (kernels/fp8_matmul.py): no activation quantization.

NOTE: torch 2.13's CPU _scaled_mm refuses block scales (F.scaled_mm with BlockWise1x128 /
BlockWise128x128 raises "Invalid scaling configuration": TensorWise and RowWise only). Newer
CUDA builds list those recipes for sm90; weft does not rely on them (unmeasured here): the block
form runs the Triton kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("weft")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# NOTE: a row of zeros must not give a zero scale (x / 0): its amax is clamped to this first
MIN_AMAX = 1e-12
BLOCK = 128  # the activation group along K of the block form (the weights' block size there)
# NOTE: whether one-row steps (batch-1 decode) use the weight-only GEMV on CUDA rather than the
# scaled matmul (which quantizes x first and runs a cuBLAS tile sized for M >= 16). Both read the
# weights once; True is a guess: measure `bench_kernels.py --fp8` (fp8 gemv vs scaled_mm M=1)
# and bench_one_batch --quantization fp8 --batch-sizes 1 with it on and off, on the GPU
FP8_GEMV_ONE_ROW = True
# Steps of 2 to this many rows take the weight-only split-K matmul (fp8_rows_matmul). Measured on
# an H100 (dummy Llama-3.1-8B, bench_one_batch): batch 16 decodes 5 % faster through it than
# through torch._scaled_mm, batch 64 29 % slower; per layer the two are even at 32 rows
# (bench_kernels.py --fp8-rows, benchmarks/RESULTS.md).
FP8_ROWS_MAX_ROWS = 16
HAS_TRITON = importlib.util.find_spec("triton") is not None


def quantize_weight(
    weight: torch.Tensor, block: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (e4m3 [out, in], float32 scales): per output row (block None, scales
    [out, 1]) or per bn x bk block (scales [ceil(out/bn), ceil(in/bk)]), amax / 448 each."""
    w = weight.float()
    n, k = w.shape
    if block is None:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    bn, bk = block
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))  # zeros do not change a block's amax
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(padded.shape)[:n, :k].to(FP8_DTYPE).contiguous(), scale


def expand_scales(
    scale: torch.Tensor, group: tuple[int, int], shape: tuple[int, int]
) -> torch.Tensor:
    """Scales [ceil(out/gn), ceil(in/gk)] -> one per element [out, in] (float32)."""
    n, k = shape
    gn, gk = group
    return scale.repeat_interleave(gn, dim=0)[:n].repeat_interleave(gk, dim=1)[:, :k]


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
    """e4m3 [out, in] and its scales -> float32 [out, in]."""
    n, k = qweight.shape
    return qweight.float() * expand_scales(scale.float(), group, (n, k))


def quantize_rows(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation scales: x [M, K] -> (e4m3 [M, K], float32 scales [M, 1] per row, or
    [M, ceil(K/group)] per row and group of `group` columns). No host sync: CUDA graphs capture
    it."""
    m, k = x.shape
    xf = x.float()
    if group is None:
        scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    padded = F.pad(xf, (0, -k % group)).view(m, -1, group)
    scale = padded.abs().amax(dim=2).clamp(min=MIN_AMAX) / FP8_MAX  # [M, G]
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return q.to(FP8_DTYPE), scale


@functools.cache
def scaled_mm_support(device: torch.device) -> str | None:
    """None where torch._scaled_mm multiplies e4m3 with rowwise scales on `device`, else why not
    (probed once per device with a 16 x 16 product: it runs at load, where a sync costs nothing).
    """
    a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
    ones = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return f"torch._scaled_mm has no rowwise e4m3 on {device}: {str(exc).splitlines()[0]}"
    return None


def _triton_support(device: torch.device) -> str | None:
    """None where the Triton FP8 kernels run on `device`, else why not."""
    if device.type != "cuda":
        return f"the Triton FP8 kernels run on CUDA, not {device.type}"
    if not HAS_TRITON:
        return "Triton is not installed"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "e4m3 dot products need a GPU of compute capability 8.9 or later"
    return None


class FP8Weight(nn.Module):
    """A linear weight [out, in] held in e4m3 with float32 scales (see the module's table).

    origin: "checkpoint" (published FP8 weights) or "load" (quantized from dense ones at load).
    NOTE: the path is chosen for the device the weight is built on: build it there, not on the
    CPU and then moved.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        group: tuple[int, int],
        *,
        dtype: torch.dtype,
        origin: str,
    ):
        super().__init__()
        n, k = qweight.shape
        gn, gk = group
        if qweight.dtype != FP8_DTYPE:
            raise ValueError(f"FP8 weight: dtype {qweight.dtype}, expected {FP8_DTYPE}")
        want = (-(-n // gn), -(-k // gk))
        if tuple(scale.shape) != want:
            raise ValueError(
                f"FP8 weight [{n}, {k}] in groups of {gn} x {gk}: scales {tuple(scale.shape)}, "
                f"expected {want}"
            )
        self.out_features, self.in_features = n, k
        self.group = (gn, min(gk, k))
        self.form = "channel" if self.group == (1, k) else "block"
        self.dtype = dtype
        self.origin = origin
        self.qweight: torch.Tensor  # [out, in] row-major: .t() is the column-major operand
        self.scale: torch.Tensor
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.path, self.why = self._choose_path(qweight.device)
        # CUDA sm89+ with Triton: activations quantized in one kernel, and the batch-1 GEMV
        # where its K tiles (powers of two) fit the scale groups
        self.triton = _triton_support(qweight.device) is None
        gk = self.group[1]
        self.gemv = self.triton and (gk == k or (gk >= 16 and gk & (gk - 1) == 0))
        # the split-K matmul: 16-bit activations, K tiles of BLOCK inside each scale group
        sixteen = dtype in (torch.bfloat16, torch.float16)
        self.rows = self.triton and sixteen and (gk == k or gk % BLOCK == 0)

    def _choose_path(self, device: torch.device) -> tuple[str, str]:
        """(path, the reason for it): see the module's table."""
        n, k = self.out_features, self.in_features
        triton_missing = _triton_support(device)
        if self.form == "channel":
            missing = scaled_mm_support(device)
            if self.dtype != torch.bfloat16:
                missing = f"rowwise torch._scaled_mm writes bfloat16, not {self.dtype}"
            if missing is None and n % 16 == 0 and k % 16 == 0:
                return "scaled_mm", "rowwise-scaled torch._scaled_mm"
            why = missing or f"torch._scaled_mm needs in and out multiples of 16, got [{n}, {k}]"
        else:
            why = f"torch._scaled_mm takes no {self.group[0]} x {self.group[1]} block scales here"
        if triton_missing is None and self.group[1] in (BLOCK, k):
            return "triton", "the Triton FP8 matmul"
        if triton_missing is None:
            why = f"the Triton FP8 matmul takes blocks of {BLOCK} columns, not {self.group[1]}"
        else:
            why = f"{why}; {triton_missing}"
        return "dequant", f"dequantized on every call ({why})"

    def dense(self) -> torch.Tensor:
        """The weight dequantized to the activation dtype, [out, in]."""
        return dequantize(self.qweight, self.scale, self.group).to(self.dtype)

    def _quantize(self, x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.triton:
            from weft.kernels.fp8_quant import quantize_rows_fp8

            return quantize_rows_fp8(x if x.stride(-1) == 1 else x.contiguous(), group)
        return quantize_rows(x, group)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, in] -> [M, out] in the activation dtype. No host sync, no branch on values."""
        if self.gemv and FP8_GEMV_ONE_ROW and x.shape[0] == 1:
            from weft.kernels.fp8_matmul import fp8_gemv  # NOTE: here: Triton may be missing

            return fp8_gemv(x.contiguous(), self.qweight, self.scale, self.group, bias)
        if self.rows and 1 < x.shape[0] <= FP8_ROWS_MAX_ROWS:
            from weft.kernels.fp8_matmul import fp8_rows_matmul

            out = fp8_rows_matmul(x.contiguous(), self.qweight, self.scale, self.group)
            return out if bias is None else out + bias
        return self.matmul_path(x, bias)

    def matmul_path(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`matmul` through `self.path` at any number of rows (no GEMV for one)."""
        if self.path == "scaled_mm":
            xq, xs = self._quantize(x, None)
            out = torch._scaled_mm(
                xq,
                self.qweight.t(),
                scale_a=xs,
                scale_b=self.scale.view(1, -1),
                out_dtype=self.dtype,
            )
        elif self.path == "triton":
            from weft.kernels.fp8_matmul import fp8_matmul

            xq, xs = self._quantize(x, None if self.group[1] == self.in_features else BLOCK)
            out = fp8_matmul(xq, xs, self.qweight, self.scale, self.group, out_dtype=self.dtype)
        else:
            return F.linear(x, self.dense(), bias)
        return out if bias is None else out + bias


def merge_shards(
    weights: list[torch.Tensor],
    scales: list[torch.Tensor],
    block: tuple[int, int] | None,
    names: list[str],
    *,
    scale_name: str,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """A merged linear's FP8 shards (row blocks, e.g. q, k, v) -> (e4m3 [out, in], scales, group).

    block None: each shard's scale is per tensor ([] or [1]) or per row ([rows] or [rows, 1]);
    else block scales [ceil(rows/bn), ceil(in/bk)]. Block scales concatenate only where every
    shard but the last has whole blocks of rows; otherwise each row gets its block's scales
    (groups of 1 x bk), which costs in / bk floats a row.
    """
    rows: list[torch.Tensor] = []
    k = weights[0].shape[1]
    for w, s, name in zip(weights, scales, names, strict=True):
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"{name}: FP8 weight of shape {tuple(w.shape)}, expected [*, {k}]")
        n = w.shape[0]
        if block is None:
            if s.numel() == 1:
                rows.append(s.float().reshape(1, 1).expand(n, 1))
            elif s.numel() == n and s.dim() in (1, 2):
                rows.append(s.float().reshape(n, 1))
            else:
                raise ValueError(
                    f"{name}: {scale_name} of shape {tuple(s.shape)} for a weight [{n}, {k}]: "
                    "expected one per tensor or one per output row"
                )
            continue
        bn, bk = block
        want = (-(-n // bn), -(-k // bk))
        if tuple(s.shape) != want:
            raise ValueError(
                f"{name}: {scale_name} of shape {tuple(s.shape)} for a weight [{n}, {k}] "
                f"in {bn} x {bk} blocks: expected {want}"
            )
        rows.append(s.float())
    weight = torch.cat(weights)
    if block is None:
        return weight, torch.cat(rows), (1, k)
    bn, bk = block
    if all(w.shape[0] % bn == 0 for w in weights[:-1]):
        return weight, torch.cat(rows), block
    per_row = [
        s.repeat_interleave(bn, dim=0)[: w.shape[0]] for s, w in zip(rows, weights, strict=True)
    ]
    return weight, torch.cat(per_row), (1, bk)
