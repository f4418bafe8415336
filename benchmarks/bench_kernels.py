"""Time the Triton kernels of weft.kernels at Llama-3-8B shapes on a CUDA GPU.

    python benchmarks/bench_kernels.py [--dtype bfloat16]

Each row: the median time (triton.testing.do_bench) of eager calls and of CUDA-graph replays
(device time without the host's launch overhead), the fewest bytes the kernel must move (inputs
read once, outputs written once) over the graph time, next to the device's copy bandwidth
measured in the same run; attention rows also give TFLOP/s next to a measured bf16 matmul rate.
`--sweep` times the attention kernels' tile settings instead.
The masked_sample rows take fp32 logits at the Llama-3 and Qwen2 vocabularies, whatever --dtype
(`--sampling`: those rows only).
The torch column times the torch twin / the code the model runs without the kernel (FP8 rows:
the same layer in bfloat16; `--fp8`: those rows only).
Inputs are random (never zeros) and sized well past the L2 cache where the shape allows.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from common import describe_device

# Llama-3-8B
HQ, HKV, D, HIDDEN, INTER = 32, 8, 128, 4096, 14336


@dataclass
class Row:
    name: str
    shape: str
    ms: float
    bytes_moved: int
    flops: int = 0
    torch_ms: float | None = None
    graph_ms: float | None = None
    host_us: float | None = None


def bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def bench_graph(fn: Callable[[], object]) -> float:
    """Median time of `fn` replayed from a CUDA graph: the device time without the host's launch
    overhead (Python wrapper, argument checks, Triton's launcher)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def host_us(fn: Callable[[], object], calls: int = 100) -> float:
    """Host time per call (wrapper checks, allocations, launches) of back-to-back calls: where it
    exceeds the device time, eager calls are host-bound and need a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def timed(name: str, shape: str, fn: Callable[[], object], bytes_moved: int, **kw: Any) -> Row:
    return Row(
        name, shape, bench(fn), bytes_moved, graph_ms=bench_graph(fn), host_us=host_us(fn), **kw
    )


def copy_gbps(dev: torch.device) -> float:
    src = torch.randn(256 * 2**20, device=dev)  # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / bench(lambda: dst.copy_(src)) / 1e6


def matmul_tflops(dev: torch.device) -> float:
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    return 2 * 8192**3 / bench(lambda: a @ b) / 1e9


def paged_pool(
    seq_lens: list[int], dtype: torch.dtype, dev: torch.device, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k/v buffers [slots, Hkv, D] and req_to_token [B, max_len] over shuffled slots."""
    total, width = sum(seq_lens), max(seq_lens)
    k_buf = torch.randn((total + 1, HKV, D), device=dev, dtype=dtype, generator=g)
    v_buf = torch.randn((total + 1, HKV, D), device=dev, dtype=dtype, generator=g)
    slots = torch.randperm(total, device=dev, generator=g) + 1
    table = torch.zeros((len(seq_lens), width), dtype=torch.int64, device=dev)
    start = 0
    for b, n in enumerate(seq_lens):
        table[b, :n] = slots[start : start + n]
        start += n
    return k_buf, v_buf, table


def decode_case(
    batch: int, seq: int, dtype: torch.dtype, dev: torch.device, g: torch.Generator
) -> Row:
    import torch.nn.functional as F

    from weft.kernels.decode_attention import decode_attention, default_num_kv_splits

    lens = [seq] * batch
    k_buf, v_buf, table = paged_pool(lens, dtype, dev, g)
    q = torch.randn((batch, HQ, D), device=dev, dtype=dtype, generator=g)
    idx = torch.arange(batch, device=dev)
    seq_lens = torch.tensor(lens, device=dev)
    scale = 1 / math.sqrt(D)
    splits = default_num_kv_splits(batch, HKV, seq, dev)

    def triton_fn() -> object:
        return decode_attention(q, k_buf, v_buf, table, idx, seq_lens, scale, num_kv_splits=splits)

    def torch_fn() -> object:  # what TorchAttention does for a decode step
        keys = k_buf[table].transpose(1, 2)  # [B, Hkv, L, D]
        values = v_buf[table].transpose(1, 2)
        return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, enable_gqa=True)

    kv_bytes = 2 * batch * seq * HKV * D * dtype.itemsize + batch * seq * 8  # K, V, table
    qo_bytes = 2 * batch * HQ * D * dtype.itemsize
    return timed(
        "decode_attention",
        f"B={batch} L={seq} S={splits}",
        triton_fn,
        kv_bytes + qo_bytes,
        flops=4 * batch * HQ * seq * D,
        torch_ms=bench(torch_fn),
    )


