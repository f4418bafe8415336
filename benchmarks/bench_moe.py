"""Decode-step time of the fused MoE layer (router + kernels) against the dense MLP of the same
active size and against the bytes roofline, on CUDA.

    python benchmarks/bench_moe.py [--batch-sizes 1 16 64] [--layers 4] [--sweep]
        [--hidden 2048 --experts 128 --top-k 8 --moe-inter 768 --model-layers 48]

The defaults are Qwen3-30B-A3B's layer: hidden 2048, 128 experts, top-8, expert intermediate
768; the dense baseline is one MLP of intermediate 8 * 768 = 6144 (the same weights per token
at batch 1). Per batch size, each variant runs over --layers distinct layers' weights (so the
chosen experts are not served from L2 between replays) inside one CUDA graph, as weft's decode
steps run; reported per layer and scaled to --model-layers.

Roofline: the bytes the MoE layer must read (the router and the experts the batch actually
chose, counted from the routing) over the copy bandwidth of a large tensor copy measured in the
same run. --sweep also times a few other tile choices per batch size and prints the best.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weft.kernels.activation import silu_and_mul
from weft.kernels.fused_moe import MoeTiles, default_tiles, fused_moe
from weft.kernels.fused_moe_ref import route_topk
from weft.runtime.models.layers import linear

from common import copy_bandwidth, cuda_graph_ms, describe_device

REPLAYS = 50
SWEEP = [
    MoeTiles(16, 32, 128, 4, 4),
    MoeTiles(16, 64, 128, 4, 4),
    MoeTiles(16, 32, 256, 4, 3),
    MoeTiles(16, 64, 64, 4, 4),
    MoeTiles(16, 128, 128, 8, 3),
    MoeTiles(32, 64, 64, 4, 3),
    MoeTiles(64, 64, 64, 4, 3),
]


@dataclass
class MoeLayer:
    gate: torch.Tensor  # [E, H] router
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]


@dataclass
class DenseLayer:
    gate_up: torch.Tensor  # [2 * I_dense, H]
    down: torch.Tensor  # [H, I_dense]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-inter", type=int, default=768)
    p.add_argument("--model-layers", type=int, default=48, help="scale per-layer times by this")
    p.add_argument("--layers", type=int, default=4, help="distinct layers timed per replay")
    p.add_argument("--no-renormalize", action="store_true", help="norm_topk_prob off")
    p.add_argument("--sweep", action="store_true", help="also time other tile choices")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def moe_step(
    layers: list[MoeLayer], x: torch.Tensor, args: argparse.Namespace, tiles: MoeTiles | None
) -> Callable[[], None]:
    def run() -> None:
        for layer in layers:
            fused_moe(
                x,
                linear(x, layer.gate),
                layer.w13,
                layer.w2,
                top_k=args.top_k,
                renormalize=not args.no_renormalize,
                tiles=tiles,
            )

    return run


def dense_step(layers: list[DenseLayer], x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        for layer in layers:
            linear(silu_and_mul(linear(x, layer.gate_up)), layer.down)

    return run


def bytes_read(layers: list[MoeLayer], x: torch.Tensor, top_k: int) -> tuple[int, float]:
    """(bytes the MoE layers must read per replay, mean distinct experts per layer), from the
    routing these inputs actually get."""
    total, distinct = 0, []
    for layer in layers:
        _, ids = route_topk(linear(x, layer.gate), top_k, True)
        chosen = int(torch.unique(ids).numel())  # NOTE: a host sync, outside the timed graphs
        distinct.append(chosen)
        per_expert = (layer.w13[0].numel() + layer.w2[0].numel()) * layer.w13.element_size()
        total += layer.gate.numel() * layer.gate.element_size() + chosen * per_expert
    return total, statistics.mean(distinct)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA device (the kernels run in CUDA graphs)")
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(args.seed)
    h, e, inter, k = args.hidden, args.experts, args.moe_inter, args.top_k
    dense_inter = k * inter

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=dev, dtype=dtype) * 0.02

    moe = [
        MoeLayer(rand(e, h), rand(e, 2 * inter, h), rand(e, h, inter)) for _ in range(args.layers)
    ]
    dense = [DenseLayer(rand(2 * dense_inter, h), rand(h, dense_inter)) for _ in range(args.layers)]
    copy_gb_s = copy_bandwidth(dev)
    per = args.layers
    print(f"device    : {describe_device(dev)}")
    print(
        f"workload  : one MoE layer: hidden {h}, {e} experts, top-{k}, expert intermediate "
        f"{inter}, bf16, {per} distinct layers per CUDA-graph replay, median of {REPLAYS}; "
        f"dense baseline: MLP intermediate {dense_inter}; x{args.model_layers} layers = model"
    )
    print(f"roofline  : copy bandwidth {copy_gb_s:.1f} GB/s (a 512 MiB copy, read + write)")
    header = (
        f"{'batch':>5} {'tiles (m,n,k,w,s)':>18} {'MoE us':>8} {'dense us':>8} {'MoE/dense':>9} "
        f"{'experts':>7} {'MB read':>8} {'roof us':>8} {'MoE/roof':>8} {'GB/s':>7} "
        f"{'model MoE ms':>12}"
    )
    print(header)
    for batch in args.batch_sizes:
        x = torch.randn(batch, h, device=dev, dtype=dtype)
        tiles = default_tiles(batch, k, e)
        moe_us = cuda_graph_ms(moe_step(moe, x, args, tiles), REPLAYS) * 1e3 / per
        dense_us = cuda_graph_ms(dense_step(dense, x), REPLAYS) * 1e3 / per
        read, distinct = bytes_read(moe, x, k)
        roof_us = read / per / (copy_gb_s * 1e9) * 1e6
        tile_text = (
            ",".join(str(v) for v in (tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_warps))
            + f",{tiles.num_stages}"
        )
        print(
            f"{batch:5d} {tile_text:>18} {moe_us:8.1f} {dense_us:8.1f} {moe_us / dense_us:9.2f} "
            f"{distinct:7.1f} {read / per / 1e6:8.1f} {roof_us:8.1f} {moe_us / roof_us:8.2f} "
            f"{read / per / (moe_us * 1e-6) / 1e9:7.1f} {moe_us * args.model_layers / 1e3:12.2f}",
            flush=True,
        )
        if args.sweep:
            results = []
            for t in SWEEP:
                try:
                    results.append(
                        (cuda_graph_ms(moe_step(moe, x, args, t), REPLAYS) * 1e3 / per, t)
                    )
                except Exception as exc:  # a tile the device cannot run (shared memory)
                    print(f"      sweep {t}: failed ({type(exc).__name__})", flush=True)
            for us, t in sorted(results, key=lambda r: r[0])[:3]:
                print(f"      sweep {t}: {us:.1f} us ({us / roof_us:.2f} x roofline)", flush=True)
    print(
        "MoE us = router + routing + grouping + both kernels + the sum over k, per layer; "
        "roof us = bytes read / copy bandwidth; experts = distinct experts chosen per layer"
    )


if __name__ == "__main__":
    main()
