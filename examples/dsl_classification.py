"""Few-shot classification with select: each label is scored from prompt logprobs.

python examples/dsl_classification.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from typing import Any

from dsl_common import backend_from_args, close

import weft

SHOTS = [
    ("for i in range(10): print(i)", "python"),
    ('fn main() { println!("hi"); }', "rust"),
    ("console.log('hi');", "javascript"),
]
LABELS = ["python", "rust", "javascript"]


@weft.function
def classify(s, code: str):
    s += "Which language is each snippet written in?\n\n"
    for snippet, label in SHOTS:
        s += f"Snippet: {snippet}\nLanguage: {label}\n\n"
    s += f"Snippet: {code}\nLanguage: " + weft.select("language", LABELS)


def main(backend: Any, max_tokens: int = 0) -> list[str]:
    inputs = ["let v: Vec<i32> = Vec::new();", "def f(x): return x * 2", "const a = [1, 2];"]
    answers = []
    for code in inputs:
        s = classify.run(code=code, backend=backend)
        scores = s.get_meta_info("language")["scores"]
        print(f"{code!r:40} -> {s['language']:<10}  scores={[round(x, 2) for x in scores]}")
        answers.append(s["language"])
    return answers


if __name__ == "__main__":
    backend, args = backend_from_args(__doc__ or "")
    try:
        main(backend)
    finally:
        close(backend)
