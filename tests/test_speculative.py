"""Speculative decoding (n-gram drafts) never changes what the model writes: greedy outputs equal
those without it (batches, prefix-cache hits, both schedules, grammars, stop strings and token
limits inside a draft), a sampled token keeps the model's distribution at drafted positions,
and the drafts are really verified (the meta_info counters say how many were kept)."""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from collections.abc import Iterator

import jsonschema
import pytest
import torch

from weft.runtime.core import Req
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.speculative import NgramIndex

from conftest import make_engine, qwen_engine

SPEC_KEYS = {"spec_verify_ct", "spec_accept_length", "spec_accept_rate"}
# stories260K retells its stories: prompts whose continuations repeat what came before
STORIES = [
    "Once upon a time, there was a little girl named Lily. She liked to play outside. "
    "Once upon a time, there was a little",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
    "Lily and Ben were friends. They played in the park.",
]
GREEDY = {"max_new_tokens": 64, "temperature": 0}
REGEX = r'\{"name": "[a-z]{1,8}", "mood": "(happy|sad)", "place": "[a-z ]{1,12}"\}'


@contextlib.contextmanager
def speculating(engine, **changes) -> Iterator[None]:
    """The engine with n-gram speculation for the block (its config restored after); every
    token the drafter has is fed, and batches draft as a request alone would (no row cost, no
    step budget, unless `changes` sets them)."""
    config = engine.scheduler.config
    changes = {
        "speculative_algorithm": "ngram",
        "speculative_max_step_rows": 1024,
        "speculative_row_cost": 0.0,
        **changes,
    }
    engine.scheduler.config = config.replace(**changes)
    try:
        yield
    finally:
        engine.scheduler.config = config


def _accepted(outs: list[dict]) -> int:
    """Draft tokens the model kept, over the outputs (from meta_info)."""
    total = 0
    for o in outs:
        m = o["meta_info"]
        total += round((m["spec_accept_length"] - 1) * m["spec_verify_ct"])
    return total


def _req(ids: list[int], output: list[int] = ()) -> Req:
    req = Req("r", list(ids), SamplingParams())
    req.output_ids = list(output)
    return req


