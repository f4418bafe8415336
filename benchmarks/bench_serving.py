"""HTTP serving load: requests at a rate (Poisson) or a fixed concurrency against a weft (or any
SGLang-compatible) server; random or shared-prefix workloads.

Prints request / input / output throughput, TTFT, ITL and E2E (mean, p50, p90, p99) and the
server's prefix-cache hit rate over the run. With --launch the script starts the server itself
(port 0, SIGTERM at the end); --compare-no-cache then runs the same workload against a second
server with the radix cache off and prints the ratio.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 64
    python benchmarks/bench_serving.py --launch "--max-total-tokens 16384" \\
        --dataset generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 8 \\
        --max-concurrency 8 --compare-no-cache

Needs aiohttp (pip install 'weft[bench]').
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

READY = re.compile(r"weft: ready, serving .* at (http://[^ ]+) ")


@dataclass
class Request:
    input_ids: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


# ---- workloads ------------------------------------------------------------------------------


def build_requests(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = random.Random(args.seed)
    # NOTE: random ids from the lower part of the vocabulary: ordinary tokens, not specials.
    hi = max(4, min(vocab, 30000))
    lo = min(1000, hi // 4)

    def ids(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    if args.dataset == "random":
        return [
            Request(
                ids(_ranged(rng, args.random_input_len, args.random_range_ratio)),
                _ranged(rng, args.random_output_len, args.random_range_ratio),
            )
            for _ in range(args.num_prompts)
        ]
    # SGLang's generated-shared-prefix: groups of prompts sharing a long system prompt
    systems = [ids(args.gsp_system_prompt_len) for _ in range(args.gsp_num_groups)]
    reqs = [
        Request(system + ids(args.gsp_question_len), args.gsp_output_len)
        for system in systems
        for _ in range(args.gsp_prompts_per_group)
    ]
    rng.shuffle(reqs)  # groups interleave, as the clients of one app would
    return reqs


def _ranged(rng: random.Random, n: int, ratio: float) -> int:
    return max(1, rng.randint(int(n * ratio), n)) if ratio < 1.0 else n


# ---- one request ----------------------------------------------------------------------------


async def send(session: aiohttp.ClientSession, url: str, backend: str, req: Request) -> Result:
    if backend == "native":
        path = "/generate"
        body: dict[str, Any] = {
            "input_ids": req.input_ids,
            "stream": True,
            "sampling_params": {
                "max_new_tokens": req.output_len,
                "ignore_eos": True,
                "temperature": 0.0,
            },
        }
    else:
        path = "/v1/completions"
        body = {
            "prompt": req.input_ids,
            "max_tokens": req.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    result = Result(prompt_len=len(req.input_ids))
    start = last = time.perf_counter()
    try:
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if _progressed(chunk, backend, result):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    return result


def _progressed(chunk: dict[str, Any], backend: str, result: Result) -> bool:
    """Whether the chunk brought new tokens; updates the token and cache counts."""
    if backend == "native":
        meta = chunk["meta_info"]
        produced = int(meta["completion_tokens"])
        result.cached = int(meta.get("cached_tokens") or 0)
        progressed = produced > result.output_len
        result.output_len = produced
        return progressed
    usage = chunk.get("usage")
    if usage:  # the last chunk (include_usage): exact counts
        result.output_len = int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        result.cached = int(details.get("cached_tokens") or 0)
    return any(c.get("text") for c in chunk.get("choices") or [])


# ---- the run --------------------------------------------------------------------------------


async def run_load(args: argparse.Namespace, url: str, reqs: list[Request]) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await send(session, url, args.backend, Request(reqs[0].input_ids[:8], 2))  # warm up
        before = await _server_info(session, url)
        gate = asyncio.Semaphore(args.max_concurrency or len(reqs))
        rng = random.Random(args.seed + 1)

        async def limited(req: Request) -> Result:
            async with gate:
                return await send(session, url, args.backend, req)

        tasks = []
        start = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(limited(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await _server_info(session, url)
    return summarize(results, duration, before, after)


async def _server_info(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    try:
        async with session.get(url + "/get_server_info") as resp:
            return dict(await resp.json()) if resp.status == 200 else {}
    except aiohttp.ClientError:
        return {}


def percentiles_ms(values: list[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 of latencies in seconds, in milliseconds."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000

    return {
        "mean": statistics.fmean(values) * 1000,
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
    }


def summarize(
    results: list[Result], duration: float, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_len for r in ok)
    output = sum(r.output_len for r in ok)
    hit = None
    if before and after and "prompt_tokens_total" in after:
        d_prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
        d_cached = after["cached_tokens_total"] - before["cached_tokens_total"]
        hit = d_cached / d_prompt if d_prompt else 0.0
    sched = {  # the scheduler's counters over the run (steps, retractions) and its peak batch
        key: after[key] - before.get(key, 0) if key != "peak_running" else after[key]
        for key in ("num_steps", "num_retractions", "peak_running")
        if key in after
    }
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": prompt / duration,
        "output_throughput": output / duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "ttft_ms": percentiles_ms([r.ttft for r in ok]),
        "itl_ms": percentiles_ms([x for r in ok for x in r.itl]),
        "e2e_ms": percentiles_ms([r.e2e for r in ok]),
        "server_cache_hit_rate": hit,
        "client_cache_hit_rate": sum(r.cached for r in ok) / prompt if prompt else 0.0,
        "scheduler": sched,
    }


def print_report(title: str, s: dict[str, Any]) -> None:
    print(f"\n===== {title} =====")
    print(f"completed / failed        {s['completed']} / {s['failed']}")
    for error in s["errors"]:
        print(f"  error: {error}")
    print(f"duration                  {s['duration_s']:.2f} s")
    print(f"request throughput        {s['request_throughput']:.2f} req/s")
    print(f"input throughput          {s['input_throughput']:.1f} tok/s")
    print(f"output throughput         {s['output_throughput']:.1f} tok/s")
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        v = s[key]
        print(
            f"{name:<5} ms  mean {v['mean']:9.1f}  p50 {v['p50']:9.1f}  p90 {v['p90']:9.1f}"
            f"  p99 {v['p99']:9.1f}"
        )
    hit = s["server_cache_hit_rate"]
    print(
        f"server cache hit rate     {'n/a' if hit is None else f'{hit:.1%}'}"
        f"   (client-side: {s['client_cache_hit_rate']:.1%})"
    )
    if s["scheduler"]:
        print(
            "scheduler                 " + ", ".join(f"{k} {v}" for k, v in s["scheduler"].items())
        )


# ---- launching a server ---------------------------------------------------------------------


class LaunchedServer:
    """`python -m weft.launch_server --port 0 ARGS`, stopped with SIGTERM."""

    def __init__(self, server_args: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "weft.launch_server",
            "--port",
            "0",
            "--log-level",
            "warning",
            "--no-show-progress",
            *shlex.split(server_args),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                match = READY.search(line)
                if match:
                    self.url = match.group(1)
                    ready.set()
                elif "error" in line.lower() or "cannot start" in line:
                    print(f"[server] {line}", end="", file=sys.stderr)
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(600) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _model_info(url: str) -> dict[str, Any]:
    async def get() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.get(url + "/get_model_info") as r:
            return dict(await r.json())

    return asyncio.run(get())


def bench_once(args: argparse.Namespace, url: str, title: str) -> dict[str, Any]:
    info = _model_info(url)
    reqs = build_requests(args, int(info.get("vocab_size") or 32000))
    stats = asyncio.run(run_load(args, url, reqs))
    print_report(title, stats)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (or use --launch)")
    p.add_argument(
        "--launch",
        default=None,
        metavar="SERVER_ARGS",
        help='start `weft serve` with these flags, e.g. "--max-total-tokens 8192"',
    )
    p.add_argument(
        "--compare-no-cache",
        action="store_true",
        help="with --launch: also run with --disable-radix-cache and print the ratio",
    )
    p.add_argument("--backend", choices=("native", "openai"), default="native")
    p.add_argument("--dataset", choices=("random", "generated-shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=32)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (Poisson arrivals); inf = all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--output-file", default=None, help="append the results as one JSON line")
    args = p.parse_args()
    if (args.base_url is None) == (args.launch is None):
        p.error("give exactly one of --base-url and --launch")

    runs: dict[str, dict[str, Any]] = {}
    if args.base_url:
        runs["server"] = bench_once(args, args.base_url.rstrip("/"), "weft serving")
    else:
        variants = [("radix cache", args.launch)]
        if args.compare_no_cache:
            variants.append(("no cache", args.launch + " --disable-radix-cache"))
        for title, server_args in variants:
            server = LaunchedServer(server_args)
            try:
                with_info = _server_config(server.url)
                print(f"\nserver: {with_info}")
                runs[title] = bench_once(args, server.url, title)
            finally:
                server.stop()
        if "no cache" in runs:
            base, ours = runs["no cache"], runs["radix cache"]
            print(
                f"\nradix cache / no cache: output throughput x"
                f"{ours['output_throughput'] / max(base['output_throughput'], 1e-9):.2f}, "
                f"TTFT p50 x{ours['ttft_ms']['p50'] / max(base['ttft_ms']['p50'], 1e-9):.2f}"
            )
    print(f"\nworkload: {_workload(args)}")
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(
                json.dumps(
                    {"args": vars(args), "runs": runs, "date": time.strftime("%Y-%m-%d %H:%M")}
                )
                + "\n"
            )


def _server_config(url: str) -> str:
    async def get() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.get(url + "/get_server_info") as r:
            return dict(await r.json())

    info = asyncio.run(get())
    model = info.get("model_info", {})
    keys = (
        "max_total_tokens",
        "max_running_requests",
        "chunked_prefill_size",
        "disable_radix_cache",
    )
    return ", ".join(
        [
            f"model={model.get('model_path')}",
            f"device={model.get('device')}",
            f"dtype={model.get('dtype')}",
        ]
        + [f"{k}={info.get(k)}" for k in keys]
    )


def _workload(args: argparse.Namespace) -> str:
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate}/s"
    shape = (
        f"random: {args.num_prompts} prompts, input {args.random_input_len}, output "
        f"{args.random_output_len}, range ratio {args.random_range_ratio}"
        if args.dataset == "random"
        else f"generated-shared-prefix: {args.gsp_num_groups} groups x "
        f"{args.gsp_prompts_per_group} prompts, system {args.gsp_system_prompt_len} + question "
        f"{args.gsp_question_len}, output {args.gsp_output_len}"
    )
    return f"{shape}; backend {args.backend}; rate {rate}; max concurrency {args.max_concurrency}"


if __name__ == "__main__":
    main()
