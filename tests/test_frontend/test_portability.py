"""One role program, the same on every backend: the in-process Engine, a real server through
RuntimeEndpoint, and (where the OpenAI API allows) OpenAIBackend. And SGLang's documented
programs, written as SGLang users write them (`import weft as sgl`), run unchanged.

The model is stories260K with a chat template added, so role programs run in CI in seconds.
"""

from __future__ import annotations

import json
import shutil

import pytest
import requests

import weft
import weft as sgl
from weft.frontend import ProgramError

from conftest import fixture_path, make_engine
from server_utils import ServerProcess, stories_args

# it writes the BOS token, as Llama's templates do
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """stories260K with a chat template in its tokenizer config."""
    folder = tmp_path_factory.mktemp("stories-chat")
    for f in fixture_path("models", "stories260K-hf").iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def engine(chat_model):
    return make_engine(chat_model, max_total_tokens=4096)


@pytest.fixture(scope="module")
def server(chat_model):
    srv = ServerProcess(*stories_args(chat_model))
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(autouse=True)
def _no_default_backend():
    yield
    weft.set_default_backend(None)


@weft.function
def triage(s, ticket):
    s += weft.system("You sort tickets.")
    s += weft.user(ticket)
    with s.assistant():
        s += "Kind: " + weft.select("kind", ["bug", "feature", "question"]) + ". Mood: "
        s += weft.gen("mood", choices=["calm", "angry"], choices_method=weft.greedy_token_selection)
    s += weft.user("Tell me more.")
    s += weft.assistant(weft.gen("more", max_tokens=12))


def run_triage(backend, **kw):
    return triage.run(ticket="The app crashes when I open it.", backend=backend, **GREEDY, **kw)


def test_a_role_program_with_selects_is_the_same_on_engine_and_server(engine, server):
    local = run_triage(engine)
    remote = run_triage(weft.RuntimeEndpoint(server.url))
    assert remote.variables == local.variables
    assert remote.text() == local.text()
    assert remote.messages() == local.messages()
    for name in ("kind", "mood"):
        want = local.get_meta_info(name)["scores"]
        assert remote.get_meta_info(name)["scores"] == pytest.approx(want, abs=1e-4), name
    # the text is the template's rendering, turn by turn, with the choices in place
    assert local.text() == engine.tokenizer.apply_chat_template(local.messages(), tokenize=False)
    assert local.messages()[2]["content"] == f"Kind: {local['kind']}. Mood: {local['mood']}"


class CountingEndpoint(weft.RuntimeEndpoint):
    """The real client, counting the streamed requests it sends."""

    streams = 0

    async def generate_stream(self, *args, **kwargs):
        self.streams += 1
        async for result in super().generate_stream(*args, **kwargs):
            yield result


def test_streaming_is_token_by_token_on_every_backend(engine, server):
    want = run_triage(engine)["more"]
    state = run_triage(engine, stream=True)
    pieces = list(state.text_iter("more"))
    assert len(pieces) > 1 and "".join(pieces) == state["more"] == want
    # the server streams the role program's gen over /generate as the engine does; it may
    # coalesce tokens into fewer events when the client reads slower than it generates
    endpoint = CountingEndpoint(server.url)
    state = run_triage(endpoint, stream=True)
    assert "".join(state.text_iter("more")) == state["more"] == want
    assert endpoint.streams == 1


def test_the_server_renders_its_template_for_clients(server, engine):
    info = server.get("/get_model_info").json()
    assert info["has_chat_template"] is True
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    for prompt in (False, True):
        body = {"messages": msgs, "add_generation_prompt": prompt}
        got = requests.post(server.url + "/render_chat", json=body, timeout=30).json()
        want = engine.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=prompt
        )
        assert got == {"text": want}
    bad = requests.post(server.url + "/render_chat", json={"messages": [{"role": "x"}]}, timeout=30)
    assert bad.status_code == 400 and "messages[0].role" in bad.json()["error"]["message"]


def test_openai_backend_runs_what_the_openai_api_allows(server, engine):
    model = server.get("/v1/models").json()["data"][0]["id"]
    be = weft.OpenAIBackend(server.url + "/v1", model=model)

    @weft.function
    def ask(s):
        s += weft.system("You sort tickets.")
        s += weft.user("The app crashes.")
        s += weft.assistant(weft.gen("answer", max_tokens=12))

    remote = ask.run(backend=be, **GREEDY)
    local = ask.run(backend=engine, **GREEDY)
    assert remote.messages() == local.messages()
    with pytest.raises(ProgramError, match=r"select\('kind'\): OpenAIBackend has no chat templ"):
        run_triage(be)


def test_trace_keeps_its_promise_without_a_backend():
    plan = triage.trace(ticket="t")
    assert [r.kind for r in plan][-1] == "generate"
    assert "<|assistant|>\nKind: bug. Mood: calm" in plan[-1].prompt  # first choices picked


def test_item_assignment_is_a_step_of_the_program(engine):
    @weft.function
    def prog(s):
        s["note"] = "before"
        s += "Once upon a time" + weft.gen("story", max_tokens=4)
        s.set_var("after", s["story"].upper())

    state = prog.run(backend=engine, **GREEDY)
    assert state["note"] == "before" and state.get_var("after") == state["story"].upper()


