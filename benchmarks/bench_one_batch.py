"""Static-batch latency (in the spirit of SGLang's bench_one_batch): one batch of equal prompts,
prefilled together and decoded to the same length, with the scheduler stepped on this thread.

    python benchmarks/bench_one_batch.py --model-path benchmarks/configs/llama-3.1-8b \\
        --load-format dummy [--batch-sizes 1 16 64] [--input-len 128] [--output-len 128] \\
        [--hf-baseline] [--json-out results.jsonl]

benchmarks/configs holds the config.json of llama-3.1-8b, qwen2.5-7b, qwen3-8b and
qwen3-30b-a3b (a mixture of experts: 61 GB of bf16 weights, one 80 GB GPU holds it), and
qwen3-8b-fp8 (Qwen3-8B-FP8's quantization_config: dummy weights in 128 x 128 FP8 blocks).
`--quantization fp8` quantizes any of them per output channel at load.

Per batch size: a fresh engine, one short warm-up pass (the first Triton compiles, autotuning
and any lazy CUDA-graph capture happen there), then --repeats measured passes. Reported:
- prefill: the steps until every request has its first token (with chunked prefill a large
  batch takes several steps, the later ones mixed with the decode of the early requests);
- decode: the median of the steps after that which ran the whole batch (the tail where early
  requests have finished is left out), and tok/s = batch / that step time;
- end to end: the first prefill step to the last token.
Baselines measured in the same run:
- the memory roofline: copy bandwidth over the weight bytes one decode step reads (tok/s at
  batch 1), and the bandwidth weft's step achieves (weights + the KV it reads, over step time);
  of a mixture of experts (Qwen3-MoE), a step reads the experts its tokens pick: counted as the
  number uniform routing picks on average (dummy weights route close to uniformly);
- the GEMV floor (CUDA): every linear layer of the model applied to [batch, in] through
  F.linear, replayed from one CUDA graph: a step built on cuBLAS GEMVs cannot be faster (at
  batch 1 the same is printed through weft's linear, whose Triton GEMV beats cuBLAS there);
- --hf-baseline: HF transformers (same config, random weights, same dtype and device), greedy
  generate of the same batch; decode tok/s from generate(output_len) minus generate(1).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from weft import Engine
from weft.runtime.config import EngineConfig
from weft.runtime.core import Req
from weft.runtime.models.layers import linear
from weft.runtime.sampling_params import SamplingParams

from common import (
    copy_bandwidth,
    cuda_graph_ms,
    decode_weight_bytes,
    describe_device,
    expected_experts,
    expert_params,
    fp8_weights,
    random_prompts,
    sync_device,
)

WARMUP_OUTPUT_LEN = 8  # tokens per request in the warm-up pass (same batch and prompt length)
GRAPH_REPLAYS = 20  # timed replays of the GEMV-floor graph (median)


@dataclass
class Pass:
    """One measured pass of the static batch."""

    prefill_s: float
    prefill_steps: int
    decode_step_s: list[float]  # each step after prefill that ran the whole batch
    decode_kv_tokens: list[int]  # KV tokens attention reads in each of those steps
    e2e_s: float


@dataclass
class Row:
    batch: int
    prefill_ms: float
    prefill_steps: int
    prefill_tok_s: float
    decode_ms: float | None  # None: no step after prefill ran the whole batch
    decode_tok_s: float | None
    e2e_ms: float
    e2e_out_tok_s: float  # output tokens / end to end
    achieved_gb_s: float | None  # (weights + KV read) / decode step
    roofline_frac: float | None  # achieved / copy bandwidth
    gemv_floor_ms: float | None = None
    floor_ratio: float | None = None  # decode step / GEMV floor
    hf_prefill_ms: float | None = None
    hf_decode_tok_s: float | None = None
    hf_e2e_ms: float | None = None
    weft_over_hf: float | None = None  # decode tok/s


@dataclass
class RunInfo:
    """What the report says about the setup (taken from the first engine)."""

    device: torch.device
    dtype: torch.dtype
    folder: str
    architecture: str
    vocab_size: int
    backend: str
    copy_gb_s: float
    weight_bytes: int  # one decode step at batch 1
    batch_weight_bytes: dict[int, int]  # at each batch size (a mixture of experts reads more)
    kv_bytes_per_token: int
    cuda_graphs: bool  # whether the engine replays decode steps from CUDA graphs
    overlap: bool  # whether the scheduler overlaps each step's host work with the next forward


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded default model")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="measured passes per batch size")
    p.add_argument("--seed", type=int, default=0)
    engine = p.add_argument_group("engine options (passed on only when given)")
    engine.add_argument("--dtype", default=None)
    engine.add_argument(
        "--quantization", default=None, help="e.g. fp8: linear weights in e4m3 (see EngineConfig)"
    )
    engine.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8_e4m3 (see EngineConfig)")
    engine.add_argument("--attention-backend", default=None)
    engine.add_argument("--chunked-prefill-size", type=int, default=None)
    engine.add_argument("--max-total-tokens", type=int, default=None)
    engine.add_argument("--context-length", type=int, default=None, help="default: the model's")
    engine.add_argument(
        "--max-running-requests", type=int, default=None, help="default: raised to the batch"
    )
    engine.add_argument("--mem-fraction-static", type=float, default=None)
    engine.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")
    engine.add_argument("--disable-radix-cache", action="store_true")
    engine.add_argument("--disable-cuda-graph", action="store_true")
    engine.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument(
        "--gemv-floor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the linear layers as GEMVs in one CUDA graph (default: on with CUDA)",
    )
    p.add_argument("--hf-baseline", action="store_true", help="also time HF transformers generate")
    p.add_argument("--json-out", default=None, help="append the results as one JSON line")
    args = p.parse_args()
    if args.output_len < 2:
        p.error("--output-len must be >= 2 (decode needs a step after prefill)")
    if args.input_len < 1 or args.repeats < 1 or min(args.batch_sizes) < 1:
        p.error("--input-len, --repeats and --batch-sizes must be >= 1")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for name in SWITCHES:
        if getattr(args, name) and name not in fields:
            p.error(f"--{name.replace('_', '-')}: this weft's EngineConfig has no {name} field")
    return args


SWITCHES = ("disable_radix_cache", "disable_cuda_graph", "disable_overlap_schedule")


def engine_kwargs(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """The engine options given on the command line; the engine's own defaults otherwise."""
    names = (
        "dtype",
        "quantization",
        "kv_cache_dtype",
        "attention_backend",
        "chunked_prefill_size",
        "max_total_tokens",
        "context_length",
        "mem_fraction_static",
        "num_threads",
    )
    kwargs: dict[str, Any] = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    max_running = args.max_running_requests or EngineConfig().max_running_requests
    if max_running < batch:
        if args.max_running_requests is not None:
            raise SystemExit(f"--max-running-requests {max_running} is below the batch {batch}")
        max_running = batch
    if max_running != EngineConfig().max_running_requests:
        kwargs["max_running_requests"] = max_running
    # NOTE: switches are passed only when given: older configs lack some of the fields
    kwargs.update({name: True for name in SWITCHES if getattr(args, name)})
    return kwargs


