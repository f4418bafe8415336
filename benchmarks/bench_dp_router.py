"""Data parallelism behind sglang-router: cache-aware routing against round-robin, and scaling.

Each run starts `weft serve --dp-size N --router-policy P` as a user does and sends the
shared-prefix workload (SGLang's generated-shared-prefix shape: groups of requests that share a
long system prompt, each with its own question) with a fixed number of requests in flight. It
prints, per run, the prefix-cache hit rate (cached / prompt tokens, from each answer's meta_info)
and the throughput; the baselines in the same run are round-robin over the same replicas and
one replica alone (linear scaling = dp_size x its throughput).

    python benchmarks/bench_dp_router.py --model-path ../shared/fixtures/models/stories260K-hf
    python benchmarks/bench_dp_router.py --model-path configs/llama-3.1-8b --load-format dummy \\
        --tokenizer-path tok/llama3 --groups 16 --per-group 16 --system-words 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from pathlib import Path

import aiohttp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import LaunchedServer

from common import describe_device

WORDS = [
    "the",
    "a",
    "little",
    "big",
    "girl",
    "boy",
    "dog",
    "cat",
    "tree",
    "park",
    "ball",
    "sun",
    "water",
    "day",
    "night",
    "happy",
    "sad",
    "friend",
    "home",
    "mom",
    "dad",
    "play",
    "run",
    "jump",
    "look",
    "find",
    "red",
    "blue",
    "green",
    "small",
    "tall",
    "bird",
    "fish",
    "cake",
    "book",
    "toy",
    "box",
    "car",
    "house",
    "garden",
    "flower",
    "rain",
    "snow",
    "wind",
    "star",
    "moon",
    "sky",
    "river",
    "hill",
    "road",
    "door",
    "window",
    "bed",
]


def workload(groups: int, per_group: int, system_words: int, seed: int) -> list[str]:
    """groups x per_group prompts: a shared system text of `system_words` words, then a
    question of its own; shuffled, as traffic interleaves them."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = " ".join(rng.choice(WORDS) for _ in range(system_words))
        for _ in range(per_group):
            question = " ".join(rng.choice(WORDS) for _ in range(12))
            prompts.append(f"{system}\nQuestion: {question}\nAnswer:")
    rng.shuffle(prompts)
    return prompts


async def run(url: str, prompts: list[str], output_len: int, concurrency: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    gate = asyncio.Semaphore(concurrency)
    prompt_tokens = cached = out_tokens = 0
    latencies: list[float] = []

    async def one(session: aiohttp.ClientSession, text: str) -> None:
        nonlocal prompt_tokens, cached, out_tokens
        async with gate:
            t = time.perf_counter()
            async with session.post(
                url + "/generate", json={"text": text, "sampling_params": params}
            ) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                meta = (await r.json())["meta_info"]
            latencies.append(time.perf_counter() - t)
        prompt_tokens += meta["prompt_tokens"]
        cached += meta["cached_tokens"]
        out_tokens += meta["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one(session, "warm up")  # (not counted below: its tokens are few)
        prompt_tokens = cached = out_tokens = 0
        latencies.clear()
        t = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        elapsed = time.perf_counter() - t
    return {
        "hit_rate": cached / prompt_tokens,
        "req_s": len(prompts) / elapsed,
        "prompt_tok_s": prompt_tokens / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "mean_latency_s": sum(latencies) / len(latencies),
        "elapsed_s": elapsed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--system-words", type=int, default=100)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="append the results as one JSON line")
    args = p.parse_args()

    flags = ["--model-path", args.model_path, "--load-format", args.load_format]
    if args.tokenizer_path:
        flags += ["--tokenizer-path", args.tokenizer_path]
    if args.max_total_tokens:
        flags += ["--max-total-tokens", str(args.max_total_tokens)]
    prompts = workload(args.groups, args.per_group, args.system_words, args.seed)
    runs = {
        f"dp {args.dp_size}, cache_aware": ["--dp-size", str(args.dp_size)],
        f"dp {args.dp_size}, round_robin": [
            "--dp-size",
            str(args.dp_size),
            "--router-policy",
            "round_robin",
        ],
        "one replica": [],
    }
    results = {}
    for label, extra in runs.items():
        print(f"[{label}] starting ...", flush=True)
        group = LaunchedServer(shlex.join(flags + extra))
        try:
            results[label] = asyncio.run(run(group.url, prompts, args.output_len, args.concurrency))
        finally:
            group.stop()
        r = results[label]
        print(f"[{label}] {r['elapsed_s']:.1f} s, hit rate {r['hit_rate']:.2f}", flush=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"\ndevice    : {describe_device(device)} (each replica: its own processes)")
    print(f"model     : {args.model_path} (load_format={args.load_format})")
    print(
        f"workload  : shared prefix, {args.groups} groups x {args.per_group} requests, system "
        f"{args.system_words} words + a 12-word question, output {args.output_len} (greedy, "
        f"ignore_eos), {args.concurrency} in flight"
    )
    print(
        f"{'run':24} {'hit rate':>8} {'req/s':>7} {'out tok/s':>10} {'latency s':>10} {'seconds':>8}"
    )
    for label, r in results.items():
        print(
            f"{label:24} {r['hit_rate']:8.2f} {r['req_s']:7.2f} {r['output_tok_s']:10.1f} "
            f"{r['mean_latency_s']:10.2f} {r['elapsed_s']:8.1f}"
        )
    aware, rr, one = results.values()
    print(
        f"cache_aware / round_robin: hit rate {aware['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x, "
        f"throughput {aware['req_s'] / rr['req_s']:.2f}x; scaling over one replica: "
        f"{aware['req_s'] / one['req_s']:.2f}x ({aware['req_s'] / (args.dp_size * one['req_s']):.2f} "
        "of linear)"
    )
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(
                json.dumps(
                    {"device": describe_device(device), "args": vars(args), "results": results}
                )
                + "\n"
            )


if __name__ == "__main__":
    main()
