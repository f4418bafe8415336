"""One program-test library, run against every backend (test_programs.py picks them).

Each check runs a program greedily and compares it with direct requests to the same backend,
so the assertions are exact whatever the model.
"""

from __future__ import annotations

import asyncio
import json

import pytest

import weft
from weft.frontend import ProgramError
from weft.frontend.backend import as_backend

GREEDY = {"temperature": 0}


def direct(backend, prompt: str, **params) -> str:
    return asyncio.run(as_backend(backend).generate(prompt, params)).text


@weft.function
def story(s, start):
    s += start + weft.gen("middle", max_tokens=12)
    s += " The end."


def check_text_and_gen_are_one_request(backend):
    s = story.run(start="Once upon a time", backend=backend, **GREEDY)
    want = direct(backend, "Once upon a time", max_new_tokens=12, **GREEDY)
    assert s["middle"] == want
    assert s.text() == "Once upon a time" + want + " The end."
    assert s.get_meta_info("middle")["finish_reason"] is not None


@weft.function
def pick(s, choices, method):
    s += "Lily went to the park. She was very " + weft.select("mood", choices, method)


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy"])
def check_select(backend, method):
    choices = ["happy", "sad", "a big red ball"]
    s = pick.run(choices=choices, method=method, backend=backend)
    meta = s.get_meta_info("mood")
    cond = meta["input_token_logprobs"]
    assert [len(c) >= 1 for c in cond] == [True] * 3
    scores = [sum(c) / len(c) for c in cond]
    assert meta["scores"] == pytest.approx(scores)
    if method == "token_length_normalized":
        assert s["mood"] == choices[max(range(3), key=lambda i: scores[i])]
    else:
        assert s["mood"] == choices[max(range(3), key=lambda i: tuple(cond[i]))]
    assert s.text().endswith("very " + s["mood"])
    # the chosen choice's logprobs are the tail of scoring the whole text in one request
    full = asyncio.run(as_backend(backend).prompt_logprobs(s.text(), 0))
    tail = [lp for lp, _ in full[-len(meta["input_token_logprobs"][choices.index(s["mood"])]) :]]
    assert tail == pytest.approx(cond[choices.index(s["mood"])], abs=1e-4)


def check_unconditional_select(backend):
    s = pick.run(
        choices=["happy", "sad"], method="unconditional_likelihood_normalized", backend=backend
    )
    meta = s.get_meta_info("mood")
    assert s["mood"] in ("happy", "sad")
    assert len(meta["unconditional_token_logprobs"]) == 2


@weft.function
def branches(s):
    s += "Tom had a dog."
    forks = s.fork(2)
    forks[0] += " The dog" + weft.gen("more", max_tokens=8)
    forks[1] += " One day" + weft.gen("more", max_tokens=8)
    forks.join()


def check_fork(backend):
    s = branches.run(backend=backend, **GREEDY)
    assert s["more"] == [
        direct(backend, "Tom had a dog. The dog", max_new_tokens=8, **GREEDY),
        direct(backend, "Tom had a dog. One day", max_new_tokens=8, **GREEDY),
    ]


@weft.function
def long_story(s, start):
    s += start + weft.gen("middle", max_tokens=STREAM_TOKENS, ignore_eos=True)


# NOTE: a server stream sends one chunk per wake-up of its handler, not per token: a 12-token
# output on a loaded CI machine once came as a single chunk. 96 decode steps take long enough
# that the handler wakes more than once.
STREAM_TOKENS = 96


def check_stream(backend):
    s = story.run(start="The little cat", backend=backend, stream=True, **GREEDY)
    pieces = list(s.text_iter("middle"))
    want = direct(backend, "The little cat", max_new_tokens=12, **GREEDY)
    assert "".join(pieces) == s["middle"] == want
    s = long_story.run(start="The little cat", backend=backend, stream=True, **GREEDY)
    pieces = list(s.text_iter("middle"))
    assert len(pieces) >= 2
    assert "".join(pieces) == s["middle"]


