"""Where constrained decoding loses throughput: a production-like JSON-schema corpus decoded
under its grammars, then unconstrained with the same per-request token counts, in one process;
per step, the grammar's host time (mask fill, accepts) and how much of it the device waited for.

    python benchmarks/bench_constrained.py --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --tokenizer-path TOK/llama3 --batch 1 16 64 --json-out r.jsonl
    python benchmarks/bench_constrained.py --device cpu --batch 1 4 --limit 12   # default model
    python benchmarks/plot_constrained.py r.jsonl -o constrained.png

Workload: every schema of the corpus (benchmarks/data/schemas.json, the extraction schemas,
benchmarks/data/production_schemas.json) is one request: a short instruction to write that JSON
(the chat template applied), up to --max-new-tokens under the schema (dummy weights write random
but grammar-valid JSON). All requests are submitted at once and at most --batch run at a time
(continuous batching). Then the same prompts, in the same order, unconstrained with ignore_eos
and max_new_tokens = the request's constrained token count. The prefix cache is flushed before
each run; a warm-up run of one token per request compiles every grammar first (compile time is
reported, not timed). Every constrained output that stopped is validated with jsonschema: an
invalid one is a bug and is reported loudly.

Per step (EngineConfig.profile_steps, weft/runtime/scheduler/step_profile.py): `fill` and
`accept` are host milliseconds in the mask fill and in the read-back's appends (grammar accepts);
`mask` and `acc` exposed are the device's idle milliseconds they caused (CUDA events around them;
on a CPU the host is the device, so all of it); `forward` (forward + lm_head) and `sampling` are
device milliseconds; `step` is a step's whole time on the device's timeline. p50 / p90 over the
steps that ran a forward (constrained: those with at least one masked row).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"
CORPORA = ("schemas", "extraction", "production")
# the shapes production schemas are made of; the corpus must hold each (tests/test_bench_corpus.py)
SHAPES = (
    "free-text-unbounded",
    "free-text-bounded",
    "array-of-objects",
    "enum",
    "optional-nested-object",
    "bounded-number",
    "anyOf",
)
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


# ---- the corpus ---------------------------------------------------------------------------


def load_corpus(corpora: tuple[str, ...] = CORPORA, tier: str | None = None) -> list[dict]:
    """Entries {name, corpus, description, schema, example, prompt_text}, in a fixed order."""
    entries: list[dict] = []
    if "schemas" in corpora:
        for e in json.loads((DATA / "schemas.json").read_text()):
            if tier is None or e["tier"] == tier:
                entries.append({**e, "corpus": "schemas", "prompt_text": e["description"]})
    if "extraction" in corpora:
        schemas = json.loads((DATA / "extraction_schemas.json").read_text())
        docs = [json.loads(line) for line in (DATA / "extraction.jsonl").read_text().splitlines()]
        for kind, schema in schemas.items():
            doc = next(d for d in docs if d["kind"] == kind)  # the first document of its kind
            entries.append(
                {
                    "name": f"extraction-{kind}",
                    "corpus": "extraction",
                    "description": f"the {kind} described in a text",
                    "schema": schema,
                    "example": doc["answer"],
                    "prompt_text": f"Extract the {kind} from this text: {doc['text']}",
                }
            )
    if "production" in corpora:
        for e in json.loads((DATA / "production_schemas.json").read_text()):
            entries.append({**e, "corpus": "production", "prompt_text": e["description"]})
    return entries


def shapes(schema: Any) -> set[str]:
    """Which of SHAPES a schema holds (properties, items, combinators and $defs walked)."""
    found: set[str] = set()

    def walk(s: Any, optional: bool = False) -> None:
        if not isinstance(s, dict):
            return
        t = s.get("type")
        types = t if isinstance(t, list) else [t]
        if "string" in types and not any(k in s for k in ("enum", "const", "pattern", "format")):
            found.add("free-text-bounded" if "maxLength" in s else "free-text-unbounded")
        if "enum" in s:
            found.add("enum")
        if {"number", "integer"} & set(types) and any(k in s for k in BOUNDS):
            found.add("bounded-number")
        if "anyOf" in s:
            found.add("anyOf")
        if optional and _objecty(s):
            found.add("optional-nested-object")
        items = s.get("items")
        if "array" in types and isinstance(items, dict) and _objecty(items):
            found.add("array-of-objects")
        required = set(s.get("required", []))
        for key, sub in (s.get("properties") or {}).items():
            walk(sub, key not in required)
        for key in ("items", "additionalProperties", "not", "if", "then", "else"):
            walk(s.get(key))
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            for sub in s.get(key, []):
                walk(sub, optional)
        for key in ("$defs", "definitions"):
            for sub in (s.get(key) or {}).values():
                walk(sub)

    walk(schema)
    return found


def _objecty(s: dict) -> bool:
    """An object schema, a $ref (to a model, in the corpus), or anyOf with an object in it."""
    if s.get("type") == "object" or "$ref" in s:
        return True
    return any(isinstance(a, dict) and _objecty(a) for a in s.get("anyOf", []))


def build_prompt(entry: dict, tokenizer: Any) -> str:
    text = (
        f"Reply with one JSON object only, no prose. Task ({entry['name']}): {entry['prompt_text']}"
    )
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return text + "\n"


def validate(entries: list[dict], outs: list[dict]) -> dict[str, list[str]]:
    """Constrained outputs by outcome: valid, cut (at the token limit: not JSON yet, not a bug),
    invalid (stopped but not valid under its schema, or aborted: a bug)."""
    result: dict[str, list[str]] = {"valid": [], "cut": [], "invalid": []}
    for entry, out in zip(entries, outs, strict=True):
        reason = (out["meta_info"]["finish_reason"] or {}).get("type")
        if reason == "length":
            result["cut"].append(entry["name"])
            continue
        try:
            if reason != "stop":
                raise ValueError(f"finish reason {out['meta_info']['finish_reason']}")
            jsonschema.validate(json.loads(out["text"]), entry["schema"])
            result["valid"].append(entry["name"])
        except Exception as exc:  # json, jsonschema or the finish reason
            message = str(exc).splitlines()[0][:160]
            result["invalid"].append(f"{entry['name']}: {message}; text {out['text'][:120]!r}")
    return result


# ---- per-step statistics ------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def step_metrics(record: dict) -> dict[str, float]:
    """One step's milliseconds (step_profile's segments grouped; see the module docstring)."""
    seg, host = record["seg_ms"], record["host_s"]
    m = {
        "fill": host.get("fill_s", 0.0) * 1e3,
        "accept": host.get("accept_s", 0.0) * 1e3,
        "mask": seg.get("mask", 0.0),
        "acc": seg.get("accept", 0.0),
        "forward": seg.get("forward", 0.0) + seg.get("logits", 0.0),
        "sampling": seg.get("sampling", 0.0),
        "step": sum(seg.values()),
    }
    m["other"] = m["step"] - m["forward"] - m["mask"] - m["acc"] - m["sampling"]
    return m


METRICS = ("fill", "accept", "mask", "acc", "forward", "sampling", "other", "step")


def summarize_steps(records: list[dict], *, constrained: bool) -> dict[str, Any]:
    """p50 / p90 / mean per metric over the steps that ran a forward (constrained: with a
    masked row), and the share of the host's grammar time that was exposed."""
    steps = [r for r in records if "forward" in r["seg_ms"] and "sched" in r["seg_ms"]]
    if constrained:
        steps = [r for r in steps if r.get("masked_rows", 0) > 0]
    rows = [step_metrics(r) for r in steps]
    out: dict[str, Any] = {"steps": len(rows)}
    for key in METRICS:
        values = [m[key] for m in rows]
        out[key] = {
            "p50": _pct(values, 0.5),
            "p90": _pct(values, 0.9),
            "mean": statistics.fmean(values) if values else float("nan"),
        }
    fill = sum(m["fill"] for m in rows)
    accept = sum(m["accept"] for m in rows)
    out["mask_exposed_share"] = sum(m["mask"] for m in rows) / fill if fill else float("nan")
    out["accept_exposed_share"] = sum(m["acc"] for m in rows) / accept if accept else float("nan")
    out["mean_rows"] = statistics.fmean(r.get("rows", 0) for r in steps) if steps else 0.0
    # the host's own milliseconds between the same marks: where the host's step goes
    names = sorted({k for r in steps for k in r.get("host_ms", {})})
    out["host_p50"] = {k: _pct([r["host_ms"].get(k, 0.0) for r in steps], 0.5) for k in names}
    out["host_step_p50"] = _pct([sum(r.get("host_ms", {}).values()) for r in steps], 0.5)
    return out


