"""Jump-forward never changes the answer: the model's own token is never re-tokenized, a forced
tail that the model's next token could merge with is left to the model, and greedy outputs with
jump-forward equal those without it (and those of a request that asks for logprobs, which turns
jump-forward off) on real models."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from weft.grammars.jump_forward import extends, settled_tokens
from weft.grammars.vocab import TokenVocab

from conftest import fixture_path, make_engine, require_default_model

FORCED = [
    b" [",
    b'"name": ',
    b'{"name": "',
    b'", "role": "',
    b'"}, "skills": [',
    b'engineer"',
    b"}\n</tool_call>",
    b'{"type": "object"}',
    b"\n\n",
]


@pytest.fixture(scope="module")
def qwen2_vocab() -> TokenVocab:
    tokenizer = AutoTokenizer.from_pretrained(fixture_path("tokenizers", "qwen2"))
    return TokenVocab.from_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _texts(vocab: TokenVocab, ids: list[int]) -> list[bytes]:
    return [vocab.token_bytes[i] or b"" for i in ids]


@pytest.mark.parametrize(
    ("forced", "want"),
    [
        # the issue's case: ` ["` is a token, so the model would not stop after ` [`
        (b" [", []),
        (b'"name": ', [b'"name', b'":']),  # ` "` is a token: the space stays with the model
        (b'{"name": "', [b'{"', b"name", b'":']),
        (b'engineer"', [b"engine", b"er"]),
        (b"}\n</tool_call>", [b"}\n", b"</tool_call>"]),  # nothing extends </tool_call>
    ],
)
def test_settled_tokens_on_qwen2(qwen2_vocab, forced, want):
    assert _texts(qwen2_vocab, settled_tokens(qwen2_vocab, forced)) == want


@pytest.mark.parametrize("forced", FORCED)
def test_no_settled_boundary_can_merge_with_what_follows(qwen2_vocab, forced):
    ids = settled_tokens(qwen2_vocab, forced)
    texts = _texts(qwen2_vocab, ids)
    assert forced.startswith(b"".join(texts))
    start = 0
    for text in texts:  # every committed token starts where the rest cannot merge on
        assert not extends(qwen2_vocab, forced[start:]), (forced, texts)
        start += len(text)
    if start < len(forced):  # what is left for the model can merge with the next token
        assert extends(qwen2_vocab, forced[start:])


def test_extends_is_a_strict_prefix_question():
    vocab = TokenVocab([b"a", b"ab", b"abc", b"b", None], [4], "byte_level")
    assert extends(vocab, b"a") and extends(vocab, b"ab")
    assert not extends(vocab, b"abc")  # a token itself, and nothing longer
    assert not extends(vocab, b"b") and not extends(vocab, b"c")
    assert extends(vocab, b"")


def test_the_models_token_is_never_retokenized(stories_dir):
    # Before: the sampled token was re-tokenized with the forced text (`{` + `"name` -> `{"` +
    # `name`), so the model saw tokens it never chose.
    from weft.grammars.manager import GrammarManager, RequestGrammar
    from weft.grammars.spec import GrammarSpec

    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    vocab = TokenVocab.from_tokenizer(tokenizer, 512, [2])
    manager = GrammarManager(lambda: vocab, order=("xgrammar",))
    try:
        compiled = manager.submit(GrammarSpec("regex", r'\{"name": "[a-z]+"\}')).result(60)
    finally:
        manager.shutdown()
    grammar = RequestGrammar(compiled, [2])
    brace = next(i for i, b in enumerate(vocab.token_bytes) if b == b"{")
    assert grammar.accept(brace)
    ids = grammar.jump_forward_from(brace)
    assert ids[0] == brace
    assert vocab.text_bytes(ids[1:]) == b'"name": "'[: len(vocab.text_bytes(ids[1:]))]
    assert grammar.jump_forward_tokens == len(ids) - 1


REGEX = r'\{"name": "[a-z]{1,8}", "mood": "(happy|sad)", "place": "[a-z ]{1,12}"\}'
SCHEMA = {
    "type": "object",
    "properties": {
        "hero": {"type": "string", "maxLength": 12},
        "friends": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "happy": {"type": "boolean"},
    },
    "required": ["hero", "friends", "happy"],
    "additionalProperties": False,
}


def _same_text_three_ways(engine, prompts, params) -> list[dict]:
    """Greedy with jump-forward, without it, and asking for logprobs: the same outputs."""
    jumped = engine.generate(prompts, params)
    with_logprobs = engine.generate(prompts, params, return_logprob=True)
    engine.scheduler.config = engine.scheduler.config.replace(disable_jump_forward=True)
    try:
        stepped = engine.generate(prompts, params)
    finally:
        engine.scheduler.config = engine.scheduler.config.replace(disable_jump_forward=False)
    for j, s, lp in zip(jumped, stepped, with_logprobs, strict=True):
        assert j["text"] == s["text"] == lp["text"]
        assert s["meta_info"]["jump_forward_tokens"] == 0
    assert sum(o["meta_info"]["jump_forward_tokens"] for o in jumped) > 0
    return jumped


# NOTE: stories260K never saw JSON and splits it its own way (`▁` + `"` where the tokenizer
# writes `▁"`; `o` + `o` for `oo`), so appending the canonical tokens of forced text still
# changes its answer. Only verifying the forced tokens against the model's own choices (one
# forward over them, as speculative decoding verifies a draft) makes jump-forward exact for
# every model; until then this test documents the gap (strict: it fails once the gap is closed).
@pytest.mark.xfail(strict=True, reason="jump-forward is not verified against the model yet")
@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_greedy_is_the_same_with_jump_forward_on_stories(stories_dir, schedule):
    engine = make_engine(
        stories_dir,
        max_total_tokens=8192,
        enable_overlap_schedule=schedule == "overlap",
        disable_overlap_schedule=schedule == "plain",
    )
    prompts = ["Once upon a time", "One day", "Lily", "Tom was", "The sun"]
    params = {"temperature": 0, "max_new_tokens": 80}
    try:
        outs = _same_text_three_ways(engine, prompts, {**params, "regex": REGEX})
        assert all(re.fullmatch(REGEX, o["text"]) for o in outs)
        outs = _same_text_three_ways(engine, prompts, {**params, "json_schema": json.dumps(SCHEMA)})
        assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    finally:
        engine.shutdown()


EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
        },
        "skills": {"type": "array", "items": {"type": "string"}},
        "email": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "address", "skills"],
}
PEOPLE = [
    (
        "Bob Chen (41) manages the finance team in Toronto, Canada; his strengths are budgeting "
        "and negotiation.",
        ["budgeting", "negotiation"],
    ),
    (
        "Eve Tanaka, 38, engineering manager in Osaka, Japan, good at roadmaps and hiring.",
        ["roadmaps", "hiring"],
    ),
    (
        "Carla Gomez is a 29-year-old product designer living in Madrid, Spain, skilled in Figma "
        "and user research.",
        ["Figma", "user research"],
    ),
]


@pytest.mark.slow
def test_extraction_is_the_same_with_jump_forward_on_qwen():
    # The issue's extraction: with the model's token re-tokenized and ` [` forced, the first
    # skill came back as ".budgeting" / "/roadmaps" (the model continued after an unnatural
    # split); without jump-forward it was right.
    require_default_model()
    engine = make_engine(None, max_total_tokens=8192)
    prompts = [
        engine.tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "Extract the person as JSON."},
                {"role": "user", "content": text},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        for text, _ in PEOPLE
    ]
    params = {"temperature": 0, "max_new_tokens": 120, "json_schema": json.dumps(EXTRACTION_SCHEMA)}
    try:
        outs = _same_text_three_ways(engine, prompts, params)
    finally:
        engine.shutdown()
    for out, (_, skills) in zip(outs, PEOPLE, strict=True):
        assert json.loads(out["text"])["skills"] == skills, out["text"]