def test_ngram_index_proposes_what_followed_the_latest_match():
    index = NgramIndex()
    req = _req([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    index.update(req)
    # suffix (2, 3): latest earlier occurrence is at positions 5..6, followed by 5, 6, 7, 2, 3
    assert index.propose(req, [], 3) == [5, 6, 7]
    assert index.propose(req, [], 10) == [5, 6, 7, 2, 3]  # up to the end of the text
    req.output_ids = [8]
    index.update(req)
    assert index.propose(req, [], 4) == []  # (3, 8) occurred nowhere before
    # the grammar's draft extends the suffix: the longest match (2, 3, 4) beats the later (2, 3)
    assert index.propose(req, [2, 3, 4], 2) == [9, 2]
    assert index.indexed == 13


def test_ngram_index_grows_with_the_output():
    index = NgramIndex()
    req = _req([5, 6, 7], [5])
    index.update(req)
    assert index.propose(req, [], 4) == []  # one token of suffix: below NGRAM_MIN
    req.output_ids.append(6)
    index.update(req)
    assert index.propose(req, [], 4) == [7, 5, 6]


def test_ngram_index_takes_a_token_that_occurred_once():
    """Where no 2-token suffix matches, a last token that occurred exactly once before drafts
    what followed it (a name the output copies after a context the text does not have)."""
    index = NgramIndex()
    req = _req([3, 41, 42, 43, 9, 3, 5], [1, 41])
    index.update(req)
    assert index.propose(req, [], 3) == []
    assert index.propose_unique(req, [], 3) == [42, 43, 9]
    assert index.propose_unique(req, [3], 3) == []  # 3 occurred twice
    req.output_ids += [42, 7]
    index.update(req)
    assert index.propose_unique(req, [], 3) == []  # 7 never occurred before


def test_a_unique_token_draft_rejected_whole_changes_nothing():
    """A draft after a single earlier token only fills a step that had none: rejected whole, it
    neither shortens the next draft nor backs off; kept, it counts as any draft."""
    from weft.runtime.config import EngineConfig
    from weft.runtime.scheduler.speculative import Speculation, Speculative

    class Memory:
        def truncate(self, req, kv_len):
            pass

    speculative = Speculative(EngineConfig(speculative_algorithm="ngram"), Memory(), None)
    req = _req([3, 41, 42, 43, 9, 3, 5], [1, 41])
    req.spec = spec = Speculation(limit=4)
    draft = speculative._ngram(req, 4, 4, None)
    assert draft == [42, 43, 9, 3] and spec.unique
    assert speculative.take_draft(req, draft, [0] * 5) == 0
    assert (spec.limit, spec.misses, spec.skip) == (4, 0, 0)
    assert (spec.verify_ct, spec.draft_tokens, spec.accepted_tokens) == (1, 4, 0)
    assert speculative.take_draft(req, draft, [42, 0, 0, 0, 0]) == 1
    assert spec.limit == 2  # kept 1: at most one more, as after any draft


def test_a_repeat_under_a_grammar_goes_on_with_what_the_grammar_forces(stories_dir):
    """An n-gram draft walked through the request's grammar: cut at the first token it forbids,
    followed by the tokens it forces there (beyond the drafter's share, within `cap`), then by
    what the text repeats after them; the grammar is left where it was."""
    from transformers import AutoTokenizer

    from weft.grammars.manager import GrammarManager, RequestGrammar
    from weft.grammars.spec import GrammarSpec
    from weft.grammars.vocab import TokenVocab
    from weft.runtime.config import EngineConfig
    from weft.runtime.scheduler.speculative import Speculation, Speculative

    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    vocab = TokenVocab.from_tokenizer(tokenizer, 512, [2])
    manager = GrammarManager(lambda: vocab, order=("xgrammar",))
    try:
        spec = GrammarSpec("regex", r" name: [a-z]+, city: [a-z]+; age: [a-z]+\.")
        compiled = manager.submit(spec).result(60)
    finally:
        manager.shutdown()

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def text(ids: list[int]) -> bytes:
        return vocab.text_bytes(ids)

    class Output:
        end_ids = frozenset([2])
        max_seq_len = 1000

    speculative = Speculative(EngineConfig(speculative_algorithm="ngram"), None, Output())
    req = _req(encode("name: tom, age: six; city: rome."), encode("name: lily,"))
    req.spec = Speculation(limit=7)
    grammar = RequestGrammar(compiled, [2])
    for tid in req.output_ids:
        assert grammar.accept(tid)
    # ',' occurred once: the text goes on with " age", which the grammar forbids here
    assert text(speculative._ngram(req, 7, 7, None)) == b" age: six"
    forced = grammar.draft(16)
    assert text(forced) == b" city:"  # (the space after may merge: not settled)
    draft = speculative._ngram(req, 7, 7, grammar)
    assert text(draft) == b" city: rome"  # forced, then the prompt's "city: " repeats
    assert grammar.draft(16) == forced  # rolled back
    assert all(grammar.accept(tid) for tid in draft)
    grammar.rollback(len(draft))
    # a share of 2: the forced tokens go past it (to the cap), the repeat after them does not
    assert speculative._ngram(req, 2, 7, grammar) == forced
    assert speculative._ngram(req, 2, 3, grammar) == forced[:3]


def test_drafts_shrink_to_what_is_kept_and_back_off_after_misses():
    from weft.runtime.config import EngineConfig
    from weft.runtime.scheduler.speculative import Speculation, Speculative

    class Memory:
        def truncate(self, req, kv_len):
            pass

    speculative = Speculative(EngineConfig(speculative_algorithm="ngram"), Memory(), None)
    req = _req([1, 2, 3])
    req.spec = spec = Speculation(limit=8)
    draft = [4, 5, 6, 7, 8, 9, 10, 11]
    assert speculative.take_draft(req, draft, [4, 5, 0, 0, 0, 0, 0, 0, 0]) == 2
    assert (spec.limit, spec.misses, spec.skip) == (3, 0, 0)  # kept 2: at most one more
    assert speculative.take_draft(req, [4, 5, 6], [4, 5, 6, 7]) == 3
    assert spec.limit == 6  # kept whole: doubled (up to speculative_num_draft_tokens)
    skips = []
    for _ in range(6):  # rejected whole: 1, 2, 4, 8, 16, 16 tokens without a draft
        assert speculative.take_draft(req, [4, 5], [0, 0, 0]) == 0
        skips.append(spec.skip)
    assert skips == [1, 2, 4, 8, 16, 16] and spec.limit == 2
    assert (spec.verify_ct, spec.draft_tokens, spec.accepted_tokens) == (8, 23, 5)


def test_a_step_shares_its_rows_by_what_each_request_kept():
    """Each request's token takes a row; the drafts share the rest: a request's k-th draft token
    counts c ** k (c its keep chance), drafted where that beats the row's cost, likeliest first,
    each request up to its limit."""
    from weft.runtime.scheduler.speculative import Speculation, _share

    reqs = [_req([1]) for _ in range(4)]
    recent = [(0, 0), (8, 0), (0, 3), None]  # (kept, rejected); None: no drafter state yet
    for req, count in zip(reqs, recent, strict=True):
        if count is not None:
            req.spec = Speculation(limit=7, recent_kept=count[0], recent_rejected=count[1])
    assert [r.spec.keep_chance for r in reqs[:3]] == [0.5, 0.9, 0.2]
    wants = [(req, 5) for req in reqs]

    def share(rows: int, cost: float) -> list[tuple[int, int]]:
        return [(reqs.index(r), n) for r, n in _share(wants, rows, cost)]

    # chances over 0.1: 0.5 0.25 0.125 | 0.9 0.81 0.729 0.656 0.59 | 0.2 | 0.5 0.25 0.125
    assert share(12, 0.1) == [(0, 3), (1, 5), (2, 1), (3, 3)]
    assert share(4, 0.1) == [(1, 4)]
    assert share(6, 0.1) == [(0, 1), (1, 5)]  # 0.5 twice: the first request's
    assert share(100, 0.6) == [(1, 4)]  # 0.59 does not pay for its row
    assert share(0, 0.0) == share(-4, 0.0) == []
    assert _share(wants, 100, 0.0) == wants


def test_step_cost_fits_the_timed_steps():
    from weft.runtime.scheduler.speculative import StepCost

    cost = StepCost(prior=0.2)
    assert cost.fit() is None and cost.row_cost(4) == pytest.approx(0.8 / 1.8)
    cost.record(4, 0.018)  # one row count: b from the prior, a = 0.018 / (1 + 0.2 * 4)
    assert cost.fit() == pytest.approx((0.01, 0.002))
    cost = StepCost(prior=0.2)
    for rows in (1, 8, 1, 8, 4):
        cost.record(rows, 0.02 + 0.004 * rows)  # several row counts: the fit, not the prior
    assert cost.fit() == pytest.approx((0.02, 0.004))
    assert cost.row_cost(4) == pytest.approx(0.016 / 0.036)


def test_a_speculating_batch_keeps_its_steps_within_the_row_budget(stories):
    """The default budget (on a CPU 8 rows, one pass of weft's kernels: 3 requests draft at
    most 5 tokens among them a step), every token the drafter has otherwise (row cost 0); the
    outputs are those without speculation."""
    from weft.runtime.config import EngineConfig
    from weft.runtime.scheduler.speculative import STEP_ROWS

    runner = stories.scheduler.runner
    rows: list[int] = []
    forward = runner.forward

    def counting(batch):
        if batch.output_only_cpu and all(batch.output_only_cpu):
            rows.append(len(batch.input_ids))
        return forward(batch)

    stories.flush_cache()
    plain = stories.generate(STORIES, GREEDY)
    runner.forward = counting
    try:
        with speculating(stories, speculative_max_step_rows=None):
            spec = stories.generate(STORIES, GREEDY)
    finally:
        del runner.forward
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    budget = STEP_ROWS[runner.device.type]
    assert max(rows) <= budget and _accepted(spec) > 0
    if budget < len(STORIES) * (1 + EngineConfig().speculative_num_draft_tokens):
        assert max(rows) == budget  # it binds (a CPU): the rows left go to drafts


@pytest.fixture(scope="module")
def stories(stories_dir):
    # NOTE: the schedule named, not the device's default (overlap on GPUs, where a request's
    # token is still on the device when its next step is laid out: a 3-token output then never
    # verifies a draft); a fixed pool, as other modules hold GPU memory
    return make_engine(stories_dir, disable_overlap_schedule=True, max_total_tokens=4096)


@pytest.fixture(scope="module")
def stories_overlap(stories_dir):
    return make_engine(stories_dir, enable_overlap_schedule=True, max_total_tokens=4096)


@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_greedy_is_the_same_with_speculation_on_stories(request, schedule):
    engine = request.getfixturevalue("stories" if schedule == "plain" else "stories_overlap")
    engine.flush_cache()
    plain = engine.generate(STORIES, GREEDY)
    assert all(SPEC_KEYS.isdisjoint(o["meta_info"]) for o in plain)
    with speculating(engine):
        batch = engine.generate(STORIES, GREEDY)  # the prompts are cached now
        alone = [engine.generate(p, GREEDY) for p in STORIES]
    for p, b, a in zip(plain, batch, alone, strict=True):
        assert b["output_ids"] == a["output_ids"] == p["output_ids"]
        assert b["meta_info"]["finish_reason"] == p["meta_info"]["finish_reason"]
        assert b["meta_info"]["cached_tokens"] > 0
    assert _accepted(batch) >= 20 and _accepted(alone) >= 20
    for o in batch:
        m = o["meta_info"]
        assert m["spec_verify_ct"] > 0 and 0 <= m["spec_accept_rate"] <= 1
        assert m["spec_accept_length"] >= 1


@pytest.mark.parametrize("schedule", ["plain", "overlap"])
def test_constrained_greedy_is_the_same_with_speculation(request, schedule):
    engine = request.getfixturevalue("stories" if schedule == "plain" else "stories_overlap")
    record = '{"name": "lily", "mood": "happy", "place": "the park"}'
    prompt = f"{record}\n{record}\n"
    params = {**GREEDY, "regex": REGEX}
    plain = engine.generate(prompt, params)
    with speculating(engine):
        spec = engine.generate(prompt, params)
    assert spec["output_ids"] == plain["output_ids"]
    assert re.fullmatch(REGEX, spec["text"])
    # (text the grammar forces may come in an n-gram draft first: then it counts there)
    assert spec["meta_info"]["spec_verify_ct"] > 0 and _accepted([spec]) > 0


def test_drafts_fed_as_decode_rows_give_the_same_tokens(stories):
    """Where CUDA graphs replay decode steps, a step of drafts feeds each draft token as a
    request of its own (build_batch's token_rows_apart), a decode batch the graphs replay (on a
    CPU, forced here): the greedy outputs, constrained too, are those without speculation."""
    scheduler = stories.scheduler
    runner = scheduler.runner
    verify_steps: list[bool] = []  # per step that fed drafts: was it a decode batch?
    forward = runner.forward

    def watching(batch):
        rows = len(batch.input_ids)
        if (
            batch.output_only_cpu
            and all(batch.output_only_cpu)
            and rows > len(set(batch.req_pool_indices.tolist()))
        ):
            verify_steps.append(batch.is_decode and batch.batch_size == rows)
        return forward(batch)

    stories.flush_cache()
    plain = stories.generate(STORIES, GREEDY)
    record = '{"name": "lily", "mood": "happy", "place": "the park"}'
    constrained = {**GREEDY, "regex": REGEX}
    plain_regex = stories.generate(f"{record}\n{record}\n", constrained)
    saved = scheduler.verify_graph_rows
    scheduler.verify_graph_rows = saved or 64
    runner.forward = watching
    try:
        with speculating(stories):
            spec = stories.generate(STORIES, GREEDY)
            spec_regex = stories.generate(f"{record}\n{record}\n", constrained)
    finally:
        del runner.forward
        scheduler.verify_graph_rows = saved
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert spec_regex["output_ids"] == plain_regex["output_ids"]
    assert _accepted(spec) >= 20 and _accepted([spec_regex]) > 0
    assert verify_steps and all(verify_steps)


def test_stop_strings_and_token_limits_inside_a_draft(stories):
    prompt = STORIES[0]
    plain = stories.generate(prompt, GREEDY)
    text, ids = plain["text"], plain["output_ids"]
    with speculating(stories):
        spec = stories.generate(prompt, GREEDY)
        assert spec["output_ids"] == ids and _accepted([spec]) >= 10
        for n in range(1, 40, 3):  # each limit lands inside a draft or at its edge
            out = stories.generate(prompt, {**GREEDY, "max_new_tokens": n})
            assert out["output_ids"] == ids[:n]
            assert out["meta_info"]["finish_reason"] == {"type": "length"}
        words = sorted(set(text.split()), key=text.find)[3:9]
        for stop in words:
            params = {**GREEDY, "stop": [stop]}
            out = stories.generate(prompt, params)
            with speculating(stories, speculative_algorithm=None):
                want = stories.generate(prompt, params)
            assert out["text"] == want["text"] == text[: text.find(stop)]
            assert out["output_ids"] == want["output_ids"]
            assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def test_opt_out_and_logprobs_turn_speculation_off(stories):
    with speculating(stories):
        off = stories.generate(STORIES[1], {**GREEDY, "speculative": False})
        logprobs = stories.generate(STORIES[1], GREEDY, return_logprob=True)
        on = stories.generate(STORIES[1], GREEDY)
    assert SPEC_KEYS.isdisjoint(off["meta_info"]) and SPEC_KEYS.isdisjoint(logprobs["meta_info"])
    assert len(logprobs["meta_info"]["output_token_logprobs"]) == len(on["output_ids"])
    assert off["output_ids"] == logprobs["output_ids"] == on["output_ids"]
    assert _accepted([on]) > 0


def test_the_prefix_cache_holds_only_kept_tokens(stories):
    stories.flush_cache()
    prompt_ids = stories.tokenizer.encode(STORIES[1])
    with speculating(stories):
        first = stories.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    assert first["meta_info"]["spec_verify_ct"] > 0
    tokens = prompt_ids + first["output_ids"]
    cache = stories.scheduler.memory.cache
    # every slot the cache holds is one of this request's tokens (the last has no KV): a draft
    # token the model rejected would be a branch or a longer path
    assert cache.total_size == len(tokens) - 1
    assert cache.match_prefix(tokens, "").length == len(tokens) - 1
    # a follow-up that shares the prefix continues as without speculation
    follow = tokens[: len(prompt_ids) + 20]
    with speculating(stories):
        again = stories.generate(input_ids=follow, sampling_params=GREEDY)
    stories.flush_cache()
    want = stories.generate(input_ids=follow, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(follow) - 1
    assert again["output_ids"] == want["output_ids"]


def test_sampling_keeps_the_distribution_at_drafted_positions(stories):
    """Temperature 1 on a prompt that repeats itself: after the first token the n-gram drafter
    proposes the rest of the sentence, so the second token decides a draft token's fate and the
    third is sampled at a drafted position when it is kept. Given the most likely first token
    t0, the pairs (t1, t2) must follow the model's p(t1 | t0) p(t2 | t0, t1), computed here."""
    prompt = stories.tokenizer.encode(REPEATING)
    t0, exact = pair_distribution(stories, prompt)
    samples = 1200
    params = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}
    with speculating(stories):
        outs = stories.generate(input_ids=[prompt] * samples, sampling_params=params)
    drafted = [o for o in outs if o["output_ids"][0] == t0]
    assert len(drafted) >= samples // 3  # t0 = 'little': p = 0.53
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in drafted) >= len(drafted) // 2
    assert _accepted(drafted) >= len(drafted) // 4  # many t2 come from a draft's row
    assert_pairs_follow(drafted, exact)


def _chi_square_pvalue(observed: list[int], expected: list[float]) -> float:
    """Pearson's chi-square test of counts against expected counts of the same total: the
    probability of a statistic at least this large (the regularized upper incomplete gamma
    function of df / 2 at statistic / 2)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


# a prompt that repeats itself: drafts follow its first tokens (the chi-square tests)
REPEATING = "Once upon a time, there was a little girl. Once upon a time, there was a"


def pair_distribution(engine, prompt: list[int]) -> tuple[int, dict[tuple[int, int], float]]:
    """The most likely first token t0 after the prompt, and p(t1 | t0) p(t2 | t0, t1) of each
    pair of the next two tokens (t1 from those above 1e-3), from the model's own logprobs."""
    t0 = int(_next_token_probs(engine, [prompt])[0].argmax())
    p1 = _next_token_probs(engine, [prompt + [t0]])[0]
    seconds = [t for t in torch.argsort(p1, descending=True).tolist() if p1[t] > 1e-3]
    p2 = _next_token_probs(engine, [prompt + [t0, t] for t in seconds])
    exact = {
        (t1, t2): float(p1[t1] * p2[i, t2])
        for i, t1 in enumerate(seconds)
        for t2 in range(p2.shape[1])
    }
    return t0, exact


def assert_pairs_follow(outs: list[dict], exact: dict[tuple[int, int], float]) -> None:
    """The outputs' second and third tokens follow `exact` (Pearson's chi-square over the pairs
    expected 5+ times, the rest pooled)."""
    seen = Counter(tuple(o["output_ids"][1:3]) for o in outs)
    n = len(outs)
    common = [pair for pair, p in exact.items() if p * n >= 5]
    observed = [seen[pair] for pair in common]
    wanted = [exact[pair] * n for pair in common]
    observed.append(n - sum(observed))
    wanted.append(n - sum(wanted))
    assert _chi_square_pvalue(observed, wanted) > 1e-3, (common, observed, wanted)


def _next_token_probs(engine, prompts: list[list[int]]) -> torch.Tensor:
    """The model's next-token distribution after each prompt ([len(prompts), vocab])."""
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=engine.scheduler.runner.model_config.vocab_size,
    )
    vocab = engine.scheduler.runner.model_config.vocab_size
    probs = torch.zeros(len(prompts), vocab, dtype=torch.float64)
    for i, o in enumerate(outs):
        for logprob, tid, _ in o["meta_info"]["output_top_logprobs"][0]:
            probs[i, tid] = float(torch.tensor(logprob, dtype=torch.float64).exp())
    return probs


