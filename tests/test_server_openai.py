"""The official `openai` client against the real server: completions on stories260K, chat on the
embedded Qwen model (it has a chat template)."""

from __future__ import annotations

import json

import openai
import pytest

from chat_templates import GEMMA3, MISTRAL_V11, QWEN3
from conftest import fixture_path, shared_server
from server_utils import ServerProcess, schedule_args, stories_args

PROMPT = "Once upon a time"
# stories260K has no chat template of its own: --chat-template gives it one (with tools, it
# teaches Qwen's <tool_call> format, so tool calls run on this model too)
TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools: {{ tools | tojson }}\n"
    "call one as <tool_call>\n{...}\n</tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def stories(stories_dir, schedule):
    srv = ServerProcess(
        *stories_args(stories_dir, *schedule_args(schedule)),
        "--served-model-name",
        "stories",
        "--chat-template",
        TEMPLATE,
        "--trust-request-chat-template",
    )
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(stories):
    return openai.OpenAI(base_url=stories.url + "/v1", api_key="unused", max_retries=0)


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories"]
    assert client.models.retrieve("stories").id == "stories"


def test_completion_matches_native_greedy(client, stories):
    native = stories.generate(
        {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 20}}
    )
    out = client.completions.create(model="stories", prompt=PROMPT, max_tokens=20, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].text == native["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert out.usage.completion_tokens == 20
    assert out.usage.total_tokens == out.usage.prompt_tokens + 20
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_with_usage(client):
    full = client.completions.create(model="stories", prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(
        client.completions.create(
            model="stories",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stop(client):
    full = (
        client.completions.create(model="stories", prompt=PROMPT, max_tokens=40, temperature=0)
        .choices[0]
        .text
    )
    word = "girl"
    assert word in full
    out = client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=40, temperature=0, stop=[word, "zzz"]
    )
    assert out.choices[0].text == full[: full.index(word)]
    assert out.choices[0].finish_reason == "stop"


def test_completion_n2_and_seed(client):
    kwargs = {
        "model": "stories",
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 1.0,
        "n": 2,
        "seed": 11,
    }
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert a.choices[0].text != a.choices[1].text  # different samples
    assert a.usage.completion_tokens == 32
    assert a.usage.prompt_tokens == b.usage.prompt_tokens  # the prompt counts once


def test_completion_batch_of_prompts_and_token_ids(client, stories):
    out = client.completions.create(
        model="stories", prompt=[PROMPT, "The dog"], max_tokens=5, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    ids = stories.generate(
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
    )
    prompt_ids = [e[1] for e in ids["meta_info"]["input_token_logprobs"]]
    by_ids = client.completions.create(
        model="stories", prompt=prompt_ids, max_tokens=5, temperature=0
    )
    assert by_ids.choices[0].text == out.choices[0].text


def test_completion_logprobs(client):
    out = client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens).strip() == out.choices[0].text.strip()
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely
        assert top[token] == pytest.approx(value)
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_echo(client):
    out = client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    assert out.choices[0].text.startswith(PROMPT)


def test_openai_errors_raise_the_right_exceptions(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="stories", prompt=PROMPT, max_tokens=-3)
    assert client.completions.create(model="stories", prompt=PROMPT, max_tokens=2).choices


def test_chat_with_a_template_given_on_the_command_line(client):
    messages = [{"role": "user", "content": "Once upon a time"}]
    out = client.chat.completions.create(
        model="stories", messages=messages, max_tokens=16, temperature=0
    )
    text = out.choices[0].message.content
    assert text and out.usage.completion_tokens <= 16
    chunks = list(
        client.chat.completions.create(
            model="stories", messages=messages, max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    # without --reasoning-parser: no reasoning_content, and separate_reasoning is a 400
    assert "reasoning_content" not in (out.choices[0].message.model_extra or {})
    with pytest.raises(openai.BadRequestError, match="--reasoning-parser"):
        client.chat.completions.create(
            model="stories",
            messages=messages,
            max_tokens=1,
            extra_body={"separate_reasoning": True},
        )
    with pytest.raises(openai.BadRequestError, match="--reasoning-parser") as err:
        client.chat.completions.create(
            model="stories", messages=messages, max_tokens=1, extra_body={"thinking_budget": 4}
        )
    assert err.value.body["param"] == "thinking_budget"
    # the rendered prompt: BOS + "user: Once upon a time\n"
    plain = client.completions.create(
        model="stories", prompt="user: Once upon a time\n", max_tokens=1
    )
    assert abs(out.usage.prompt_tokens - plain.usage.prompt_tokens) <= 1


# ---- chat: constrained outputs on stories260K ---------------------------------------------

HI = [{"role": "user", "content": "Hi"}]
# this model writes property after property up to max_tokens, where the schema lets it
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_strict_json_schema_is_a_closed_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}}
    # (stories260K spends tokens on the whitespace JSON allows: 120 let it end)
    out = client.chat.completions.create(
        model="stories", messages=HI, response_format=fmt, max_tokens=120, temperature=0
    )
    assert list(json.loads(out.choices[0].message.content)) == ["ok"]
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [3, 8, 15])
def test_a_tool_call_cut_off_by_max_tokens_is_no_content(client, max_tokens):
    # 3 tokens: "<to"; 15: '<tool_call>\n{"n' (the model must call, so the output is markup)
    tool = {"type": "function", "function": {"name": "f", "parameters": ANSWER}}
    kwargs = {
        "model": "stories",
        "messages": HI,
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (None, None)
    assert (choice.finish_reason, out.usage.completion_tokens) == ("length", max_tokens)
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs)]
    assert [(c.delta.content, c.delta.tool_calls, c.finish_reason) for c in chunks] == [
        ("", None, None),
        (None, None, "length"),
    ]


def test_chat_template_from_a_file_or_a_string(tmp_path):
    from weft.runtime.server.chat import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError):
        load_chat_template("no-such-file.jinja")


