"""DSL program throughput with the radix cache on, against the same programs with it off.

    python benchmarks/bench_programs.py --model-path ../shared/fixtures/models/stories260K-hf
    python benchmarks/bench_programs.py                  # the embedded default model
    python benchmarks/bench_programs.py --workload json  # one workload

Workloads (seeded inputs), each run as one `run_batch` on one event loop:
- few-shot: a long shared few-shot prefix, a short story, `select` over labels, then two forked
  gens (the shape of SGLang's few-shot benchmarks);
- fork: a shared context, then `fork(4)` with a gen per branch;
- json: a shared extraction instruction, a short record, one gen under a JSON schema (grammar-
  constrained; jump-forward on).
For each: programs/s, the tokens the model computed (prefill + decode, from the scheduler), the
share of them the cache saved, and the speed-up over the cache-off engine in the same run.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import weft

from common import describe_device

SHOTS = [
    ("The cat sat on the warm mat and purred.", "happy"),
    ("The dog lost its ball and cried all day.", "sad"),
    ("Tom found a shiny coin in the park.", "happy"),
    ("Lily's kite broke in the strong wind.", "sad"),
] * 2
SUBJECTS = ["Ben", "Mia", "The bird", "A little fox", "Sue", "The old man"]
EVENTS = ["found a toy", "fell in the mud", "got a cake", "lost a shoe", "saw a rainbow"]
CONTEXT = (
    "Once upon a time, in a small village by the sea, there lived a girl who loved to tell "
    "stories. Every evening the children gathered around her to listen. "
) * 3
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "mood": {"enum": ["happy", "sad"]},
        "event": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "mood", "event"],
    "additionalProperties": False,
}
INSTRUCTION = (
    "Extract a JSON record with the person's name, their mood (happy or sad) and what happened. "
    "Answer with the JSON object only.\n\n"
) * 2


@weft.function
def few_shot(s, story: str, max_tokens: int, shots: int):
    for text, label in (SHOTS * (shots // len(SHOTS) + 1))[:shots]:
        s += f"Story: {text}\nMood: {label}\n\n"
    s += f"Story: {story}\nMood: " + weft.select("mood", ["happy", "sad"]) + "\n"
    forks = s.fork(2)
    forks[0] += "Why:" + weft.gen("note", max_tokens=max_tokens, stop="\n")
    forks[1] += "Next:" + weft.gen("note", max_tokens=max_tokens, stop="\n")
    forks.join()


@weft.function
def fork_heavy(s, story: str, max_tokens: int, shots: int):
    s += CONTEXT + f"One day, {story} "
    forks = s.fork(4)
    for i, branch in enumerate(forks):
        branch += f"Ending {i + 1}:" + weft.gen("note", max_tokens=max_tokens, stop="\n")
    forks.join()


@weft.function
def extract(s, story: str, max_tokens: int, shots: int):
    s += INSTRUCTION + f"Text: {story}\nJSON: "
    s += weft.gen("note", max_tokens=max_tokens * 4, json_schema=RECORD_SCHEMA)


WORKLOADS = {"few-shot": few_shot, "fork": fork_heavy, "json": extract}


def inputs(n: int, seed: int, max_tokens: int, shots: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "story": f"{rng.choice(SUBJECTS)} {rng.choice(EVENTS)}.",
            "max_tokens": max_tokens,
            "shots": shots,
        }
        for _ in range(n)
    ]


def run(engine: Any, program: Any, batch: list[dict[str, Any]]) -> tuple[float, int]:
    """(seconds, tokens the model computed)."""
    # NOTE: on CUDA the warm-up is the whole batch: Triton compiles a kernel again for each new
    # batch-size specialization, and one program alone left seconds of compiling in the timed
    # run (the json workload measured 6 programs/s instead of 58 on an H100).
    warm_up = batch if engine.runner.device.type == "cuda" else batch[:1]
    engine.flush_cache()
    program.run_batch(warm_up, backend=engine, temperature=0)  # grammar compile too
    engine.flush_cache()
    computed = engine.scheduler.num_tokens_computed
    start = time.perf_counter()
    states = program.run_batch(batch, backend=engine, temperature=0)
    seconds = time.perf_counter() - start
    for state in states:
        state.text()  # raises if the program failed
    return seconds, engine.scheduler.num_tokens_computed - computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--num-programs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shots", type=int, default=8, help="few-shot examples (prefix length)")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (GPU runs)")
    parser.add_argument("--max-total-tokens", type=int, default=None, help="KV pool per engine")
    parser.add_argument("--workload", choices=list(WORKLOADS), nargs="+", default=list(WORKLOADS))
    args = parser.parse_args()
    common: dict[str, Any] = dict(
        show_progress=False, log_level="warning", load_format=args.load_format
    )
    if args.max_total_tokens:
        common["max_total_tokens"] = args.max_total_tokens
    engines = {
        "cache on": weft.Engine(args.model_path, **common),
        "cache off": weft.Engine(args.model_path, disable_radix_cache=True, **common),
    }
    device = engines["cache on"].runner.device
    print(f"# {describe_device(device)}; model {args.model_path or 'default (Qwen2.5 0.5B)'}")
    print(f"# {args.num_programs} programs per workload, up to {args.max_tokens} tokens per gen")
    batch = inputs(args.num_programs, args.seed, args.max_tokens, args.shots)
    print(f"{'workload':<9} {'engine':<10} {'programs/s':>10} {'computed tok':>13} {'speed-up':>9}")
    try:
        for name in args.workload:
            program = WORKLOADS[name]
            rows = {label: run(e, program, batch) for label, e in engines.items()}
            off_s, off_tokens = rows["cache off"]
            for label, (seconds, computed) in rows.items():
                print(
                    f"{name:<9} {label:<10} {len(batch) / seconds:>10.2f} {computed:>13} "
                    f"{off_s / seconds:>8.2f}x"
                )
            saved = 1 - rows["cache on"][1] / max(off_tokens, 1)
            print(f"{'':<9} the cache saved {saved:.0%} of the computed tokens")
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(
        "# requests per program:", {n: len(WORKLOADS[n].trace(**batch[0])) for n in args.workload}
    )


if __name__ == "__main__":
    main()