# ---- the default model: code editing, JSON under a schema ---------------------------------

CODE = '''def moving_average(x, width):
    """The mean of each window of `width` values of x."""
    if width <= 0:
        raise ValueError("width must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(x):
        total += value
        if i >= width:
            total -= x[i - width]
        if i >= width - 1:
            out.append(total / width)
    return out
'''
EDIT = f"{CODE}\nRename the parameter x to values and return the full code."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "job": {"type": "string"},
    },
    "required": ["name", "city", "job"],
    "additionalProperties": False,
}
PERSON = (
    "Extract the person as JSON: Maria Lopez lives in Valencia, where she works as a "
    "marine biologist at the city aquarium."
)


STORY = "Write a long story about a dragon who learns to bake bread in a small mountain village."


def _uncached(engine, prompt, params):
    """A generation from an empty prefix cache (repeats from a warm one are checked apart:
    test_a_repeat_from_the_prefix_cache_is_the_same_on_the_default_model)."""
    engine.flush_cache()
    return engine.generate(prompt, params)


def _chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def test_code_editing_on_the_default_model():
    engine = qwen_engine()
    prompt = _chat(engine, EDIT)
    params = {"max_new_tokens": 100, "temperature": 0}
    plain = _uncached(engine, prompt, params)
    with speculating(engine):
        spec = _uncached(engine, prompt, params)
    assert spec["output_ids"] == plain["output_ids"]
    m = spec["meta_info"]
    # the answer repeats the code: much of it comes from drafts
    assert _accepted([spec]) >= len(spec["output_ids"]) // 3, m
    assert m["spec_accept_length"] >= 3


