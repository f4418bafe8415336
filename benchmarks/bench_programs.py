"""DSL program throughput: a few-shot select + fork-and-gen program, run one by one and as a
batch on one event loop (the radix cache shares the few-shot prefix).

    python benchmarks/bench_programs.py --model-path ../shared/fixtures/models/stories260K-hf
    python benchmarks/bench_programs.py                       # the embedded default model
    python benchmarks/bench_programs.py --url http://127.0.0.1:30000

The workload follows SGLang's few-shot benchmarks in shape (a long shared few-shot prefix,
a short question, select over labels, then two short parallel gens), with seeded inputs.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import weft

SHOTS = [
    ("The cat sat on the warm mat and purred.", "happy"),
    ("The dog lost its ball and cried all day.", "sad"),
    ("Tom found a shiny coin in the park.", "happy"),
    ("Lily's kite broke in the strong wind.", "sad"),
] * 2
SUBJECTS = ["Ben", "Mia", "The bird", "A little fox", "Sue", "The old man"]
EVENTS = ["found a toy", "fell in the mud", "got a cake", "lost a shoe", "saw a rainbow"]


@weft.function
def judge(s, story: str, max_tokens: int):
    for text, label in SHOTS:
        s += f"Story: {text}\nMood: {label}\n\n"
    s += f"Story: {story}\nMood: " + weft.select("mood", ["happy", "sad"]) + "\n"
    forks = s.fork(2)
    forks[0] += "Why:" + weft.gen("note", max_tokens=max_tokens, stop="\n")
    forks[1] += "Next:" + weft.gen("note", max_tokens=max_tokens, stop="\n")
    forks.join()


def inputs(n: int, seed: int, max_tokens: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"story": f"{rng.choice(SUBJECTS)} {rng.choice(EVENTS)}.", "max_tokens": max_tokens}
        for _ in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--url", default=None)
    parser.add_argument("--num-programs", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    backend: Any
    if args.url:
        backend = weft.RuntimeEndpoint(args.url)
    else:
        backend = weft.Engine(args.model_path, show_progress=False, log_level="warning")
    batch = inputs(args.num_programs, args.seed, args.max_tokens)
    try:
        judge.run(**batch[0], backend=backend, temperature=0)  # warm-up
        t = time.perf_counter()
        one_by_one = [judge.run(**kw, backend=backend, temperature=0) for kw in batch]
        seq_s = time.perf_counter() - t
        t = time.perf_counter()
        batched = judge.run_batch(batch, backend=backend, temperature=0)
        batch_s = time.perf_counter() - t
    finally:
        if hasattr(backend, "shutdown"):
            backend.shutdown()
    tokens = sum(m["completion_tokens"] for s in batched for m in s.get_meta_info("note"))
    same = sum(a["mood"] == b["mood"] for a, b in zip(one_by_one, batched, strict=True))
    print(f"programs: {len(batch)}, requests per program: {len(judge.trace(**batch[0]))}")
    print(f"one by one: {len(batch) / seq_s:7.2f} programs/s ({seq_s:.2f} s)")
    print(
        f"run_batch : {len(batch) / batch_s:7.2f} programs/s ({batch_s:.2f} s), "
        f"{tokens / batch_s:.1f} generated tok/s"
    )
    print(f"select agrees between the two runs: {same}/{len(batch)}")


if __name__ == "__main__":
    main()