# ---- runs ---------------------------------------------------------------------------------


def timed_run(engine: Any, prompts: list[str], params: list[dict], batch: int) -> dict[str, Any]:
    """All prompts submitted at once, at most `batch` running; the prefix cache flushed first."""
    # NOTE: the admission limit is set per run on one engine (one weight load, one CUDA-graph
    # capture up to the largest batch); the engine is built with the largest as its limit
    engine.scheduler.admission.max_running = batch
    # NOTE: refused while a step is in flight: under the overlap schedule generate() can return
    # with one launched for requests that have finished meanwhile (the engine thread ends it)
    deadline = time.perf_counter() + 30
    while not engine.flush_cache():
        assert time.perf_counter() < deadline, "the engine did not go idle"
        time.sleep(0.01)
    engine.call(engine.scheduler.profile.take)  # drop the steps of earlier runs
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    steps = engine.call(engine.scheduler.profile.take)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"seconds": seconds, "tokens": tokens, "outs": outs, "steps": steps}


async def _warm_up(engine: Any, prompts: list[str], params: list[dict]) -> list[Any]:
    """One token of each constrained request, all at once: a result or the exception of a
    schema every backend refused (Engine.generate would raise for the whole batch)."""
    one = [{**q, "max_new_tokens": 1} for q in params]
    calls = [engine.async_generate(p, q) for p, q in zip(prompts, one, strict=True)]
    return await asyncio.gather(*calls, return_exceptions=True)


