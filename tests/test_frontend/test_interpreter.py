"""The interpreter against a scripted backend: IR, request merging, forks, select, errors."""

from __future__ import annotations

import asyncio

import pytest
from fake_backend import FakeBackend

import weft
from weft.frontend import ProgramError
from weft.frontend.ir import Gen, RoleBegin, RoleEnd, Select, Text, flatten
from weft.frontend.scoring import Tail as _Tail
from weft.frontend.scoring import choose


def test_ir_nodes_print_as_the_program():
    nodes = flatten("Q: " + weft.user("hi") + weft.gen("a", max_tokens=4, stop="\n"))
    assert nodes == [
        Text("Q: "),
        RoleBegin("user"),
        Text("hi"),
        RoleEnd("user"),
        Gen("a", {"max_new_tokens": 4, "stop": "\n"}),
    ]
    assert repr(weft.gen("a", max_tokens=4)) == "Gen('a', max_new_tokens=4)"
    assert repr(weft.select("c", ["x", "y"])) == (
        "Select('c', ['x', 'y'], method=token_length_normalized)"
    )
    assert repr(weft.user("hi")) == "RoleBegin('user') + Text('hi') + RoleEnd('user')"
    assert weft.gen("c", choices=["a", "b"]) == Select("c", ["a", "b"])


def test_constrained_gen_becomes_sampling_params():
    assert weft.gen("x", regex="[0-9]+").params == {"regex": "[0-9]+"}
    assert weft.gen("x", json_schema={"type": "object"}).params == {
        "json_schema": '{"type": "object"}'
    }
    assert weft.gen("x", ebnf='root ::= "a"').params == {"ebnf": 'root ::= "a"'}
    with pytest.raises(ValueError, match=r"gen\('x'\): give one of regex, ebnf, not several"):
        weft.gen("x", regex="a", ebnf='root ::= "a"')


def test_dtype_is_a_regex_that_can_end():
    # a number may end with one space or newline, after which the grammar can only end
    assert weft.gen("x", dtype=int).params == {"regex": r"[-+]?[0-9]+[ \n]?"}
    assert weft.gen("x", dtype="float").params == {"regex": r"[-+]?[0-9]*\.?[0-9]+[ \n]?"}
    assert weft.gen("x", dtype=bool).params == {"regex": "(True|False)"}
    assert weft.gen("x", dtype=str, max_tokens=9).params == {
        "max_new_tokens": 9,
        "regex": r'"([^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
    }
    assert repr(weft.gen("x", dtype=int)) == r"Gen('x', regex='[-+]?[0-9]+[ \\n]?', dtype=int)"
    with pytest.raises(ValueError, match=r"gen\('x'\): dtype must be int, float, bool or str"):
        weft.gen("x", dtype=list)
    with pytest.raises(ValueError, match=r"gen\('x'\): give one of regex, dtype, not several"):
        weft.gen("x", regex="a", dtype=int)


@weft.function
def person(s):
    s += "Age: " + weft.gen("age", dtype=int)
    s += "Height: " + weft.gen("height", dtype=float)
    s += "Adult: " + weft.gen("adult", dtype=bool)
    s += "Name: " + weft.gen("name", dtype=str)


PERSON_REPLIES = {"Age: ": "34\n", "Height: ": "1.75 ", "Adult: ": "True", "Name: ": '"Al \\"A\\""'}
PERSON_VALUES = {"age": 34, "height": 1.75, "adult": True, "name": 'Al "A"'}


@pytest.mark.parametrize("stream", [False, True])
def test_dtype_variables_hold_values(stream):
    s = person.run(backend=FakeBackend(replies=PERSON_REPLIES), stream=stream)
    assert s.variables == PERSON_VALUES
    assert [type(s[k]) for k in PERSON_VALUES] == [int, float, bool, str]
    assert s.text() == 'Age: 34\nHeight: 1.75 Adult: TrueName: "Al \\"A\\""'


def test_dtype_variables_hold_values_through_chat():
    be = FakeBackend(replies={"How old?": "-7 "})

    @weft.function
    def chat(s):
        s += weft.user("How old?") + weft.assistant(weft.gen("age", dtype=int))

    s = chat.run(backend=be)
    assert be.calls == [
        ("chat", [{"role": "user", "content": "How old?"}], {"regex": r"[-+]?[0-9]+[ \n]?"})
    ]
    assert s["age"] == -7 and type(s["age"]) is int


