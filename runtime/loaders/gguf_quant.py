"""GGUF blocks -> the two weight-only forms weft's CPU matmuls take (numpy, at conversion time).

    form  GGUF types               stored (per linear weight [N, K])                   exact?
    int4  Q4_0, Q4_1, Q4_K         qweight u8 [N, K/2] (k even: low nibble, odd: high), yes (*)
                                   qscale, qzero f32 [N, K/32];
                                   w = (q - 8) * scale + zero
    int8  Q5_0, Q5_1, Q5_K, Q6_K,  qweight i8 [N, K], qscale f32 [N]; w = q * scale     no
          Q8_0

(*) every GGUF int4 type is an affine map of q in 0..15 per group of 32 (Q4_K: 8 sub-blocks of
32 per super-block, scale d * sc, offset -dmin * m), so the groups carry over exactly; the
runtime rounds scale and zero to bfloat16 (torch's int4 kernel takes them so).

int8: torch's int8 CPU matmul has one scale per output channel, the GGUF types one per block of
32 (Q6_K: 16), so these are dequantized and requantized per row (absmax / 127); the added error
is measured in tests/test_quantized.py. Q5_0 is here because llama.cpp's Q4_K_M falls back to it
for every tensor whose input size is not a multiple of 256 (Qwen2.5-0.5B: all but ffn_down).
"""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
GROUP = 32  # the int4 form's group size along K
INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
INT8_TYPES = (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0)
DENSE_TYPES = (T.F32, T.F16, T.BF16)


def form_of(qtype: gguf.GGMLQuantizationType) -> str | None:
    """'int4', 'int8' or 'dense' for a linear weight of this GGUF type; None: not servable."""
    if qtype in INT4_TYPES:
        return "int4"
    if qtype in INT8_TYPES:
        return "int8"
    if qtype in DENSE_TYPES:
        return "dense"
    return None


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the 16 low nibbles, then the 16 high ones (ggml)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def int4_groups(rows: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, ...]:
    """Raw GGUF rows [N, row_bytes] -> (q u8 [N, K] in 0..15, scale f32 [N, K/32],
    zero f32 [N, K/32]) with w = (q - 8) * scale + zero, exactly the GGUF dequantization."""
    n = rows.shape[0]
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = np.ascontiguousarray(rows).reshape(-1, type_size)
    nb = blocks.shape[0]
    if qtype == T.Q4_0:  # d f16, 16 bytes of nibbles; w = d * (q - 8)
        scale = _f16(blocks[:, 0:2])
        zero = np.zeros_like(scale)
        q = _nibbles(blocks[:, 2:18])
    elif qtype == T.Q4_1:  # d f16, m f16, 16 bytes; w = d * q + m
        scale = _f16(blocks[:, 0:2])
        zero = _f16(blocks[:, 2:4]) + 8 * scale
        q = _nibbles(blocks[:, 4:20])
    elif qtype == T.Q4_K:  # d, dmin f16, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scale = d * sc.astype(np.float32)  # [nb, 8]
        zero = 8 * scale - dmin * mn.astype(np.float32)
        # each 32-byte chunk holds sub-block 2i in its low nibbles, 2i + 1 in its high ones
        qs = blocks[:, 16:144].reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(
            1, 1, 2, 1
        )
        q = (qs & 0x0F).reshape(nb, 256)
    else:
        raise ValueError(f"{qtype.name} is not an int4 GGUF type")
    return q.reshape(n, -1), scale.reshape(n, -1), zero.reshape(n, -1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q u8 [N, K] in 0..15 -> [N, K/2]: even k in the low nibble, odd k in the high one."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def int4_from_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dequantized rows f32 [N, K] -> the int4 groups of `int4_groups` (asymmetric min..max
    per group of 32): lossy, for the lm_head only (see _LM_HEAD_INT4 in gguf_convert)."""
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    scale = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    q = np.clip(np.rint((groups - lo[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    return q.reshape(n, k), scale, (lo + 8 * scale).astype(np.float32)


def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dequantized rows f32 [N, K] -> (q i8 [N, K], scale f32 [N]): symmetric, per row."""
    absmax = np.abs(w).max(axis=1)
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale
