"""Plot decode tok/s against batch size from `bench_one_batch.py --json-out` records, with the
memory roofline and the cuBLAS GEMV floor measured in the same runs.

    python benchmarks/plot_decode.py benchmarks/data/one_batch_h100_*.jsonl -o decode.png

Roofline at batch b: b x copy bandwidth / (weight bytes + b x KV bytes per token x the mean
context of a decode step); the GEMV floor: b / the measured time of all linear layers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers
import matplotlib.pyplot as plt


def load(paths: list[str]) -> list[dict[str, Any]]:
    records = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                record["label"] = Path(path).stem
                records.append(record)
    return records


def roofline_tok_s(record: dict[str, Any], batch: int) -> float:
    args = record["args"]
    context = args["input_len"] + args["output_len"] / 2  # mean KV length over the decode
    step_bytes = record["weight_bytes"] + batch * record["kv_bytes_per_token"] * context
    return batch * record["copy_gb_s"] * 1e9 / step_bytes


def plot(records: list[dict[str, Any]], out: str) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, record in enumerate(records):
        rows = sorted(record["rows"], key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        name = f"{record['label']} ({record['model']['architecture']})"
        color = f"C{i}"
        ax.plot(batches, [r["decode_tok_s"] for r in rows], "o-", color=color, label=f"weft {name}")
        ax.plot(
            batches,
            [roofline_tok_s(record, b) for b in batches],
            "--",
            color=color,
            label="memory roofline (copy bandwidth)",
        )
        floors = [(r["batch"], r["gemv_floor_ms"]) for r in rows if r.get("gemv_floor_ms")]
        if floors:
            ax.plot(
                [b for b, _ in floors],
                [b * 1e3 / ms for b, ms in floors],
                ":",
                color=color,
                label="cuBLAS GEMV floor (linears only)",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests decoding at once)")
    ax.set_ylabel("decode tokens / s")
    args = records[0]["args"]
    ax.set_title(
        f"{records[0]['device']}\nstatic batch, prompt {args['input_len']}, "
        f"{args['output_len']} new tokens, greedy"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("records", nargs="+", help="bench_one_batch --json-out files")
    p.add_argument("-o", "--out", default="decode_tok_s.png")
    args = p.parse_args()
    plot(load(args.records), args.out)


if __name__ == "__main__":
    main()