@pytest.mark.parametrize(
    "dtype,reply",
    [(int, "-"), (int, "forty"), (float, "3."), (float, "inf"), (bool, "true"), (str, '"abc')],
)
def test_dtype_output_that_is_no_value_names_the_gen(dtype, reply):
    @weft.function
    def prog(s):
        s += "x=" + weft.gen("x", dtype=dtype)

    with pytest.raises(ProgramError) as err:
        prog.run(backend=FakeBackend(replies={"x=": reply}))
    regex = weft.gen("x", dtype=dtype).params["regex"]
    assert str(err.value) == (
        f"gen('x') with dtype={dtype.__name__}: the output {reply!r} does not match the "
        f"{dtype.__name__} regex {regex!r}; finish_reason None"
    )


def test_bad_select_arguments():
    with pytest.raises(ValueError, match="choices must be a non-empty list"):
        weft.select("x", [])
    with pytest.raises(ValueError, match="unknown choices_method 'best'"):
        weft.select("x", ["a"], choices_method="best")


@weft.function
def qa(s, question):
    s += "Q: " + question + "\n"
    s += "A: " + weft.gen("answer", max_tokens=8, stop="\n")
    s += "\nThanks."


def test_text_and_gen_are_one_request_and_defaults_apply():
    be = FakeBackend(replies={"A: ": "four"})
    s = qa.run(question="2+2?", backend=be, temperature=0, max_new_tokens=99)
    assert be.calls == [
        ("generate", "Q: 2+2?\nA: ", {"temperature": 0, "max_new_tokens": 8, "stop": "\n"})
    ]
    assert s["answer"] == "four"
    assert s.text() == "Q: 2+2?\nA: four\nThanks."
    assert s.get_meta_info("answer") == {"completion_tokens": 4}


def test_unknown_run_argument():
    with pytest.raises(TypeError, match="unknown run\\(\\) argument 'colour'"):
        qa.run(question="x", backend=FakeBackend(), colour=1)


def test_trace_prints_the_plan():
    plan = qa.trace(question="2+2?")
    assert [(r.kind, r.label, r.prompt) for r in plan] == [
        ("generate", "gen('answer')", "Q: 2+2?\nA: ")
    ]
    assert str(plan) == (
        "  1. generate gen('answer')            prompt='Q: 2+2?\\nA: ' "
        "params={'max_new_tokens': 8, 'stop': '\\n'}"
    )


@weft.function
def tips(s, topic):
    s += f"Tips on {topic}:\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Tip {i + 1}: " + weft.gen("tip", max_tokens=5)
    s += "".join(f["tip"] for f in forks)


def test_fork_warms_the_prefix_once_then_runs_branches_concurrently():
    be = FakeBackend(replies={"Tip 1: ": "a", "Tip 2: ": "b", "Tip 3: ": "c"}, delay=0.05)
    s = tips.run(topic="tea", backend=be)
    prefix = "Tips on tea:\n"
    assert be.calls[0] == ("generate", prefix, {"max_new_tokens": 0})
    assert sorted(c[1] for c in be.calls[1:]) == [prefix + f"Tip {i}: " for i in (1, 2, 3)]
    assert be.max_in_flight == 3
    assert s.text() == prefix + "abc"


def test_forks_see_parent_variables_and_join_gathers():
    be = FakeBackend(replies={"name: ": "Ann", "x": "1", "y": "2"})

    @weft.function
    def prog(s):
        s += "name: " + weft.gen("name")
        forks = s.fork(2)
        forks[0] += "x" + weft.gen("v")
        forks[1] += "y" + weft.gen("v")
        assert [f["name"] for f in forks] == ["Ann", "Ann"]
        forks.join()

    s = prog.run(backend=be)
    assert s["v"] == ["1", "2"]
    assert s.get_meta_info("v") == [{"completion_tokens": 1}] * 2
    assert s["name"] == "Ann"


def test_copy_is_an_independent_continuation():
    be = FakeBackend()

    @weft.function
    def prog(s):
        s += "a"
        c = s.copy()
        c += "b"
        s += "c"
        assert c.text() == "ab"

    assert prog.run(backend=be).text() == "ac"
    assert be.calls == []  # a copy of one branch needs no warm request


