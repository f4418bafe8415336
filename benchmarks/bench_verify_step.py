"""What a speculative verify step costs against a plain decode step, on any weights (dummy ones
too): the device's half of speculation's speed-up, whose other half, the tokens a verify step
keeps, needs real weights (bench_speculative.py measures both on the default model).

    python benchmarks/bench_verify_step.py --model-path benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --batch 1 8 32 --draft-tokens 1 3 7

Per batch size B (B equal random prompts of --input-len tokens, --output-len tokens each, greedy,
ignore_eos) and draft length k, in one engine:
- plain: no speculation;
- verify: every request drafts exactly k tokens every step (a drafter that proposes k copies of
  its last token; the n-gram drafter's adaptive length and back-off are held off), fed as one-
  token rows of a decode batch, which the CUDA graphs of decode steps replay (the default where
  they are captured and the step's B * (1 + k) rows fit them);
- eager: the same steps with the drafts fed as an extend (the whole step runs eagerly: before
  verify steps replayed graphs, and still past the graphs' largest batch).
Step ms = decode wall time (the run less a one-token run: its prefill) / decode steps (the
scheduler's count). Each row is the median of --repeats interleaved runs.
Expected speed-up at acceptance length A (tokens a verify step writes per request, meta_info's
spec_accept_length): A * plain ms / verify ms, printed for A = 1 + k * --accept-rate (a rate
measured elsewhere on real weights: bench_speculative.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weft import Engine

from common import describe_device, random_prompts


def decode_step_ms(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    """Decode ms per step of the prompts' batch (the prefix cache flushed before each run)."""
    scheduler = engine.scheduler
    runs = []
    for n in (1, output_len):
        engine.flush_cache()
        params = {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
        steps = scheduler.num_steps
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        runs.append((time.perf_counter() - start, scheduler.num_steps - steps))
    (wall_1, steps_1), (wall_n, steps_n) = runs
    return 1e3 * (wall_n - wall_1) / max(steps_n - steps_1, 1)


def set_mode(engine: Engine, mode: str, draft_tokens: int, graph_rows: int | None) -> None:
    """plain, verify or eager (the module's docstring)."""
    scheduler = engine.scheduler
    speculative = scheduler.speculative
    config = scheduler.config.replace(
        speculative_algorithm=None if mode == "plain" else "ngram",
        speculative_num_draft_tokens=draft_tokens,
        speculative_max_step_rows=1 << 20,
        speculative_row_cost=0.0,
    )
    scheduler.config = config
    scheduler.verify_graph_rows = graph_rows if mode == "verify" else None

    def last_token_copies(req: Any, limit: int, cap: int, grammar: Any) -> list[int]:
        return req.tokens(req.seq_len - 1, req.seq_len) * limit

    speculative._ngram = last_token_copies  # type: ignore[method-assign]
    speculative._adapt = lambda *args: None  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded default model")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 3, 7])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--accept-rate",
        type=float,
        default=0.84,
        help="drafted tokens kept, for the expected speed-up (default: bench_speculative's code "
        "workload on the default model, batch 1)",
    )
    args = p.parse_args()
    kwargs: dict[str, Any] = dict(show_progress=False, log_level="warning", device=args.device)
    if args.model_path:
        kwargs.update(model_path=args.model_path, load_format=args.load_format)
    if args.quantization:
        kwargs["quantization"] = args.quantization
    engine = Engine(**kwargs)
    runner = engine.scheduler.runner
    graph_rows = engine.scheduler.verify_graph_rows
    print(f"# device: {describe_device(runner.device)}")
    print(f"# model: {runner.model_config.architecture} ({args.model_path or 'default'})")
    print(
        f"# prompts of {args.input_len} tokens, {args.output_len} new; CUDA graphs up to "
        f"{graph_rows} rows"
        if graph_rows
        else "# no CUDA graphs"
    )
    vocab = runner.model_config.vocab_size
    print(
        f"{'batch':>5} {'k':>3} {'plain ms':>9} {'verify ms':>10} {'eager ms':>9} "
        f"{'verify/plain':>13} {'eager/plain':>12} {'expected x':>11}"
    )
    for batch in args.batch:
        prompts = random_prompts(batch, args.input_len, vocab, seed=batch)
        for k in args.draft_tokens:
            samples: dict[str, list[float]] = {"plain": [], "verify": [], "eager": []}
            for mode in samples:  # warm-up: kernels, graphs
                set_mode(engine, mode, k, graph_rows)
                decode_step_ms(engine, prompts[:1], 4)
            for _ in range(args.repeats):
                for mode, values in samples.items():
                    set_mode(engine, mode, k, graph_rows)
                    values.append(decode_step_ms(engine, prompts, args.output_len))
            ms = {mode: statistics.median(v) for mode, v in samples.items()}
            accept = 1 + k * args.accept_rate
            expected = accept * ms["plain"] / min(ms["verify"], ms["eager"])
            print(
                f"{batch:>5} {k:>3} {ms['plain']:>9.2f} {ms['verify']:>10.2f} {ms['eager']:>9.2f} "
                f"{ms['verify'] / ms['plain']:>13.2f} {ms['eager'] / ms['plain']:>12.2f} "
                f"{expected:>10.2f}x",
                flush=True,
            )
    set_mode(engine, "plain", 1, graph_rows)
    engine.shutdown()


if __name__ == "__main__":
    main()
