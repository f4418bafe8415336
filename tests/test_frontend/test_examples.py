"""Every DSL example runs against the embedded default model (slow)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, qwen_engine, require_default_model

pytestmark = pytest.mark.slow
EXAMPLES = REPO_ROOT / "examples"


@pytest.fixture
def qwen():
    return qwen_engine()


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


def test_quickstart(example, qwen, capsys):
    s = example("dsl_quickstart").main(qwen, max_tokens=16)
    assert s.text().startswith("# A Python function named fibonacci\ndef fibonacci(")
    assert "gen('signature')" in capsys.readouterr().out


def test_classification(example, qwen):
    answers = example("dsl_classification").main(qwen)
    assert answers == ["rust", "python", "javascript"]


def test_chat(example, qwen):
    msgs = example("dsl_chat").main(qwen, max_tokens=16)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"] for m in msgs)


def test_fork(example, qwen):
    s = example("dsl_fork").main(qwen, max_tokens=12)
    assert s.text().count("\n- ") == 3


def test_batch(example, qwen, capsys):
    codes = example("dsl_batch").main(qwen, max_tokens=12)
    assert len(codes) == 4 and all(codes)
    assert "4/4" in capsys.readouterr().err  # the progress bar


def test_an_example_runs_standalone():
    require_default_model()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "dsl_quickstart.py"), "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finish_reason:" in done.stdout


def test_extraction_into_a_pydantic_model(example, qwen):
    module = example("dsl_extraction")
    people = module.main(qwen)
    assert [type(p) for p in people] == [module.Person, module.Person]
    alice, bob = (p.model_dump(mode="json") for p in people)
    assert alice == {
        "name": "Alice Martin",
        "age": 34,
        "role": "engineer",
        "address": {"city": "Lyon", "country": "France"},
        "skills": ["Rust", "Go"],
        "email": "alice@example.com",
    }
    assert bob == {
        "name": "Bob Okafor",
        "age": 51,
        "role": "manager",
        "address": {"city": "Lagos", "country": "Nigeria"},
        "skills": ["budgeting", "hiring"],
        "email": None,
    }


def test_react_agent_calls_its_tools(example, qwen):
    calc, weather = example("dsl_agent").main(qwen)
    # each question: one tool call with the right input, its observation, then the answer
    assert calc["observations"] == ["395"] and calc["action"] == "finish"
    assert "395" in calc["answer"]
    assert weather["observations"] == ["18 C, clear"] and weather["action"] == "finish"
    assert "Input: Tokyo\nObservation: 18 C, clear" in weather.text()


def test_openai_tools_agent(example, qwen_server):
    (calc_calls, calc_answer), (weather_calls, weather_answer) = example("openai_tools_agent").main(
        qwen_server.url
    )
    assert calc_calls == [
        {"name": "calculator", "arguments": {"expression": "17 * 23 + 4"}, "result": "395"}
    ]
    assert weather_calls == [
        {"name": "weather", "arguments": {"city": "Tokyo"}, "result": "18 C, clear"}
    ]
    assert "395" in calc_answer and "18" in weather_answer