def check_batch(backend):
    starts = ["Once upon a time", "The sun", "Ben and Mia"]
    states = story.run_batch(
        [{"start": x} for x in starts], backend=backend, progress_bar=True, **GREEDY
    )
    assert [s["middle"] for s in states] == [
        direct(backend, x, max_new_tokens=12, **GREEDY) for x in starts
    ]


def check_backend_error_names_the_gen(backend):
    with pytest.raises(ProgramError, match=r"gen\('middle'\) failed: .*temperature"):
        story.run(start="Once", backend=backend, temperature=-1.0)


# the model could write more digits than this; a number that can end does end before it
DTYPE_TOKENS = 24
DTYPE_PROMPTS = {
    "age": ("Alice Martin, 34. Her age is ", int),
    "height": ("She is tall, her height in meters is ", float),
    "happy": ("Is she happy? ", bool),
    "said": ("Lily said: ", str),
}
# how each type is spelled: Python's spelling, a str as a JSON string literal
SPELLED = {int: int, float: float, bool: {"True": True, "False": False}.get, str: json.loads}


@weft.function
def typed(s):
    for name, (prompt, dtype) in DTYPE_PROMPTS.items():
        s += prompt + weft.gen(name, dtype=dtype, max_tokens=DTYPE_TOKENS)
        s += "\n"


def check_dtype(backend):
    s = typed.run(backend=backend, **GREEDY)
    text = ""
    for name, (prompt, dtype) in DTYPE_PROMPTS.items():
        regex = weft.gen(name, dtype=dtype).params["regex"]
        out = direct(backend, text + prompt, max_new_tokens=DTYPE_TOKENS, regex=regex, **GREEDY)
        text += prompt + out + "\n"
        assert s[name] == SPELLED[dtype](out.strip()) and type(s[name]) is dtype, name
        assert s.get_meta_info(name)["finish_reason"]["type"] == "stop", name
    assert s.text() == text


@weft.function
def chat(s, question):
    s += weft.system("You are a terse assistant.")
    s += weft.user(question)
    s += weft.assistant(weft.gen("answer", max_tokens=8))
    with s.user():
        s += "And in French?"
    with s.assistant():
        s += weft.gen("french", max_tokens=8)


def check_roles(backend, tokenizer=None):
    s = chat.run(question="Say hello.", backend=backend, **GREEDY)
    msgs = s.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == s["answer"] and msgs[4]["content"] == s["french"]
    assert s["answer"] and s["french"]
    if tokenizer is not None:  # the text is the model's own template, turn by turn
        assert s.text() == tokenizer.apply_chat_template(msgs, tokenize=False)
        head = tokenizer.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
        assert s["answer"] == direct(backend, head, max_new_tokens=8, **GREEDY)


@weft.function
def thoughtful(s, start):
    # stories260K writes no <think>: a generic parser whose thinking is the first sentence
    s += start + weft.separate_reasoning(
        weft.gen("story", max_tokens=40), model_type="generic", reasoning_end="."
    )
    s += " The end."


def check_separate_reasoning(backend):
    s = thoughtful.run(start="Once upon a time", backend=backend, **GREEDY)
    raw = direct(backend, "Once upon a time", max_new_tokens=40, **GREEDY)
    thought, dot, answer = raw.partition(".")
    assert dot, raw  # the split is at the first "." (the thinking stripped, the answer lstripped)
    assert (s["story_reasoning_content"], s["story"]) == (thought.strip(), answer.lstrip())
    assert s.text() == "Once upon a time" + answer.lstrip() + " The end."
    return s


PLAIN = [
    check_text_and_gen_are_one_request,
    check_select,
    check_unconditional_select,
    check_fork,
    check_stream,
    check_batch,
    check_backend_error_names_the_gen,
    check_dtype,
    check_separate_reasoning,
]
