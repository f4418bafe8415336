"""A text prompt's ids (runtime/tokenizer.encode_prompt), shared by the Engine and the server:
a chat template's rendering that spells the BOS token gets no second one."""

from __future__ import annotations

import pytest

from weft.runtime.tokenizer import encode_prompt

from conftest import fixture_path


@pytest.fixture(scope="module")
def llama2():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fixture_path("tokenizers", "llama2"))


def test_a_prompt_that_spells_bos_gets_no_second_one(llama2):
    rendered = "<s>[INST] Hi [/INST]"
    assert llama2.encode(rendered)[:2] == [1, 1]  # what the tokenizer alone gives
    ids = encode_prompt(llama2, rendered)
    assert ids == llama2.encode(rendered, add_special_tokens=False) and ids[:2] != [1, 1]


def test_bos_the_text_writes_twice_stays_and_plain_text_is_untouched(llama2):
    assert encode_prompt(llama2, "<s><s>Hi")[:3] == [1, 1, llama2.encode("<s>Hi")[2]]
    assert encode_prompt(llama2, "Hi there") == llama2.encode("Hi there")
    assert encode_prompt(llama2, "<s>Hi", add_special_tokens=False) == llama2.encode(
        "<s>Hi", add_special_tokens=False
    )


def test_a_tokenizer_that_adds_no_bos_keeps_the_ones_the_text_writes():
    from transformers import AutoTokenizer

    phi3 = AutoTokenizer.from_pretrained(fixture_path("tokenizers", "phi3"))
    text = "<s><s>Hello"
    assert phi3.encode(text)[:2] == [1, 1]  # phi3 adds no BOS: both are the text's
    assert encode_prompt(phi3, text) == phi3.encode(text)