def test_a_story_whose_drafts_miss_is_the_same_on_the_default_model():
    """Drafts that are mostly rejected, on real weights: every verify step's rows must round as
    decode steps do, alone or in a batch (weft's CPU kernels and C attention). Before the C
    attention, the verify step's SDPA rounded apart and this story left the plain one at token
    59."""
    engine = qwen_engine()
    prompts = [_chat(engine, STORY), _chat(engine, STORY.replace("dragon", "fox"))]
    params = {"max_new_tokens": 96, "temperature": 0}
    plain = _uncached(engine, prompts, params)
    with speculating(engine):
        spec, alone = _uncached(engine, prompts, params), _uncached(engine, prompts[1], params)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert alone["output_ids"] == plain[1]["output_ids"]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in spec)


def test_a_repeat_from_the_prefix_cache_is_the_same_on_the_default_model():
    """The same greedy request from an empty cache, then with its prompt cached (its last token
    computed alone: the dense copy's single-row product must round as the whole prompt's), in a
    batch beside another prompt, and speculating: the same tokens and log-probabilities."""
    engine = qwen_engine()
    prompt = _chat(engine, STORY.replace("dragon", "fox"))
    params = {"max_new_tokens": 64, "temperature": 0}

    def run(prompts):
        outs = engine.generate(prompts, params, return_logprob=True)
        return outs if isinstance(outs, list) else [outs]

    engine.flush_cache()
    first = run(prompt)[0]
    again = run(prompt)[0]
    batch = run([_chat(engine, STORY), prompt])[1]
    with speculating(engine):
        spec = run(prompt)[0]
    assert again["meta_info"]["cached_tokens"] > 0
    logprobs = first["meta_info"]["output_token_logprobs"]
    for out in (again, batch):
        assert out["meta_info"]["output_token_logprobs"] == logprobs
    assert spec["output_ids"] == first["output_ids"]


