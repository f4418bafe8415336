"""Plot a step's time split into forward, mask (exposed), accepts (exposed), sampling and the rest,
constrained beside unconstrained, per batch size, from `bench_constrained.py --json-out` records.

    python benchmarks/plot_constrained.py r.jsonl -o constrained_steps.png

Bars are the mean over the steps that ran a forward (constrained: with a masked row); each is
labelled with its run's output tok/s. Without matplotlib, says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PARTS = (  # (the record's key, legend label, colour)
    ("forward", "forward + lm_head", "#4c72b0"),
    ("mask", "mask fill (device idle)", "#dd8452"),
    ("acc", "accepts (device idle)", "#c44e52"),
    ("sampling", "sampling", "#55a868"),
    ("other", "other host (scheduling, read-back)", "#a0a0a0"),
)
RUNS = ("constrained", "unconstrained")


def load(paths: list[str]) -> list[dict[str, Any]]:
    records = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                # (a run with --no-step-profile has no step times to plot)
                if record.get("bench") == "constrained" and record["constrained"]["steps"]["steps"]:
                    records.append(record)
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("paths", nargs="+")
    p.add_argument("-o", "--out", default="constrained_steps.png")
    args = p.parse_args()
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    records = sorted(load(args.paths), key=lambda r: (r["device"], r["schedule"], r["batch"]))
    if not records:
        raise SystemExit("no bench_constrained records in " + ", ".join(args.paths))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(records) + 2), 4.8))
    width, ticks, labels = 0.38, [], []
    for i, record in enumerate(records):
        for j, run in enumerate(RUNS):
            steps, x, bottom = record[run]["steps"], i + (j - 0.5) * width, 0.0
            for key, label, colour in PARTS:
                value = max(steps[key]["mean"], 0.0)
                ax.bar(
                    x,
                    value,
                    width,
                    bottom=bottom,
                    color=colour,
                    label=label if i + j == 0 else None,
                )
                bottom += value
            tok_s = record[run]["tokens"] / record[run]["seconds"]
            ax.text(x, bottom, f"{tok_s:,.0f}\ntok/s", ha="center", va="bottom", fontsize=7)
            ax.text(x, 0, run[0].upper(), ha="center", va="bottom", fontsize=7, color="white")
        ticks.append(i)
        jump = ", no jump-fwd" if record.get("jump_forward") == "off" else ""
        labels.append(
            f"batch {record['batch']}\n{record['ratio']:.2f}x\n{record['schedule']}{jump}"
        )
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("mean step time (ms)")
    ax.margins(y=0.2)
    device = records[0]["device"].split(",")[0]
    ax.set_title(
        f"Constrained (C) vs unconstrained (U) decoding, {_schemas(records)} schemas\n"
        f"{device}, {records[0]['model']}, {records[0]['graphs']}",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=150)
    print(f"wrote {args.out}")


def _schemas(records: list[dict[str, Any]]) -> str:
    """The schema counts of the runs ("75" or "75 / 16": batch sizes may run on a subset)."""
    return " / ".join(str(n) for n in dict.fromkeys(r["schemas"] for r in records))


if __name__ == "__main__":
    main()
