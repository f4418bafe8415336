"""Server start time: launch `weft serve` until its ready line, several times, and split the time
into its parts as the server's log reports them (model load, CUDA graph capture, the rest).

    python benchmarks/bench_startup.py --model-path M [--repeats 3] [-- extra serve flags]

Prints the device, then per configuration the median time to ready and its parts; the baseline
in the same run is the same server with --disable-cuda-graph, and the launcher that imports
everything before it spawns the children (as it did until 2026-11-26). The first launch also pays
cold caches (Triton's kernel cache, the page cache): it is reported apart.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

import requests
import torch

from common import describe_device

READY = re.compile(r"weft: ready, serving .* at (http://[^ ]+) ")
# the first requests after the start: a prompt prefill and a few decode steps, greedy, then a
# constrained one (kernels not compiled at start compile on them)
FIRST = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
CONSTRAINED = {"text": "Once", "sampling_params": {"max_new_tokens": 8, "regex": "[a-z ]{1,20}"}}
PARTS = {
    "graphs": re.compile(r"captured CUDA graphs .* in ([0-9.]+) s"),
    "scheduler": re.compile(r"scheduler ready in ([0-9.]+) s"),
}


# The launcher as it was before 2026-11-26: torch, transformers and the HTTP stack imported
# before the children are spawned (now they are imported while the children load).
IMPORT_FIRST = (
    "import sys; import weft.runtime.server.http_server, weft.runtime.server.tokenizer_manager, "
    "weft.runtime.scheduler_process, weft.runtime.detokenizer_process; from weft.cli import main; "
    "sys.exit(main(['serve', *sys.argv[1:]]))"
)


def launch(args: list[str], import_first: bool = False) -> dict[str, float]:
    entry = ["-c", IMPORT_FIRST] if import_first else ["-m", "weft.launch_server"]
    cmd = [sys.executable, *entry, "--port", "0", "--log-level", "info"]
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "--no-show-progress", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out: dict[str, float] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        for name, pattern in PARTS.items():
            match = pattern.search(line)
            if match:
                out[name] = float(match.group(1))
        ready = READY.search(line)
        if ready:
            out["ready"] = time.perf_counter() - started
            for name, body in [("first", FIRST), ("second", FIRST), ("constrained", CONSTRAINED)]:
                sent = time.perf_counter()
                requests.post(
                    ready.group(1) + "/generate", json=body, timeout=300
                ).raise_for_status()
                out[name] = time.perf_counter() - sent
            break
    proc.terminate()
    proc.wait(30)
    if "ready" not in out:
        raise RuntimeError(f"the server did not start: {' '.join(cmd + args)}")
    return out


KEYS = ("ready", "scheduler", "graphs", "first", "second", "constrained")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="more serve flags (after --)")
    args = parser.parse_args()
    base = ["--model-path", args.model_path, *args.extra]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {describe_device(device)}; model: {args.model_path}; serve flags: {args.extra}")
    first = launch(base)
    print(f"first launch (cold caches): ready in {first['ready']:.1f} s {first}")
    results = {}
    configs = [
        ("default", [], False),
        ("--disable-cuda-graph", ["--disable-cuda-graph"], False),
        ("imports before spawn", [], True),
    ]
    for label, flags, import_first in configs:
        runs = [launch(base + flags, import_first) for _ in range(args.repeats)]
        results[label] = {key: statistics.median(r.get(key, 0.0) for r in runs) for key in KEYS}
    print(f"{'config':24} " + " ".join(f"{k + ' s':>13}" for k in KEYS))
    for label, r in results.items():
        print(f"{label:24} " + " ".join(f"{r[k]:13.2f}" for k in KEYS))
    default = results["default"]["ready"]
    print(
        f"default / --disable-cuda-graph time to ready: "
        f"{default / results['--disable-cuda-graph']['ready']:.2f}x; default / imports before "
        f"spawn: {default / results['imports before spawn']['ready']:.2f}x"
    )


if __name__ == "__main__":
    main()
