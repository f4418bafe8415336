"""Jump-forward never changes the answer: the text a grammar forces is only a draft (its settled
tokens, never the model's own token re-tokenized) that the model verifies in one forward, so
greedy outputs with jump-forward equal those without it (and those of a request that asks for
logprobs, which turns jump-forward off) on real models."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from weft.grammars.jump_forward import extends, settled_tokens
from weft.grammars.vocab import TokenVocab

from conftest import fixture_path, jump_forward_off, make_engine, qwen_engine

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


def test_a_draft_is_proposed_not_taken(stories_dir):
    # Before: the sampled token was re-tokenized with the forced text (`{` + `"name` -> `{"` +
    # `name`), and the forced tokens were appended unchecked, so the model saw tokens it never
    # chose. Now the forced text is only a draft, after the model's token, for the model to
    # verify; the grammar stays where the model's token left it.
    from weft.grammars.manager import GrammarManager, RequestGrammar
    from weft.grammars.spec import GrammarSpec

    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    vocab = TokenVocab.from_tokenizer(tokenizer, 512, [2])
    manager = GrammarManager(lambda: vocab, order=("xgrammar",))
    try:
        compiled = manager.submit(GrammarSpec("regex", r"\. the end of [a-z]+")).result(60)
    finally:
        manager.shutdown()
    grammar = RequestGrammar(compiled, [2])
    assert grammar.accept(vocab.token_bytes.index(b"."))
    draft = grammar.draft(16)
    assert vocab.text_bytes(draft) == b" the end of"  # the trailing space may merge: left out
    assert grammar.draft(2) == draft[:2]
    assert grammar.jump_forward() == b" the end of "
    assert grammar.jump_forward_tokens == 0


PROSE = r"[A-Z][a-z]+ was happy\. One day, (he|she) went to the park with (his|her) mom\. The end\."
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
    with jump_forward_off(engine):
        stepped = engine.generate(prompts, params)
    for j, s, lp in zip(jumped, stepped, with_logprobs, strict=True):
        assert j["text"] == s["text"] == lp["text"]
        assert s["meta_info"]["jump_forward_tokens"] == 0
    return jumped


def _jumped(outs: list[dict]) -> int:
    return sum(o["meta_info"]["jump_forward_tokens"] for o in outs)


# NOTE: stories260K never saw JSON and splits it its own way (`▁` + `"` where the tokenizer
# writes `▁"`; `o` + `o` for `oo`): appending the canonical tokens of forced text changed its
# answer. Verifying the forced tokens against the model's own choices (one forward over them,
# as speculative decoding verifies a draft) makes jump-forward exact for every model.
@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_greedy_is_the_same_with_jump_forward_on_stories(stories_dir, schedule):
    engine = make_engine(
        stories_dir,
        max_total_tokens=8192,
        enable_overlap_schedule=schedule == "overlap",
        disable_overlap_schedule=schedule == "plain",
        # stories260K never saw JSON: offered whitespace, it writes little else; compact JSON
        # leaves more forced text to draft
        constrained_json_disable_any_whitespace=True,
        enable_jump_forward=True,  # (on CUDA too, beside the decode graphs)
    )
    prompts = ["Once upon a time", "One day", "Lily", "Tom was", "The sun"]
    params = {"temperature": 0, "max_new_tokens": 80}
    try:
        outs = _same_text_three_ways(engine, prompts, {**params, "regex": PROSE})
        assert all(re.fullmatch(PROSE, o["text"]) for o in outs)
        # English the model tokenizes as the tokenizer does: the drafts are long, and taken
        assert _jumped(outs) >= 5 * 8
        outs = _same_text_three_ways(engine, prompts, {**params, "regex": REGEX})
        assert all(re.fullmatch(REGEX, o["text"]) for o in outs)
        outs = _same_text_three_ways(engine, prompts, {**params, "json_schema": json.dumps(SCHEMA)})
        # the model writes long friends' names: some outputs run out of tokens
        stopped = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
        assert len(stopped) >= 2
        for out in stopped:
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        engine.check_integrity()  # the KV of rejected draft tokens went back
        assert engine.memory_stats()["in_use"] == 0
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
    engine = qwen_engine()  # the session's (3 prompts of ~200 tokens fit its 4096)
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
    outs = _same_text_three_ways(engine, prompts, params)
    assert _jumped(outs) > 0
    for out, (_, skills) in zip(outs, PEOPLE, strict=True):
        assert json.loads(out["text"])["skills"] == skills, out["text"]


def test_sampling_keeps_the_models_distribution_with_drafts(stories_dir):
    # Each draft row samples from the model's own distribution after the draft tokens before
    # it, and the draft is kept up to the first row that sampled something else: sequential
    # sampling, in distribution. Appending the draft unchecked (as jump-forward once did) moved
    # both distributions below (p 1e-14 over the texts, 1e-84 over the token counts).
    engine = make_engine(
        stories_dir,
        max_total_tokens=16384,
        disable_overlap_schedule=True,
        enable_jump_forward=True,  # (on CUDA too, beside the decode graphs)
    )
    regex = r"(He|She) went to the park\. The (sun|dog) was (happy|big)\."

    def outputs(jump: bool) -> list[dict]:
        params = [
            {"temperature": 1.0, "max_new_tokens": 40, "regex": regex, "seed": 1000 * jump + i}
            for i in range(400)
        ]
        if jump:
            return engine.generate(["Once upon a time"] * 400, params)
        with jump_forward_off(engine):
            return engine.generate(["Once upon a time"] * 400, params)

    try:
        jumped, stepped = outputs(True), outputs(False)
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert _jumped(jumped) > 400 * 4
    for key in (lambda o: o["text"], lambda o: min(len(o["output_ids"]), 26) // 2):
        a, b = Counter(map(key, jumped)), Counter(map(key, stepped))
        keys = sorted(set(a) | set(b), key=str)
        assert _same_distribution_p([a[k] for k in keys], [b[k] for k in keys]) > 1e-3


def _same_distribution_p(a: list[int], b: list[int]) -> float:
    """Pearson's chi-square test that two samples' category counts come from one distribution:
    the p-value (scipy's chi2_contingency gives the same to 1e-15 on the counts above)."""
    import torch

    n_a, n_b = sum(a), sum(b)
    stat = 0.0
    for x, y in zip(a, b, strict=True):
        for count, n in ((x, n_a), (y, n_b)):
            expected = (x + y) * n / (n_a + n_b)
            stat += (count - expected) ** 2 / expected
    df = len(a) - 1
    half = torch.tensor([df / 2, stat / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_drafts_beside_cuda_graphs_only_where_enabled_and_they_replay_them(stories_dir):
    # beside the decode graphs jump-forward is off unless enabled; enabled, a step that feeds
    # drafts lays its draft tokens out as rows of a decode batch, which the graphs replay: no
    # eager forward of output tokens
    params = {"temperature": 0, "max_new_tokens": 40, "regex": PROSE}
    by_default = make_engine(stories_dir, max_total_tokens=4096)
    enabled = make_engine(stories_dir, max_total_tokens=4096, enable_jump_forward=True)
    runner = enabled.runner
    eager: list[int] = []
    model = runner.model
    forward = model.forward

    def counting(batch, attention):
        if batch.output_only_cpu and all(batch.output_only_cpu):
            eager.append(len(batch.input_ids))  # (graph replays do not call the module)
        return forward(batch, attention)

    try:
        assert by_default.runner.graphs is not None and runner.graphs is not None
        plain = by_default.generate(["Once upon a time"] * 3, params)
        replays = runner.graphs.num_replays
        model.forward = counting
        jumped = enabled.generate(["Once upon a time"] * 3, params)
    finally:
        del model.forward
        by_default.shutdown()
        enabled.shutdown()
    assert _jumped(plain) == 0 and _jumped(jumped) > 0
    assert [o["text"] for o in plain] == [o["text"] for o in jumped]
    assert runner.graphs.num_replays > replays and eager == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="jump-forward is off beside CUDA graphs")
def test_drafts_keep_a_step_within_the_graphs_rows_unless_enabled(stories_dir):
    # where CUDA graphs replay decode steps (their largest batch forced small here, on a CPU),
    # a step's forced drafts fill only the rows a graph holds past its decodes: a full graph's
    # batch drafts nothing; enable_jump_forward feeds them all (eagerly past the graph)
    params = {"temperature": 0, "max_new_tokens": 40, "regex": PROSE}
    engine = make_engine(stories_dir, max_total_tokens=4096, disable_overlap_schedule=True)
    scheduler = engine.scheduler
    steps: list[int] = []
    forward = engine.runner.forward

    def counting(batch):
        if batch.output_only_cpu and all(batch.output_only_cpu):
            steps.append(len(batch.input_ids))
        return forward(batch)

    saved = scheduler.verify_graph_rows
    engine.runner.forward = counting
    try:
        scheduler.verify_graph_rows = 6
        capped = engine.generate(["Once upon a time"] * 4, params)
        capped_steps, steps[:] = list(steps), []
        full = engine.generate(["Once upon a time"] * 6, params)  # 6 decodes: no room
        full_steps, steps[:] = list(steps), []
        scheduler.config = scheduler.config.replace(enable_jump_forward=True)
        enabled = engine.generate(["Once upon a time"] * 6, params)
    finally:
        del engine.runner.forward
        scheduler.verify_graph_rows = saved
        engine.shutdown()
    assert max(capped_steps) <= 6 < max(steps) and _jumped(capped) > 0
    assert _jumped(full) == 0 and max(full_steps) == 6 and _jumped(enabled) > 0
    assert [o["text"] for o in full] == [o["text"] for o in enabled]


def test_enable_and_disable_jump_forward_contradict(stories_dir):
    from weft.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="enable_jump_forward and disable_jump_forward"):
        EngineConfig(
            model_path=str(stories_dir), enable_jump_forward=True, disable_jump_forward=True
        )
