"""Extraction quality: JSON-schema constrained decoding against the unconstrained model whose
answer is parsed out of its text. Constrained decoding must never score below that baseline.

    python benchmarks/bench_extraction_quality.py                  # the embedded default model
    python benchmarks/bench_extraction_quality.py --limit 10 --out quality.json
    python benchmarks/bench_extraction_quality.py --model-path DIR
    python benchmarks/bench_extraction_quality.py --configs "xgrammar-first +jump"   # and the baseline

Workload: benchmarks/data/extraction.jsonl, short texts (a bio, an invoice, a meeting note, a
product listing, a company profile) each with its known answer, under one schema per kind
(benchmarks/data/extraction_schemas.json: strings, bounded integers, enums, nested objects,
lists, optional fields, a date). `--limit N` takes N texts round-robin over the kinds.

Configs, each on a freshly built Engine (shut down before the next: one model in memory):
- unconstrained: the baseline. Greedy; the output is parsed (`parse_json_object`).
- json_schema constrained, the grammar backend chain led by xgrammar, llguidance or outlines
  (a backend that refuses a schema passes it down the chain: the `served by` column), each with
  jump-forward on and off; and xgrammar first with compact JSON
  (--constrained-json-disable-any-whitespace) instead of whitespace as the model writes it.
Every config gets the same prompt: a system message asking for the JSON object, with the schema
in it, then the text; the constrained configs also enforce the schema.

Scoring (`score_record`), against the known answer:
- fields: the answer's leaves. A nested object's fields count one by one ("home.city"); a list
  is one field compared as a whole, in order. A key the output lacks reads as null (a pydantic
  default), so an absent optional field is right when the answer is null.
- equality after `normalize`: strings NFKC, casefolded, whitespace collapsed; numbers by value
  (24.5 == 24.50, 79 == 79.0) but never a bool or a string for a number; objects inside lists
  key by key, null values dropped.
- an output with no JSON object in it scores 0 on every field, null ones included.
Per config: field exact match, whole-record exact match (every field right), valid JSON (an
object parsed), schema-valid (jsonschema with formats), mean output tokens, jump-forward tokens,
wall time (grammar compiles included), and the field score over the baseline's.

Exit status 1, with a FAIL line each, when a constrained config scores below the baseline on
fields or on whole records; the fields it lost are listed under it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

DATA = Path(__file__).resolve().parent / "data"
RECORDS_PATH = DATA / "extraction.jsonl"
SCHEMAS_PATH = DATA / "extraction_schemas.json"

SYSTEM_PROMPT = (
    "Extract the facts in the user's text as one JSON object that follows this JSON schema. "
    "Reply with the JSON object only. Copy names as the text writes them, write dates as "
    "YYYY-MM-DD, and use null for an optional field the text does not give.\n\n"
    "JSON schema:\n{schema}"
)
ORDERS = {  # chain for each "<backend>-first" config
    "xgrammar": "xgrammar,llguidance,outlines",
    "llguidance": "llguidance,xgrammar,outlines",
    "outlines": "outlines,xgrammar,llguidance",
}
BASELINE = "unconstrained"


@dataclass(frozen=True)
class Record:
    id: str
    kind: str
    text: str
    answer: dict[str, Any]


@dataclass(frozen=True)
class RunConfig:
    name: str
    grammar_backend: str | None  # None: unconstrained
    jump_forward: bool
    compact_json: bool = False  # --constrained-json-disable-any-whitespace


@dataclass
class Scored:
    """One output, scored."""

    id: str
    kind: str
    output: str
    parsed: dict[str, Any] | None
    fields: dict[str, bool]  # leaf path -> right
    schema_valid: bool = False
    output_tokens: int = 0
    jump_forward_tokens: int = 0
    backend: str | None = None

    @property
    def exact(self) -> bool:
        return all(self.fields.values())


@dataclass
class Summary:
    name: str
    records: int
    fields_right: int
    fields_total: int
    records_exact: int
    valid_json: int
    schema_valid: int
    mean_output_tokens: float
    jump_forward_tokens: int
    wall_s: float
    served_by: dict[str, int] = field(default_factory=dict)

    @property
    def field_score(self) -> float:
        return self.fields_right / self.fields_total if self.fields_total else 0.0

    @property
    def record_score(self) -> float:
        return self.records_exact / self.records if self.records else 0.0


def run_configs(only: list[str] | None = None) -> list[RunConfig]:
    """Every config, or the baseline and those named in `only` (an unknown name is an error)."""
    configs = [RunConfig(BASELINE, None, False)]
    for lead, chain in ORDERS.items():
        for jump in (True, False):
            name = f"{lead}-first {'+jump' if jump else 'no-jump'}"
            configs.append(RunConfig(name, chain, jump))
    configs.append(RunConfig("xgrammar-first compact", ORDERS["xgrammar"], True, compact_json=True))
    if only is None:
        return configs
    unknown = set(only) - {c.name for c in configs}
    if unknown:
        known = ", ".join(repr(c.name) for c in configs)
        raise ValueError(f"unknown config {sorted(unknown)[0]!r} (known: {known})")
    return [c for c in configs if c.name == BASELINE or c.name in only]


# ---- workload ----------------------------------------------------------------------------


def load_schemas(path: Path = SCHEMAS_PATH) -> dict[str, dict[str, Any]]:
    return json.loads(path.read_text())


def load_records(path: Path = RECORDS_PATH) -> list[Record]:
    with path.open() as f:
        return [Record(**json.loads(line)) for line in f if line.strip()]


def select(records: list[Record], limit: int | None) -> list[Record]:
    """The first `limit` records taken round-robin over the kinds (each kind in file order)."""
    if limit is None:
        return list(records)
    by_kind: dict[str, list[Record]] = {}
    for r in records:
        by_kind.setdefault(r.kind, []).append(r)
    picked: list[Record] = []
    for i in range(max(len(v) for v in by_kind.values())):
        picked.extend(group[i] for group in by_kind.values() if i < len(group))
    return picked[:limit]


def build_prompt(tokenizer: Any, schema: dict[str, Any], text: str) -> str:
    system = SYSTEM_PROMPT.format(schema=json.dumps(schema, ensure_ascii=False))
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system}\n\nText: {text}\nJSON: "


# ---- scoring -----------------------------------------------------------------------------

_FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def parse_json_object(text: str) -> dict[str, Any] | None:
    """The JSON object in a model's output: the whole text, else a ```json fenced block, else the
    first object that parses from a "{" on. None when there is none."""
    candidates = [text.strip(), *(m.group(1).strip() for m in _FENCE.finditer(text))]
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def normalize(value: Any) -> Any:
    """A value in the form the scorer compares (see the module docstring)."""
    if isinstance(value, str):
        return " ".join(unicodedata.normalize("NFKC", value).casefold().split())
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return ("number", float(value))  # NOTE: tagged, so 1 never equals True
    if isinstance(value, list):
        return tuple(normalize(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, normalize(v)) for k, v in value.items() if v is not None))
    return ("other", repr(value))


def leaf_paths(answer: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The scored fields of an answer: its leaves, a list being one leaf."""
    paths: list[tuple[str, ...]] = []
    for key, value in answer.items():
        if isinstance(value, dict):
            paths.extend(leaf_paths(value, (*prefix, key)))
        else:
            paths.append((*prefix, key))
    return paths