# ---- chat: the Qwen model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(qwen_api_server):
    yield from shared_server(qwen_api_server)


@pytest.fixture(scope="module")
def qclient(qwen):
    return openai.OpenAI(base_url=qwen.url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.mark.slow
def test_chat_stream_and_not(qclient):
    model = qclient.models.list().data[0].id
    out = qclient.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant" and message.content
    assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 10
    chunks = list(
        qclient.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


@pytest.mark.slow
def test_chat_n2_logprobs_stop_and_cached_usage(qclient, qwen):
    model = qclient.models.list().data[0].id
    out = qclient.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_completion_tokens=6,
        temperature=0.7,
        n=2,
        seed=5,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) >= 1 and all(len(t.top_logprobs) == 2 for t in content)
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)
    # the same conversation again: its prompt comes from the prefix cache
    again = qclient.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, stop=["\n"]
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert "\n" not in again.choices[0].message.content
    assert "weft:generation_tokens_total" in qwen.get("/metrics").text


@pytest.mark.slow
def test_special_tokens_in_text_are_special(qwen):
    """A chat template rendered by the client: <|im_start|> must be one token, not characters."""
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    out = qwen.generate(
        {
            "text": text,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
    )
    ids = [e[1] for e in out["meta_info"]["input_token_logprobs"]]
    assert ids[0] == 151644  # <|im_start|>
    assert ids.count(151644) == 2 and 151645 in ids  # <|im_end|>


@pytest.mark.slow
def test_multibyte_text_streams_whole_characters(qwen):
    body = {
        "text": "<|im_start|>user\n用中文写一句关于猫的话，加一个表情符号。<|im_end|>\n"
        "<|im_start|>assistant\n",
        "sampling_params": {"temperature": 0, "max_new_tokens": 24},
    }
    # NOTE: each request in its own cache namespace: a prefix hit would compute the last prompt
    # token alone (the quantized one-row kernels, not the prefill's), and greedy decoding may
    # then flip at a near tie (it did: "好奇。" against "好奇的光芒。")
    full = qwen.generate({**body, "cache_salt": "multibyte-whole"})
    assert any(ord(ch) > 0x2E80 for ch in full["text"])  # the answer has CJK text
    events = list(
        qwen.stream("/generate", {**body, "stream": True, "cache_salt": "multibyte-stream"})
    )
    texts = [e["text"] for e in events[:-1]]
    assert all("\ufffd" not in t for t in texts)
    assert texts[-1] == full["text"]


def test_cache_salt_in_the_openai_api(client):
    prompt = "Once upon a time a small bird built a nest of twigs on a high branch of a tree."

    def cached(salt: str) -> int:
        out = client.completions.create(
            model="stories", prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("x") == 0
    assert cached("y") == 0  # "x"'s KV is not shared with "y"
    assert cached("x") > 0


# ---- each tool-call format, through a request's own chat template ---------------------------

# short: a tool-laden prompt must leave room in stories260K's 512-token context
CITY = {
    "type": "function",
    "function": {
        "name": "weather",
        "strict": True,  # closed: this model would add properties up to max_tokens
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}}},
    },
}
PING = {"type": "function", "function": {"name": "ping"}}


def _nemo_template() -> str:
    return fixture_path(
        "tokenizers", "chat-templates", "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    )


@pytest.mark.parametrize(
    "template",
    [QWEN3, None, MISTRAL_V11, GEMMA3],  # None: Mistral v3 (Nemo's), from the fixtures
    ids=["qwen3", "mistral", "mistral_v11", "gemma3"],
)
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_tool_call_formats_stream_the_calls_they_return(client, template, tool_choice):
    # the grammar makes this tiny model's calls well-formed in each format
    template = template or _nemo_template().read_text()
    named = {"type": "function", "function": {"name": "weather"}}
    kwargs = {
        "model": "stories",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [CITY] if tool_choice == "required" else [CITY, PING],
        "tool_choice": named if tool_choice == "named" else "required",
        "parallel_tool_calls": False,  # (no max_tokens: what the 512-token context leaves)
        "temperature": 0,
        # NOTE: unpenalized, this model can repeat inside a string argument to the context's end
        "frequency_penalty": 2.0,
        "extra_body": {"chat_template": template},
    }
    out = client.chat.completions.create(**kwargs)
    whole = out.choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    [(name, args)] = calls
    assert name == "weather" and set(json.loads(args)) <= {"city"}
    streamed: dict[int, list[str]] = {}
    finish = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        assert not delta.content
        finish.append(chunk.choices[0].finish_reason)
        for part in delta.tool_calls or []:
            call = streamed.setdefault(part.index, ["", ""])
            call[0] += part.function.name or ""
            call[1] += part.function.arguments or ""
    assert [tuple(c) for c in streamed.values()] == calls
    assert finish[-1] == "tool_calls"
    # every template shows the model the tools (Gemma's through weft's prompt)
    plain = client.chat.completions.create(**{**kwargs, "tool_choice": "none", "max_tokens": 1})
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 40


def test_a_request_template_must_not_be_empty(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="stories", messages=HI, max_tokens=1, extra_body={"chat_template": "  "}
        )
    assert err.value.body["param"] == "chat_template"
