"""The thinking phase's bookkeeping (weft.runtime.thinking): marker matching over token ids,
the budget's forced marker, the whitespace gap before the grammar."""

from __future__ import annotations

import pytest

from weft.runtime.thinking import MAX_GAP_TOKENS, Thinking

END = 9  # a one-token marker (Qwen3's </think>)


def feed(phase: Thinking, tokens: list[int]) -> list[bool]:
    return [phase.observe(t) for t in tokens]


def test_a_one_token_marker_ends_the_thinking():
    phase = Thinking((END,))
    assert feed(phase, [1, 2, END]) == [False, False, True]
    assert phase.ended and phase.in_gap and not phase.free
    assert phase.tokens == 3


def test_a_multi_token_marker_matches_across_false_starts():
    phase = Thinking((5, 6, 7))
    # 5 6 5 6 7: the first "5 6" is not followed by 7; the match restarts at the second 5
    assert feed(phase, [5, 6, 5, 6, 7]) == [False, False, False, False, True]
    phase = Thinking((5, 5, 6))
    assert feed(phase, [5, 5, 5, 6]) == [False, False, False, True]  # overlapping prefixes


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_the_budget_forces_the_marker_after_that_many_tokens(budget):
    phase = Thinking((5, 6), budget=budget)
    out = []
    while not phase.ended:
        token = phase.forced()
        if token is None:
            token = 1  # the model's own thinking
        out.append(token)
        phase.observe(token)
    assert out == [1] * budget + [5, 6]
    assert phase.forced() is None


def test_a_marker_the_model_began_is_finished_not_counted():
    phase = Thinking((5, 6), budget=2)
    feed(phase, [1, 5])  # one token of thinking, then the marker's first token
    assert phase.forced() is None  # 1 thinking token: the model may go on
    feed(phase, [1, 1])  # it did not finish the marker: 3 thinking tokens
    assert phase.forced() == 5
    phase.observe(5)
    assert phase.forced() == 6


def test_the_gap_takes_whitespace_until_other_text_or_its_limit():
    phase = Thinking((END,))
    phase.observe(END)
    assert phase.take_gap(True) and phase.take_gap(True)
    assert not phase.take_gap(False) and not phase.in_gap
    assert not phase.take_gap(True)  # closed: whitespace is the grammar's now
    phase = Thinking((END,))
    phase.observe(END)
    assert [phase.take_gap(True) for _ in range(MAX_GAP_TOKENS + 1)] == [True] * MAX_GAP_TOKENS + [
        False
    ]
    fresh = phase.fresh()
    assert fresh.free and fresh.tokens == 0 and fresh.end_ids == (END,)