def test_seam_finds_where_the_choice_tokens_start():
    assert _Tail(0, [1, 2, 3]).seam([1, 2, 3, 4, 5]) == 3
    # the choice's first token swallowed the prefix's last one (" yes" after "A: ")
    assert _Tail(0, [1, 2, 3]).seam([1, 2, 9, 5]) == 2
    assert _Tail(2, [3, 4]).seam([3, 4, 7]) == 4
    assert _Tail(2, [3, 4]).seam([8, 7]) is None  # differs at the window's start: read all


def test_choose_each_method_exactly():
    cond = [[-1.0, -3.0], [-2.5], [-1.0, -2.0, -3.0]]
    assert choose("token_length_normalized", cond) == (0, [-2.0, -2.5, -2.0])
    # greedy: the first token ties (-1.0) between 0 and 2; the second token decides
    assert choose("greedy", cond) == (2, [-2.0, -2.5, -2.0])
    uncond: list[list[float | None]] = [[None, -1.0], [None], [-3.0, -3.0, -3.0]]
    assert choose("unconditional_likelihood_normalized", cond, uncond) == (2, [-1.0, -2.5, 1.0])


def test_select_scores_choice_tokens_after_the_prefix():
    be = FakeBackend(char_logprob={"a": -0.5, "b": -2.0, "c": -0.25})

    @weft.function
    def prog(s):
        s += "pick: " + weft.select("x", ["ab", "c", "bb"])

    s = prog.run(backend=be)
    assert s["x"] == "c" and s.text() == "pick: c"
    meta = s.get_meta_info("x")
    assert meta["input_token_logprobs"] == [[-0.5, -2.0], [-0.25], [-2.0, -2.0]]
    assert meta["scores"] == [-1.25, -0.25, -2.0]
    # the prefix is cached unscored first, then its last 8 tokens are read; each choice
    # re-reads those 8 prefix tokens
    assert be.calls[0] == ("generate", "pick: ", {"max_new_tokens": 0})
    assert be.calls[1] == ("score", "pick: ", {"start": 0})
    assert sorted(c[1:] for c in be.calls[2:]) == [
        ("pick: ab", {"start": 0}),
        ("pick: bb", {"start": 0}),
        ("pick: c", {"start": 0}),
    ]


def test_select_window_starts_near_the_end_of_a_long_prefix():
    be = FakeBackend()

    @weft.function
    def prog(s):
        s += "0123456789abc" + weft.select("x", ["y", "n"], choices_method="greedy")

    prog.run(backend=be)
    # the prefix is not scored from 0: a scored position cannot come from the radix cache
    assert be.calls[0] == ("generate", "0123456789abc", {"max_new_tokens": 0})
    assert {c[2]["start"] for c in be.calls[1:]} == {13 - 8}
    assert [c[1] for c in be.calls[1:] if c[0] == "score"].count("0123456789abc") == 1


def test_unconditional_select_scores_choices_alone():
    be = FakeBackend(char_logprob={"y": -1.0, "n": -2.0})

    @weft.function
    def prog(s):
        s += "q" + weft.select(
            "x", ["yy", "nn"], choices_method="unconditional_likelihood_normalized"
        )

    s = prog.run(backend=be)
    # alone, each choice's first token has no context: only the second counts
    assert s.get_meta_info("x")["unconditional_token_logprobs"] == [[None, -1.0], [None, -2.0]]
    assert s.get_meta_info("x")["scores"] == [0.0, 0.0]
    assert s["x"] == "yy"


def test_roles_render_with_the_backend_template():
    be = FakeBackend(template=True, replies={"<assistant>": "hello"})

    @weft.function
    def chat(s):
        s += weft.system("be brief")
        with s.user():
            s += "hi"
        s += weft.assistant(weft.gen("reply"))

    s = chat.run(backend=be)
    assert be.calls == [("generate", "<system>be brief</system><user>hi</user><assistant>", {})]
    assert s.text() == "<system>be brief</system><user>hi</user><assistant>hello</assistant>"
    assert s.messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]


