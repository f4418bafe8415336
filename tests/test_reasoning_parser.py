"""The reasoning parser (runtime/server/reasoning.py): exact splits, any chunking of the text."""

from __future__ import annotations

import pytest

from weft.runtime.sampling_params import SamplingParams
from weft.runtime.server.errors import ApiError
from weft.runtime.server.reasoning import (
    MarkerIds,
    ReasoningParser,
    marker_ids,
    reasoning_format,
    split_reasoning,
    thinking_phase,
)

QWEN3 = reasoning_format("qwen3")
R1 = reasoning_format("deepseek-r1")


def stream(fmt, chunks, in_reasoning, stream_reasoning=True):
    """(reasoning pieces, content pieces) of a stream fed `chunks`, empty pieces left out."""
    parser = ReasoningParser(fmt, in_reasoning, stream_reasoning)
    outs = [parser.feed(c) for c in chunks] + [parser.finish()]
    return [r for r, _ in outs if r], [c for _, c in outs if c]


def splits(text):
    """Every way to cut `text` in two or three chunks (each marker split at every position)."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(0, len(text) + 1, 3):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


CASES = [
    # (format, prompt-side start state, output, reasoning, content)
    (
        QWEN3,
        True,
        "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
        "Let me see.",
        "The answer is 4.",
    ),
    (
        QWEN3,
        False,
        "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
        "Let me see.",
        "The answer is 4.",
    ),
    # no start marker: thinking up to </think> (the prompt, or thinking on, opened it)
    (QWEN3, True, "Let me see.\n</think>\n\n4", "Let me see.", "4"),
    # no end marker: all thinking (max_tokens cut it off)
    (QWEN3, True, "<think>\nstill thinking ", "still thinking", ""),
    (QWEN3, True, "no markers at all", "no markers at all", ""),
    # thinking off (the prompt closed the block): the output is the answer, as written
    (QWEN3, False, "  The answer <is> 4 \n", "", "  The answer <is> 4 \n"),
    (QWEN3, False, "<thin", "", "<thin"),
    # empty thinking
    (QWEN3, True, "<think>\n\n</think>\n\n4", "", "4"),
    # markers after the thinking are answer
    (QWEN3, True, "<think>a</think>b<think>c</think>d", "a", "b<think>c</think>d"),
    # a partial end marker that never completes is thinking
    (QWEN3, True, "<think>x </thi", "x </thi", ""),
    # whitespace inside the thinking is kept, around it dropped
    (R1, True, "\n step 1\n\n step 2 \n</think> ok ", "step 1\n\n step 2", "ok "),
    (R1, True, "a</think>b", "a", "b"),
]


@pytest.mark.parametrize(("fmt", "opened", "text", "reasoning", "content"), CASES)
def test_exact_split_in_every_chunking(fmt, opened, text, reasoning, content):
    assert split_reasoning(fmt, text, opened) == (reasoning, content)
    for chunks in splits(text):
        for live in (True, False):
            got = stream(fmt, chunks, opened, stream_reasoning=live)
            assert ("".join(got[0]), "".join(got[1])) == (reasoning, content), chunks
    # one character at a time, too
    got = stream(fmt, list(text), opened)
    assert ("".join(got[0]), "".join(got[1])) == (reasoning, content)


def test_held_text_waits_for_the_marker_to_be_decided():
    parser = ReasoningParser(QWEN3, True)
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>\nab") == ("ab", "")
    assert parser.feed(" \n</th") == ("", "")  # trailing whitespace, a partial end marker
    assert parser.feed("ink>\n\nThe") == ("", "The")
    assert parser.feed(" end") == ("", " end")
    assert parser.finish() == ("", "")


def test_stream_reasoning_false_sends_the_thinking_in_one_piece_when_it_ends():
    chunks = ["<think>", "a ", "b", "</think>", "c", "d"]
    parser = ReasoningParser(QWEN3, True, stream_reasoning=False)
    assert [parser.feed(c) for c in chunks] == [
        ("", ""),
        ("", ""),
        ("", ""),
        ("a b", ""),
        ("", "c"),
        ("", "d"),
    ]
    assert stream(QWEN3, ["<think>x", " y"], True, stream_reasoning=False) == (["x y"], [])


def test_generic_markers():
    fmt = reasoning_format("generic", "[[", "]]")
    assert not fmt.forced
    assert split_reasoning(fmt, "[[plan]] done", False) == ("plan", "done")
    assert split_reasoning(fmt, "plan]] done", False) == ("", "plan]] done")
    forced = reasoning_format("generic", None, ".")
    assert forced.forced and forced.start == ""
    assert split_reasoning(forced, "Once upon a time. Lily", True) == ("Once upon a time", "Lily")
    with pytest.raises(ValueError, match="end marker"):
        reasoning_format("generic", "[[", None)
    with pytest.raises(ValueError, match="one of"):
        reasoning_format("qwen4")


def test_where_an_output_starts():
    # Qwen3's template: thinking on adds nothing; off closes an empty block; thinking models
    # open the block in the prompt
    on = "<|im_start|>assistant\n"
    off = on + "<think>\n\n</think>\n\n"
    opened = on + "<think>\n"
    assert QWEN3.starts_in_reasoning(on) is True
    assert QWEN3.starts_in_reasoning(on, thinking=False) is False
    assert QWEN3.starts_in_reasoning(off, thinking=False) is False
    assert QWEN3.starts_in_reasoning(off) is False
    assert QWEN3.starts_in_reasoning(opened, thinking=False) is True  # the template ignores it
    assert R1.starts_in_reasoning(on, thinking=False) is True
    generic = reasoning_format("generic", "[[", "]]")
    assert generic.starts_in_reasoning("q") is False
    assert generic.starts_in_reasoning("q [[\n") is True
    assert reasoning_format("generic", "", ".").starts_in_reasoning("Once.") is False


def test_the_marker_is_tokenized_as_written_mid_text(stories_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    dot = reasoning_format("generic", None, ".")
    # sentencepiece starts a text with a word boundary ("▁" "."): not how "." follows a word
    assert tokenizer.encode(".", add_special_tokens=False) == [410, 426]
    assert marker_ids(tokenizer, dot) == MarkerIds([426], [])
    assert marker_ids(None, dot) == MarkerIds([], []) == marker_ids(tokenizer, None)
    opens = reasoning_format("generic", ".", ".")
    assert marker_ids(tokenizer, opens) == MarkerIds([426], [426])


def test_only_a_constraint_or_a_budget_takes_the_thinking_phase():
    plain, regex = SamplingParams(), SamplingParams(regex="a")
    budget = SamplingParams(thinking_budget=0)
    ids = MarkerIds([7], [5, 6])
    assert thinking_phase(ids, "thinking", plain, "thinking_budget") is None
    assert thinking_phase(ids, "thinking", regex, "thinking_budget") == MarkerIds([7], [])
    assert thinking_phase(ids, "thinking", budget, "thinking_budget") == MarkerIds([7], [])
    # before the thinking, free to open it: the start marker's ids come along
    assert thinking_phase(ids, "opens", plain, "thinking_budget") is None
    assert thinking_phase(ids, "opens", regex, "thinking_budget") == ids
    assert thinking_phase(ids, "opens", budget, "thinking_budget") == ids
    assert thinking_phase(ids, "answer", regex, "thinking_budget") is None  # begins in the answer
    for markers, start in [(ids, "answer"), (MarkerIds([7], []), "opens")]:
        with pytest.raises(ApiError) as err:
            thinking_phase(markers, start, budget, "sampling_params.thinking_budget")
        assert err.value.param == "sampling_params.thinking_budget"


def test_where_an_output_begins_for_generation():
    generic = reasoning_format("generic", "[[", "]]")
    assert generic.opens and not reasoning_format("generic", None, "]]").opens
    assert generic.output_start("q [[\n") == "thinking"
    assert generic.output_start("q") == "opens"
    assert generic.output_start("q [[ x ]]") == "opens"  # the parser reads a new block too
    assert reasoning_format("generic", None, "]]").output_start("q") == "thinking"
    qwen3 = reasoning_format("qwen3")
    assert qwen3.output_start("<|im_start|>assistant\n", thinking=False) == "answer"
