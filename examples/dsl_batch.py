"""A batch of inputs on one event loop, with a progress bar.

python examples/dsl_batch.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from typing import Any

from dsl_common import backend_from_args, close

import weft

TASKS = ["reverse a string", "check if a number is prime", "flatten a list", "count words"]


@weft.function
def one_liner(s, task: str, max_tokens: int):
    s += f"# Python one-liner to {task}\n"
    s += "result = " + weft.gen("code", max_tokens=max_tokens, stop="\n")


def main(backend: Any, max_tokens: int = 24) -> list[str]:
    states = one_liner.run_batch(
        [{"task": t, "max_tokens": max_tokens} for t in TASKS],
        backend=backend,
        progress_bar=True,
        max_concurrency=4,
        temperature=0,
    )
    for task, s in zip(TASKS, states, strict=True):
        print(f"{task:<28} result = {s['code']}")
    return [s["code"] for s in states]


if __name__ == "__main__":
    backend, args = backend_from_args(__doc__ or "")
    try:
        main(backend, args.max_tokens)
    finally:
        close(backend)
