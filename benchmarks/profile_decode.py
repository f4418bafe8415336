"""Profile decode steps of the scheduler (no engine thread), printing the top ops by time.

    python benchmarks/profile_decode.py --model-path benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --batch 1 --steps 16

The default model on a CPU (batch 1, its GGUF weights kept quantized), with the forward split into
its matmuls and the rest (--split: the forward timed again with every linear layer's matmul
replaced by a zeros tensor of its output's shape):

    python benchmarks/profile_decode.py --threads 2 --input-len 32 --split

With --prefill-len N, the steps profiled are mixed ones instead: one request of N new prompt
tokens arrives while the batch decodes, and its chunks share steps with the decodes (a busy
server). Its step time is printed with the mixed step's decode attention on the decode kernel
(the default) and on the extend kernel (the ablation, Triton backend only).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import time
from typing import Any
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from weft import Engine
from weft.runtime.core import Req
from weft.runtime.sampling_params import SamplingParams

from common import random_prompts, sync_device


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument(
        "--prefill-len", type=int, default=0, help="profile mixed steps: see the docstring"
    )
    p.add_argument("--trace", default=None, help="write the profiled steps as a Chrome trace")
    p.add_argument("--no-profile", action="store_true", help="print the step time only")
    p.add_argument("--host", action="store_true", help="cProfile the host side instead")
    p.add_argument(
        "--split", action="store_true", help="time the forward with and without its matmuls"
    )
    p.add_argument(
        "--json-schema", action="store_true", help="constrained (bench_grammar's schema)"
    )
    args = p.parse_args()
    engine = Engine(
        args.model_path,
        load_format=args.load_format,
        quantization=args.quantization,
        num_threads=args.threads,
        log_level="warning",
        max_total_tokens=args.max_total_tokens,
        disable_cuda_graph=args.disable_cuda_graph,
        disable_overlap_schedule=args.disable_overlap_schedule,
    )
    engine.shutdown()  # drive the scheduler from this thread
    sched = engine.scheduler
    cuda = engine.runner.device.type == "cuda"

    schema = None
    if args.json_schema:
        from bench_grammar import FIXED_KEYS_SCHEMA

        schema = json.dumps(FIXED_KEYS_SCHEMA)

    def run(steps: int, tag: str) -> float:
        for i in range(args.batch):
            params = SamplingParams(
                temperature=0, max_new_tokens=steps, ignore_eos=True, json_schema=schema
            )
            sched.add(Req(f"{tag}{i}", [1000 + i] * args.input_len, params))
        while sched.has_work and not any(r.output_ids for r in sched.running):
            sched.step()  # grammar compile, prefill
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        taken = 0
        while sched.has_work:
            sched.step()
            taken += 1
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / max(taken, 1)

    if args.prefill_len:
        profile_mixed(engine, args)
        return
    run(4, "w")
    per_step = run(args.steps, "t")
    print(
        f"batch {args.batch}: {per_step * 1e3:.2f} ms per decode step, "
        f"{args.batch / per_step:.1f} tok/s"
    )
    graphs = engine.runner.graphs
    if graphs is not None and args.batch <= graphs.max_bs:
        # the forward alone: the step's graph replayed back to back (no host work in between)
        graph = graphs._graphs[graphs.padded_size(args.batch)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        forward_ms = start.elapsed_time(end) / 20
        print(
            f"  graph replay alone {forward_ms:.2f} ms; the rest of the step "
            f"(logits, sampling, host) {per_step * 1e3 - forward_ms:.2f} ms"
        )
    if args.split:
        split_forward(engine, args.input_len, per_step)
    if args.host:
        import cProfile
        import pstats

        with cProfile.Profile() as host_prof:
            run(args.steps, "h")
        pstats.Stats(host_prof).sort_stats("tottime").print_stats(25)
        return
    if args.no_profile:
        return
    prof = _profiler(cuda)
    with prof:
        run(min(args.steps, 16), "p")
    _report(prof, cuda, args.trace)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def profile_mixed(engine: Engine, args: argparse.Namespace) -> None:
    """Mixed steps: a prompt of --prefill-len tokens prefilled while --batch requests decode."""
    sched = engine.scheduler
    attention = engine.runner.attention
    device = engine.runner.device
    vocab = engine.runner.model_config.vocab_size
    seeds = itertools.count()  # new random ids per run: no prefix-cache hits between runs
    # NOTE: enough new tokens to outlast the batch's own chunked prefill and the steps below,
    # few enough that the pool admits the whole batch
    budget = (args.batch * args.input_len + args.prefill_len) // sched.chunk_size + 32

    def run(tag: str, around: Any = None) -> tuple[float, int, float]:
        """(ms per mixed step, mixed steps, ms per decode step just before); `around` (a
        context manager) wraps the mixed steps."""
        params = SamplingParams(temperature=0, max_new_tokens=budget, ignore_eos=True)
        prompts = random_prompts(args.batch, args.input_len, vocab, next(seeds))
        for i, ids in enumerate(prompts):
            sched.add(Req(f"{tag}{i}", ids, params))
        while not all(r.output_ids for r in sched.running) or sched.waiting:
            sched.step()
        for _ in range(3):
            sched.step()
        sync_device(device)
        t = time.perf_counter()
        for _ in range(8):
            sched.step()
        sync_device(device)
        decode_ms = (time.perf_counter() - t) / 8 * 1e3
        ids = random_prompts(1, args.prefill_len, vocab, next(seeds))[0]
        new = Req(f"{tag}p", ids, SamplingParams(temperature=0, max_new_tokens=1))
        with around or contextlib.nullcontext():
            t = time.perf_counter()
            sched.add(new)
            steps = 0
            while not new.finished:
                sched.step()
                steps += 1
            sync_device(device)
        mixed_ms = (time.perf_counter() - t) / steps * 1e3
        for i in range(args.batch):
            sched.abort(f"{tag}{i}")
        while sched.has_work:
            sched.step()
        return mixed_ms, steps, decode_ms

    ablation = hasattr(attention, "split_mixed")  # the Triton backend's
    run("w")  # compiles and warms every kernel of the shapes
    for split in [True, False] if ablation else [True]:
        if ablation:
            attention.split_mixed = split
        mixed_ms, steps, decode_ms = run(f"s{split}")
        kernel = "decode kernel" if split else "extend kernel"
        print(
            f"batch {args.batch} decoding at {args.input_len} + prompt of {args.prefill_len} "
            f"({steps} steps): mixed step {mixed_ms:.2f} ms, decode step {decode_ms:.2f} ms "
            f"(decodes of mixed steps on the {kernel})"
        )
    if ablation:
        attention.split_mixed = True
    if args.no_profile:
        return
    prof = _profiler(device.type == "cuda")
    run("p", prof)
    _report(prof, device.type == "cuda", args.trace)


def split_forward(engine: Engine, input_len: int, step_s: float) -> None:
    """A decode step's forward timed alone, then with every linear layer's matmul stubbed (a
    zeros tensor of its output's shape): the time outside the matmuls (norms, rotary,
    attention, residual adds, Python). Then the logits, and the rest of the measured step
    (sampling, scheduler: the step's mean time less these best times, on a busy machine
    an upper bound)."""
    from weft.runtime.models import layers

    sched, runner = engine.scheduler, engine.runner
    batches: list[Any] = []
    real_forward = runner.forward

    def capture(batch: Any) -> torch.Tensor:
        batches.append(batch)
        return real_forward(batch)

    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    with mock.patch.object(runner, "forward", capture):
        sched.add(Req("split", [1000] * input_len, params))
        while sched.has_work:
            sched.step()
    # NOTE: the runs below write this batch's KV slot again: the cache must not hand it out
    sched.flush_cache()
    batch = next(b for b in reversed(batches) if b.is_decode)
    zeros: dict[tuple[int, int], torch.Tensor] = {}

    def no_matmul(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = weight.out_features if hasattr(weight, "out_features") else weight.shape[0]
        key = (x.shape[0], out)
        if key not in zeros:
            zeros[key] = torch.zeros(key, dtype=x.dtype, device=x.device)
        return zeros[key] if bias is None else zeros[key] + bias

    def best_ms(fn: Any, n: int = 20) -> float:
        """The fastest of n runs: on a shared machine, other work only ever adds time."""
        fn()
        times = []
        for _ in range(n):
            sync_device(runner.device)
            t = time.perf_counter()
            fn()
            sync_device(runner.device)
            times.append(time.perf_counter() - t)
        return min(times) * 1e3

    hidden = torch.zeros(1, runner.model_config.hidden_size, dtype=runner.dtype)
    with torch.inference_mode():
        forward_ms = best_ms(lambda: runner.model(batch, runner.attention))
        logits_ms = best_ms(lambda: runner.logits(hidden.to(runner.device)))
        with mock.patch.object(layers, "linear", no_matmul):
            rest_ms = best_ms(lambda: runner.model(batch, runner.attention))
    print(
        f"  forward {forward_ms:.2f} ms: matmuls {forward_ms - rest_ms:.2f} ms, the rest "
        f"{rest_ms:.2f} ms (matmuls stubbed); logits {logits_ms:.2f} ms; the rest of the step "
        f"(sampling, scheduler) {step_s * 1e3 - forward_ms - logits_ms:.2f} ms"
    )


def _profiler(cuda: bool) -> profile:
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


def _report(prof: profile, cuda: bool, trace: str | None) -> None:
    """The top ops by device time (CPU time on a CPU); the Chrome trace to `trace` if given."""
    if trace:
        prof.export_chrome_trace(trace)
    key = "cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20))


if __name__ == "__main__":
    main()
