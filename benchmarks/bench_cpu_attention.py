"""TorchAttention on a CPU with weft's C attention (kernels/csrc/attention.c) against the same
backend without it (the gathered KV through SDPA, the baseline, measured in the same run): one
layer of the default model's shape (14 query heads over 2 KV heads of 64), bfloat16 KV over
shuffled slots, `prepare` + `forward` as the model calls them. Workloads: a decode step of one
request at several context lengths, a batch of 8 decode rows, a prompt's prefill, and a verify
step of 1 + 7 rows after a long context.

    python benchmarks/bench_cpu_attention.py [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weft.runtime.attention import TorchAttention
from weft.runtime.core import ForwardBatch
from weft.runtime.kv_pool import KVPool, ReqToTokenPool

from common import cpu_kernels_or_exit, describe_device

HQ, HKV, DIM = 14, 2, 64
CPU = torch.device("cpu")


def step(seqs: list[int], exts: list[int], rows: list[int]) -> ForwardBatch:
    n = sum(exts)
    prefix = [s - e for s, e in zip(seqs, exts, strict=True)]
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seqs, strict=True)]),
        out_cache_loc=torch.zeros(n, dtype=torch.int64),  # (slot 0: a scratch write)
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seqs),
        prefix_lens=torch.tensor(prefix),
        extend_lens=torch.tensor(exts),
        logits_indices=torch.arange(n),
        seq_lens_cpu=seqs,
        prefix_lens_cpu=prefix,
        extend_lens_cpu=exts,
        output_only_cpu=[],
    )


def best_ms(backend: TorchAttention, batch: ForwardBatch, repeats: int) -> float:
    n = len(batch.input_ids)
    q = torch.randn(n, HQ, DIM).to(torch.bfloat16)
    k = torch.randn(n, HKV, DIM).to(torch.bfloat16)
    v = torch.randn(n, HKV, DIM).to(torch.bfloat16)
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        backend.prepare(batch)
        backend.forward(q, k, v, 0, batch)
        if i:  # (the first: warm-up)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    native = cpu_kernels_or_exit(args.threads)
    context = 4096
    pool = KVPool(8 * context + 1, 1, HKV, DIM, torch.bfloat16, CPU)
    table = ReqToTokenPool(10, context, CPU)
    perm = torch.randperm(8 * context) + 1  # (slot 0: the steps' scratch writes)
    for buf in (pool.k_buffers[0], pool.v_buffers[0]):
        buf.copy_(torch.randn(buf.shape).to(torch.bfloat16))
    rows = [table.allocate() for _ in range(8)]
    for i, row in enumerate(rows):
        table.write(row, 0, perm[i * context : (i + 1) * context])
    ours = TorchAttention(pool, table, native=native)
    sdpa = TorchAttention(pool, table)
    workloads = [
        *[(f"decode, 1 row, context {n}", step([n], [1], rows[:1])) for n in (64, 512, 2048, 4096)],
        (
            "decode, 8 rows, contexts 100 .. 2900",
            step([100 + 400 * i for i in range(8)], [1] * 8, rows),
        ),
        *[(f"prefill, {n} tokens", step([n], [n], rows[:1])) for n in (128, 512, 1024)],
        ("verify, 1 + 7 rows after 2048", step([2056], [8], rows[:1])),
    ]
    print(f"# device: {describe_device(CPU)}")
    print(
        f"# one layer, {HQ} query heads over {HKV} KV heads of {DIM}, bfloat16 KV; C build: {native.isa}"
    )
    print("| workload | weft's C, ms | gather + SDPA, ms | speed-up |")
    print("|---|---:|---:|---:|")
    for name, batch in workloads:
        t_ours = best_ms(ours, batch, args.repeats)
        t_sdpa = best_ms(sdpa, batch, max(args.repeats // 4, 2))
        print(f"| {name} | {t_ours:.3f} | {t_sdpa:.3f} | {t_sdpa / t_ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
