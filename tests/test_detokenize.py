"""Incremental detokenization: the streamed text equals a one-shot decode, whole characters only,
and the tokenizers-library fast path gives the text transformers' decode gives."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from weft.runtime.detokenize import IncrementalDecoder

from conftest import fixture_path

TEXT = (
    "Héllo wörld! 你好，世界。 Emoji: 🦙🚀 — “quotes”, tabs\tand\nnewlines;  double  spaces, "
    "code: def f(x): return x ** 2  # ok"
)


@pytest.fixture(scope="module", params=["llama2", "qwen2", "stories"])
def tokenizer(request):
    if request.param == "stories":
        return AutoTokenizer.from_pretrained(fixture_path("models", "stories260K-hf"))
    return AutoTokenizer.from_pretrained(fixture_path("tokenizers", request.param))


def _stream(decoder: IncrementalDecoder, ids: list[int], chunk: int) -> list[str]:
    deltas = [decoder.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [decoder.flush()]


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_one_decode_in_whole_characters(tokenizer, chunk):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    deltas = _stream(decoder, ids, chunk)
    assert "".join(deltas) == decoder.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_the_fast_path_matches_transformers_decode(tokenizer):
    fast = IncrementalDecoder(tokenizer)
    slow = IncrementalDecoder(tokenizer)
    slow._fast = None  # force transformers' decode
    assert fast._fast is not None  # these fixtures are fast tokenizers without cleanup
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    ids[::37] = [rng.choice(special) for _ in ids[::37]]  # special tokens are skipped alike
    assert _stream(fast, ids, 1) == _stream(slow, ids, 1)
