"""How long constrained requests wait for their grammar under production traffic, cold and
cached, and whether the compiles hold up the plain requests beside them.

    python benchmarks/bench_compile_latency.py --device cpu          # the default model
    python benchmarks/bench_compile_latency.py --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --tokenizer-path TOK/llama3 --rate 8

Reference: every schema of the corpus (bench_constrained's: the project's schemas, the
extraction schemas, the production schemas) compiled alone by xgrammar and by llguidance
(--reference-backends), one at a time, nothing cached, nothing else running: a spec's fastest
compile, or none where both refuse it.

Traffic: Poisson arrivals at --rate requests/s, in a seeded random order: every schema twice
(the second request finds the grammar cached once the first compile has ended) and
--plain-share plain requests per schema, each up to --max-new-tokens. Then the same schedule's
plain requests alone, for their latency without compiles beside them. Burst: the engine's
grammar cache emptied, every schema at once (a fresh server's first traffic).

Per request, meta_info's `grammar_wait_s` (from its arrival at the scheduler until its grammar
was compiled, or found in the cache) and `grammar_cached`; plain requests' latency (client side,
up to --max-new-tokens). Targets (issue 20): no request waits more than 2 s for a spec
that some backend compiles alone in under 100 ms; a cached spec starts in under 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench_constrained import CORPORA, build_prompt, load_corpus

FAST_S = 0.1  # "a spec that some backend compiles in under 100 ms"
FAST_WAIT_S = 2.0  # ... waits no longer than this
CACHED_WAIT_S = 1e-3  # a cached spec starts within this
BANDS = ((0.0, 0.1), (0.1, 1.0), (1.0, float("inf")))  # fastest compile alone, seconds


@dataclass
class Item:
    at: float  # seconds after the traffic's start
    name: str  # the schema's, or "plain"
    prompt: str
    params: dict


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def _stats(values: list[float], scale: float = 1.0) -> str:
    if not values:
        return "-"
    return (
        f"p50 {_pct(values, 0.5) * scale:.3g} / p99 {_pct(values, 0.99) * scale:.3g} / "
        f"max {max(values) * scale:.3g}"
    )


def reference(vocab: Any, entries: list[dict], order: list[str], timeout: float) -> dict:
    """{schema name: {backend: compile seconds, or None where it refused or timed out}}."""
    from weft.grammars.manager import GrammarError, GrammarManager
    from weft.grammars.spec import parse_spec

    times: dict[str, dict[str, float | None]] = {e["name"]: {} for e in entries}
    for name in order:
        manager = GrammarManager(lambda: vocab, order=[name], timeout_s=timeout)
        manager._backend(name)  # its setup (the vocabulary's import) is not a compile
        start = time.perf_counter()
        for entry in entries:
            spec = parse_spec("json_schema", json.dumps(entry["schema"]))
            t = time.perf_counter()
            try:
                manager.compile(spec)
                times[entry["name"]][name] = time.perf_counter() - t
            except GrammarError:
                times[entry["name"]][name] = None
        manager.shutdown()
        done = [t[name] for t in times.values() if t[name] is not None]
        print(
            f"# reference {name}: {len(done)}/{len(entries)} compiled alone in "
            f"{time.perf_counter() - start:.1f} s; compile {_stats(done, 1e3)} ms",
            flush=True,
        )
    return times


async def _send(engine: Any, items: list[Item]) -> list[Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(item: Item) -> Any:
        await asyncio.sleep(max(0.0, item.at - (loop.time() - start)))
        t = time.perf_counter()
        try:
            out = await engine.async_generate(item.prompt, item.params)
        except Exception as exc:  # a schema every backend refuses: a 400
            return exc
        out["meta_info"]["client_s"] = time.perf_counter() - t
        return out

    return await asyncio.gather(*(one(i) for i in items))


def run(engine: Any, items: list[Item]) -> tuple[list[Any], float]:
    deadline = time.perf_counter() + 30
    while not engine.flush_cache():  # no prefix hits carried from run to run
        assert time.perf_counter() < deadline, "the engine did not go idle"
        time.sleep(0.01)
    start = time.perf_counter()
    outs = asyncio.run(_send(engine, items))
    return outs, time.perf_counter() - start


def empty_grammar_cache(engine: Any) -> None:
    """A fresh grammar manager with its backends built, as in a server started a few seconds
    ago (the scheduler builds them in the background from its start)."""

    def swap() -> Any:
        constrained = engine.scheduler.constrained
        old, constrained._grammars = constrained._grammars, None
        if old is not None:
            old.shutdown()
        return constrained.grammars.prepare()

    engine.call(swap).result()


def report(label: str, items: list[Item], outs: list[Any], fastest: dict[str, float | None]):
    """Waits by the spec's fastest compile alone; the targets' counts. Returns the misses."""
    cold: dict[tuple[float, float], list[float]] = {band: [] for band in BANDS}
    cached, plain, refused, misses = [], [], 0, []
    for item, out in zip(items, outs, strict=True):
        if isinstance(out, BaseException):
            refused += 1
            continue
        meta = out["meta_info"]
        if item.name == "plain":
            plain.append(meta["client_s"])
            continue
        if "grammar_wait_s" not in meta:  # ended before its grammar was ready
            if fastest[item.name] is None:  # every backend refuses it (a 400 over HTTP)
                refused += 1
            else:
                finish = meta["finish_reason"] or {}
                misses.append(f"{item.name}: no grammar: {finish.get('message', finish)}")
            continue
        wait = meta["grammar_wait_s"]
        if meta["grammar_cached"]:
            cached.append(wait)
            if wait >= CACHED_WAIT_S:
                misses.append(f"{item.name}: cached, waited {wait * 1e3:.2f} ms")
            continue
        best = fastest[item.name]
        band = next(b for b in BANDS if best is not None and b[0] <= best < b[1]) if best else None
        if band is None:
            band = BANDS[-1]  # only compiled under load (the reference timed out)
        cold[band].append(wait)
        if best is not None and best < FAST_S and wait > FAST_WAIT_S:
            misses.append(
                f"{item.name}: compiles alone in {best * 1e3:.0f} ms, waited {wait:.2f} s"
            )
    print(f"\n## {label}")
    for (lo, hi), waits in cold.items():
        span = f"{lo * 1e3:.0f}-{hi * 1e3:.0f} ms" if hi < float("inf") else f">= {lo:.0f} s"
        print(
            f"cold, fastest compile alone {span:<11}: {len(waits):>4} requests, wait s {_stats(waits)}"
        )
    print(f"cached{'':<31}: {len(cached):>4} requests, wait ms {_stats(cached, 1e3)}")
    if plain:
        print(f"plain{'':<32}: {len(plain):>4} requests, latency s {_stats(plain)}")
    if refused:
        print(f"refused by every backend: {refused} requests (a 400 each)")
    return misses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded default model")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--corpus", nargs="+", choices=CORPORA, default=list(CORPORA))
    p.add_argument("--limit", type=int, default=None, help="the first N schemas only")
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    p.add_argument("--plain-share", type=float, default=1.0, help="plain requests per schema")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--grammar-backends", default="xgrammar,llguidance,outlines")
    p.add_argument(
        "--reference-backends",
        default="xgrammar,llguidance",
        help="outlines-core takes seconds (p50 9.7 s on Qwen2's vocabulary): never the fast one",
    )
    p.add_argument("--timeout", type=float, default=20.0, help="the reference's compile limit")
    p.add_argument("--no-burst", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from weft import Engine

    from common import describe_device

    entries = load_corpus(tuple(args.corpus))[: args.limit]
    kwargs: dict[str, Any] = dict(
        show_progress=False,
        log_level="warning",
        load_format=args.load_format,
        device=args.device,
        grammar_backend=args.grammar_backends,
    )
    if args.tokenizer_path:
        kwargs["tokenizer_path"] = args.tokenizer_path
    engine = Engine(args.model_path, **kwargs)
    sched = engine.scheduler
    print(f"# device: {describe_device(engine.runner.device)}")
    print(
        f"# model: {args.model_path or 'default (Qwen2.5-Coder-0.5B-Instruct)'}, vocab "
        f"{engine.model_config.vocab_size}; grammar backends {args.grammar_backends}, race "
        f"budget {engine.config.grammar_race_budget} s"
    )
    vocab = engine.call(lambda: sched.constrained.grammars.vocab)
    times = reference(vocab, entries, args.reference_backends.split(","), args.timeout)
    fastest = {
        n: min((s for s in t.values() if s is not None), default=None) for n, t in times.items()
    }
    fast = sum(1 for s in fastest.values() if s is not None and s < FAST_S)
    print(f"# {fast}/{len(entries)} schemas compile alone in under {FAST_S * 1e3:.0f} ms somewhere")

    rng = random.Random(args.seed)
    base = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    kinds = [e for e in entries for _ in range(2)] + [None] * round(args.plain_share * len(entries))
    rng.shuffle(kinds)
    items, at = [], 0.0
    for entry in kinds:
        at += rng.expovariate(args.rate)
        if entry is None:
            prompt_entry = rng.choice(entries)
            prompt = build_prompt(prompt_entry, engine.tokenizer)
            items.append(Item(at, "plain", prompt, base))
        else:
            prompt = build_prompt(entry, engine.tokenizer)
            params = {**base, "json_schema": json.dumps(entry["schema"])}
            items.append(Item(at, entry["name"], prompt, params))
    print(
        f"# traffic: {len(items)} requests over {at:.0f} s (Poisson, {args.rate:g}/s): "
        f"{len(entries)} schemas twice each, {len(items) - 2 * len(entries)} plain; up to "
        f"{args.max_new_tokens} new tokens each, greedy",
        flush=True,
    )
    empty_grammar_cache(engine)
    outs, seconds = run(engine, items)
    misses = report(f"traffic ({seconds:.0f} s)", items, outs, fastest)
    plain_items = [i for i in items if i.name == "plain"]
    if plain_items:
        outs, seconds = run(engine, plain_items)
        report(f"the same plain requests alone ({seconds:.0f} s)", plain_items, outs, fastest)
    if not args.no_burst:
        empty_grammar_cache(engine)
        burst = [
            Item(
                0.0,
                e["name"],
                build_prompt(e, engine.tokenizer),
                {**base, "json_schema": json.dumps(e["schema"])},
            )
            for e in entries
        ]
        outs, seconds = run(engine, burst)
        burst_misses = report(
            f"burst: {len(burst)} schemas at once, cache empty ({seconds:.0f} s)",
            burst,
            outs,
            fastest,
        )
        print(f"(burst misses, not a target: {len(burst_misses)})")
    print(
        f"\ntargets: fast specs (< {FAST_S * 1e3:.0f} ms alone somewhere) wait <= {FAST_WAIT_S:g} s, "
        f"cached specs < {CACHED_WAIT_S * 1e3:g} ms: {'MET' if not misses else 'MISSED'}"
    )
    for miss in misses:
        print(f"  miss: {miss}")
    engine.shutdown()
    sys.stdout.flush()
    # NOTE: not sys.exit: compiles that lost their race may still run in native threads, which
    # the interpreter's teardown aborts ("terminate called without an active exception")
    os._exit(0)


if __name__ == "__main__":
    main()