def _refusal(result: Any) -> str | None:
    """Why a warm-up request failed (its schema refused by every backend), or None."""
    if isinstance(result, BaseException):
        return f"{type(result).__name__}: {result}"
    finish = result["meta_info"]["finish_reason"] or {}
    return finish.get("message", "aborted") if finish.get("type") == "abort" else None


def _fmt(stat: dict) -> str:
    return f"{stat['p50']:>7.2f} {stat['p90']:>7.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded default model")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--corpus", nargs="+", choices=CORPORA, default=list(CORPORA))
    p.add_argument("--tier", choices=["core", "extended"], default=None, help="of schemas.json")
    p.add_argument("--stride", type=int, default=1, help="every N-th schema only (a spread)")
    p.add_argument("--limit", type=int, default=None, help="the first N schemas only")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="default: 1 16 64 on "
                   "CUDA, 1 4 on a CPU")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--grammar-backends", default="xgrammar,llguidance,outlines")
    p.add_argument("--compact-json", action="store_true", help="as the server flag")
    p.add_argument(
        "--grammar-race-budget",
        type=float,
        default=None,
        help="as the server flag; inf pins which backend serves each schema (the chain's "
        "order), so runs of different code decode the same tokens (a finite budget drops to "
        "0.02 s while specs queue, as in the warm-up)",
    )
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--enable-overlap-schedule", action="store_true", help="on a CPU too")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-jump-forward", action="store_true")
    p.add_argument("--no-step-profile", action="store_true", help="wall times only")
    p.add_argument("--repeats", type=int, default=1, help="wall time: median of repeats")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json-out", default=None, help="append one JSON line per batch size")
    p.add_argument("--steps-out", default=None, help="append every step's record (JSON lines)")
    args = p.parse_args()

    from weft import Engine

    from common import describe_device  # (imports torch: not at the top, for the corpus test)

    entries = load_corpus(tuple(args.corpus), args.tier)[:: args.stride][: args.limit]
    batches = args.batch
    kwargs: dict[str, Any] = dict(
        show_progress=False,
        log_level="warning",
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        grammar_backend=args.grammar_backends,
        constrained_json_disable_any_whitespace=args.compact_json,
        disable_overlap_schedule=args.disable_overlap_schedule,
        enable_overlap_schedule=args.enable_overlap_schedule,
        disable_cuda_graph=args.disable_cuda_graph,
        disable_jump_forward=args.disable_jump_forward,
        profile_steps=not args.no_step_profile,
        max_running_requests=max(batches or [64]),
    )
    for key in ("tokenizer_path", "max_total_tokens", "num_threads", "grammar_race_budget"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    engine = Engine(args.model_path, **kwargs)
    device = engine.runner.device
    if batches is None:
        batches = [1, 16, 64] if device.type == "cuda" else [1, 4]
        assert max(batches) <= engine.config.max_running_requests
    sched = engine.scheduler
    mode = "overlap" if sched.overlap else "no overlap"
    graphs = "CUDA graphs" if engine.runner.graphs is not None else "eager"
    print(f"# device: {describe_device(device)}")
    print(
        f"# model: {args.model_path or 'default (Qwen2.5-Coder-0.5B-Instruct)'} "
        f"({engine.model_config.architecture}, {args.load_format}), vocab "
        f"{engine.model_config.vocab_size}, tokenizer {args.tokenizer_path or 'the model folder'}"
    )
    print(
        f"# schedule: {mode}, {graphs}, jump-forward "
        f"{'off' if args.disable_jump_forward else 'default'}; grammar backends "
        f"{args.grammar_backends}"
    )
    print(
        f"# workload: {len(entries)} schemas ({', '.join(args.corpus)}), one request each, up "
        f"to {args.max_new_tokens} new tokens, temperature {args.temperature}; then the same "
        f"prompts unconstrained (ignore_eos, each request's token count)"
    )
    prompts = [build_prompt(e, engine.tokenizer) for e in entries]
    base = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
    constrained = [{**base, "json_schema": json.dumps(e["schema"])} for e in entries]

    # warm-up: every grammar compiled (cached by spec), the kernels of both paths compiled
    start = time.perf_counter()
    engine.scheduler.admission.max_running = max(batches)
    warm = asyncio.run(_warm_up(engine, prompts, constrained))
    refused = [(e, _refusal(r)) for e, r in zip(entries, warm, strict=True) if _refusal(r)]
    for entry, why in refused:
        print(f"# refused: {entry['name']}: {why[:160]}")
    kept = [i for i, r in enumerate(warm) if not _refusal(r)]
    entries = [entries[i] for i in kept]
    prompts = [prompts[i] for i in kept]
    constrained = [constrained[i] for i in kept]
    if not entries:
        raise SystemExit("every schema was refused: nothing to time")
    few = prompts[:4]
    timed_run(engine, few, [{**base, "max_new_tokens": 4, "ignore_eos": True}] * len(few), 4)
    compile_s = sched.grammar_compile_s
    print(
        f"# warm-up {time.perf_counter() - start:.1f} s: {sum(compile_s.counts)} grammars "
        f"compiled ({compile_s.sum:.1f} s of compiles), {len(refused)} schemas refused: "
        f"{len(entries)} timed"
    )

    header = (
        f"{'run':<14} {'wall s':>7} {'out tok':>8} {'tok/s':>8} {'steps':>6} {'rows':>5} "
        + " ".join(f"{k + ' p50':>7} {'p90':>7}" for k in METRICS)
    )
    bugs = 0
    for batch in batches:
        runs: dict[str, list[dict]] = {"constrained": [], "unconstrained": []}
        for _ in range(args.repeats):
            con = timed_run(engine, prompts, constrained, batch)
            counts = [max(o["meta_info"]["completion_tokens"], 1) for o in con["outs"]]
            plain = [{**base, "max_new_tokens": n, "ignore_eos": True} for n in counts]
            unc = timed_run(engine, prompts, plain, batch)
            runs["constrained"].append(con)
            runs["unconstrained"].append(unc)
        median = {k: sorted(v, key=lambda r: r["seconds"])[len(v) // 2] for k, v in runs.items()}
        con, unc = median["constrained"], median["unconstrained"]
        checks = validate(entries, con["outs"])
        jump = sum(o["meta_info"].get("jump_forward_tokens", 0) for o in con["outs"])
        print(f"\n## batch {batch}: {len(entries)} requests, median of {args.repeats}")
        print(header)
        summaries = {}
        for name, results in runs.items():
            run = median[name]
            steps = [s for r in results for s in r["steps"]]
            summary = summarize_steps(steps, constrained=name == "constrained")
            summaries[name] = summary
            line = (
                f"{name:<14} {run['seconds']:>7.2f} {run['tokens']:>8} "
                f"{run['tokens'] / run['seconds']:>8.1f} {summary['steps'] // args.repeats:>6} "
                f"{summary['mean_rows']:>5.1f} "
            )
            print(line + " ".join(_fmt(summary[k]) for k in METRICS))
            host = " ".join(f"{k} {v:.2f}" for k, v in summary["host_p50"].items())
            print(f"{'':<14} host ms p50: {host}; the host's step {summary['host_step_p50']:.2f}")
        ratio = unc["seconds"] / con["seconds"]
        s = summaries["constrained"]
        print(
            f"constrained / unconstrained throughput: {ratio:.2f}x "
            f"({con['tokens']} vs {unc['tokens']} tokens; jump-forward took {jump})"
        )
        print(
            f"grammar on the critical path: mask fill {s['mask_exposed_share']:.0%} exposed, "
            f"accepts {s['accept_exposed_share']:.0%} exposed; mean per constrained step: "
            f"fill {s['fill']['mean']:.2f} ms, accept {s['accept']['mean']:.2f} ms, "
            f"step {s['step']['mean']:.2f} ms (unconstrained "
            f"{summaries['unconstrained']['step']['mean']:.2f} ms)"
        )
        print(
            f"outputs: {len(checks['valid'])} valid, {len(checks['cut'])} cut at the token "
            f"limit, {len(checks['invalid'])} INVALID"
        )
        for line in checks["invalid"]:
            print(f"  !! INVALID (a bug): {line}")
        bugs += len(checks["invalid"])
        if args.json_out:
            record = {
                "bench": "constrained",
                "date": time.strftime("%Y-%m-%d"),
                "device": describe_device(device),
                "model": args.model_path or "default",
                "schedule": mode,
                "graphs": graphs,
                "grammar_backends": args.grammar_backends,
                "jump_forward": "off" if args.disable_jump_forward else "default",
                "batch": batch,
                "schemas": len(entries),
                "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats,
                "ratio": ratio,
                "jump_forward_tokens": jump,
                "invalid": checks["invalid"],
                "cut": len(checks["cut"]),
                **{
                    name: {
                        "seconds": median[name]["seconds"],
                        "tokens": median[name]["tokens"],
                        "steps": summaries[name],
                    }
                    for name in runs
                },
            }
            with open(args.json_out, "a") as f:
                f.write(json.dumps(record) + "\n")
        if args.steps_out:
            with open(args.steps_out, "a") as f:
                for name, results in runs.items():
                    for r in results:
                        for step in r["steps"]:
                            f.write(json.dumps({"batch": batch, "run": name, **step}) + "\n")
    engine.shutdown()
    if bugs:
        print(f"\n!! {bugs} constrained outputs were INVALID under their schema: a bug")
        sys.exit(1)


if __name__ == "__main__":
    main()