def extend_case(
    prefix: list[int], ext: list[int], dtype: torch.dtype, dev: torch.device, g: torch.Generator
) -> Row:
    from weft.kernels.extend_attention import extend_attention

    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    k_buf, v_buf, table = paged_pool(lens, dtype, dev, g)
    q = torch.randn((sum(ext), HQ, D), device=dev, dtype=dtype, generator=g)
    idx = torch.arange(len(lens), device=dev)
    qo_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64, device=dev)
    qo_indptr[1:] = torch.tensor(ext, device=dev).cumsum(0)
    prefix_t = torch.tensor(prefix, device=dev)
    scale, longest = 1 / math.sqrt(D), max(ext)

    def triton_fn() -> object:
        return extend_attention(q, k_buf, v_buf, table, idx, qo_indptr, prefix_t, longest, scale)

    # causal: query t of a request sees prefix + t + 1 keys
    pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix, ext, strict=True))
    moved = (2 * sum(ext) * HQ * D + 2 * sum(lens) * HKV * D) * dtype.itemsize
    shape = f"{len(lens)}x(prefix {prefix[0]} + {ext[0]})"
    return timed("extend_attention", shape, triton_fn, moved, flops=4 * HQ * D * pairs)


def bench_attention(dtype: torch.dtype, dev: torch.device, g: torch.Generator) -> list[Row]:
    rows = [decode_case(b, s, dtype, dev, g) for b, s in ((64, 4096), (1, 32768), (256, 1024))]
    for prefix, ext in (([0] * 4, [4096] * 4), ([3072] * 8, [1024] * 8)):
        rows.append(extend_case(prefix, ext, dtype, dev, g))
    return rows


def bench_elementwise(dtype: torch.dtype, dev: torch.device, g: torch.Generator) -> list[Row]:
    from weft.kernels.activation import silu_and_mul, silu_and_mul_ref
    from weft.kernels.kv_store import kv_store, kv_store_ref
    from weft.kernels.rmsnorm import rmsnorm, rmsnorm_ref
    from weft.kernels.rotary import apply_rotary, apply_rotary_ref
    from weft.runtime.models.layers import Rotary

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=dev, dtype=dtype, generator=g)

    size = dtype.itemsize
    rows = []

    tokens = 32768
    k, v = rand(tokens, HKV, D), rand(tokens, HKV, D)
    k_buf, v_buf = rand(4 * tokens, HKV, D), rand(4 * tokens, HKV, D)
    loc = torch.randperm(4 * tokens, device=dev, generator=g)[:tokens]
    rows.append(
        timed(
            "kv_store",
            f"T={tokens}",
            lambda: kv_store(k, v, k_buf, v_buf, loc),
            4 * tokens * HKV * D * size + tokens * 8,
            torch_ms=bench(lambda: kv_store_ref(k, v, k_buf, v_buf, loc)),
        )
    )

    tokens = 16384
    x, res = rand(tokens, HIDDEN), rand(tokens, HIDDEN)
    w = rand(HIDDEN)
    rows.append(
        timed(
            "rmsnorm+residual",
            f"T={tokens} H={HIDDEN}",
            lambda: rmsnorm(x, w, 1e-5, res),
            4 * tokens * HIDDEN * size,
            torch_ms=bench(lambda: rmsnorm_ref(x, w, 1e-5, res)),
        )
    )

    rot = Rotary(D, 131072, 500000.0, None)
    cos, sin = rot.cos.to(dev), rot.sin.to(dev)
    qkv = rand(tokens, (HQ + 2 * HKV) * D)
    qk = qkv[:, : (HQ + HKV) * D].view(tokens, HQ + HKV, D)
    pos = torch.randint(0, 131072, (tokens,), device=dev, generator=g)
    rows.append(
        timed(
            "rotary (q+k, in place)",
            f"T={tokens} H={HQ + HKV}",
            lambda: apply_rotary(qk, cos, sin, pos, out=qk),
            2 * tokens * (HQ + HKV) * D * size + tokens * D * 4,
            torch_ms=bench(lambda: apply_rotary_ref(qk, cos, sin, pos)),
        )
    )

    tokens = 8192
    gate_up = rand(tokens, 2 * INTER)
    rows.append(
        timed(
            "silu_and_mul",
            f"T={tokens} I={INTER}",
            lambda: silu_and_mul(gate_up),
            3 * tokens * INTER * size,
            torch_ms=bench(lambda: silu_and_mul_ref(gate_up)),
        )
    )
    return rows


