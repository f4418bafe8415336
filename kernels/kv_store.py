"""Write the new tokens' K and V into one layer of the paged KV pool.

Grid (T,): program t copies k[t] and v[t] ([Hkv, D] each) to slot out_cache_loc[t] of the
buffers. Slots, not positions: the paged layout does not matter here. Into FP8 (e4m3) buffers it
stores k / k_scale and v / v_scale, saturated to +-448 (runtime/kv_pool.py, `quantize_kv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_shape,
    check_tensor,
    next_pow2,
)
from weft.runtime.kv_pool import quantize_kv
from weft.runtime.models.fp8 import FP8_DTYPE, FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # stored values saturate there


@triton.jit
def _kv_store_kernel(
    k,  # [T, Hkv, D]
    v,
    k_buf,  # [slots, Hkv, D]
    v_buf,
    out_cache_loc,  # [T]
    inv_k_scale,  # 1 / k_scale (FP8 buffers only)
    inv_v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the buffers are e4m3
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(out_cache_loc + t).to(tl.int64)  # int64: slot * stride can pass 2^31
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = offs_h[:, None] * stride_kh + offs_d[None, :]
    dst = offs_h[:, None] * stride_kbh + offs_d[None, :]
    k_tile = tl.load(k + t * stride_kt + src, mask=mask)
    if FP8:
        k_tile = tl.clamp(k_tile.to(tl.float32) * inv_k_scale, -_FP8_MAX, _FP8_MAX)
    tl.store(k_buf + slot * stride_kbs + dst, k_tile.to(k_buf.dtype.element_ty), mask=mask)
    src = offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = offs_h[:, None] * stride_vbh + offs_d[None, :]
    v_tile = tl.load(v + t * stride_vt + src, mask=mask)
    if FP8:
        v_tile = tl.clamp(v_tile.to(tl.float32) * inv_v_scale, -_FP8_MAX, _FP8_MAX)
    tl.store(v_buf + slot * stride_vbs + dst, v_tile.to(v_buf.dtype.element_ty), mask=mask)


def kv_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k_buffer[out_cache_loc] = k; v_buffer[out_cache_loc] = v, in place.

    k/v [T, Hkv, D] (token and head strides free, e.g. views of a fused qkv output),
    buffers [slots, Hkv, D] of k's dtype or float8_e4m3fn (then k / k_scale and v / v_scale go
    in), out_cache_loc [T] int32/int64 (distinct slots).
    """
    dev = k.device
    check_tensor("k", k, 3, FLOAT_DTYPES, dev)
    check_tensor("v", v, 3, (k.dtype,), dev)
    check_tensor("k_buffer", k_buffer, 3, (k.dtype, FP8_DTYPE), dev)
    check_tensor("v_buffer", v_buffer, 3, (k_buffer.dtype,), dev)
    check_tensor("out_cache_loc", out_cache_loc, 1, INDEX_DTYPES, dev)
    num_tokens, num_heads, head_dim = k.shape
    check_shape("v", v, (num_tokens, num_heads, head_dim))
    check_shape("v_buffer", v_buffer, tuple(k_buffer.shape))
    check_shape("k_buffer", k_buffer, (k_buffer.shape[0], num_heads, head_dim))
    check_shape("out_cache_loc", out_cache_loc, (num_tokens,))
    if num_tokens == 0:
        return
    _kv_store_kernel[(num_tokens,)](
        k,
        v,
        k_buffer,
        v_buffer,
        out_cache_loc,
        1.0 / k_scale,
        1.0 / v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim),
        FP8=k_buffer.dtype == FP8_DTYPE,
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )


def kv_store_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The torch twin (what AttentionBackend.store_kv does)."""
    k_buffer[out_cache_loc] = quantize_kv(k, k_scale, k_buffer.dtype)
    v_buffer[out_cache_loc] = quantize_kv(v, v_scale, v_buffer.dtype)
