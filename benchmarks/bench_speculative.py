"""Speculative decoding (n-gram drafts, or a draft model's): tok/s with and without it, in one
process, on three workloads of the default model.

    python benchmarks/bench_speculative.py                       # batch 1, ~2 min on a CPU
    python benchmarks/bench_speculative.py --batch 1 4 --draft-tokens 4 8 16
    python benchmarks/bench_speculative.py --model-path BIG --speculative-algorithm draft \
        --speculative-draft-model-path SMALL                     # a draft model of its tokenizer

Workloads (chat template applied, greedy):
- code: a 40-line Python function and "rename the variable ... and return the full code": the
  answer repeats most of the prompt (drafts hit);
- json: extraction of a record of string fields from a text, under its JSON schema; the baseline
  is the same prompts unconstrained, without speculation, with ignore_eos and max_new_tokens =
  each constrained output's token count (as bench_constrained.py), so both write as many tokens;
- miss: a story from a one-line prompt (n-grams rarely repeat: the cost of drafts that miss).

Each run: the prefix cache flushed, all requests of the batch submitted at once (the same prompt
`batch` times: each request decodes alone the same tokens), tok/s = output tokens / wall time.
A warm-up run of each workload first (grammar compiles, first-call costs). Greedy outputs with
and without speculation are compared: a difference is a bug and is reported loudly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weft import Engine
from weft.runtime.config import EngineConfig

from common import describe_device

CODE = '''def summarize_orders(x, currency="EUR"):
    """Totals per customer of a list of orders, and the overall statistics."""
    totals = {}
    counts = {}
    largest = None
    for order in x:
        customer = order["customer"]
        amount = order["amount"]
        if order.get("currency", currency) != currency:
            raise ValueError(f"order {order['id']} is not in {currency}")
        if amount < 0:
            raise ValueError(f"order {order['id']} has a negative amount")
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
        if largest is None or amount > largest["amount"]:
            largest = order
    if not x:
        return {"customers": {}, "total": 0.0, "mean": 0.0, "largest": None}
    total = sum(totals.values())
    mean = total / len(x)
    customers = {}
    for customer, value in sorted(totals.items()):
        customers[customer] = {
            "total": round(value, 2),
            "orders": counts[customer],
            "mean": round(value / counts[customer], 2),
        }
    top = max(customers, key=lambda name: customers[name]["total"])
    return {
        "customers": customers,
        "total": round(total, 2),
        "mean": round(mean, 2),
        "largest": largest["id"],
        "top_customer": top,
        "currency": currency,
        "count": len(x),
    }
'''
CODE_PROMPT = f"{CODE}\nRename the variable x to orders and return the full code."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "company": {"type": "string"},
        "role": {"type": "string"},
        "city": {"type": "string"},
        "email": {"type": "string"},
    },
    "required": ["name", "company", "role", "city", "email"],
    "additionalProperties": False,
}
DOCS = [
    "Dr. Maria Lopez joined Oceanic Research Labs in Valencia last spring as a senior marine "
    "biologist; reach her at maria.lopez@oceanic-labs.org for interviews.",
    "After ten years in Toronto, Kenji Watanabe now leads the data platform team at Northwind "
    "Analytics as its head of engineering (kenji.w@northwind.io).",
    "Please send the signed contract to Amelia Brooks, procurement manager at Harbor Freight "
    "Logistics, Rotterdam office: amelia.brooks@harborfreight.nl.",
]
STORY = "Write a long story about a dragon who learns to bake bread in a small mountain village."


def chat(engine: Engine, text: str) -> str:
    """The text as a user turn of the chat template (as it is for a model without one)."""
    assert engine.tokenizer is not None
    if engine.tokenizer.chat_template is None:
        return text
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def run(
    engine: Engine, prompts: list[str], params: list[dict[str, Any]], batch: int
) -> tuple[float, list]:
    """(wall seconds, outputs) of the prompts, `batch` submitted at once, the prefix cache
    flushed."""
    engine.flush_cache()
    start = time.perf_counter()
    outs: list = []
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i : i + batch], params[i : i + batch])
    return time.perf_counter() - start, outs


@dataclasses.dataclass(frozen=True)
class Drafter:
    """The speculation measured: ngram, or draft with the draft model the engine loaded."""

    algorithm: str
    draft_model_path: str | None = None


def speculation(engine: Engine, drafter: Drafter | None, draft_tokens: int) -> None:
    """The engine with this speculation from now on (None: none; the draft model stays
    loaded)."""
    engine.scheduler.config = engine.scheduler.config.replace(
        speculative_algorithm=drafter.algorithm if drafter else None,
        speculative_draft_model_path=drafter.draft_model_path if drafter else None,
        speculative_num_draft_tokens=draft_tokens,
    )


def measure(
    engine: Engine,
    drafter: Drafter,
    name: str,
    *,
    batch: int,
    draft_tokens: int,
    max_new: int,
    repeats: int,
) -> dict[str, Any]:
    """One workload at one batch size: tok/s without and with speculation."""
    greedy = {"temperature": 0.0, "max_new_tokens": max_new}
    if name == "json":
        prompts = [chat(engine, f"Extract the person from this text as JSON: {d}") for d in DOCS]
        prompts = [p for p in prompts for _ in range(batch)]
        constrained = [{**greedy, "json_schema": json.dumps(SCHEMA)}] * len(prompts)
    else:
        text = CODE_PROMPT if name == "code" else STORY
        prompts = [chat(engine, text)] * batch
        constrained = [greedy] * len(prompts)
    warm_up = [{**constrained[0], "max_new_tokens": 8}]
    speculation(engine, drafter, draft_tokens)
    run(engine, prompts[:1], warm_up, 1)  # (the draft model's first steps too)
    speculation(engine, None, draft_tokens)
    run(engine, prompts[:1], warm_up, 1)
    _, reference = run(engine, prompts, constrained, batch)  # the outputs speculation must repeat
    plain_params = constrained
    if name == "json":  # the baseline: unconstrained, as many tokens as each constrained output
        plain_params = [
            {**greedy, "ignore_eos": True, "max_new_tokens": len(o["output_ids"])}
            for o in reference
        ]
    firsts = [{**c, "max_new_tokens": 1} for c in constrained]
    walls: dict[str, float] = {}
    for _ in range(repeats):  # NOTE: interleaved, the fastest of each: a shared CPU is noisy
        for key, spec_drafter, params in (
            ("prefill", None, firsts),
            ("no_spec", None, constrained),
            ("plain", None, plain_params),
            ("spec", drafter, constrained),
        ):
            if key == "plain" and name != "json":
                continue  # the same run as no_spec
            speculation(engine, spec_drafter, draft_tokens)
            wall, outs = run(engine, prompts, params, batch)
            walls[key] = min(walls.get(key, wall), wall)
            if key == "spec":
                spec = outs
            elif key == "plain":
                plain = outs
    speculation(engine, None, draft_tokens)
    if name != "json":
        walls["plain"], plain = walls["no_spec"], reference
    diverged = [
        next(
            i
            for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"], strict=False))
            if x != y
        )
        for a, b in zip(spec, reference, strict=True)
        if a["output_ids"] != b["output_ids"]
    ]
    if diverged:
        # NOTE: on a CPU the linear layers give a verify step's rows the bits of decode steps
        # (weft's CPU kernels, layers.QuantRows), but attention does not: a verify step's
        # queries go through the extend path (a causal mask over prefix + drafts), a decode
        # step's through the decode path, which round differently; a near tie may go the
        # other way
        print(f"!!! {name}: outputs differ from those without speculation at tokens {diverged}")
    for o in spec if name == "json" else []:
        json.loads(o["text"])  # must parse (the tests validate the schema)
    metas = [o["meta_info"] for o in spec if "spec_verify_ct" in o["meta_info"]]

    def decode_tok_s(outs: list[dict[str, Any]], key: str) -> float:
        """Tokens after each request's first / the time after the prefill."""
        return sum(len(o["output_ids"]) - 1 for o in outs) / (walls[key] - walls["prefill"])

    def tok_s(outs: list[dict[str, Any]], key: str) -> float:
        return sum(len(o["output_ids"]) for o in outs) / walls[key]

    return {
        "workload": name,
        "algorithm": drafter.algorithm,
        "batch": batch,
        "draft_tokens": draft_tokens,
        "tokens": sum(len(o["output_ids"]) for o in spec),
        "prefill_s": walls["prefill"],
        "tok_s_plain": decode_tok_s(plain, "plain"),
        "tok_s_no_spec": decode_tok_s(reference, "no_spec"),
        "tok_s_spec": decode_tok_s(spec, "spec"),
        "e2e_ratio": tok_s(spec, "spec") / tok_s(plain, "plain"),
        "accept_length": statistics.mean(m["spec_accept_length"] for m in metas) if metas else 1.0,
        "accept_rate": statistics.mean(m["spec_accept_rate"] for m in metas) if metas else 0.0,
        "verify_ct": sum(m["spec_verify_ct"] for m in metas),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded default model")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--workload", nargs="+", default=["code", "json", "miss"])
    p.add_argument(
        "--draft-tokens",
        type=int,
        nargs="+",
        default=[EngineConfig().speculative_num_draft_tokens],
    )
    p.add_argument("--speculative-algorithm", choices=["ngram", "draft"], default="ngram")
    p.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="with --speculative-algorithm draft: the draft model (of the model's tokenizer)",
    )
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2, help="the fastest of interleaved runs")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json-out", default=None, help="append one JSON line per measurement")
    args = p.parse_args()
    kwargs: dict[str, Any] = dict(show_progress=False, log_level="warning", device=args.device)
    if args.num_threads is not None:
        kwargs["num_threads"] = args.num_threads
    drafter = Drafter(args.speculative_algorithm, args.speculative_draft_model_path)
    if drafter.algorithm == "draft":  # loaded with the model; off (unused) in the baselines
        kwargs["speculative_algorithm"] = "draft"
        kwargs["speculative_draft_model_path"] = drafter.draft_model_path
    engine = Engine(args.model_path, **kwargs)
    print(f"# device: {describe_device(engine.runner.device)}")
    print(f"# model: {args.model_path or 'default (Qwen2.5-Coder-0.5B-Instruct)'}")
    if drafter.algorithm == "draft":
        print(f"# speculation: the draft model {drafter.draft_model_path}")
    else:
        print("# speculation: n-gram drafts")
    print("# tok/s: decode (output tokens after each first / wall time after the prefill)")
    print("# plain: without speculation (json: unconstrained, the same token counts)")
    print("# no spec: the workload itself without speculation (json: constrained)")
    header = (
        "workload  batch  draft  tokens  prefill s  plain  no spec   spec  ratio  e2e ratio"
        "  accept len  rate"
    )
    print(header)
    for batch in args.batch:
        for draft_tokens in args.draft_tokens:
            for name in args.workload:
                max_new = args.max_new_tokens if name != "json" else 120
                r = measure(
                    engine,
                    drafter,
                    name,
                    batch=batch,
                    draft_tokens=draft_tokens,
                    max_new=max_new,
                    repeats=args.repeats,
                )
                ratio = r["tok_s_spec"] / r["tok_s_plain"]
                print(
                    f"{r['workload']:<8}  {batch:>5}  {draft_tokens:>5}  {r['tokens']:>6}  "
                    f"{r['prefill_s']:>9.2f}  {r['tok_s_plain']:>5.1f}  {r['tok_s_no_spec']:>7.1f}"
                    f"  {r['tok_s_spec']:>5.1f}  {ratio:>5.2f}  {r['e2e_ratio']:>9.2f}  "
                    f"{r['accept_length']:>10.2f}  {r['accept_rate']:>4.2f}",
                    flush=True,
                )
                if args.json_out:
                    with open(args.json_out, "a") as f:
                        f.write(json.dumps({**r, "device": describe_device(engine.runner.device)}))
                        f.write("\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
