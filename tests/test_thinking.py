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


START = (3, 4)  # a two-token start marker the output may write to open the thinking


def test_the_start_marker_opens_the_thinking_and_is_finished_once_begun():
    phase = Thinking((END,), budget=1, start_ids=START)
    assert phase.opening and not phase.free and not phase.ended
    assert phase.may_open() == 3 and phase.forced() is None  # a choice beside the grammar's
    assert phase.open(3)
    assert phase.may_open() is None and phase.forced() == 4  # begun: finished
    assert phase.open(4)
    assert phase.free and not phase.opening and phase.tokens == 0
    # the budget counts from here: one token of thinking, then the end marker
    assert phase.forced() is None
    phase.observe(1)
    assert phase.forced() == END
    assert phase.observe(END) and phase.in_gap


def test_another_first_token_begins_the_answer_without_thinking():
    phase = Thinking((END,), budget=0, start_ids=START)
    assert not phase.open(7)
    assert phase.ended and not phase.opening and not phase.free
    assert not phase.in_gap and phase.forced() is None  # no gap: the grammar from this token
    assert not phase.take_gap(True)
    with pytest.raises(AssertionError):
        Thinking((END,), start_ids=START).observe(1)  # not thinking before the marker
    begun = Thinking((END,), start_ids=START)
    begun.open(3)
    with pytest.raises(AssertionError, match="forced"):
        begun.open(7)
    fresh = begun.fresh()
    assert fresh.opening and fresh.opened == 0 and fresh.start_ids == START
