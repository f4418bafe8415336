"""Token bytes: concatenating the bytes of a text's tokens gives the text, for every tokenizer
kind (the grammar backends match these bytes)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from weft.grammars.vocab import TokenVocab, byte_level_table, tokenizer_kind

from conftest import fixture_path

TEXTS = [
    'Hello world, {"a": [1, 2.5e-3, null]}',
    "  leading spaces\n\ttabs and\r\nnewlines",
    "été ✓ 日本語 🙂 emoji",
    '<tool_call>\n{"name": "f"}\n</tool_call>',
]


def test_byte_level_table_is_a_bijection_onto_bytes():
    table = byte_level_table()
    assert len(table) == 256
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n") and table["A"] == ord("A")


def test_qwen_vocab_spells_texts_and_hides_specials(qwen_tokenizer, qwen_vocab):
    assert qwen_vocab.kind == "byte_level"
    assert qwen_vocab.size == 151936
    for text in TEXTS:
        ids = qwen_tokenizer.encode(text, add_special_tokens=False)
        assert qwen_vocab.text_bytes(ids) == text.encode()
    im_end = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert qwen_vocab.token_bytes[im_end] is None  # special: never text
    tool_call = qwen_tokenizer.convert_tokens_to_ids("<tool_call>")
    assert qwen_vocab.token_bytes[tool_call] == b"<tool_call>"  # added, not special


@pytest.mark.parametrize("name", ["llama2", "phi3"])
def test_sentencepiece_vocab_spells_texts_after_the_dummy_prefix(name):
    tokenizer = AutoTokenizer.from_pretrained(fixture_path("tokenizers", name))
    assert tokenizer_kind(tokenizer) == "sentencepiece"
    vocab = TokenVocab.from_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    for text in (TEXTS[0], TEXTS[2]):  # no leading spaces: Llama-2 normalizes those
        ids = tokenizer.encode(text, add_special_tokens=False)
        # SentencePiece spells a text's first word with its leading "▁": mid-output bytes
        assert vocab.text_bytes(ids) == b" " + text.encode()
    byte_token = tokenizer.convert_tokens_to_ids("<0x0A>")
    assert vocab.token_bytes[byte_token] == b"\n"


def test_model_vocab_larger_than_the_tokenizer_pads_with_nothing(stories_tokenizer):
    vocab = TokenVocab.from_tokenizer(stories_tokenizer, 600, [2])
    assert vocab.size == 600
    assert all(piece is None for piece in vocab.token_bytes[512:])
    assert vocab.token_bytes[2] is None  # the end token
