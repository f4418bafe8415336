"""weft vs llama.cpp (llama-cpp-python) on this CPU, on the same GGUF file: the embedded default
model's Q4_K_M (Qwen2.5-Coder-0.5B-Instruct). llama.cpp runs its blocks as they are; weft keeps
them quantized (int4 / int8, `--quantization gguf`, its default on a CPU with bf16 in hardware) or
dequantizes them (`none`); `--quantization none,auto` runs weft once per value in the same run,
`--cpu-kernels auto,torch` once with weft's own CPU kernels for the quantized products and once
with torch's.

Workloads, greedy, end tokens ignored, the same raw prompt text on both sides (each side
tokenizes it; the script checks that the ids agree):

  decode   a 32-token prompt, 128 new tokens: decode tok/s (first token excluded) and TTFT
  prefill  a 512-token prompt, 1 new token: prompt tok/s
  batch    8 prompts of 128 tokens, 64 new tokens each, all submitted at once to weft; llama.cpp
           (its high-level API has no batch) runs the same 8 one after another, its TTFTs counted
           from the same common start

Single-stream times are medians of --repeats runs: TTFT is a 1-token run, decode tok/s is
(N - 1) / (time of the N-token run - TTFT), the same on both sides. Each side runs alone in a
child process of this script (one after the other), with the same thread count.

    pip install 'weft[llamacpp]'    # builds llama.cpp from source (5-15 minutes)
    python benchmarks/bench_llamacpp.py [--threads N] [--dtype float32] [--quantization none,auto]

NOTE: llama.cpp's default build (-march=native) uses AMX where the CPU lists it; a VM whose
kernel lists AMX but does not enable it (this project's CPU machines) kills the first forward
with SIGILL (`tilezero`). Build it without AMX there:

    CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="$CFLAGS" \
        pip install --force-reinstall --no-deps llama-cpp-python
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
PROGRESS_EVERY_S = 15.0
# Words that are one token each, with their leading space, in Qwen2.5's vocabulary: a prompt of
# n of them is n tokens on both sides (checked at run time).
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her their it this which are be "
    "have had not but what all were when we there can an your one more has if will about out up "
    "other into so some them these would time like him only its two then first any new may people "
    "could now made over such after also did many most me long way down use see even our because "
    "just where much good still through well back year work should three last being right never "
    "might know same under very another day around every life while world great between each "
    "since both house small place old part man hand number home few end large thing general left "
    "state set point school high government system group week case fact word"
)
WORDS = _WORD_TEXT.split()


def prompt_text(n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(["The"] + [rng.choice(WORDS) for _ in range(n_tokens - 1)])


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "decode": prompt_text(args.decode_prompt_len, seed=1),
        "prefill": prompt_text(args.prefill_len, seed=2),
        "batch": [prompt_text(args.batch_prompt_len, seed=10 + i) for i in range(args.batch)],
        "warmup": prompt_text(16, seed=0),
    }


def progress(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


# ---- the measurements, the same for both sides ---------------------------------------------

# generate(ids, n) -> the n output ids, after timing nothing itself
Generate = Callable[[list[int], int], list[int]]


def timed(generate: Generate, ids: list[int], n: int) -> tuple[float, list[int]]:
    t = time.perf_counter()
    out = generate(ids, n)
    elapsed = time.perf_counter() - t
    if len(out) != n:
        raise RuntimeError(f"asked for {n} tokens, got {len(out)}")
    return elapsed, out


def single_stream(generate: Generate, ids: dict[str, list[int]], args: argparse.Namespace) -> dict:
    generate(ids["warmup"], 4)
    ttfts, totals, prefills = [], [], []
    out: list[int] = []
    for r in range(args.repeats):
        ttfts.append(timed(generate, ids["decode"], 1)[0])
        total, out = timed(generate, ids["decode"], args.decode_len)
        totals.append(total)
        progress(f"decode run {r + 1}/{args.repeats}: {total:.2f} s for {args.decode_len} tokens")
    for r in range(args.repeats):
        prefills.append(timed(generate, ids["prefill"], 1)[0])
        progress(f"prefill run {r + 1}/{args.repeats}: {prefills[-1]:.2f} s")
    ttft = statistics.median(ttfts)
    prefill = statistics.median(prefills)
    return {
        "decode_tok_s": (args.decode_len - 1) / (statistics.median(totals) - ttft),
        "ttft_ms": 1e3 * ttft,
        "prefill_tok_s": len(ids["prefill"]) / prefill,
        "prefill_ms": 1e3 * prefill,
        "decode_output": out,
    }


def batch_result(ttfts: list[float], out_tokens: int, elapsed: float) -> dict:
    return {
        "batch_mean_ttft_ms": 1e3 * statistics.mean(ttfts),
        "batch_max_ttft_ms": 1e3 * max(ttfts),
        "batch_output_tok_s": out_tokens / elapsed,
        "batch_elapsed_s": elapsed,
    }


# ---- the sides, each in its own child process ------------------------------------------------


def run_llamacpp(args: argparse.Namespace, texts: dict[str, Any]) -> dict:
    import llama_cpp

    progress(f"llama.cpp: loading {args.gguf}")
    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=max(1024, args.prefill_len + 8),
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )

    def tokenize(text: str) -> list[int]:
        return list(llm.tokenize(text.encode(), add_bos=True, special=True))

    def generate(ids: list[int], n: int) -> list[int]:
        # NOTE: reset, or generate() reuses the KV of the longest common prefix with the last
        # call; generate() itself never stops at an end token (create_completion does).
        llm.reset()
        out: list[int] = []
        for token in llm.generate(ids, temp=0.0, reset=True):
            out.append(token)
            if len(out) == n:
                break
        return out

    ids = tokenized(tokenize, texts)
    progress("llama.cpp: single stream")
    result = single_stream(generate, ids, args)
    progress(f"llama.cpp: batch of {args.batch}, one after another")
    ttfts: list[float] = []
    out_tokens = 0
    t = time.perf_counter()
    for i, prompt in enumerate(ids["batch"]):
        llm.reset()
        token_count = 0
        for token_count, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True), 1):
            if token_count == 1:
                ttfts.append(time.perf_counter() - t)
            if token_count == args.batch_output_len:
                break
        out_tokens += token_count
        if token_count != args.batch_output_len:
            raise RuntimeError(f"asked for {args.batch_output_len} tokens, got {token_count}")
        progress(f"request {i + 1}/{args.batch} done, {time.perf_counter() - t:.0f} s")
    result.update(batch_result(ttfts, out_tokens, time.perf_counter() - t))
    info = llama_cpp.llama_print_system_info()
    result["system_info"] = info.decode() if isinstance(info, bytes) else str(info)
    result["prompt_ids"] = ids
    llm.close()
    return result


def run_weft(args: argparse.Namespace, texts: dict[str, Any]) -> dict:
    import torch

    from weft import Engine
    from weft.runtime.models.layers import QuantWeight
    from weft.runtime.tokenizer import encode_prompt

    progress(
        f"weft: starting Engine(dtype={args.dtype}, quantization={args.quantization}, "
        f"cpu_kernels={args.cpu_kernels}, num_threads={args.threads})"
    )
    engine = Engine(
        dtype=args.dtype,
        quantization=args.quantization,
        cpu_kernels=args.cpu_kernels,
        num_threads=args.threads,
        log_level="warning",
    )

    def params(n: int) -> dict[str, Any]:
        return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}

    def generate(ids: list[int], n: int) -> list[int]:
        engine.flush_cache()  # NOTE: the repeats share prompts; llama.cpp reuses no KV either
        out = engine.generate(input_ids=ids, sampling_params=params(n))
        assert isinstance(out, dict)
        return list(out["output_ids"])

    ids = tokenized(lambda text: encode_prompt(engine.tokenizer, text), texts)
    # NOTE: first, on the main thread: once the engine thread has run torch work (the batch's
    # async streams), single-stream decode slows on this CPU (RESULTS.md, bench_offline)
    progress("weft: single stream (Engine.generate on the main thread)")
    result = single_stream(generate, ids, args)
    progress(f"weft: batch of {args.batch}, all submitted at once")
    engine.flush_cache()
    result.update(asyncio.run(weft_batch(engine, ids["batch"], params(args.batch_output_len))))
    result["dtype"] = str(engine.runner.dtype).removeprefix("torch.")
    quantized = [m for m in engine.runner.model.modules() if isinstance(m, QuantWeight)]
    kernels = f", {quantized[0].kernel}'s kernels" if quantized else ""
    result["weights"] = (
        f"{len(quantized)} quantized linear weights{kernels}" if quantized else "dense"
    )
    result["torch_threads"] = torch.get_num_threads()
    result["prompt_ids"] = ids
    engine.shutdown()
    return result


async def weft_batch(engine: Any, prompts: list[list[int]], params: dict[str, Any]) -> dict:
    ttfts: list[float] = []
    out_tokens = 0

    async def one(prompt: list[int]) -> None:
        nonlocal out_tokens
        first = True
        async for chunk in engine.generate_stream(input_ids=prompt, sampling_params=params):
            if first:
                ttfts.append(time.perf_counter() - t)
                first = False
            meta = chunk["meta_info"]
        out_tokens += meta["completion_tokens"]

    t = time.perf_counter()
    runs = [asyncio.ensure_future(one(p)) for p in prompts]
    while True:
        done, _ = await asyncio.wait(runs, timeout=PROGRESS_EVERY_S)
        progress(f"{len(done)}/{len(runs)} requests done, {time.perf_counter() - t:.0f} s")
        if len(done) == len(runs):
            break
    for run in runs:
        run.result()  # re-raise a request's failure
    return batch_result(ttfts, out_tokens, time.perf_counter() - t)


def tokenized(tokenize: Callable[[str], list[int]], texts: dict[str, Any]) -> dict[str, Any]:
    return {
        key: [tokenize(t) for t in value] if isinstance(value, list) else tokenize(value)
        for key, value in texts.items()
    }


# ---- the parent: run both sides, print the comparison ---------------------------------------


def cpu_description() -> tuple[str, list[str]]:
    model, flags = "unknown CPU", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return model, [f"{flag}={'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS]


def run_side(
    side: str, args: argparse.Namespace, gguf: Path, out_dir: str, extra: tuple[str, ...] = ()
) -> dict:
    result_file = Path(out_dir) / f"{side}{'-'.join(extra)}.json"
    argv = [*sys.argv[1:], "--side", side, "--gguf", str(gguf), "--result-file", str(result_file)]
    argv += extra
    print(f"[{side}] running in a child process ...", flush=True)
    t = time.perf_counter()
    code = subprocess.run([sys.executable, __file__, *argv]).returncode
    if code == -signal.SIGILL and side == "llamacpp":
        sys.exit(f"[{side}] died of SIGILL: rebuild llama-cpp-python without AMX (see --help)")
    if code != 0:
        sys.exit(f"[{side}] failed with exit status {code}")
    print(f"[{side}] done in {time.perf_counter() - t:.0f} s", flush=True)
    return dict(json.loads(result_file.read_text()))


def token_counts(ids: dict[str, Any]) -> str:
    batch = sorted({len(p) for p in ids["batch"]})
    return f"decode {len(ids['decode'])}, prefill {len(ids['prefill'])}, batch {batch}"


def print_report(args: argparse.Namespace, weft: dict, lcpp: dict) -> None:
    rows = [
        ("single-stream decode, tok/s (first token excluded)", "decode_tok_s", "{:.1f}"),
        (f"single-stream TTFT, {args.decode_prompt_len}-token prompt, ms", "ttft_ms", "{:.0f}"),
        (f"prefill, {args.prefill_len}-token prompt, prompt tok/s", "prefill_tok_s", "{:.0f}"),
        (f"prefill, {args.prefill_len}-token prompt, ms", "prefill_ms", "{:.0f}"),
        (f"batch {args.batch} x {args.batch_prompt_len} in: mean TTFT, ms", "batch_mean_ttft_ms",
         "{:,.0f}"),
        ("batch: max TTFT, ms", "batch_max_ttft_ms", "{:,.0f}"),
        (f"batch ({args.batch_output_len} out each): output tok/s", "batch_output_tok_s",
         "{:.1f}"),
        ("batch: elapsed, s", "batch_elapsed_s", "{:.2f}"),
    ]  # fmt: skip
    print("\n| metric | weft | llama.cpp | weft / llama.cpp |")
    print("|---|---:|---:|---:|")
    for label, key, fmt in rows:
        w, c = weft[key], lcpp[key]
        print(f"| {label} | {fmt.format(w)} | {fmt.format(c)} | {w / c:.2f}x |")
    print(
        "\n(ratios: above 1 is weft faster for tok/s, slower for ms and s; llama.cpp ran the "
        f"batch's {args.batch} prompts one after another through llama-cpp-python, its TTFTs "
        "counted from the common start)"
    )
    decode_ratio = weft["decode_tok_s"] / lcpp["decode_tok_s"]
    ttft_s = weft["batch_mean_ttft_ms"] / 1e3
    print("\nissue-21 targets:")
    print(f"  single-stream decode >= 0.7x llama.cpp : {decode_ratio:.2f}x", end="")
    print("  (met)" if decode_ratio >= 0.7 else "  (not met)")
    print(f"  batch {args.batch} x {args.batch_prompt_len} TTFT < 5 s: mean {ttft_s:.2f} s", end="")
    print("  (met)" if ttft_s < 5 else "  (not met)")


def parent(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit(
            "bench_llamacpp needs llama-cpp-python: pip install 'weft[llamacpp]' "
            "(it builds llama.cpp from source, 5-15 minutes)"
        )
    from weft.runtime.loaders.default_model import default_cache_root, default_model_gguf

    gguf = default_model_gguf(default_cache_root())
    with tempfile.TemporaryDirectory(prefix="bench_llamacpp.") as out_dir:
        lcpp = run_side("llamacpp", args, gguf, out_dir)
        wefts = {
            (q, k): run_side("weft", args, gguf, out_dir, ("--quantization", q, "--cpu-kernels", k))
            for q in args.quantization.split(",")
            for k in args.cpu_kernels.split(",")
        }
    for (q, k), weft in wefts.items():
        print(f"\n===== weft --quantization {q} --cpu-kernels {k}: {weft['weights']} =====")
        report(args, gguf, weft, lcpp)


def report(args: argparse.Namespace, gguf: Path, weft: dict, lcpp: dict) -> None:

    model, flags = cpu_description()
    print(f"\nCPU       : {model}, {os.cpu_count()} cores; {', '.join(flags)}")
    print(f"llama.cpp : llama-cpp-python {importlib.metadata.version('llama-cpp-python')}")
    print(f"            {lcpp['system_info'].strip()}")
    print(f"torch     : {importlib.metadata.version('torch')}")
    print(f"threads   : {args.threads} (llama.cpp n_threads; weft torch {weft['torch_threads']})")
    print(f"weft dtype: {weft['dtype']} (--dtype {args.dtype})")
    print(f"model     : {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)")
    print(
        f"workload  : greedy, end tokens ignored, raw prompts; single-stream medians of "
        f"{args.repeats}; decode {args.decode_len} new tokens; batch {args.batch} x "
        f"{args.batch_output_len} new tokens"
    )
    print(f"prompt tokens, weft      : {token_counts(weft['prompt_ids'])}")
    print(f"prompt tokens, llama.cpp : {token_counts(lcpp['prompt_ids'])}")
    same = weft["prompt_ids"] == lcpp["prompt_ids"]
    print(f"prompt ids agree         : {'yes' if same else 'NO: the sides read different tokens'}")
    agree = 0
    for a, b in zip(weft["decode_output"], lcpp["decode_output"], strict=True):
        if a != b:
            break
        agree += 1
    print(f"decode outputs agree on the first {agree} of {args.decode_len} greedy tokens")
    print_report(args, weft, lcpp)
    if not same:
        sys.exit("the two tokenizers disagree on the prompts: the comparison is not like for like")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="both sides (default: all)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument(
        "--quantization",
        default="auto",
        help="weft's GGUF weights: auto, none or gguf; several comma-separated: one weft run each",
    )
    p.add_argument(
        "--cpu-kernels",
        default="auto",
        help="weft's products of quantized weights: auto (weft's own) or torch; comma-separated: "
        "one weft run each (times each --quantization)",
    )
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--decode-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batch-prompt-len", type=int, default=128)
    p.add_argument("--batch-output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="single-stream runs (median)")
    # internal: a child process running one side
    p.add_argument("--side", choices=["llamacpp", "weft"], help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side is None:
        parent(args)
        return
    texts = workload(args)
    run = run_llamacpp if args.side == "llamacpp" else run_weft
    result = run(args, texts)
    Path(args.result_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
