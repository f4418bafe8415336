"""Tool-call markers that are special tokens (Mistral's `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`):
text in the grammar vocabulary and in the output, while every other special token stays
textless. A Llama-2 vocabulary with Mistral's control tokens (tests/mistral_dummy.py)."""

from __future__ import annotations

import json

import pytest
import torch
from mistral_dummy import CONFIG, EOS_ID, TOOL_CALLS_ID, mistral_tokenizer

from weft.grammars.bitmask import allocate_bitmask, bit_is_set
from weft.grammars.manager import GrammarManager, RequestGrammar
from weft.grammars.spec import parse_spec
from weft.grammars.vocab import TokenVocab
from weft.runtime.detokenize import IncrementalDecoder
from weft.runtime.server.tool_calls import ToolChoice, check_tools, structural_tag
from weft.runtime.server.tool_formats import MISTRAL
from weft.runtime.tokenizer import skipped_special_ids, text_marker_ids

TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
CALL = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'


@pytest.fixture(scope="module")
def tokenizer():
    return mistral_tokenizer()


@pytest.fixture(scope="module")
def vocab(tokenizer):
    markers = text_marker_ids(tokenizer)
    return TokenVocab.from_tokenizer(tokenizer, CONFIG["vocab_size"], [EOS_ID], markers)


def test_the_markers_and_only_they_are_text(tokenizer, vocab):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")}
    assert text_marker_ids(tokenizer) == frozenset(ids.values())
    for text, tid in ids.items():
        assert vocab.token_bytes[tid] == text.encode()
    for other in ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "</s>", "<s>"):
        assert vocab.token_bytes[tokenizer.convert_tokens_to_ids(other)] is None, other
    # the text the grammar sees is the text the output shows
    ids_of_call = tokenizer.encode("Sure." + CALL, add_special_tokens=False)
    assert TOOL_CALLS_ID in ids_of_call
    assert vocab.text_bytes(ids_of_call) == (" Sure." + CALL).encode()  # SentencePiece's space
    # skipped: every other special token (<unk>, <s>, </s> and the control tokens)
    assert skipped_special_ids(tokenizer) == frozenset({0, 1, 2, *range(32000, 32007)}) - {
        TOOL_CALLS_ID
    }
    # a vocabulary told of no markers: as before
    plain = TokenVocab.from_tokenizer(tokenizer, CONFIG["vocab_size"], [EOS_ID])
    assert plain.token_bytes[TOOL_CALLS_ID] is None


@pytest.mark.parametrize("chunk", [1, 4])
def test_the_output_keeps_the_markers_and_skips_the_other_specials(tokenizer, chunk):
    text = "[INST]Sure." + CALL + "[/TOOL_RESULTS]</s>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer, True, True, skipped_special_ids(tokenizer))
    out = "".join(decoder.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
    assert out + decoder.flush() == "Sure." + CALL
    # skip_special_tokens false: every special token, as before
    decoder = IncrementalDecoder(tokenizer, False, True, skipped_special_ids(tokenizer))
    decoder.push(ids)
    assert decoder.text + decoder.flush() == tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_a_grammar_writes_the_marker_token(vocab, tokenizer, backend):
    tag = structural_tag(MISTRAL, check_tools([TOOL]), ToolChoice("required"))
    manager = GrammarManager(lambda: vocab, order=[backend], timeout_s=60)
    try:
        spec = parse_spec("structural_tag", json.dumps(tag))
        grammar = RequestGrammar(manager.compile(spec), [EOS_ID])
        bitmask = allocate_bitmask(1, vocab.size)
        grammar.matcher.fill_bitmask(bitmask, 0)
        allowed = [t for t in range(vocab.size) if bit_is_set(bitmask, 0, t)]
        # llguidance names the token in the grammar: only it; the others may spell it too
        assert TOOL_CALLS_ID in allowed
        assert (allowed == [TOOL_CALLS_ID]) == (backend == "llguidance")
        ids = tokenizer.encode(CALL, add_special_tokens=False)
        assert ids[0] == TOOL_CALLS_ID
        assert all(grammar.accept(t) for t in ids)
        bitmask = torch.zeros_like(bitmask)
        grammar.matcher.fill_bitmask(bitmask, 0)
        assert grammar.matcher.can_end(bitmask, 0) and grammar.accept(EOS_ID)
    finally:
        manager.shutdown()
