"""Offline throughput: N requests through the in-process Engine, all submitted at once.

Prints prompt and output tok/s, mean TTFT and ITL, the cache hit rate and the device; the
baselines measured in the same run are the memory roofline of single-stream decode (device copy
bandwidth / weight bytes per step) and, with --compare-no-cache, the same workload with the
radix cache off.

    python benchmarks/bench_offline.py --num-prompts 8 --input-len 128 --output-len 64
    python benchmarks/bench_offline.py --model-path cfg_dir --load-format dummy \\
        --tokenizer-path tok_dir --workload shared-prefix --compare-no-cache
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weft import Engine

from common import (
    copy_bandwidth,
    decode_weight_bytes,
    describe_device,
    linear_macs_per_token,
    random_prompts,
    shared_prefix_prompts,
    sync_device,
)

PROGRESS_EVERY_S = 15.0


def build_workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    if args.workload == "random":
        return random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    per_group = max(args.num_prompts // args.groups, 1)
    return shared_prefix_prompts(
        args.groups, per_group, args.system_len, args.input_len, vocab, args.seed
    )


async def run_workload(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    ttfts: list[float] = []
    itls: list[float] = []
    cached = 0
    out_tokens = 0

    async def one(prompt: list[int]) -> None:
        nonlocal cached, out_tokens
        start = last = time.perf_counter()
        first = True
        async for chunk in engine.generate_stream(input_ids=prompt, sampling_params=params):
            now = time.perf_counter()
            if first:
                ttfts.append(now - start)
                first = False
            else:
                itls.append(now - last)
            last = now
            meta = chunk["meta_info"]
        cached += meta["cached_tokens"]
        out_tokens += meta["completion_tokens"]

    t = time.perf_counter()
    runs = [asyncio.ensure_future(one(p)) for p in prompts]
    while True:
        done, _ = await asyncio.wait(runs, timeout=PROGRESS_EVERY_S)
        if len(done) == len(runs):
            break
        print(
            f"  {len(done)}/{len(runs)} requests done, {len(ttfts)} started, "
            f"{time.perf_counter() - t:.0f} s",
            flush=True,
        )
    for run in runs:
        run.result()  # re-raise a request's failure
    elapsed = time.perf_counter() - t
    in_tokens = sum(len(p) for p in prompts)
    return {
        "requests": len(prompts),
        "elapsed_s": elapsed,
        "prompt_tok_s": in_tokens / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "mean_ttft_ms": 1e3 * statistics.mean(ttfts),
        "mean_itl_ms": 1e3 * statistics.mean(itls) if itls else float("nan"),
        "cache_hit_rate": cached / in_tokens,
    }


def single_stream_decode(engine: Engine, vocab: int, output_len: int) -> float:
    prompt = random_prompts(1, 16, vocab, seed=99)[0]
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 4})
    t = time.perf_counter()
    out = engine.generate(input_ids=prompt + [vocab - 1], sampling_params=params)
    return out["meta_info"]["completion_tokens"] / (time.perf_counter() - t)


def prefill_rate(engine: Engine, vocab: int, length: int) -> float:
    """Prompt tokens a second of one prompt of `length` tokens alone (best of 2, cache off)."""
    prompt = random_prompts(1, length, vocab, seed=98)[0]
    params = {"temperature": 0, "max_new_tokens": 1}
    best = float("inf")
    for _ in range(2):
        engine.flush_cache()
        t = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params=params)
        best = min(best, time.perf_counter() - t)
    return length / best


def plain_matmul_gflops(
    rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device
) -> float:
    """GFLOP/s of torch's own [rows, k] x [k, n] product in `dtype` (best of 5): the processor's
    matmul rate, beside which the prefill's is read."""
    x = torch.randn(rows, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(5):
        sync_device(device)
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        sync_device(device)
        best = min(best, time.perf_counter() - t)
    return 2 * rows * n * k / best / 1e9


def hf_single_stream(
    folder: str, dtype: torch.dtype, device: torch.device, vocab: int, output_len: int
) -> float:
    """HF transformers greedy decode of the same weights, single stream (the same-run baseline)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    prompt = torch.tensor([random_prompts(1, 16, vocab, seed=99)[0] + [vocab - 1]], device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(prompt, max_new_tokens=4, min_new_tokens=4, **kwargs)
    t = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
    elapsed = time.perf_counter() - t
    del model
    return (out.shape[1] - prompt.shape[1]) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded default model")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--quantization", default="auto", help="e.g. fp8: linear weights in e4m3 (EngineConfig)"
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8_e4m3 (EngineConfig)")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--workload", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128, help="prompt (or question) tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512, help="the prefill rate's prompt")
    p.add_argument("--cpu-float32-products", action="store_true", help="see weft serve --help")
    p.add_argument("--quantized-prefill", action="store_true", help="see weft serve --help")
    p.add_argument("--groups", type=int, default=2, help="shared-prefix: number of groups")
    p.add_argument("--system-len", type=int, default=512, help="shared-prefix: prefix tokens")
    p.add_argument("--compare-no-cache", action="store_true")
    p.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also time HF transformers single-stream decode on the same weights",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="append the results as one JSON line")
    args = p.parse_args()

    common = dict(
        tokenizer_path=args.tokenizer_path,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        cpu_float32_products=args.cpu_float32_products,
        quantized_prefill=args.quantized_prefill,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        attention_backend=args.attention_backend,
        log_level="warning",
    )
    runs = [("radix cache on", False)] + (
        [("radix cache off", True)] if args.compare_no_cache else []
    )
    results = {}
    for label, disable in runs:
        engine = Engine(args.model_path, disable_radix_cache=disable, **common)
        vocab = engine.model_config.vocab_size
        device = engine.runner.device
        prompts = build_workload(args, vocab)
        if label == "radix cache on":
            # NOTE: first, while only the main thread has run torch work (see RESULTS.md: OpenMP
            # kernels slow down once another thread has used them, on the 2-core CPU)
            single_fresh = single_stream_decode(engine, vocab, args.output_len)
        print(f"[{label}] {len(prompts)} requests, warming up ...", flush=True)
        asyncio.run(run_workload(engine, prompts[:1], 4))
        engine.flush_cache()
        results[label] = asyncio.run(run_workload(engine, prompts, args.output_len))
        if label == "radix cache on":
            bw = copy_bandwidth(device)
            weight_bytes = decode_weight_bytes(engine.runner.model)
            single = single_stream_decode(engine, vocab, args.output_len)
            prefill = prefill_rate(engine, vocab, args.prefill_len)
            macs = linear_macs_per_token(engine.runner.model)
            config = engine.model_config
            dtype = str(engine.runner.dtype).removeprefix("torch.")
            torch_dtype, folder = engine.runner.dtype, str(engine.source.folder)
            backend = type(engine.runner.attention).__name__
            pool = engine.runner.kv_pool
            kv_text = f"{pool.size} tokens in {str(pool.dtype).removeprefix('torch.')}"
        engine.shutdown()
        del engine  # NOTE: the next run's engine sizes its KV pool from the memory left free
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    hf = None
    if args.hf_baseline:
        hf = hf_single_stream(folder, torch_dtype, device, vocab, args.output_len)
    print(f"\ndevice    : {describe_device(device)}")
    print(
        f"model     : {args.model_path or 'default (Qwen2.5-Coder-0.5B-Instruct)'} "
        f"{config.architecture}, {dtype}, load_format={args.load_format}, {backend}, "
        f"quantization={args.quantization}, kv_cache_dtype={args.kv_cache_dtype}"
    )
    print(f"kv pool   : {kv_text}")
    shape = (
        f"{args.groups} groups x system {args.system_len} + question {args.input_len}"
        if args.workload == "shared-prefix"
        else f"input {args.input_len}"
    )
    print(
        f"workload  : {args.workload}, {len(prompts)} prompts, {shape}, output "
        f"{args.output_len} (ignore_eos, greedy)"
    )
    roof = bw * 1e9 / weight_bytes
    print(
        f"roofline  : copy bandwidth {bw:.1f} GB/s, {weight_bytes / 1e9:.2f} GB of weights per "
        f"decode step -> {roof:.1f} tok/s single stream"
    )
    print(
        f"single    : {single_fresh:.1f} tok/s decode ({single_fresh / roof:.2f}x the roofline) "
        f"before the batch run; {single:.1f} tok/s after it"
    )
    if macs:
        rows = min(args.prefill_len, args.chunked_prefill_size)
        shape = (2 * config.intermediate_size, config.hidden_size)
        plain = {
            str(dt).removeprefix("torch."): plain_matmul_gflops(rows, *shape, dt, device)
            for dt in dict.fromkeys((torch_dtype, torch.float32))
        }
        rate = prefill * 2 * macs / 1e9
        best = max(plain.values())
        listed = ", ".join(f"{name} {g:.1f}" for name, g in plain.items())
        print(
            f"prefill   : {args.prefill_len}-token prompt alone, {prefill:.1f} tok/s = {rate:.1f} "
            f"GFLOP/s in the linear layers ({rate / best:.2f}x the plain matmul: {rows} x "
            f"{shape[1]} @ {shape[1]} x {shape[0]}, {listed} GFLOP/s)"
        )
    if hf is not None:
        print(
            f"HF        : {hf:.1f} tok/s decode, same weights and dtype "
            f"(weft {single_fresh / hf:.2f}x before, {single / hf:.2f}x after the batch run)"
        )
    header = (
        f"{'run':16} {'prompt tok/s':>13} {'output tok/s':>13} {'TTFT ms':>9} "
        f"{'ITL ms':>8} {'cache hit':>9} {'seconds':>8}"
    )
    print(header)
    for label, r in results.items():
        print(
            f"{label:16} {r['prompt_tok_s']:13.1f} {r['output_tok_s']:13.1f} "
            f"{r['mean_ttft_ms']:9.1f} {r['mean_itl_ms']:8.1f} {r['cache_hit_rate']:9.2f} "
            f"{r['elapsed_s']:8.2f}"
        )
    if "radix cache off" in results:
        on, off = results["radix cache on"], results["radix cache off"]
        print(f"cache on / off throughput: {off['elapsed_s'] / on['elapsed_s']:.2f}x")
    if args.json_out:
        record = {
            "device": describe_device(device),
            "args": vars(args),
            "results": results,
            "single_stream_tok_s": single,
            "single_stream_fresh_tok_s": single_fresh,
            "roofline_tok_s": roof,
            "prefill_tok_s": prefill,
            "copy_gb_s": bw,
        }
        with open(args.json_out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