def run_pass(engine: Engine, prompts: list[list[int]], output_len: int, tag: str) -> Pass:
    """Add the batch, step the scheduler until it is done, time each step; then audit the KV
    pool and empty the prefix cache (the next pass must not hit this one's prefixes)."""
    sched, device = engine.scheduler, engine.runner.device
    reqs: list[Req] = []
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
        reqs += sched.add(Req(f"{tag}-{i}", list(ids), params))
    batch = len(reqs)
    retractions = sched.num_retractions
    prefill_s: float | None = None
    prefill_steps = 0
    step_s: list[float] = []
    kv_tokens: list[int] = []
    # NOTE: under the overlap schedule a step returns once the *previous* step's tokens are
    # back, with its own forward still running: a device sync around it would serialize what
    # the schedule overlaps, so the step time is then the period between step returns.
    sync_each_step = not sched.overlap
    sync_device(device)
    start = time.perf_counter()
    while sched.has_work:
        # KV positions a decode step reads: each running request's length after the step
        kv = sum(r.seq_len for r in sched.running)
        if sync_each_step:
            sync_device(device)
        t = time.perf_counter()
        updated = sched.step()
        if sync_each_step:
            sync_device(device)
        now = time.perf_counter()
        if prefill_s is None:
            prefill_steps += 1
            if all(r.output_ids for r in reqs):
                prefill_s = now - start
        elif len(updated) == batch:
            step_s.append(now - t)
            kv_tokens.append(kv)
    e2e = time.perf_counter() - start
    assert prefill_s is not None
    short = [r.rid for r in reqs if len(r.output_ids) != output_len]
    if short:
        raise RuntimeError(f"{len(short)} request(s) did not produce {output_len} tokens: {short}")
    if sched.num_retractions != retractions:
        print(
            f"  NOTE: {sched.num_retractions - retractions} retraction(s): the KV pool is too "
            "small for a static batch (raise --max-total-tokens)",
            flush=True,
        )
    sched.check_integrity()
    if not sched.flush_cache():
        raise RuntimeError("the scheduler still has work after the batch finished")
    return Pass(prefill_s, prefill_steps, step_s, kv_tokens, e2e)


