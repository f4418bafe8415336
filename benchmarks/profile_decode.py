"""Profile decode steps of the scheduler (no engine thread), printing the top ops by time.

    python benchmarks/profile_decode.py --model-path benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --batch 1 --steps 16
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from weft import Engine
from weft.runtime.core import Req
from weft.runtime.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--trace", default=None, help="write the profiled steps as a Chrome trace")
    p.add_argument("--no-profile", action="store_true", help="print the step time only")
    p.add_argument("--host", action="store_true", help="cProfile the host side instead")
    p.add_argument(
        "--json-schema", action="store_true", help="constrained (bench_grammar's schema)"
    )
    args = p.parse_args()
    engine = Engine(
        args.model_path,
        load_format=args.load_format,
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
    if args.host:
        import cProfile
        import pstats

        with cProfile.Profile() as host_prof:
            run(args.steps, "h")
        pstats.Stats(host_prof).sort_stats("tottime").print_stats(25)
        return
    if args.no_profile:
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run(min(args.steps, 16), "p")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    key = "cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=18))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
