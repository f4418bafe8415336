"""A grammar backend that raises on the scheduler's loop (a bug in its native code) ends only the
request it raised for, with a server error naming the backend and the exception; the requests
beside it finish normally and the KV pool stays intact.

The fault is injected through the real grammar manager: the backend's `matcher()` is wrapped so
that the victim's matcher instance gets one method that raises (after `after` good calls).
"""

from __future__ import annotations

import asyncio

import pytest

from weft.grammars.spec import parse_spec

from conftest import jump_forward_off, make_engine

VICTIM = "The end of [a-z]+( [a-z]+){3}"  # forced text: accept, jump-forward and rollback run
HEALTHY = "[A-Z][a-z]+( [a-z]+){4}"
PROMPT = "Once upon a time"
PARAMS = {"temperature": 0, "max_new_tokens": 24}
# NOTE: no compile race: on a loaded machine llguidance could win it, and serve the victims
# with matchers _break did not break
ENGINE = {"max_total_tokens": 4096, "enable_jump_forward": True, "grammar_race_budget": 60.0}


def _fault() -> UnicodeDecodeError:
    return UnicodeDecodeError("utf-8", b"\xe4", 0, 1, "unexpected end of data")


@pytest.fixture(scope="module")
def plain(stories_dir):
    return make_engine(stories_dir, disable_overlap_schedule=True, **ENGINE)


@pytest.fixture(scope="module")
def overlap(stories_dir):
    """The overlap schedule forced on (the default on CUDA): a failing token was fed already."""
    return make_engine(stories_dir, enable_overlap_schedule=True, **ENGINE)


def _break(engine, monkeypatch, regex: str, method: str, after: int) -> list[int]:
    """Make `method` of the matcher of every request constrained by `regex` raise after `after`
    calls; returns a one-item list counting the calls."""
    compiled = engine.scheduler.grammars.compile(parse_spec("regex", regex))  # cached from now
    backend = compiled.backend
    make_matcher = backend.matcher
    calls = [0]

    def matcher(grammar):
        m = make_matcher(grammar)
        if grammar is compiled.grammar:
            good = getattr(m, method)

            def flaky(*args):
                calls[0] += 1
                if calls[0] > after:
                    raise _fault()
                return good(*args)

            monkeypatch.setattr(m, method, flaky)
        return m

    monkeypatch.setattr(backend, "matcher", matcher)
    return calls


def _run_together(engine, specs: list[str | None]) -> list[dict]:
    async def run():
        jobs = [
            engine.async_generate(PROMPT, {**PARAMS, **({"regex": s} if s else {})}) for s in specs
        ]
        return await asyncio.gather(*jobs)

    return asyncio.run(run())


def _assert_failed(out: dict, method: str) -> None:
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort", out
    assert reason["status_code"] == 500
    assert reason["message"].startswith("the grammar backend xgrammar failed: UnicodeDecodeError:")
    assert out["meta_info"]["grammar_backend"] == "xgrammar", method


