"""Shared benchmark helpers: device description, copy bandwidth, weight bytes, workloads."""

from __future__ import annotations

import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def copy_bandwidth(device: torch.device, mbytes: int = 512, repeats: int = 5) -> float:
    """Device memory bandwidth in GB/s (bytes read + written) of a large copy."""
    src = torch.empty(mbytes * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync_device(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync_device(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens pick, k each, under uniform routing (dummy weights route
    close to uniformly): E * (1 - (1 - k/E)^tokens)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expert_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The stacked expert weights [E, out, in] of a mixture-of-experts model (none if dense)."""
    return [p for name, p in model.named_parameters() if ".experts." in name and p.dim() == 3]


def fp8_weights(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's FP8 linear weights (quantization fp8, or an FP8 checkpoint)."""
    from weft.runtime.models.fp8 import FP8Weight

    return [m for m in model.modules() if isinstance(m, FP8Weight)]


def quant_weights(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's linear weights kept GGUF-quantized (quantization gguf)."""
    from weft.runtime.models.layers import QuantWeight

    return [m for m in model.modules() if isinstance(m, QuantWeight)]


def linear_macs_per_token(model: torch.nn.Module) -> int:
    """Multiply-adds of one token through the model's linear layers, lm_head excluded (a
    prefill computes logits for its last token only); 0 for a mixture of experts."""
    from weft.runtime.models.layers import ColumnLinear, RowLinear

    if expert_params(model):
        return 0
    total = 0
    for module in model.modules():
        if isinstance(module, (ColumnLinear, RowLinear)):
            weight = module.weight
            if isinstance(weight, torch.Tensor):
                total += weight.numel()
            else:
                total += weight.out_features * weight.in_features
    return total


def decode_weight_bytes(model: torch.nn.Module, batch: int = 1) -> int:
    """Bytes one decode step of `batch` tokens must read: every parameter except an untied
    embedding table; of a mixture of experts, only the experts the batch is expected to pick."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # FP8 linear weights are buffers (e4m3 values and float32 scales), not parameters; so are
    # GGUF weights kept quantized (packed values and scales; their dense copy serves prefill)
    total += sum(b.numel() * b.element_size() for m in fp8_weights(model) for b in m.buffers())
    total += sum(
        b.numel() * b.element_size()
        for m in quant_weights(model)
        for name, b in m.named_buffers()
        if name != "dense"
    )
    embed = model.embed_tokens.weight
    tied = getattr(model, "lm_head", None) is None
    if not tied and isinstance(embed, torch.Tensor):
        total -= embed.numel() * embed.element_size()
    for p in expert_params(model):
        cfg = model.config  # type: ignore[union-attr]
        share = expected_experts(cfg.num_experts, cfg.num_experts_per_tok, batch) / cfg.num_experts
        total -= int(p.numel() * p.element_size() * (1.0 - share))
    return total


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(n: int, length: int, vocab: int, seed: int, lo: int = 1000) -> list[list[int]]:
    rng = random.Random(seed)
    lo = min(lo, vocab // 4)  # a tiny vocabulary (stories260K: 512) has no id 1000
    hi = max(lo + 1, min(vocab, 30000))
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(
    groups: int, per_group: int, system_len: int, question_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """SGLang's generated-shared-prefix shape: groups of prompts sharing a long system prompt."""
    systems = random_prompts(groups, system_len, vocab, seed)
    questions = random_prompts(groups * per_group, question_len, vocab, seed + 1)
    return [systems[i // per_group] + q for i, q in enumerate(questions)]


def cuda_graph_ms(fn: Callable[[], object], replays: int, warmups: int = 3) -> float:
    """Median time of one replay of a CUDA graph of `fn` (ms). The warm-up calls run on a side
    stream before the capture: Triton compiles and cuBLAS picks its kernels and sets up its
    workspace there, never inside the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def cpu_kernels_or_exit(threads: int | None):
    """weft's C kernels for this CPU (kernels/cpu_native.py) on `threads` torch threads, or the
    benchmark exits saying why they do not run here."""
    from weft.kernels import cpu_native

    if threads:
        torch.set_num_threads(threads)
    native = cpu_native.native()
    if native is None:
        sys.exit(f"weft's CPU kernels do not run here: {cpu_native.why_not()}")
    return native