Weight = torch.Tensor | torch.nn.Module  # a dense [out, in] matrix or an FP8Weight


def linear_weights(model: torch.nn.Module, batch: int) -> list[tuple[Weight, int]]:
    """The [out, in] matrices a decode step of `batch` tokens multiplies, each with the rows it
    multiplies: every 2-D parameter except the embedding table, which counts only when it is
    tied (it is then the lm_head), at `batch` rows, and every FP8 weight; of a mixture of
    experts, the experts the batch is expected to pick (uniform routing), each at its share of
    the batch * k rows."""
    embed = model.get_parameter("embed_tokens.weight")
    tied = getattr(model, "lm_head", None) is None
    out: list[tuple[Weight, int]] = [
        (p, batch) for p in model.parameters() if p.dim() == 2 and (p is not embed or tied)
    ]
    out += [(w, batch) for w in fp8_weights(model)]
    for stacked in expert_params(model):
        cfg = model.config  # type: ignore[union-attr]
        picked = max(1, round(expected_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)))
        rows = -(-batch * cfg.num_experts_per_tok // picked)
        out += [(stacked[e], rows) for e in range(picked)]
    return out


def _in_features(w: Weight) -> int:
    return w.shape[1] if isinstance(w, torch.Tensor) else int(w.in_features)  # type: ignore[arg-type]


@torch.inference_mode()
def gemv_floor_ms(weights: list[tuple[Weight, int]], batch: int, fn: Any = F.linear) -> float:
    """Median device time of fn([rows, in], W) over all (W, rows), from one CUDA graph. FP8
    weights always go through weft's own FP8 matmul (`linear`): cuBLAS has no FP8 GEMV."""
    first = weights[0][0]
    device = first.device if isinstance(first, torch.Tensor) else next(first.buffers()).device
    dtypes = [w.dtype for w, _ in weights if isinstance(w, torch.Tensor)]
    inputs = {
        _in_features(w): torch.randn(batch, _in_features(w), dtype=dtypes[0], device=device)
        for w, _ in weights
    }

    def run() -> None:
        for w, rows in weights:
            x = inputs[_in_features(w)][:rows]
            fn(x, w) if isinstance(w, torch.Tensor) else linear(x, w)  # type: ignore[arg-type]

    return cuda_graph_ms(run, GRAPH_REPLAYS)


def prompt_lo(vocab: int) -> int:
    """Lowest token id of the random prompts (common.random_prompts assumes a large vocab)."""
    return min(1000, vocab // 4)


def measure(args: argparse.Namespace, batch: int, info: RunInfo | None) -> tuple[Row, RunInfo]:
    """One batch size on a fresh engine (freed before returning)."""
    tag = f"[batch {batch}]"
    print(f"{tag} building the engine ...", flush=True)
    engine = Engine(
        args.model_path,
        load_format=args.load_format,
        log_level="warning",
        show_progress=False,
        **engine_kwargs(args, batch),
    )
    engine.shutdown()  # drive the scheduler from this thread
    sched, runner = engine.scheduler, engine.runner
    need = batch * (args.input_len + args.output_len)
    if args.input_len + args.output_len > sched.max_seq_len or need > runner.kv_pool.size:
        raise SystemExit(
            f"{tag} does not fit: {batch} x ({args.input_len} + {args.output_len}) tokens, KV pool "
            f"{runner.kv_pool.size} tokens, max sequence {sched.max_seq_len} "
            "(raise --max-total-tokens or lower the lengths)"
        )
    if info is None:
        info = RunInfo(
            device=runner.device,
            dtype=runner.dtype,
            folder=str(engine.source.folder),
            architecture=engine.model_config.architecture,
            vocab_size=engine.model_config.vocab_size,
            backend=type(runner.attention).__name__,
            copy_gb_s=copy_bandwidth(runner.device),
            weight_bytes=decode_weight_bytes(runner.model),
            batch_weight_bytes={b: decode_weight_bytes(runner.model, b) for b in args.batch_sizes},
            kv_bytes_per_token=runner.kv_pool.bytes_per_token,
            cuda_graphs=getattr(runner, "graphs", None) is not None,
            overlap=getattr(engine.scheduler, "overlap", False),
        )
    vocab, lo = info.vocab_size, prompt_lo(info.vocab_size)
    print(f"{tag} warming up ({WARMUP_OUTPUT_LEN} tokens) ...", flush=True)
    warm = random_prompts(batch, args.input_len, vocab, args.seed + 10_000, lo)
    run_pass(engine, warm, min(WARMUP_OUTPUT_LEN, args.output_len), "warmup")
    passes = []
    for r in range(args.repeats):
        prompts = random_prompts(batch, args.input_len, vocab, args.seed + r, lo)
        one = run_pass(engine, prompts, args.output_len, f"run{r}")
        decode = f"{statistics.median(one.decode_step_s) * 1e3:.2f}" if one.decode_step_s else "-"
        print(
            f"{tag} pass {r + 1}/{args.repeats}: prefill {one.prefill_s * 1e3:.1f} ms "
            f"({one.prefill_steps} step(s)), decode {decode} ms/step "
            f"({len(one.decode_step_s)} full-batch steps), end to end {one.e2e_s * 1e3:.1f} ms",
            flush=True,
        )
        passes.append(one)
    row = summarize(args, batch, passes, info)
    if args.gemv_floor and info.device.type == "cuda":
        weights = linear_weights(runner.model, batch)
        row.gemv_floor_ms = gemv_floor_ms(weights, batch)
        if row.decode_ms is not None:
            row.floor_ratio = row.decode_ms / row.gemv_floor_ms
        print(f"{tag} GEMV floor: {row.gemv_floor_ms:.3f} ms ({len(weights)} linears)", flush=True)
        if batch == 1:
            own = gemv_floor_ms(weights, batch, linear)
            print(f"{tag} the same through weft's linear (Triton GEMV): {own:.3f} ms", flush=True)
    sched.check_integrity()
    if runner.kv_pool.num_free != runner.kv_pool.size:
        raise AssertionError(f"{tag} KV slots leaked: {runner.kv_pool.num_free} free after flush")
    print(f"{tag} KV pool integrity ok ({runner.kv_pool.size} slots free)", flush=True)
    del engine, sched, runner
    _free_memory(info.device)
    return row, info


def summarize(args: argparse.Namespace, batch: int, passes: list[Pass], info: RunInfo) -> Row:
    steps = [s for p in passes for s in p.decode_step_s]
    kv = [k for p in passes for k in p.decode_kv_tokens]
    prefill_s = statistics.median(p.prefill_s for p in passes)
    e2e_s = statistics.median(p.e2e_s for p in passes)
    row = Row(
        batch=batch,
        prefill_ms=prefill_s * 1e3,
        prefill_steps=max(p.prefill_steps for p in passes),
        prefill_tok_s=batch * args.input_len / prefill_s,
        decode_ms=None,
        decode_tok_s=None,
        e2e_ms=e2e_s * 1e3,
        e2e_out_tok_s=batch * args.output_len / e2e_s,
        achieved_gb_s=None,
        roofline_frac=None,
    )
    if steps:
        step = statistics.median(steps)
        read = info.batch_weight_bytes[batch] + statistics.mean(kv) * info.kv_bytes_per_token
        row.decode_ms = step * 1e3
        row.decode_tok_s = batch / step
        row.achieved_gb_s = read / step / 1e9
        row.roofline_frac = row.achieved_gb_s / info.copy_gb_s
    return row


def _free_memory(device: torch.device) -> None:
    # NOTE: the next engine sizes its KV pool from the memory left free
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_baseline(args: argparse.Namespace, rows: list[Row], info: RunInfo) -> None:
    """Fill the HF columns of `rows`; prints why and leaves them empty when it cannot run."""
    import transformers

    print("[HF] building the model (random weights) ...", flush=True)
    try:
        config = transformers.AutoConfig.from_pretrained(info.folder)
        with torch.device(info.device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=info.dtype)
    except (ValueError, KeyError) as exc:
        print(f"[HF] skipped: transformers cannot build this model ({exc})", flush=True)
        return
    except torch.OutOfMemoryError:
        print("[HF] skipped: the model does not fit in device memory", flush=True)
        _free_memory(info.device)
        return
    model.to(info.device).eval()
    for row in rows:
        try:
            hf_row(args, model, row, info)
        except torch.OutOfMemoryError:
            print(f"[HF] batch {row.batch} skipped: out of device memory", flush=True)
            _free_memory(info.device)
    del model
    _free_memory(info.device)


@torch.inference_mode()
def hf_row(args: argparse.Namespace, model: torch.nn.Module, row: Row, info: RunInfo) -> None:
    prompts = random_prompts(
        row.batch, args.input_len, info.vocab_size, args.seed, prompt_lo(info.vocab_size)
    )
    ids = torch.tensor(prompts, device=info.device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> float:
        sync_device(info.device)
        t = time.perf_counter()
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            use_cache=True,
            pad_token_id=0,
        )
        sync_device(info.device)
        assert out.shape == (row.batch, args.input_len + n)
        return time.perf_counter() - t

    generate(WARMUP_OUTPUT_LEN)
    first = statistics.median(generate(1) for _ in range(args.repeats))
    full = statistics.median(generate(args.output_len) for _ in range(args.repeats))
    row.hf_prefill_ms = first * 1e3
    row.hf_e2e_ms = full * 1e3
    row.hf_decode_tok_s = row.batch * (args.output_len - 1) / max(full - first, 1e-9)
    if row.decode_tok_s is not None:
        row.weft_over_hf = row.decode_tok_s / row.hf_decode_tok_s
    print(
        f"[HF] batch {row.batch}: prefill {row.hf_prefill_ms:.1f} ms, decode "
        f"{row.hf_decode_tok_s:.1f} tok/s, end to end {row.hf_e2e_ms:.1f} ms",
        flush=True,
    )


def _fmt(value: float | None, width: int, digits: int) -> str:
    return "-".rjust(width) if value is None else f"{value:{width}.{digits}f}"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def report(args: argparse.Namespace, rows: list[Row], info: RunInfo) -> None:
    dtype = str(info.dtype).removeprefix("torch.")
    cuda = info.device.type == "cuda"
    roof = info.copy_gb_s * 1e9 / info.weight_bytes
    print(f"\ndevice    : {describe_device(info.device)}")
    print(
        f"model     : {args.model_path or 'default (Qwen2.5-Coder-0.5B-Instruct)'} "
        f"{info.architecture}, {dtype}, load_format={args.load_format}, {info.backend}"
        + (f", quantization={args.quantization}" if args.quantization else "")
        + (f", CUDA graphs {'on' if info.cuda_graphs else 'off'}" if cuda else "")
        + (f", overlap schedule {'on' if info.overlap else 'off'}" if cuda else "")
    )
    print(
        f"workload  : static batch, random prompt ids, input {args.input_len}, output "
        f"{args.output_len} (greedy, ignore_eos), {args.repeats} pass(es) after a warm-up"
    )
    print(
        f"roofline  : copy bandwidth {info.copy_gb_s:.1f} GB/s, {_bytes(info.weight_bytes)} of "
        f"weights per decode step -> {roof:.1f} tok/s at batch 1; KV "
        f"{_bytes(info.kv_bytes_per_token)} per token"
    )
    if not cuda:
        print("GEMV floor: skipped (needs CUDA graphs)")
    elif not args.gemv_floor:
        print("GEMV floor: skipped (--no-gemv-floor)")
    header = (
        f"{'batch':>5} {'prefill ms':>10} {'steps':>5} {'decode ms':>9} {'decode tok/s':>12} "
        f"{'e2e ms':>9} {'floor ms':>8} {'x floor':>7} {'GB/s':>7} {'% copy':>6} "
        f"{'HF tok/s':>9} {'weft/HF':>7}"
    )
    print(header)
    for r in rows:
        pct = None if r.roofline_frac is None else 100 * r.roofline_frac
        print(
            f"{r.batch:5d} {r.prefill_ms:10.1f} {r.prefill_steps:5d} {_fmt(r.decode_ms, 9, 2)} "
            f"{_fmt(r.decode_tok_s, 12, 1)} {r.e2e_ms:9.1f} {_fmt(r.gemv_floor_ms, 8, 3)} "
            f"{_fmt(r.floor_ratio, 7, 2)} {_fmt(r.achieved_gb_s, 7, 1)} {_fmt(pct, 6, 1)} "
            f"{_fmt(r.hf_decode_tok_s, 9, 1)} {_fmt(r.weft_over_hf, 7, 2)}"
        )
    print(
        "decode ms = median full-batch step; x floor = decode step / GEMV floor; GB/s = (weights "
        "+ KV read) / decode step; HF tok/s = HF decode tok/s (generate(n) - generate(1))"
    )
    if any(r.decode_ms is None for r in rows):
        print(
            "NOTE: '-' in decode: no step after prefill ran the whole batch (chunked prefill "
            "staggers a large batch): raise --output-len or --chunked-prefill-size"
        )
    if args.json_out:
        record = {
            "bench": "one_batch",
            "device": describe_device(info.device),
            "args": vars(args),
            "model": {"architecture": info.architecture, "dtype": dtype, "backend": info.backend},
            "copy_gb_s": info.copy_gb_s,
            "weight_bytes": info.weight_bytes,
            "kv_bytes_per_token": info.kv_bytes_per_token,
            "roofline_tok_s": roof,
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        with open(args.json_out, "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    args = parse_args()
    if args.gemv_floor is None:
        args.gemv_floor = torch.cuda.is_available()
    rows: list[Row] = []
    info: RunInfo | None = None
    for batch in args.batch_sizes:
        row, info = measure(args, batch, info)
        rows.append(row)
    assert info is not None
    if args.hf_baseline:
        hf_baseline(args, rows, info)
    report(args, rows, info)


if __name__ == "__main__":
    main()
