"""The embedded default model (Qwen2.5-Coder-0.5B-Instruct GGUF) end to end through the Engine."""

from __future__ import annotations

import json
import re

import pytest

from conftest import qwen_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return qwen_engine()  # (audited after each test)


def _chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def test_chat_answers_with_the_json_and_stops_at_its_end_token(engine):
    prompt = _chat(
        engine,
        "Give me a JSON object for a user named Ann, age 31, with fields "
        "name and age. Reply with only the JSON.",
    )
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 128})
    found = re.search(r"\{.*\}", out["text"], re.S)
    assert found, out["text"]
    assert json.loads(found.group(0)) == {"name": "Ann", "age": 31}
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] in (151645, 151643)
    assert out["output_ids"][-1] == reason["matched"]
    assert out["meta_info"]["completion_tokens"] < 60
    assert "<|im_end|>" not in out["text"] and "<|endoftext|>" not in out["text"]


def test_every_end_token_of_the_model_is_known(engine):
    tok = engine.tokenizer
    assert {
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    } <= engine.end_ids


def test_special_token_text_in_a_prompt_is_tokenized_as_specials(engine):
    ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 151644 and 151645 in ids
