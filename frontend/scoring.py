"""Choosing a select's answer from the logprobs of each choice's tokens.

`cond[i]` holds the logprobs of choice i's tokens after the prompt; `uncond[i]` those of choice
i scored alone (None where a token had no context).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def choose(
    method: str,
    cond: Sequence[Sequence[float]],
    uncond: Sequence[Sequence[float | None]] | None = None,
) -> tuple[int, list[float]]:
    """(index of the chosen choice, one score per choice); ties go to the earliest choice.

    - token_length_normalized: the mean token logprob;
    - greedy: the lexicographically largest logprob sequence (the best first token wins, ties
      look at the next token; a choice that ends inside a tie loses to a longer one);
    - unconditional_likelihood_normalized: mean(cond) - mean(uncond), so choices the model
      likes anywhere do not win just for being common.
    """
    if method == "token_length_normalized":
        scores = [mean(c) for c in cond]
    elif method == "greedy":
        scores = [mean(c) for c in cond]
        best = max(range(len(cond)), key=lambda i: (tuple(cond[i]), -i))
        return best, scores
    elif method == "unconditional_likelihood_normalized":
        assert uncond is not None and len(uncond) == len(cond)
        scores = [
            mean(c) - mean([x for x in u if x is not None])
            for c, u in zip(cond, uncond, strict=True)
        ]
    else:
        raise ValueError(f"unknown choices_method {method!r}")
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    return best, scores


@dataclass(frozen=True)
class Tail:
    """The token ids of a prefix from position `start` to its end."""

    start: int
    ids: list[int]

    def seam(self, ids: list[int]) -> int | None:
        """Position of the choice's first token in prefix + choice, whose ids from `start` on
        are `ids`; None when they differ already at `start` (> 0): the window was too short."""
        n = 0
        while n < len(self.ids) and n < len(ids) and ids[n] == self.ids[n]:
            n += 1
        if n == 0 and self.start > 0:
            return None
        return self.start + n
