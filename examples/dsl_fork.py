"""Parallel branches: the shared prefix is sent once, then the forks run concurrently.

python examples/dsl_fork.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from typing import Any

from dsl_common import backend_from_args, close

import weft

ASPECTS = ["readability", "performance", "testing"]


@weft.function
def review(s, code: str, max_tokens: int):
    s += f"Code:\n{code}\n\nA short code review.\n"
    forks = s.fork(len(ASPECTS))
    for f, aspect in zip(forks, ASPECTS, strict=True):
        f += f"On {aspect}: " + weft.gen("note", max_tokens=max_tokens, stop="\n")
    for aspect, f in zip(ASPECTS, forks, strict=True):
        s += f"- {aspect}: {f['note'].strip()}\n"


def main(backend: Any, max_tokens: int = 32) -> weft.frontend.ProgramState:
    code = "def total(xs):\n    t = 0\n    for x in xs: t += x\n    return t"
    print(review.trace(code=code, max_tokens=max_tokens), "\n")
    s = review.run(code=code, max_tokens=max_tokens, backend=backend, temperature=0)
    print(s.text())
    return s


if __name__ == "__main__":
    backend, args = backend_from_args(__doc__ or "")
    try:
        main(backend, args.max_tokens)
    finally:
        close(backend)
