"""Profile decode steps of the scheduler (no engine thread), printing the top ops by time.

    python benchmarks/profile_decode.py --model-path benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --batch 1 --steps 16
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--max-total-tokens", type=int, default=65536)
    args = p.parse_args()
    engine = Engine(
        args.model_path,
        load_format=args.load_format,
        log_level="warning",
        max_total_tokens=args.max_total_tokens,
    )
    engine.shutdown()  # drive the scheduler from this thread
    sched = engine.scheduler
    cuda = engine.runner.device.type == "cuda"

    def run(steps: int, tag: str) -> float:
        for i in range(args.batch):
            params = SamplingParams(temperature=0, max_new_tokens=steps, ignore_eos=True)
            sched.add(Req(f"{tag}{i}", [1000 + i] * 128, params))
        sched.step()  # prefill
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        while sched.has_work:
            sched.step()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / max(steps - 1, 1)

    run(4, "w")
    per_step = run(args.steps, "t")
    print(
        f"batch {args.batch}: {per_step * 1e3:.2f} ms per decode step, "
        f"{args.batch / per_step:.1f} tok/s"
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run(8, "p")
    key = "cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=18))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