def test_gen_logprobs_reach_the_variables_meta(engine, server):
    @weft.function
    def prog(s):
        s += "Once upon a time" + weft.gen(
            "x", max_tokens=3, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True
        )

    for backend in (engine, weft.RuntimeEndpoint(server.url)):
        meta = prog.run(backend=backend, **GREEDY).get_meta_info("x")
        entries = meta["output_token_logprobs"]
        assert len(entries) == 3 and all(isinstance(e[2], str) for e in entries), backend
        assert len(meta["output_top_logprobs"][0]) == 2
    with pytest.raises(ValueError, match=r"n=2: one sample per gen"):
        weft.gen("x", n=2)


def test_join_appends_each_forks_text_in_concate_and_append_mode(engine):
    @weft.function
    def prog(s):
        s += "Once upon a time"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" ({i})" + weft.gen("x", max_tokens=3)
        forks.join(mode="concate_and_append")

    state = prog.run(backend=engine, **GREEDY)
    first, second = state["x"]
    assert state.text() == f"Once upon a time (0){first} (1){second}"
    with pytest.raises(ValueError, match="join mode must be one of"):
        weft.function(lambda s: s.fork(2).join(mode="zip")).run(backend=engine)


class LongestChoice(weft.ChoicesSamplingMethod):
    """A user's own method: the longest choice, whatever the model thinks."""

    def __call__(self, *, choices, input_token_logprobs, **_):
        best = max(choices, key=len)
        assert all(isinstance(e[0], float) for entries in input_token_logprobs for e in entries)
        return weft.ChoicesDecision(best, {"lengths": [len(c) for c in choices]})


def test_a_choices_method_can_be_subclassed(engine):
    @weft.function
    def prog(s):
        s += "Once upon a time there was a " + weft.select(
            "who", ["cat", "princess", "dog"], choices_method=LongestChoice()
        )

    state = prog.run(backend=engine)
    assert state["who"] == "princess"
    assert state.get_meta_info("who")["lengths"] == [3, 8, 3]


# ---- SGLang's documented programs, as SGLang users write them ---------------------------------


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=16))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=16))


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "
    if s["tool"] == "calculator":
        s += "The math expression is" + sgl.gen("expression", max_tokens=8)
    elif s["tool"] == "search engine":
        s += "The key word to search is" + sgl.gen("word", max_tokens=8)


@sgl.function
def tip_suggestion(s):
    s += "Here are two tips for staying healthy: 1. Balanced Diet. 2. Regular Exercise.\n\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=16, stop="\n\n")
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary", max_tokens=8)


@sgl.function
def character_gen(s, name):
    s += name + " is a character in a story. Name: " + sgl.gen("name", stop=",", max_tokens=8)
    s += sgl.user_begin() + "Age?" + sgl.user_end()
    s += sgl.assistant_begin() + sgl.gen_int("age", max_tokens=4) + sgl.assistant_end()


def test_sglang_programs_run_unchanged(server):
    sgl.set_default_backend(sgl.RuntimeEndpoint(server.url))
    state = multi_turn_question.run(
        question_1="What is the capital of France?",
        question_2="List two local attractions.",
        temperature=0,
    )
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"] * 1 + [
        "user",
        "assistant",
    ]
    assert state["answer_1"] == state.messages()[2]["content"]

    state = tool_use(question="What is 2 + 2?", temperature=0)  # a program called directly
    assert state["tool"] in ("calculator", "search engine")
    assert ("expression" in state) == (state["tool"] == "calculator")

    state = tip_suggestion.run(temperature=0)
    assert state.text().startswith("Here are two tips") and "Tip 2:" in state.text()

    states = character_gen.run_batch(
        [{"name": "Alice"}, {"name": "Bob"}], num_threads=2, temperature=0
    )
    assert all(isinstance(s["age"], int) for s in states)


def test_openai_backend_streams_chat_replies_token_by_token(server):
    model = server.get("/v1/models").json()["data"][0]["id"]
    be = weft.OpenAIBackend(server.url + "/v1", model=model)

    @weft.function
    def ask(s):
        s += weft.user("Tell me a story.")
        s += weft.assistant(weft.gen("story", max_tokens=12))

    state = ask.run(backend=be, stream=True, **GREEDY)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1 and "".join(pieces) == state["story"]
    assert state["story"] == ask.run(backend=be, **GREEDY)["story"]


def test_cache_and_server_info_helpers(server, engine):
    endpoint = weft.RuntimeEndpoint(server.url)
    assert weft.flush_cache(endpoint) is True
    assert weft.get_server_info(endpoint)["served_model_name"]
    weft.set_default_backend(engine)
    assert weft.flush_cache() is True
    assert weft.get_server_info()["memory"]
    weft.set_default_backend(None)
    with pytest.raises(ValueError, match="no backend: pass backend="):
        weft.flush_cache()


def test_a_runtime_started_from_python_serves_programs(chat_model, engine):
    with weft.Runtime(
        model_path=str(chat_model), max_total_tokens=4096, show_progress=False
    ) as runtime:
        assert runtime.get_model_info()["has_chat_template"] is True
        assert run_triage(runtime).variables == run_triage(engine).variables
    assert runtime.process.poll() == 0  # stopped cleanly
    with pytest.raises(weft.BackendError, match="the server did not start"):
        weft.Runtime(model_path=str(chat_model / "missing"))
    with pytest.raises(TypeError, match="unknown option 'max_tokens_total'"):
        weft.Runtime(model_path=str(chat_model), max_tokens_total=4096)
