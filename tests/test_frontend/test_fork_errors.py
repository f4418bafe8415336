"""A fork whose warm-up request fails (its prefix is longer than the stories model's 512-token
context) fails every fork with that error; nothing waits forever, no task is left pending."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_backend import FakeBackend

import weft
from weft.frontend import ProgramError, ProgramState
from weft.frontend.backend import GenResult

from conftest import fixture_path, make_engine, within

TOO_LONG = "Once upon a time, there was a little girl named Lily. " * 60
FAILED = r"fork\(2\) failed: prompt is too long"


@pytest.fixture(scope="module")
def engine():
    engine = make_engine(fixture_path("models", "stories260K-hf"), max_total_tokens=4096)
    assert len(engine.tokenizer.encode(TOO_LONG)) > engine.context_length
    return engine


@weft.function
def read_a_fork(s):
    s += TOO_LONG
    forks = s.fork(2)
    for f in forks:
        f += weft.gen("a", max_tokens=2)
    return forks[0]["a"]  # waits for the fork, in the program's body


@weft.function
def forks_left_unread(s):
    s += TOO_LONG
    forks = s.fork(2)
    for f in forks:
        f += weft.gen("a", max_tokens=2)


def test_reading_a_fork_whose_warm_up_failed_raises_its_error(engine):
    with pytest.raises(ProgramError, match=FAILED):
        within(30, lambda: read_a_fork.run(backend=engine))
    # a batch keeps each program's error, the body's own included, on its state
    states = within(30, lambda: read_a_fork.run_batch([{}, {}], backend=engine))
    for state in states:
        with pytest.raises(ProgramError, match=FAILED):
            state.text()


def test_a_failed_fork_fails_every_fork_and_leaves_no_task_pending(engine):
    states = within(30, lambda: forks_left_unread.run_batch([{}, {}], backend=engine))
    for state in states:
        run = state._ctx.states  # the program's state, then its two forks
        assert len(run) == 3
        assert isinstance(run[0].error, ProgramError)
        assert [s.error for s in run] == [run[0].error] * 3  # the one original error
        with pytest.raises(ProgramError, match=FAILED):
            run[2].text()
    assert asyncio.all_tasks(states[0]._ctx.loop) == set()


def test_run_raises_the_fork_error_once_every_fork_settled(engine):
    forks: list[ProgramState] = []

    @weft.function
    def prog(s):
        s += TOO_LONG
        forks.extend(s.fork(2))
        for f in forks:
            f += weft.gen("a", max_tokens=2)

    with pytest.raises(ProgramError, match=FAILED) as raised:
        within(30, lambda: prog.run(backend=engine))
    assert [f.error for f in forks] == [raised.value] * 2
    assert asyncio.all_tasks(forks[0]._ctx.loop) == set()


class _SlowCopy(FakeBackend):
    """Fails "bad" at once; answers "slow" only after a while."""

    async def generate(self, prompt: str, params: dict[str, Any]) -> GenResult:
        if prompt.endswith("slow"):
            await asyncio.sleep(0.2)
        return await super().generate(prompt, params)


def test_a_failed_state_raises_only_after_the_other_states_of_the_run_settled():
    copies: list[ProgramState] = []

    @weft.function
    def prog(s):
        copy = s.copy()
        copy += "slow" + weft.gen("late")
        copies.append(copy)
        s += "bad" + weft.gen("a")

    with pytest.raises(ProgramError, match=r"gen\('a'\) failed"):
        within(30, lambda: prog.run(backend=_SlowCopy(fail_on="bad")))
    # finished, not abandoned mid-request (checked before text(), which would run the loop)
    assert asyncio.all_tasks(copies[0]._ctx.loop) == set()
    assert copies[0].text() == "slowok"


def test_an_empty_fork_read_in_the_body_waits_for_its_fork_point():
    texts: list[str] = []

    @weft.function
    def prog(s):
        s += "name: " + weft.gen("name")
        forks = s.fork(2)
        forks[0] += "!"
        texts.append(forks[1].text())  # nothing was added to it: the parent at the fork

    within(30, lambda: prog.run(backend=FakeBackend(replies={"name: ": "Ann"})))
    assert texts == ["name: Ann"]


def test_an_empty_fork_of_a_failed_fork_raises_its_error():
    seen: list[object] = []

    @weft.function
    def prog(s):
        s += "prefix " * 10
        forks = s.fork(2)
        try:
            seen.append(forks[1].text())  # nothing was added to it
        except ProgramError as exc:
            seen.append(exc)

    with pytest.raises(ProgramError, match=r"fork\(2\) failed: HTTP 400 from /generate") as e:
        within(30, lambda: prog.run(backend=FakeBackend(fail_on="prefix")))
    assert seen == [e.value]
