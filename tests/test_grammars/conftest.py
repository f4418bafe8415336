"""Grammar tests run on real vocabularies: the default model's Qwen2 tokenizer (byte-level BPE,
151,936 ids) and stories260K's SentencePiece tokenizer with byte fallback."""

from __future__ import annotations

import pytest

from conftest import fixture_path, require_default_model

QWEN_VOCAB = 151936
QWEN_END_IDS = [151643, 151645]


@pytest.fixture(scope="session")
def qwen_tokenizer():
    require_default_model()
    from weft.runtime.config import EngineConfig
    from weft.runtime.loaders.source import resolve_source
    from weft.runtime.tokenizer import load_tokenizer

    source = resolve_source(EngineConfig(show_progress=False))
    return load_tokenizer(source.tokenizer_folder)


@pytest.fixture(scope="session")
def qwen_vocab(qwen_tokenizer):
    from weft.grammars.vocab import TokenVocab

    return TokenVocab.from_tokenizer(qwen_tokenizer, QWEN_VOCAB, QWEN_END_IDS)


@pytest.fixture(scope="session")
def stories_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fixture_path("models", "stories260K-hf"))
