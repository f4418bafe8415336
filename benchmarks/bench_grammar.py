"""Grammar backends on real vocabularies: compile time and per-token mask time, and constrained
vs unconstrained decoding through the Engine.

    python benchmarks/bench_grammar.py masks --tokenizer DIR [--vocab-size N] [--tier core]
    python benchmarks/bench_grammar.py decode [--model-path DIR --load-format dummy] --batch 1 64

`masks`: for each backend alone and for the fallback chain, compile every schema of
benchmarks/data/schemas.json (cold: a fresh manager, nothing cached) and walk its example
instance (one line, ", " and ": ") token by token, timing each mask fill: p50 / p99 / max per
token. `--compact-json` compiles as --constrained-json-disable-any-whitespace does.
`decode`: the same prompts decoded unconstrained, under the no-grammar backend (the mask path
at no grammar cost), and under a JSON schema; output tok/s and ITL, and the ratio to the
unconstrained run measured in the same process. Also jump-forward on a schema with long fixed
keys: steps saved and the speed-up over the same run without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from common import describe_device

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "benchmarks" / "data" / "schemas.json"
ORDERS = {
    "xgrammar": ["xgrammar"],
    "llguidance": ["llguidance"],
    "outlines": ["outlines"],
    "chain": ["xgrammar", "llguidance", "outlines"],
}


def load_corpus(tier: str | None) -> list[dict]:
    entries = json.loads(CORPUS.read_text())
    return [e for e in entries if tier is None or e["tier"] == tier]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def bench_masks(args: argparse.Namespace) -> None:
    from weft.grammars.bitmask import allocate_bitmask, bit_is_set
    from weft.grammars.manager import GrammarError, GrammarManager, RequestGrammar
    from weft.grammars.spec import parse_spec
    from weft.grammars.vocab import TokenVocab

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = args.vocab_size or len(tokenizer)
    end_ids = [tokenizer.convert_tokens_to_ids(t) for t in args.end_tokens.split(",")]
    start = time.perf_counter()
    vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size, end_ids)
    print(
        f"# vocabulary {args.tokenizer}: {vocab_size} ids, {vocab.kind}, "
        f"converted in {time.perf_counter() - start:.2f} s; {describe_device(torch.device('cpu'))}"
    )
    entries = load_corpus(args.tier)
    layout = "compact JSON (--compact-json)" if args.compact_json else "whitespace as models write"
    print(
        f"# workload: {len(entries)} schemas ({args.tier or 'all'} tier), example instances "
        f'written with ", " and ": "; grammars allow {layout}'
    )
    print(
        f"{'backend':<11} {'compiled':>9} {'compile p50 ms':>15} {'p99 ms':>8} {'max ms':>8} "
        f"{'mask p50 us':>12} {'p99 us':>8} {'max us':>8} {'walked':>7}"
    )
    for label, order in ORDERS.items():
        if args.backends and label not in args.backends:
            continue
        manager = GrammarManager(
            lambda: vocab, order=order, timeout_s=args.timeout, compact_json=args.compact_json
        )
        for name in order:  # backend setup (vocabulary import) is not a compile
            manager._backend(name)
        compile_ms, mask_us, compiled_n, walked = [], [], 0, 0
        for entry in entries:
            spec = parse_spec("json_schema", json.dumps(entry["schema"]))
            t = time.perf_counter()
            try:
                compiled = manager.compile(spec)
            except GrammarError:
                continue
            compile_ms.append((time.perf_counter() - t) * 1e3)
            compiled_n += 1
            grammar = RequestGrammar(compiled, end_ids)
            text = json.dumps(entry["example"], separators=(", ", ": "), ensure_ascii=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            bitmask = allocate_bitmask(1, vocab_size)
            ok = True
            for tid in ids:
                t = time.perf_counter()
                manager.fill([grammar], bitmask, [0])
                mask_us.append((time.perf_counter() - t) * 1e6)
                if not bit_is_set(bitmask, 0, tid) or not grammar.accept(tid):
                    ok = False
                    break
            walked += ok
        manager.shutdown()
        print(
            f"{label:<11} {compiled_n:>4}/{len(entries):<4} {_pct(compile_ms, 0.5):>15.1f} "
            f"{_pct(compile_ms, 0.99):>8.1f} {max(compile_ms, default=float('nan')):>8.1f} "
            f"{_pct(mask_us, 0.5):>12.1f} {_pct(mask_us, 0.99):>8.1f} "
            f"{max(mask_us, default=float('nan')):>8.1f} {walked:>7}"
        )
    print(
        "# walked = examples whose every token the masks allowed (tokenization of the compact "
        "text, not necessarily what a model would pick)"
    )


# ---- decode ------------------------------------------------------------------------------

FIXED_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer"},
        "primary_shipping_address_line": {"type": "string", "maxLength": 24},
        "requested_delivery_time_window": {"enum": ["morning", "afternoon", "evening"]},
        "signature_required_on_delivery": {"type": "boolean"},
    },
    "required": [
        "customer_identification_number",
        "primary_shipping_address_line",
        "requested_delivery_time_window",
        "signature_required_on_delivery",
    ],
    "additionalProperties": False,
}


def _run(engine, prompts, params) -> tuple[float, int, float, list]:
    """(seconds, output tokens, mean ITL seconds, outputs)."""
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    steps = max(o["meta_info"]["completion_tokens"] for o in outs)
    return seconds, tokens, seconds / max(steps, 1), outs


def bench_decode(args: argparse.Namespace) -> None:
    from weft import Engine

    common = dict(show_progress=False, log_level="warning")
    if args.model_path:
        common.update(model_path=args.model_path, load_format=args.load_format)
    if args.max_total_tokens:
        common["max_total_tokens"] = args.max_total_tokens
    if args.disable_overlap_schedule:
        common["disable_overlap_schedule"] = True
    schema = json.dumps(FIXED_KEYS_SCHEMA)
    engines = {
        "unconstrained": Engine(**common),
        "none-backend": Engine(grammar_backend="none", **common),
    }
    engine = engines["unconstrained"]  # constrained runs share it (grammar chosen per request)
    device = engine.runner.device
    print(f"# {describe_device(device)}; model {engine.runner.model_config.architecture}")
    prompt = (
        "Write the JSON of a delivery order for customer 1042 to 5 Elm Street, evening, signed."
    )
    if engine.tokenizer is not None and engine.tokenizer.chat_template:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    n_new = args.max_new_tokens
    for batch in args.batch:
        prompts = [prompt] * batch
        # NOTE: ignore_eos keeps the unconstrained runs the same length as constrained ones
        plain = {"temperature": 0, "max_new_tokens": n_new, "ignore_eos": True}
        constrained = {"temperature": 0, "max_new_tokens": n_new, "json_schema": schema}
        runs = {
            "unconstrained": (engine, plain, True),
            "none-backend": (engines["none-backend"], {**plain, "regex": ".*"}, True),
            "json_schema": (engine, constrained, False),
            "json_schema +jump": (engine, constrained, True),
        }
        for target, params, _ in runs.values():  # warm-up: clocks, kernels, grammar compiles
            _run(target, prompts, params)
        # NOTE: runs interleave and repeat: GPU clocks drift between runs by tens of percent,
        # more than the effect measured; each row keeps its median.
        samples: dict[str, list] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (target, params, jump) in runs.items():
                # (enabled beside CUDA graphs too, where it is off by default)
                target.scheduler.config = target.scheduler.config.replace(
                    disable_jump_forward=not jump, enable_jump_forward=jump
                )
                samples[name].append(_run(target, prompts, params))
        rows = {name: sorted(s, key=lambda r: r[0])[len(s) // 2] for name, s in samples.items()}
        base = rows["unconstrained"]
        print(f"\n## batch {batch}, up to {n_new} new tokens per request, median of {args.repeats}")
        print(f"{'run':<18} {'out tok/s':>10} {'ITL ms':>8} {'tokens':>7} {'vs unconstrained':>17}")
        for name, (seconds, tokens, itl, outs) in rows.items():
            ratio = (tokens / seconds) / (base[1] / base[0])
            saved = sum(o["meta_info"].get("jump_forward_tokens", 0) for o in outs)
            extra = f"  jump-forward saved {saved} steps" if saved else ""
            print(
                f"{name:<18} {tokens / seconds:>10.1f} {itl * 1e3:>8.2f} {tokens:>7} {ratio:>16.2f}x{extra}"
            )
    for e in engines.values():
        e.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("masks")
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--vocab-size", type=int, default=None)
    m.add_argument("--end-tokens", default="<|im_end|>")
    m.add_argument("--tier", choices=["core", "extended"], default=None)
    m.add_argument("--timeout", type=float, default=30.0)
    m.add_argument("--compact-json", action="store_true", help="as the server flag")
    m.add_argument("--backends", nargs="+", choices=list(ORDERS), default=None)
    d = sub.add_parser("decode")
    d.add_argument("--model-path", default=None)
    d.add_argument("--load-format", default="auto")
    d.add_argument("--max-total-tokens", type=int, default=None)
    d.add_argument("--batch", type=int, nargs="+", default=[1])
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--disable-overlap-schedule", action="store_true")
    args = parser.parse_args()
    bench_masks(args) if args.cmd == "masks" else bench_decode(args)


if __name__ == "__main__":
    sys.exit(main())