# Llama-3-8B's linear layers [out, in]: qkv, o, gate_up, down
LINEARS = ((HQ + 2 * HKV) * D, HIDDEN), (HIDDEN, HQ * D), (2 * INTER, HIDDEN), (HIDDEN, INTER)


def bench_fp8(dev: torch.device, g: torch.Generator) -> list[Row]:
    """FP8 weights at batch 1: the weight-only GEMV (per channel, 128 x 128 blocks) and the
    channel form's scaled matmul at one row (FP8_GEMV_ONE_ROW picks between them), each beside
    weft's bf16 GEMV of the same layer (torch column); and the scaled matmul at 64 and 2048 rows
    beside bf16 F.linear. Bytes: the e4m3 weight, its scales, x and the output."""
    from weft.kernels.fp8_matmul import fp8_gemv
    from weft.runtime.models.fp8 import FP8Weight, quantize_weight
    from weft.runtime.models.layers import linear

    rows = []
    for n, k in LINEARS:
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device=dev, generator=g, dtype=torch.bfloat16)
        bf16_ms = bench_graph(lambda w=w, x=x: linear(x, w))
        shape = f"N={n} K={k}"
        for block in (None, (128, 128)):
            q, scale = quantize_weight(w, block)
            group = (1, k) if block is None else block
            moved = n * k + scale.numel() * 4 + 2 * (k + n)
            form = "channel" if block is None else "block"
            rows.append(
                timed(
                    f"fp8 gemv ({form})",
                    shape,
                    lambda q=q, s=scale, gr=group, x=x: fp8_gemv(x, q, s, gr),
                    moved,
                    torch_ms=bf16_ms,
                )
            )
        q, scale = quantize_weight(w, None)
        weight = FP8Weight(q, scale, (1, k), dtype=torch.bfloat16, origin="load")
        for m in (1, 64, 2048):
            xm = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            moved = n * k + n * 4 + 2 * m * (k + n)
            ref = (
                bf16_ms
                if m == 1
                else bench_graph(lambda w=w, xm=xm: torch.nn.functional.linear(xm, w))
            )
            rows.append(
                timed(
                    f"fp8 {weight.path} M={m}",
                    shape,
                    # NOTE: the path itself, not matmul(): that sends one row to the GEMV
                    lambda wt=weight, xm=xm: wt.matmul_path(xm, None),
                    moved,
                    flops=2 * m * n * k,
                    torch_ms=ref,
                )
            )
    return rows