def lookup(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def score_record(answer: dict[str, Any], parsed: dict[str, Any] | None) -> dict[str, bool]:
    """Each field of `answer` (dotted path) -> whether `parsed` has it right."""
    return {
        ".".join(path): parsed is not None
        and normalize(lookup(parsed, path)) == normalize(lookup(answer, path))
        for path in leaf_paths(answer)
    }


def summarize(name: str, scored: list[Scored], wall_s: float) -> Summary:
    return Summary(
        name=name,
        records=len(scored),
        fields_right=sum(sum(s.fields.values()) for s in scored),
        fields_total=sum(len(s.fields) for s in scored),
        records_exact=sum(s.exact for s in scored),
        valid_json=sum(s.parsed is not None for s in scored),
        schema_valid=sum(s.schema_valid for s in scored),
        mean_output_tokens=sum(s.output_tokens for s in scored) / max(len(scored), 1),
        jump_forward_tokens=sum(s.jump_forward_tokens for s in scored),
        wall_s=wall_s,
        served_by=dict(Counter(s.backend for s in scored if s.backend)),
    )


def field_changes(base: list[Scored], other: list[Scored]) -> tuple[list[str], list[str]]:
    """(fields the baseline has right and `other` wrong, the reverse), as "id:field"."""
    lost, won = [], []
    for b, o in zip(base, other, strict=True):
        for path, right in b.fields.items():
            if right and not o.fields[path]:
                lost.append(f"{b.id}:{path}")
            elif o.fields[path] and not right:
                won.append(f"{b.id}:{path}")
    return lost, won


def failures(summaries: list[Summary]) -> dict[str, list[str]]:
    """Constrained configs below the baseline on fields or whole records -> why."""
    base = next(s for s in summaries if s.name == BASELINE)
    found: dict[str, list[str]] = {}
    for s in summaries:
        if s.name == BASELINE:
            continue
        why = []
        if s.fields_right < base.fields_right:
            why.append(f"fields {s.fields_right}/{s.fields_total} < {base.fields_right}")
        if s.records_exact < base.records_exact:
            why.append(f"whole records {s.records_exact}/{s.records} < {base.records_exact}")
        if why:
            found[s.name] = why
    return found


# ---- running -----------------------------------------------------------------------------


def run_config(
    config: RunConfig,
    records: list[Record],
    schemas: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    *,
    on_ready: Any = None,
) -> tuple[list[Scored], float]:
    from weft import Engine

    kwargs: dict[str, Any] = {"show_progress": False, "log_level": "warning"}
    if config.grammar_backend is not None:
        kwargs["grammar_backend"] = config.grammar_backend
    kwargs["disable_jump_forward"] = not config.jump_forward
    kwargs["constrained_json_disable_any_whitespace"] = config.compact_json
    if args.load_format:
        kwargs["load_format"] = args.load_format
    engine = Engine(args.model_path, **kwargs)
    try:
        if on_ready is not None:
            on_ready(engine)
        prompts = [build_prompt(engine.tokenizer, schemas[r.kind], r.text) for r in records]
        params: list[dict[str, Any]] = []
        for r in records:
            p: dict[str, Any] = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
            if config.grammar_backend is not None:
                p["json_schema"] = json.dumps(schemas[r.kind])
            params.append(p)
        start = time.perf_counter()
        outputs: list[dict[str, Any]] = []
        for i in range(0, len(prompts), args.batch_size):
            batch = engine.generate(
                prompts[i : i + args.batch_size], params[i : i + args.batch_size]
            )
            outputs.extend(batch)
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    scored = []
    for r, out in zip(records, outputs, strict=True):
        parsed = parse_json_object(out["text"])
        validator = jsonschema.Draft202012Validator(
            schemas[r.kind], format_checker=jsonschema.FormatChecker()
        )
        meta = out["meta_info"]
        scored.append(
            Scored(
                id=r.id,
                kind=r.kind,
                output=out["text"],
                parsed=parsed,
                fields=score_record(r.answer, parsed),
                schema_valid=parsed is not None and validator.is_valid(parsed),
                output_tokens=meta["completion_tokens"],
                jump_forward_tokens=meta.get("jump_forward_tokens", 0),
                backend=meta.get("grammar_backend"),
            )
        )
    return scored, wall


def print_table(summaries: list[Summary], scored: dict[str, list[Scored]]) -> None:
    base = next(s for s in summaries if s.name == BASELINE)
    print(
        f"\n{'config':<24} {'fields':>14} {'vs base':>8} {'lost':>5} {'won':>4} {'records':>12} "
        f"{'valid JSON':>10} {'schema ok':>9} {'out tok':>8} {'jump tok':>8} {'wall s':>7}  served by"
    )
    for s in summaries:
        lost, won = field_changes(scored[BASELINE], scored[s.name])
        served = ", ".join(f"{k} {v}" for k, v in sorted(s.served_by.items())) or "-"
        ratio = s.field_score / base.field_score if base.field_score else float("nan")
        print(
            f"{s.name:<24} {s.fields_right:>4}/{s.fields_total:<4} {s.field_score:>4.0%}"
            f" {ratio:>7.3f}x {len(lost):>5} {len(won):>4}"
            f" {s.records_exact:>3}/{s.records:<3} {s.record_score:>4.0%}"
            f" {s.valid_json:>6}/{s.records:<3} {s.schema_valid:>5}/{s.records:<3}"
            f" {s.mean_output_tokens:>8.1f} {s.jump_forward_tokens:>8} {s.wall_s:>7.1f}  {served}"
        )


def print_fields(summaries: list[Summary], scored: dict[str, list[Scored]]) -> None:
    """Right answers per field, for the fields where some config differs from the baseline."""
    names = [s.name for s in summaries]
    counts = {
        name: Counter(f"{s.kind}.{p}" for s in scored[name] for p, ok in s.fields.items() if ok)
        for name in names
    }
    totals = Counter(f"{s.kind}.{p}" for s in scored[BASELINE] for p in s.fields)
    differing = [f for f in totals if len({counts[n][f] for n in names}) > 1]
    if not differing:
        print("\nevery config has the same fields right")
        return
    print("\nright answers per field, where configs differ (columns in the table's order):")
    for f in differing:
        cells = " ".join(f"{counts[n][f]:>3}" for n in names)
        print(f"  {f:<28} of {totals[f]:<3} {cells}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the embedded model")
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--limit", type=int, default=None, help="texts, round-robin over kinds")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="texts per generate call")
    parser.add_argument("--out", default=None, help="write summaries and outputs as JSON")
    parser.add_argument(
        "--configs",
        default=None,
        help='comma-separated configs besides the baseline, e.g. "xgrammar-first +jump"',
    )
    args = parser.parse_args()
    try:
        configs = run_configs(args.configs.split(",") if args.configs else None)
    except ValueError as e:
        parser.error(str(e))

    from common import describe_device

    schemas = load_schemas()
    records = select(load_records(), args.limit)
    kinds = Counter(r.kind for r in records)

    def header(engine: Any) -> None:
        print(f"# device: {describe_device(engine.runner.device)}")
        print(f"# model: {engine.source.display_path} ({engine.model_config.architecture})")
        print(
            f"# workload: {len(records)} texts ("
            + ", ".join(f"{k} {v}" for k, v in kinds.items())
            + f"), {sum(len(leaf_paths(r.answer)) for r in records)} fields; greedy, "
            f"max_new_tokens {args.max_new_tokens}, batches of {args.batch_size}",
            flush=True,
        )

    summaries: list[Summary] = []
    scored: dict[str, list[Scored]] = {}
    for i, config in enumerate(configs):
        start = time.perf_counter()
        results, wall = run_config(
            config, records, schemas, args, on_ready=header if i == 0 else None
        )
        summary = summarize(config.name, results, wall)
        summaries.append(summary)
        scored[config.name] = results
        print(
            f"[{i + 1}/{len(configs)}] {config.name:<24} fields {summary.field_score:.1%} "
            f"records {summary.record_score:.1%} generate {wall:.0f} s "
            f"(with engine start {time.perf_counter() - start:.0f} s)",
            flush=True,
        )

    print_table(summaries, scored)
    print_fields(summaries, scored)
    fails = failures(summaries)
    for name, why in fails.items():
        print(f"FAIL {name}: {'; '.join(why)} (the baseline's)")
        lost, _ = field_changes(scored[BASELINE], scored[name])
        by_id = {s.id: s for s in scored[name]}
        for item in lost:
            rid, path = item.split(":", 1)
            got = lookup(by_id[rid].parsed, tuple(path.split(".")))
            print(f"    lost {item}: {json.dumps(got, ensure_ascii=False)}")
    print(
        "FAIL" if fails else "PASS: no constrained config scores below the unconstrained baseline"
    )
    if args.out:
        payload = {
            "args": vars(args),
            "summaries": [asdict(s) for s in summaries],
            "outputs": {name: [asdict(s) for s in rows] for name, rows in scored.items()},
        }
        Path(args.out).write_text(json.dumps(payload, indent=1, ensure_ascii=False))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
