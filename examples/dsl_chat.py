"""A multi-turn chat rendered with the model's own chat template.

    python examples/dsl_chat.py [--url http://127.0.0.1:30000]

With --url the gens go through the server's /v1/chat/completions (the native API does not
expose the template, and the frontend never guesses one).
"""

from __future__ import annotations

from typing import Any

from dsl_common import backend_from_args, close

import weft


@weft.function
def chat(s, questions: list[str], max_tokens: int):
    s += weft.system("You are a helpful Python expert. Answer in one or two sentences.")
    for i, q in enumerate(questions):
        s += weft.user(q)
        s += weft.assistant(weft.gen(f"answer_{i}", max_tokens=max_tokens))


def main(backend: Any, max_tokens: int = 48) -> list[dict[str, str]]:
    questions = ["What does `zip` do?", "And `enumerate`?"]
    s = chat.run(questions=questions, max_tokens=max_tokens, backend=backend, temperature=0)
    for m in s.messages():
        print(f"[{m['role']}] {m['content']}")
    return s.messages()


if __name__ == "__main__":
    backend, args = backend_from_args(__doc__ or "")
    try:
        main(backend, args.max_tokens)
    finally:
        close(backend)
