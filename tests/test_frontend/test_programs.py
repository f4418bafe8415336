"""The program library against the in-process Engine and a real server (stories260K), and
against the default Qwen model (slow; it has a chat template)."""

from __future__ import annotations

import programs
import pytest

import weft

from conftest import fixture_path, make_engine, qwen_engine, shared_server


@pytest.fixture
def qwen():
    return qwen_engine()


@pytest.fixture(scope="module")
def stories_engine():
    return make_engine(fixture_path("models", "stories260K-hf"), max_total_tokens=4096)


@pytest.fixture(scope="module")
def stories_server(stories_server):
    yield from shared_server(stories_server)


def _cases(checks):
    out = []
    for check in checks:
        marks = getattr(check, "pytestmark", [])
        methods = [m.args[1] for m in marks if m.name == "parametrize"]
        for kw in [{"method": x} for x in methods[0]] if methods else [{}]:
            out.append(pytest.param(check, kw, id=check.__name__[6:] + "".join(kw.values())))
    return out


@pytest.mark.parametrize(("check", "kw"), _cases(programs.PLAIN))
def test_engine(stories_engine, check, kw):
    check(stories_engine, **kw)


@pytest.mark.parametrize(("check", "kw"), _cases(programs.PLAIN))
def test_server(stories_server, check, kw):
    check(weft.RuntimeEndpoint(stories_server.url), **kw)


def test_separate_reasoning_splits_alike_on_engine_and_server(stories_engine, stories_server):
    on_engine = programs.check_separate_reasoning(stories_engine)
    on_server = programs.check_separate_reasoning(weft.RuntimeEndpoint(stories_server.url))
    assert on_engine.variables == on_server.variables
    assert on_engine.text() == on_server.text()


def test_engine_without_chat_template_rejects_roles(stories_engine):
    with pytest.raises(
        weft.frontend.ProgramError, match=r"gen\('answer'\) failed: the model has no chat template"
    ):
        programs.chat.run(question="hi", backend=stories_engine)


def test_server_role_program_needs_a_template(stories_server):
    # stories260K has none: the server's chat endpoint refuses, the error names the gen
    with pytest.raises(weft.frontend.ProgramError, match=r"gen\('answer'\) failed: HTTP 400"):
        programs.chat.run(question="hi", backend=weft.RuntimeEndpoint(stories_server.url))


# (the reasoning split is the parser's, whatever the model: stories260K tests it exactly, and
# 40 Qwen tokens cost seconds)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("check", "kw"),
    [
        c
        for c in _cases(programs.PLAIN)
        if not any(word in c.id for word in ("error", "batch", "reasoning"))
    ],
)
def test_qwen(qwen, check, kw):
    check(qwen, **kw)


@pytest.mark.slow
def test_qwen_roles_use_the_models_template(qwen):
    programs.check_roles(qwen, qwen.tokenizer)


def test_openai_backend_completions(stories_server):
    be = openai_backend(stories_server)
    s = programs.story.run(start="Once upon a time", backend=be, temperature=0)
    want = programs.direct(
        stories_server_endpoint(stories_server),
        "Once upon a time",
        max_new_tokens=12,
        temperature=0,
    )
    assert s["middle"] == want
    assert s.get_meta_info("middle")["finish_reason"] in ("length", "stop")


def test_openai_backend_dtype(stories_server):
    # the regex goes as the extension field /v1/completions takes; the values are the same
    be = openai_backend(stories_server)
    s = programs.typed.run(backend=be, temperature=0)
    want = programs.typed.run(backend=stories_server_endpoint(stories_server), temperature=0)
    assert s.variables == want.variables
    assert [type(v) for v in s.variables.values()] == [int, float, bool, str]
    assert s.text() == want.text()
    assert [s.get_meta_info(n)["finish_reason"] for n in programs.DTYPE_PROMPTS] == ["stop"] * 4


def test_openai_backend_select_is_a_clear_error(stories_server):
    be = openai_backend(stories_server)
    with pytest.raises(weft.frontend.ProgramError, match=r"select\('mood'\) failed: .*no logpro"):
        programs.pick.run(choices=["a", "b"], method="greedy", backend=be)


def stories_server_endpoint(srv):
    return weft.RuntimeEndpoint(srv.url)


def openai_backend(srv):
    model = srv.get("/v1/models").json()["data"][0]["id"]
    return weft.OpenAIBackend(srv.url + "/v1", model=model)


@pytest.mark.slow
def test_qwen_server_renders_roles_as_the_engine_does(qwen_server, qwen):
    remote = programs.chat.run(
        question="Say hello.", backend=weft.RuntimeEndpoint(qwen_server.url), temperature=0
    )
    local = programs.chat.run(question="Say hello.", backend=qwen, temperature=0)
    assert remote.messages() == local.messages()
    assert remote.text() == local.text()
