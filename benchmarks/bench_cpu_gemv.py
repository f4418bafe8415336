"""weft's CPU kernels for quantized decode products (kernels/csrc/quant_gemv.c) against torch's packed
int4 / int8 kernels and bfloat16 products of the dequantized weight, on the default model's
layer shapes, per layer, as decode calls them: each call on the next of enough copies of the
weight that none is in the caches (at least 256 MB in all). Baseline measured in the same run:
the copy bandwidth (bytes read + written of a 512 MB copy, benchmarks/common.py).

    python benchmarks/bench_cpu_gemv.py [--threads 2] [--rows 1 4 8]

With --prompt-rows, prompts' products instead (kernels/csrc/quant_gemm.c: float32 sums over the
weight dequantized a panel at a time), compute-bound: GFLOP/s (2 M N K / time) against torch's
float32 matmul of the same rows and the dequantized float32 weight, measured in the same run:

    python benchmarks/bench_cpu_gemv.py --threads 2 --prompt-rows 128 512 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weft.kernels import cpu_gemv

from common import copy_bandwidth, cpu_kernels_or_exit, describe_device

# (name, out, in, form): Qwen2.5-0.5B's linear layers as the Q4_K_M file keeps them
SHAPES = [
    ("qkv", 1152, 896, "int8"),
    ("o", 896, 896, "int8"),
    ("gate_up", 9728, 896, "int8"),
    ("down (Q6_K)", 896, 4864, "int8"),
    ("down (Q4_K)", 896, 4864, "int4"),
    ("lm_head", 151936, 896, "int4"),
]
COLD_BYTES = 256 << 20


def best_ms(fn: Callable[[int], object], copies: int, repeats: int) -> float:
    """The fastest mean time of a call, over `repeats` passes of one call on each copy."""
    fn(0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(copies):
            fn(i)
        best = min(best, (time.perf_counter() - start) / copies)
    return best * 1e3


def times(x, form, run, ours, theirs, bf16, repeats) -> tuple[float, float, float]:
    """ms a call of weft's kernel, torch's packed one and the bf16 product, for these rows x."""
    t_ours = best_ms(lambda i: run(x, *ours[i]), len(ours), repeats)
    if form == "int8":
        t_torch = best_ms(
            lambda i: torch.ops.aten._weight_int8pack_mm(x, *theirs[i]), len(theirs), repeats
        )
    else:
        t_torch = best_ms(
            lambda i: torch.ops.aten._weight_int4pack_mm_for_cpu(x, theirs[i][0], 32, theirs[i][1]),
            len(theirs),
            repeats,
        )
    if x.shape[0] == 1:
        t_bf16 = best_ms(lambda i: torch.mv(bf16[i], x[0]), len(bf16), repeats)
    else:
        t_bf16 = best_ms(lambda i: F.linear(x, bf16[i]), len(bf16), repeats)
    return t_ours, t_torch, t_bf16


def layer(name: str, n: int, k: int, form: str, rows: list[int], native, repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    weight_bytes = n * k if form == "int8" else n * k // 2 + n * k // 32 * 4
    copies = max(2, -(-COLD_BYTES // weight_bytes))
    ours, theirs = [], []
    for _ in range(copies):
        if form == "int8":
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            scale = (torch.rand(n, generator=g) / 50).to(torch.bfloat16)
            ours.append((q, scale))
            theirs.append((q, scale))
        else:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            scale, zero = torch.rand(n, k // 32, generator=g) / 20, torch.randn(n, k // 32) / 10
            ours.append(cpu_gemv.pack_int4(q, scale, zero))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            sz = torch.stack((scale, zero), -1).transpose(0, 1).contiguous().to(torch.bfloat16)
            theirs.append((packed, sz))
    # the bf16 product reads 2 bytes a weight: as many copies as fill COLD_BYTES
    bf16 = [torch.randn(n, k, generator=g).to(torch.bfloat16) for _ in range(max(2, copies // 2))]
    run = native.int8 if form == "int8" else native.int4
    for m in rows:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        t_ours, t_torch, t_bf16 = times(x, form, run, ours, theirs, bf16, repeats)
        gbs = weight_bytes / t_ours / 1e6
        print(
            f"| {name} {n} x {k} | {form} | {m} | {t_ours:.3f} | {gbs:.1f} | {t_torch:.3f} | "
            f"{t_torch / t_ours:.2f}x | {t_bf16:.3f} | {t_bf16 / t_ours:.2f}x |",
            flush=True,
        )


def prompt_layer(
    name: str, n: int, k: int, form: str, rows: list[int], native, repeats: int
) -> None:
    """weft's float32 prompt product against torch's float32 matmul (weights in the caches where
    they fit: at these rows the products, not the bytes, take the time)."""
    g = torch.Generator().manual_seed(0)
    if form == "int8":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        scale = (torch.rand(n, generator=g) / 50).to(torch.bfloat16)
        ours, run = (q, scale), native.prompt_int8
    else:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        scale, zero = torch.rand(n, k // 32, generator=g) / 20, torch.randn(n, k // 32) / 10
        ours, run = cpu_gemv.pack_int4(q, scale, zero), native.prompt_int4
    dense = torch.randn(n, k, generator=g)  # (its values do not move a float32 matmul's time)
    for m in rows:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        xf = x.float()
        t_ours = best_ms(lambda i, x=x: run(x, *ours), 1, repeats)
        t_f32 = best_ms(lambda i, xf=xf: F.linear(xf, dense), 1, repeats)
        flop = 2 * m * n * k / 1e6
        print(
            f"| {name} {n} x {k} | {form} | {m} | {t_ours:.2f} | {flop / t_ours:.1f} | "
            f"{t_f32:.2f} | {flop / t_f32:.1f} | {t_f32 / t_ours:.2f}x |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--prompt-rows",
        type=int,
        nargs="+",
        default=None,
        help="time prompts' float32 products at these row counts instead",
    )
    args = p.parse_args()
    native = cpu_kernels_or_exit(args.threads)
    print(f"# device: {describe_device(torch.device('cpu'))}; weft's {native.isa} kernels")
    if args.prompt_rows:
        print(f"# prompt products on {torch.get_num_threads()} threads; GFLOP/s = 2 M N K / time")
        print(
            "| layer | form | rows | weft ms | weft GFLOP/s | torch float32 ms | "
            "torch GFLOP/s | torch / weft |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for name, n, k, form in SHAPES[:-1]:  # (a prompt's lm_head takes its last rows only)
            prompt_layer(name, n, k, form, args.prompt_rows, native, args.repeats)
        return
    copy = copy_bandwidth(torch.device("cpu"))
    print(f"# copy bandwidth (read + write): {copy:.1f} GB/s")
    print("# ms a call, each on the next of >= 256 MB of copies of the weight (none cached)")
    print(
        "| layer | form | rows | weft ms | weft GB/s | torch packed ms | torch / weft | "
        "bf16 ms | bf16 / weft |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, n, k, form in SHAPES:
        layer(name, n, k, form, args.rows, native, args.repeats)


if __name__ == "__main__":
    main()