def _assert_fine(engine, outs: list[dict], specs: list[str | None]) -> None:
    want = engine.generate([PROMPT] * len(specs), [{**PARAMS, "regex": s} for s in specs])
    for out, ref in zip(outs, want, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        assert out["output_ids"] == ref["output_ids"]  # as if the victim had never been there


# rollback runs only when the masks of a jump-forward draft are filled (accept each draft
# token, fill, undo): that is the draft-fill failure
@pytest.mark.parametrize(("method", "after"), [("accept", 2), ("jump_forward", 1), ("rollback", 0)])
def test_a_raising_matcher_ends_only_its_request(plain, monkeypatch, method, after):
    calls = _break(plain, monkeypatch, VICTIM, method, after)
    victim, healthy, free = _run_together(plain, [VICTIM, HEALTHY, None])
    assert calls[0] == after + 1  # it raised once, and was never called again
    _assert_failed(victim, method)
    _assert_fine(plain, [healthy, free], [HEALTHY, None])
    plain.check_integrity()
    assert plain.memory_stats()["in_use"] == 0
    with pytest.raises(RuntimeError, match="grammar backend xgrammar failed: UnicodeDecodeError"):
        plain.generate(PROMPT, {**PARAMS, "regex": VICTIM})


def test_a_fed_token_is_kept_when_its_accept_raises(overlap, monkeypatch):
    """Under the overlap schedule the next step has fed the token already: its KV is cached."""
    _break(overlap, monkeypatch, VICTIM, "accept", 2)
    victim, healthy, free = _run_together(overlap, [VICTIM, HEALTHY, None])
    _assert_failed(victim, "accept")
    _assert_fine(overlap, [healthy, free], [HEALTHY, None])
    overlap.check_integrity()


@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_a_raising_batched_fill_finds_the_culprits(request, monkeypatch, schedule):
    """A batched fill raises for one of its rows (a backend bug): row-by-row fills find the two
    failing rows, the third constrained row and the free one go on. Under the overlap schedule
    the fill runs while the next step is laid out (with the victims in it): they end after
    that step's forward is launched, and their KV is freed all the same."""
    plain = request.getfixturevalue(schedule)
    other_victim = VICTIM.replace("{3}", "{4}")
    calls = [_break(plain, monkeypatch, v, "fill_bitmask", 3) for v in (VICTIM, other_victim)]
    backend = plain.scheduler.grammars.compile(parse_spec("regex", VICTIM)).backend
    batch_fill = backend.fill_many

    def fill_many(matchers, bitmask, rows):
        # the native batch fills every row; a broken row's fault surfaces from the whole call
        for matcher, row in zip(matchers, rows, strict=True):
            if "fill_bitmask" in vars(matcher):  # a victim's (see _break)
                matcher.fill_bitmask(bitmask, row)
        batch_fill(matchers, bitmask, rows)

    monkeypatch.setattr(backend, "fill_many", fill_many)
    # no drafts: their masks are filled row by row, outside the batched fill
    with jump_forward_off(plain):
        outs = _run_together(plain, [VICTIM, HEALTHY, other_victim, None])
    # 3 good calls, the batched call, its own row's; the batched call stops at the first
    # raising row, so the other victim's row may not have been reached in it (4 calls)
    assert sorted(c[0] for c in calls) in ([4, 5], [5, 5])
    _assert_failed(outs[0], "fill_bitmask")
    _assert_failed(outs[2], "fill_bitmask")
    _assert_fine(plain, [outs[1], outs[3]], [HEALTHY, None])
    plain.check_integrity()
    assert plain.memory_stats()["in_use"] == 0


def test_a_grammar_that_never_compiles_fails_its_request_in_bounded_time(plain, monkeypatch):
    # a compile future that never resolves (a deadlocked grammar worker once held 31 requests
    # forever): the request fails once it has waited the chain's timeouts plus a slack
    from concurrent.futures import Future

    from weft.runtime.scheduler import constrained as constrained_module

    never: Future = Future()
    grammars = plain.call(lambda: plain.scheduler.grammars)
    monkeypatch.setattr(grammars, "submit", lambda *args, **kwargs: never)  # the parsed spec
    monkeypatch.setattr(constrained_module, "GRAMMAR_QUEUE_SLACK_S", 0.5)
    config = plain.scheduler.config
    plain.scheduler.config = config.replace(grammar_compile_timeout=0.1)
    try:
        limit = plain.scheduler.constrained.wait_limit_s
        # the last backend joins the race at most one timeout (< the race budget) after another
        assert config.grammar_race_budget > 0.1
        assert limit == pytest.approx(len(config.grammar_backends) * 0.1 + 0.5)
        with pytest.raises(RuntimeError, match=f"did not compile within {limit:g} s"):
            plain.generate(PROMPT, {**PARAMS, "regex": HEALTHY})
    finally:
        plain.scheduler.config = config
    assert plain.generate(PROMPT, PARAMS)["meta_info"]["finish_reason"]["type"] == "length"