def test_roles_without_template_go_through_chat():
    be = FakeBackend(replies={"hi": "hello"})

    @weft.function
    def chat(s):
        s += weft.user("hi") + weft.assistant(weft.gen("reply", max_tokens=3))

    s = chat.run(backend=be)
    assert be.calls == [("chat", [{"role": "user", "content": "hi"}], {"max_new_tokens": 3})]
    assert s["reply"] == "hello"


def test_roles_without_template_reject_text_outside_roles():
    @weft.function
    def chat(s):
        s += "preamble" + weft.user("hi") + weft.assistant(weft.gen("reply"))

    with pytest.raises(ProgramError, match=r"gen\('reply'\): Fake has no chat template"):
        chat.run(backend=FakeBackend())


def test_backend_error_names_the_gen():
    with pytest.raises(ProgramError, match=r"gen\('answer'\) failed: HTTP 400 from /generate"):
        qa.run(question="bad", backend=FakeBackend(fail_on="bad"))


def test_stream_text_iter_yields_pieces():
    be = FakeBackend(replies={"A: ": "four"})
    s = qa.run(question="2+2?", backend=be, stream=True)
    assert list(s.text_iter("answer")) == ["f", "o", "u", "r"]
    assert s.text() == "Q: 2+2?\nA: four\nThanks."


def test_stream_async_iter():
    be = FakeBackend(replies={"A: ": "hey"})

    async def main() -> list[str]:
        s = await qa.run_async(question="x", backend=be, stream=True)
        return [p async for p in s.text_async_iter()]

    assert "".join(asyncio.run(main())) == "Q: x\nA: hey\nThanks."


def test_run_batch_on_one_loop_with_max_concurrency():
    be = FakeBackend(replies={"A: ": "ok"}, delay=0.02)
    states = qa.run_batch([{"question": str(i)} for i in range(6)], backend=be, max_concurrency=2)
    assert [s["answer"] for s in states] == ["ok"] * 6
    assert be.max_in_flight == 2
    assert [c[1] for c in be.calls] == [f"Q: {i}\nA: " for i in range(6)]


def test_run_batch_runs_programs_with_fork_and_join_concurrently():
    # join must not block the program's body: that would run a batch one program at a time
    be = FakeBackend(replies={"Why:": "w", "Next:": "n"}, delay=0.02)

    @weft.function
    def branches(s, i):
        s += f"Story {i}. "
        forks = s.fork(2)
        forks[0] += "Why:" + weft.gen("note", max_tokens=3)
        forks[1] += "Next:" + weft.gen("note", max_tokens=3)
        forks.join()

    states = branches.run_batch([{"i": i} for i in range(8)], backend=be)
    assert [s["note"] for s in states] == [["w", "n"]] * 8
    assert be.max_in_flight >= 8  # one program alone has at most 2 requests in flight


def test_run_batch_keeps_errors_on_their_states():
    states = qa.run_batch(
        [{"question": "good"}, {"question": "bad"}], backend=FakeBackend(fail_on="bad")
    )
    assert states[0]["answer"] == "ok"
    with pytest.raises(ProgramError, match=r"gen\('answer'\) failed"):
        states[1].text()


def test_run_batch_warms_a_shared_prefix_first():
    system = "You are a careful assistant who answers in one word.\n"

    @weft.function
    def ask(s, question):
        s += system + "Q: " + question + "\nA: " + weft.gen("answer", max_tokens=4)

    be = FakeBackend(replies={"A: ": "ok"})
    states = ask.run_batch([{"question": q} for q in ("one", "two", "three")], backend=be)
    assert [s["answer"] for s in states] == ["ok"] * 3
    assert be.calls[0] == ("generate", system + "Q: ", {"max_new_tokens": 0})
    assert sorted(c[1] for c in be.calls[1:]) == sorted(
        f"{system}Q: {q}\nA: " for q in ("one", "two", "three")
    )
    assert len(be.calls) == 4


def test_run_batch_num_threads_caps_requests_in_flight():
    be = FakeBackend(replies={"A: ": "ok"}, delay=0.02)
    states = qa.run_batch([{"question": str(i)} for i in range(6)], backend=be, num_threads=3)
    assert [s["answer"] for s in states] == ["ok"] * 6
    assert be.max_in_flight == 3
    with pytest.raises(ValueError, match="num_threads must be 'auto' or an int >= 1"):
        qa.run_batch([{"question": "x"}], backend=be, num_threads=0)