def bench_fp8_rows(dev: torch.device, g: torch.Generator) -> list[Row]:
    """The channel form's matmul at decode batches (16-128 rows), by the ways it can run: the
    rowwise torch._scaled_mm as FP8Weight calls it (x @ w^T), the same swapped (w @ x^T, the
    rows padded to 16: cuBLAS then tiles the layer's outputs, not the few rows), and the Triton
    scaled matmul at a few tile widths (each including the quantization of x), and the
    weight-only split-K matmul FP8Weight takes up to FP8_ROWS_MAX_ROWS. torch column: bf16."""
    from weft.kernels.fp8_matmul import fp8_matmul, fp8_rows_matmul
    from weft.kernels.fp8_quant import quantize_rows_fp8
    from weft.runtime.models.fp8 import quantize_weight

    def swapped(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pad = -m % 16
        xq, xs = quantize_rows_fp8(F.pad(x, (0, 0, 0, pad)) if pad else x, None)
        out = torch._scaled_mm(
            q, xq.t(), scale_a=s.view(-1, 1), scale_b=xs.view(1, -1), out_dtype=torch.bfloat16
        )
        return out[:, :m].t().contiguous()

    def direct(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows_fp8(x, None)
        return torch._scaled_mm(
            xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16
        )

    def tiled(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
        xq, xs = quantize_rows_fp8(x, None)
        group = (1, x.shape[1])
        return fp8_matmul(xq, xs, q, s, group, block_m=bm, block_n=bn)

    rows = []
    for n, k in LINEARS:
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        q, scale = quantize_weight(w, None)
        shape = f"N={n} K={k}"
        for m in (16, 32, 64, 128):
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            moved = n * k + n * 4 + 2 * m * (k + n)
            ref = bench_graph(lambda w=w, x=x: F.linear(x, w))
            kw: dict[str, Any] = {"flops": 2 * m * n * k, "torch_ms": ref}
            want = F.linear(x.float(), q.float() * scale)  # (the weight dequantized)
            cases: list[tuple[str, Callable[[], torch.Tensor]]] = [
                ("scaled_mm", lambda q=q, s=scale, x=x: direct(q, s, x)),
                ("scaled_mm swapped", lambda q=q, s=scale, x=x: swapped(q, s, x)),
            ]
            for bn, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
                cases.append(
                    (
                        f"rows split-K {bn}/{warps}w",
                        lambda q=q, s=scale, x=x, k=k, bn=bn, w=warps: fp8_rows_matmul(
                            x, q, s, (1, k), block_n=bn, num_warps=w
                        ),
                    )
                )
            for bn in (32, 64, 128):
                bm = min(max(16, m), 64)
                cases.append(
                    (
                        f"triton {bm}x{bn}",
                        lambda q=q, s=scale, x=x, bm=bm, bn=bn: tiled(q, s, x, bm, bn),
                    )
                )
            for name, fn in cases:
                # (x in e4m3 costs the quantized ways a few percent; the split-K way reads it
                # as it is)
                err = (fn().float() - want).abs().max().item()
                assert err <= 0.05 * want.abs().max().item(), (name, shape, m, err)
                rows.append(timed(f"fp8 {name} M={m}", shape, fn, moved, **kw))
    return rows


def bench_fp8_prefill(dev: torch.device, g: torch.Generator) -> list[Row]:
    """The channel form's matmul at prompt sizes (512-8192 rows), where it is compute-bound: the
    rowwise torch._scaled_mm as FP8Weight calls it (x quantized per row first), its parts (the
    quantization alone; the product of x already in e4m3, with cuBLAS's fp32 accumulation and
    with its fast accumulation), and the Triton scaled matmul. torch column: bf16 F.linear."""
    from weft.kernels.fp8_matmul import fp8_matmul
    from weft.kernels.fp8_quant import quantize_rows_fp8
    from weft.runtime.models.fp8 import FP8Weight, quantize_weight

    rows = []
    for n, k in LINEARS:
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        q, scale = quantize_weight(w, None)
        weight = FP8Weight(q, scale, (1, k), dtype=torch.bfloat16, origin="load")
        shape = f"N={n} K={k}"
        for m in (512, 2048, 8192):
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            xq, xs = quantize_rows_fp8(x, None)
            moved = n * k + n * 4 + 2 * m * (k + n)
            kw: dict[str, Any] = {"flops": 2 * m * n * k}
            kw["torch_ms"] = bench_graph(lambda w=w, x=x: F.linear(x, w))

            def mm(xq: torch.Tensor, xs: torch.Tensor, fast: bool, q=q, s=scale) -> torch.Tensor:
                return torch._scaled_mm(
                    xq,
                    q.t(),
                    scale_a=xs,
                    scale_b=s.view(1, -1),
                    out_dtype=torch.bfloat16,
                    use_fast_accum=fast,
                )

            cases: list[tuple[str, Callable[[], object], int]] = [
                ("scaled_mm (as served)", lambda wt=weight, x=x: wt.matmul_path(x, None), moved),
                ("quantize x alone", lambda x=x: quantize_rows_fp8(x, None), 3 * m * k + 4 * m),
                ("scaled_mm, x in e4m3", lambda xq=xq, xs=xs: mm(xq, xs, False), moved),
                ("scaled_mm fast accum", lambda xq=xq, xs=xs: mm(xq, xs, True), moved),
                (
                    "triton scaled matmul",
                    lambda xq=xq, xs=xs, q=q, s=scale, k=k: fp8_matmul(xq, xs, q, s, (1, k)),
                    moved,
                ),
            ]
            for name, fn, nbytes in cases:
                flops = kw["flops"] if "quantize" not in name else 0
                rows.append(
                    timed(
                        f"fp8 {name} M={m}", shape, fn, nbytes, flops=flops, torch_ms=kw["torch_ms"]
                    )
                )
    return rows


SAMPLE_VOCABS = (128256, 151936)  # Llama-3, Qwen2


def masked_sample_case(
    batch: int, vocab: int, greedy: bool, dev: torch.device, g: torch.Generator
) -> Row:
    """fp32 logits of `batch` rows, half of them grammar-constrained (a random bitmask); sampled
    rows at temperature 0.8, top-p 0.9 and top-k 50 (both thresholds searched), or all greedy."""
    from weft.kernels.masked_sample import masked_sample
    from weft.kernels.masked_sample_ref import masked_sample_reference

    logits = torch.randn((batch, vocab), device=dev, generator=g) * 4  # peaked, as LM logits
    words = -(-vocab // 32)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, device=dev, generator=g
    )
    constrained = torch.arange(batch, device=dev) % 2 == 0
    temperature = torch.full((batch,), 0.0 if greedy else 0.8, device=dev)
    top_k = torch.full((batch,), 0 if greedy else 50, dtype=torch.int32, device=dev)
    top_p = torch.full((batch,), 1.0 if greedy else 0.9, device=dev)
    min_p = torch.zeros(batch, device=dev)
    uniform = torch.rand(batch, device=dev, generator=g)
    args = (logits, bitmask, constrained, temperature, top_k, top_p, min_p, uniform)
    # logits once, the constrained rows' bitmask once, ids + logprobs
    moved = batch * vocab * 4 + (batch + 1) // 2 * words * 4 + batch * 12
    return timed(
        "masked_sample",
        f"B={batch} V={vocab} {'greedy' if greedy else 'k+p'}",
        lambda: masked_sample(*args, want_logprobs=True),
        moved,
        torch_ms=bench(lambda: masked_sample_reference(*args, want_logprobs=True)),
    )


def bench_sampling(dev: torch.device, g: torch.Generator) -> list[Row]:
    return [
        masked_sample_case(batch, vocab, greedy, dev, g)
        for vocab in SAMPLE_VOCABS
        for batch in (1, 64)
        for greedy in (False, True)
    ]


def sweep(dtype: torch.dtype, dev: torch.device, g: torch.Generator, kv_fp8: bool = False) -> None:
    """Graph-replay times of the attention kernels' tile/launch settings (for choosing defaults).
    kv_fp8: decode only, over an FP8 (e4m3) KV pool (--kv-cache-dtype fp8_e4m3)."""
    from weft.kernels.decode_attention import decode_attention
    from weft.kernels.extend_attention import extend_attention

    cases = ((64, 4096, 2), (64, 4096, 4), (1, 32768, 64), (256, 1024, 1))
    if kv_fp8:  # (the offline 4096/2048 workload's batch 64 at ~5,000 tokens of context)
        cases = ((64, 5120, 2), (64, 5120, 4), (64, 5120, 8), (1, 32768, 64))
    for batch, seq, splits in cases:
        k_buf, v_buf, table = paged_pool([seq] * batch, dtype, dev, g)
        if kv_fp8:
            k_buf, v_buf = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
        q = torch.randn((batch, HQ, D), device=dev, dtype=dtype, generator=g)
        idx = torch.arange(batch, device=dev)
        lens = torch.full((batch,), seq, device=dev)
        moved = 2 * batch * seq * HKV * D * k_buf.dtype.itemsize
        settings = itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4))
        if kv_fp8:  # (halved tiles move half the bytes: the larger ones)
            settings = itertools.product((64, 128, 256), (2, 4, 8), (2, 3, 4))
        for block_n, warps, stages in settings:
            kw = dict(num_kv_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = bench_graph(
                    functools.partial(
                        decode_attention, q, k_buf, v_buf, table, idx, lens, 0.1, **kw
                    )
                )
            except Exception as exc:  # e.g. out of shared memory for large tiles
                print(f"decode B={batch} L={seq} {kw}: failed ({type(exc).__name__})")
                continue
            print(f"decode B={batch} L={seq} {kw}: {ms:.3f} ms {moved / ms / 1e6:.0f} GB/s")
        del k_buf, v_buf
    if kv_fp8:
        return
    ext = [4096] * 4
    k_buf, v_buf, table = paged_pool(ext, dtype, dev, g)
    q = torch.randn((sum(ext), HQ, D), device=dev, dtype=dtype, generator=g)
    idx = torch.arange(4, device=dev)
    qo_indptr = torch.arange(0, 5 * 4096, 4096, device=dev)
    prefix = torch.zeros(4, dtype=torch.int64, device=dev)
    flops = 4 * HQ * D * 4 * 4096 * 4097 // 2
    for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
        kw = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        try:
            ms = bench_graph(
                functools.partial(
                    extend_attention,
                    q,
                    k_buf,
                    v_buf,
                    table,
                    idx,
                    qo_indptr,
                    prefix,
                    4096,
                    0.1,
                    **kw,
                )
            )
        except Exception as exc:  # e.g. out of shared memory for large tiles
            print(f"extend {kw}: failed ({type(exc).__name__})")
            continue
        print(f"extend 4x4096 {kw}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--sweep", action="store_true", help="time the attention kernels' tile settings")
    p.add_argument("--sampling", action="store_true", help="time the masked_sample rows only")
    p.add_argument("--fp8", action="store_true", help="time the FP8 weight rows only")
    p.add_argument(
        "--fp8-rows", action="store_true", help="time the FP8 matmul's ways at 16-128 rows only"
    )
    p.add_argument(
        "--fp8-prefill",
        action="store_true",
        help="time the FP8 matmul's ways at 512-8192 rows (prompts) only",
    )
    p.add_argument(
        "--kv-fp8", action="store_true", help="with --sweep: decode over an FP8 KV pool only"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench_kernels: no CUDA device. The kernels are timed on a GPU only (on the CPU "
            "Triton's interpreter runs them, for tests: pytest tests/test_kernels)."
        )
    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"device: {describe_device(dev)}")
    if args.sweep:
        sweep(dtype, dev, g, kv_fp8=args.kv_fp8)
        return
    peak_bw, peak_flops = copy_gbps(dev), matmul_tflops(dev)
    print(f"measured: copy {peak_bw:.0f} GB/s (read + write), bf16 matmul {peak_flops:.0f} TFLOP/s")
    print(f"Llama-3-8B shapes: Hq={HQ} Hkv={HKV} D={D} hidden={HIDDEN} inter={INTER}, {dtype}")
    if args.sampling:
        rows = bench_sampling(dev, g)
    elif args.fp8:
        rows = bench_fp8(dev, g)
    elif args.fp8_rows:
        rows = bench_fp8_rows(dev, g)
    elif args.fp8_prefill:
        rows = bench_fp8_prefill(dev, g)
    else:
        rows = bench_attention(dtype, dev, g) + bench_elementwise(dtype, dev, g)
        rows += bench_sampling(dev, g) + bench_fp8(dev, g)
    header = (
        f"{'kernel':24} {'shape':26} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} "
        f"{'graph ms':>9} {'host us':>8} {'torch ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        device_ms = r.graph_ms if r.graph_ms is not None else r.ms
        gbps = r.bytes_moved / device_ms / 1e6
        tflops = f"{r.flops / device_ms / 1e9:8.1f}" if r.flops else " " * 8
        torch_ms = f"{r.torch_ms:9.3f}" if r.torch_ms is not None else " " * 9
        graph_ms = f"{r.graph_ms:9.3f}" if r.graph_ms is not None else " " * 9
        host = f"{r.host_us:8.1f}" if r.host_us is not None else " " * 8
        print(
            f"{r.name:24} {r.shape:26} {r.ms:8.3f} {gbps:7.0f} {100 * gbps / peak_bw:5.0f}% "
            f"{tflops} {graph_ms} {host} {torch_ms}"
        )
    print(
        f"(peak: copy {peak_bw:.0f} GB/s, matmul {peak_flops:.0f} TFLOP/s; ms: eager calls from "
        "Python; graph ms: the same call replayed from a CUDA graph, without the host's launch "
        "overhead; host us: host time per call; GB/s and TFLOP/s from graph ms)"
    )


if __name__ == "__main__":
    main()