def test_json_schema_with_speculation_on_the_default_model():
    engine = qwen_engine()
    prompt = _chat(engine, PERSON)
    params = {"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    plain = _uncached(engine, prompt, params)
    with speculating(engine):
        spec = _uncached(engine, prompt, params)
    assert spec["output_ids"] == plain["output_ids"]
    jsonschema.validate(json.loads(spec["text"]), SCHEMA)
    m = spec["meta_info"]
    assert m["jump_forward_tokens"] > 0 and m["spec_verify_ct"] > 0
    assert _accepted([spec]) > 0  # the values repeat the text's words


# ---- through the server -------------------------------------------------------------------


def test_server_reports_speculation(stories_dir, stories_server):
    from server_utils import ServerProcess, stories_args

    srv = ServerProcess(
        *stories_args(stories_dir, "--speculative-algorithm", "ngram"), "--enable-metrics"
    )
    try:
        body = {"text": STORIES[1], "sampling_params": GREEDY}
        spec = srv.generate(body)
        plain = stories_server.generate(body)
        opted_out = srv.generate({**body, "sampling_params": {**GREEDY, "speculative": False}})
        assert spec["output_ids"] == plain["output_ids"] == opted_out["output_ids"]
        assert spec["text"] == plain["text"]
        assert set(spec["meta_info"]) >= SPEC_KEYS and _accepted([spec]) > 0
        assert SPEC_KEYS.isdisjoint(plain["meta_info"]) and SPEC_KEYS.isdisjoint(
            opted_out["meta_info"]
        )
        metrics = srv.get("/metrics").text
        verified = [
            line for line in metrics.splitlines() if line.startswith("weft:spec_verify_ct_total")
        ]
        assert verified == [
            f"weft:spec_verify_ct_total {float(spec['meta_info']['spec_verify_ct'])}"
        ]
        srv.assert_kv_intact()
    finally:
        assert srv.stop() == 0