def test_a_body_that_raises_fails_only_its_own_batch_member():
    be = FakeBackend(replies={"A: ": "ok"}, delay=0.01)

    @weft.function
    def prog(s, i):
        s += f"Q: {i}\nA: " + weft.gen("answer", max_tokens=2)
        if i == 1:
            raise KeyError("bad input")

    states = prog.run_batch([{"i": i} for i in range(3)], backend=be)
    assert states[0]["answer"] == states[2]["answer"] == "ok"
    with pytest.raises(KeyError, match="bad input"):
        states[1].text()
    assert [c[1] for c in be.calls] == ["Q: 0\nA: ", "Q: 2\nA: "]  # 1's queue was cancelled


def test_item_assignment_runs_in_program_order():
    be = FakeBackend(replies={"A: ": "model"})

    @weft.function
    def prog(s):
        s += "A: " + weft.gen("x", max_tokens=5)
        s["x"] = "mine"  # after the gen: the gen must not overwrite it
        s["y"] = "set"

    state = prog.run(backend=be)
    assert state["x"] == "mine" and state["y"] == "set"
    with pytest.raises(KeyError):
        state.get_meta_info("x")  # the gen's meta no longer describes the value


def test_trace_reads_no_value_from_placeholders():
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int

    @weft.function
    def prog(s):
        s += "P: " + weft.gen("p", json_schema=Point) + weft.gen("n", dtype=int)

    plan = prog.trace()
    assert [r.label for r in plan] == ["gen('p')", "gen('n')"]


# ---- separate_reasoning ----------------------------------------------------------------------


@weft.function
def thinker(s):
    s += weft.user("2+2?")
    s += weft.assistant(weft.separate_reasoning(weft.gen("answer"), model_type="qwen3"))
    s += weft.user("And 3+3?")
    s += weft.assistant(weft.gen("again"))


THINKING_REPLIES = {
    "2+2?</user><assistant>": "<think>\nadd two </think>\n\nfour",
    "3+3?</user><assistant>": "six",
}


@pytest.mark.parametrize("stream", [False, True])
def test_separate_reasoning_keeps_the_answer_in_the_text(stream):
    be = FakeBackend(replies=THINKING_REPLIES, template=True)
    s = thinker.run(backend=be, stream=stream)
    assert (s["answer"], s["answer_reasoning_content"]) == ("four", "add two")
    assert s["again"] == "six"
    # as SGLang: the thinking leaves the running prompt, the next request does not see it
    first = "<user>2+2?</user><assistant>four</assistant>"
    assert s.text() == first + "<user>And 3+3?</user><assistant>six</assistant>"
    assert be.calls[-1][1] == first + "<user>And 3+3?</user><assistant>"
    assert s.messages()[1] == {"role": "assistant", "content": "four"}
    assert repr(weft.separate_reasoning(weft.gen("a"), model_type="qwen3")) == (
        "Gen('a') + SeparateReasoning(['a'], model_type='qwen3')"
    )


@weft.function
def two_thinkers(s):
    s += "Q: " + weft.separate_reasoning(
        weft.gen("a", stop="|") + " and " + weft.gen("b"),
        model_type="generic",
        reasoning_end=".",
    )
    s += " Done."


def test_separate_reasoning_of_several_gens_outside_roles():
    be = FakeBackend(replies={"Q: ": "I think. one|", " and ": "So. two"})
    s = two_thinkers.run(backend=be)
    assert (s["a"], s["a_reasoning_content"]) == ("one|", "I think")
    assert (s["b"], s["b_reasoning_content"]) == ("two", "So")
    assert s.text() == "Q: one| and two Done."


def test_separate_reasoning_errors():
    with pytest.raises(ValueError, match="model_type is required"):
        weft.separate_reasoning(weft.gen("a"))
    with pytest.raises(ValueError, match="needs a name"):
        weft.separate_reasoning(weft.gen(), model_type="qwen3")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        weft.separate_reasoning(weft.gen("a"), model_type="kimi")

    @weft.function
    def typed(s):
        s += "n=" + weft.separate_reasoning(weft.gen("n", dtype=int), model_type="qwen3")

    with pytest.raises(ProgramError, match=r"separate_reasoning\(.n.\): .* int, not text"):
        typed.run(backend=FakeBackend(replies={"n=": "4"}))
