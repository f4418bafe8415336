"""Each grammar backend on the real Qwen2 vocabulary: masks allow exactly the tokens that keep
the output in the language, end tokens only where it may end; the fallback chain, the compile
timeout and the cache."""

from __future__ import annotations

import json
import time

import pytest
import torch

from weft.grammars.bitmask import allocate_bitmask, allowed_ids, bit_is_set
from weft.grammars.manager import GrammarError, GrammarManager, RequestGrammar
from weft.grammars.spec import JSON_WHITESPACE_MAX, InvalidSpec, choices_spec, parse_spec

from .conftest import QWEN_END_IDS, QWEN_VOCAB

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOL_TAG = {
    "structures": [
        {
            "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
            "schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "end": "}\n</tool_call>",
        }
    ],
    "triggers": ["<tool_call>"],
    "free_text": False,
    "at_least_one": True,
}
# (spec, an output in the language, an output that leaves it)
CASES = {
    "json_schema": (
        parse_spec("json_schema", json.dumps(SCHEMA)),
        '{"name": "Ann", "age": 31, "tags": ["b"]}',
        '{"name": "Ann", "age": 1, "tags": ["c"]}',
    ),
    "regex": (parse_spec("regex", r"(yes|no)-[0-9]{2}"), "no-42", "maybe"),
    "ebnf": (
        parse_spec("ebnf", 'root ::= "(" digits ")" \ndigits ::= [0-9]+'),
        "(1234)",
        "(12a",
    ),
    "choices": (choices_spec(["red apple", "green (pear)"]), "green (pear)", "blue"),
    "structural_tag": (
        parse_spec("structural_tag", json.dumps(TOOL_TAG)),
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time"',
    ),
}
SUPPORTED = {
    "xgrammar": set(CASES),
    "llguidance": set(CASES),
    "outlines": set(CASES) - {"ebnf"},
}


@pytest.fixture(scope="module")
def managers(qwen_vocab):
    made = {name: GrammarManager(lambda: qwen_vocab, order=[name]) for name in SUPPORTED}
    yield made
    for manager in made.values():
        manager.shutdown()


def _walk(manager, grammar, tokenizer, text):
    """Feed `text` token by token; return the index of the first token the mask forbids, or
    None if all pass. Checks end tokens: forbidden before the end of a complete output."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bitmask = allocate_bitmask(1, QWEN_VOCAB)
    for i, tid in enumerate(ids):
        manager.fill([grammar], bitmask, [0])
        if not bit_is_set(bitmask, 0, tid):
            return i
        assert grammar.accept(tid)
    manager.fill([grammar], bitmask, [0])
    return None if bit_is_set(bitmask, 0, QWEN_END_IDS[0]) else len(ids)


@pytest.mark.parametrize("backend", list(SUPPORTED))
@pytest.mark.parametrize("kind", list(CASES))
def test_masks_follow_the_grammar(managers, qwen_tokenizer, backend, kind):
    spec, good, bad = CASES[kind]
    manager = managers[backend]
    if kind not in SUPPORTED[backend]:
        with pytest.raises(GrammarError, match="cannot compile"):
            manager.compile(spec)
        return
    compiled = manager.compile(spec)
    assert compiled.backend.name == backend
    grammar = RequestGrammar(compiled, QWEN_END_IDS)
    assert _walk(manager, grammar, qwen_tokenizer, good) is None
    assert grammar.accept(QWEN_END_IDS[0]) and grammar.ended
    # the bad output is refused at some token (before its end)
    fresh = RequestGrammar(compiled, QWEN_END_IDS)
    stop = _walk(manager, fresh, qwen_tokenizer, bad)
    assert stop is not None and stop < len(qwen_tokenizer.encode(bad, add_special_tokens=False))


@pytest.mark.parametrize("backend", list(SUPPORTED))
def test_tool_call_arguments_hold_whitespace_runs_to_the_json_bound(
    managers, qwen_tokenizer, backend
):
    # unbounded, a small model fills its context with newlines inside the arguments
    compiled = managers[backend].compile(CASES["structural_tag"][0])
    head = '<tool_call>\n{"name": "get_weather", "arguments": {'
    for run, allowed in ((JSON_WHITESPACE_MAX, True), (JSON_WHITESPACE_MAX + 1, False)):
        grammar = RequestGrammar(compiled, QWEN_END_IDS)
        text = head + " " * run + '"city": "Oslo"}}\n</tool_call>'
        stop = _walk(managers[backend], grammar, qwen_tokenizer, text)
        assert (stop is None) == allowed, (run, stop)


@pytest.mark.parametrize("backend", list(SUPPORTED))
def test_compact_json_holds_tool_call_arguments_too(qwen_vocab, qwen_tokenizer, backend):
    # --constrained-json-disable-any-whitespace: the arguments on one line, as any JSON (at
    # most outlines-core's one optional space in a gap)
    manager = GrammarManager(lambda: qwen_vocab, order=[backend], compact_json=True)
    try:
        compiled = manager.compile(CASES["structural_tag"][0])
        head = '<tool_call>\n{"name": "get_weather", "arguments": {'
        for gap, allowed in (("", True), ("  ", False), ("\n", False)):
            grammar = RequestGrammar(compiled, QWEN_END_IDS)
            text = head + gap + '"city": "Oslo"}}\n</tool_call>'
            stop = _walk(manager, grammar, qwen_tokenizer, text)
            assert (stop is None) == allowed, (gap, stop)
    finally:
        manager.shutdown()


@pytest.mark.parametrize("backend", list(SUPPORTED))
def test_end_tokens_only_where_the_grammar_may_end(managers, backend):
    manager = managers[backend]
    grammar = RequestGrammar(manager.compile(CASES["regex"][0]), QWEN_END_IDS)
    bitmask = allocate_bitmask(1, QWEN_VOCAB)
    manager.fill([grammar], bitmask, [0])
    assert not any(bit_is_set(bitmask, 0, e) for e in QWEN_END_IDS)
    for tid in _ids(manager, "yes-07"):
        assert grammar.accept(tid)
    manager.fill([grammar], bitmask, [0])
    assert allowed_ids(bitmask, 0, QWEN_VOCAB) == QWEN_END_IDS  # complete: only the end


def _ids(manager, text):
    return manager.vocab.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_rollback_restores_the_mask(managers, backend):
    manager = managers[backend]
    grammar = RequestGrammar(manager.compile(CASES["json_schema"][0]), QWEN_END_IDS)
    bitmask = allocate_bitmask(2, QWEN_VOCAB)
    ids = _ids(manager, '{"name": "Ann", "age": 3')
    for tid in ids[:3]:
        assert grammar.accept(tid)
    manager.fill([grammar], bitmask, [0])
    for tid in ids[3:]:
        assert grammar.accept(tid)
    grammar.rollback(len(ids) - 3)
    manager.fill([grammar], bitmask, [1])
    assert bool((bitmask[0] == bitmask[1]).all())


@pytest.mark.parametrize("backend", list(SUPPORTED))
def test_requests_of_one_compiled_grammar_start_apart(managers, backend):
    """Matchers of one compiled (cached) grammar: each starts at the grammar's start, however
    far another went (llguidance's are copies of one built at compile time)."""
    manager = managers[backend]
    compiled = manager.compile(CASES["json_schema"][0])
    first = RequestGrammar(compiled, QWEN_END_IDS)
    bitmask = allocate_bitmask(2, QWEN_VOCAB)
    manager.fill([first], bitmask, [0])
    for tid in _ids(manager, '{"name": "Ann"'):
        assert first.accept(tid)
    second = RequestGrammar(compiled, QWEN_END_IDS)
    manager.fill([second], bitmask, [1])
    assert bool((bitmask[0] == bitmask[1]).all())
    assert first.accept(_ids(manager, ",")[0]) and not second.accept(_ids(manager, ",")[0])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_jump_forward_returns_the_forced_text(managers, backend):
    manager = managers[backend]
    grammar = RequestGrammar(manager.compile(CASES["structural_tag"][0]), QWEN_END_IDS)
    forced = grammar.jump_forward()
    # nothing is free before the arguments object: the whole begin string is forced
    assert forced.startswith(b'<tool_call>\n{"name": "get_weather", "arguments": {')
    for tid in _ids(manager, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}'):
        assert grammar.accept(tid)
    assert grammar.jump_forward() == b"}\n</tool_call>"


def test_chain_falls_back_and_says_why(qwen_vocab):
    ebnf = CASES["ebnf"][0]
    manager = GrammarManager(lambda: qwen_vocab, order=["outlines", "llguidance"])
    try:
        compiled = manager.submit(ebnf).result(timeout=60)
    finally:
        manager.shutdown()
    assert compiled.backend.name == "llguidance"
    assert compiled.refused == [
        "outlines: outlines-core cannot compile EBNF (context-free) grammars"
    ]


def test_compile_timeout_passes_the_spec_on(qwen_vocab):
    # outlines-core builds a token automaton for a long regex in seconds; 20 ms is too little
    spec = parse_spec(
        "regex", "(" + "|".join(f"item-{i:04d}-[a-z]{{3,9}}" for i in range(400)) + ")"
    )
    manager = GrammarManager(lambda: qwen_vocab, order=["outlines", "llguidance"], timeout_s=0.1)
    try:
        for name in manager.order:  # built outside the timed compiles
            manager._backend(name)
        compiled = manager.submit(spec).result(timeout=120)
    finally:
        manager.shutdown()
    # llguidance compiles lazily (an Earley parser): milliseconds for the same regex
    assert compiled.backend.name == "llguidance"
    assert compiled.refused == ["outlines: compile timed out after 0.1 s"]


def test_every_backend_refusing_is_one_error_naming_each(qwen_vocab):
    manager = GrammarManager(lambda: qwen_vocab, order=["xgrammar", "llguidance", "outlines"])
    try:
        with pytest.raises(GrammarError) as err:
            manager.compile(parse_spec("regex", "(unclosed"))
    finally:
        manager.shutdown()
    message = str(err.value)
    assert message.startswith("cannot compile the regex: xgrammar: ")
    assert "; llguidance: " in message and "; outlines: " in message


def test_compiled_grammars_are_cached(managers):
    manager = managers["xgrammar"]
    spec = parse_spec(
        "json_schema", json.dumps({"type": "object", "properties": {"k": {"type": "string"}}})
    )
    first = manager.compile(spec)
    # NOTE: the fastest of a few: one lookup can be preempted on a loaded machine (parallel test
    # workers), while a recompile is slow every time
    times = []
    for _ in range(3):
        start = time.perf_counter()
        second = manager.compile(spec)
        times.append(time.perf_counter() - start)
        assert second.grammar is first.grammar
    assert min(times) < 0.05, times


@pytest.mark.parametrize(
    ("field", "text", "message"),
    [
        ("json_schema", "{not json", "json_schema is not valid JSON"),
        ("json_schema", '{"type": "strange"}', "json_schema is not a valid JSON schema"),
        ("json_schema", "[1, 2]", "json_schema must be a JSON object"),
        ("json_schema", '{"items":' * 70 + "{}" + "}" * 70, "nested too deeply"),
        ("structural_tag", '{"structures": []}', "structures must be a non-empty list"),
        ("regex", "   ", "regex is empty"),
    ],
)
def test_bad_specs_name_the_problem(field, text, message):
    with pytest.raises(InvalidSpec, match=message):
        parse_spec(field, text)


def test_spec_keeps_property_order():
    # generation follows the schema's property order: canonical text must not sort keys
    spec = parse_spec("json_schema", '{"properties": {"zeta": {}, "alpha": {}}}')
    assert spec.text.index("zeta") < spec.text.index("alpha")


def test_sentencepiece_vocab_through_every_backend(stories_tokenizer):
    from weft.grammars.vocab import TokenVocab

    vocab = TokenVocab.from_tokenizer(stories_tokenizer, 512, [2])
    spec = parse_spec("regex", r" Once upon a (time|day)\.")
    for name in ("xgrammar", "llguidance", "outlines"):
        manager = GrammarManager(lambda: vocab, order=[name])
        try:
            grammar = RequestGrammar(manager.compile(spec), [2])
            bitmask = allocate_bitmask(1, 512)
            ids = stories_tokenizer.encode("Once upon a day.", add_special_tokens=False)
            for tid in ids:
                manager.fill([grammar], bitmask, [0])
                assert bit_is_set(bitmask, 0, tid), (name, tid)
                assert grammar.accept(tid)
            manager.fill([grammar], bitmask, [0])
            assert allowed_ids(bitmask, 0, 512) == [2], name
        finally:
            manager.shutdown()


@pytest.mark.parametrize(
    ("backend", "schema", "keyword"),
    [
        ("outlines", {"type": "integer", "minimum": 5}, "minimum"),
        ("outlines", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ("xgrammar", {"type": "array", "uniqueItems": True}, "uniqueItems"),
        ("xgrammar", {"allOf": [{"required": ["a"]}, {"required": ["b"]}]}, "allOf"),
    ],
)
def test_backends_refuse_keywords_they_would_not_enforce(managers, backend, schema, keyword):
    # measured: these backends compile the keyword but let violating instances through
    with pytest.raises(GrammarError, match=f"does not enforce {keyword}"):
        managers[backend].compile(parse_spec("json_schema", json.dumps(schema)))


def test_set_bits_rows_sets_and_clears_per_row():
    from weft.grammars.bitmask import set_bits_rows

    bitmask = allocate_bitmask(3, 96)
    bitmask[1].zero_()
    ids = [33, 34, 95]  # 33 and 34 share a word
    set_bits_rows(bitmask, [0, 1, 2], ids, [False, True, False])
    assert [t for t in ids if bit_is_set(bitmask, 0, t)] == []
    assert [t for t in ids if bit_is_set(bitmask, 1, t)] == ids
    assert allowed_ids(bitmask, 1, 96) == ids  # nothing else was set
    assert len(allowed_ids(bitmask, 2, 96)) == 96 - 3  # nothing else was cleared


@pytest.mark.parametrize("text", ["root ::= undefined_rule", "this is not a grammar"])
def test_a_bad_ebnf_is_refused_by_every_backend_with_its_reason(stories_tokenizer, text):
    from weft.grammars.manager import GrammarError, GrammarManager
    from weft.grammars.spec import parse_spec
    from weft.grammars.vocab import TokenVocab

    manager = GrammarManager(
        lambda: TokenVocab.from_tokenizer(stories_tokenizer, 512, [2]),
        order=["xgrammar", "llguidance", "outlines"],
        timeout_s=30,
    )
    try:
        with pytest.raises(GrammarError) as err:
            manager.compile(parse_spec("ebnf", text))
    finally:
        manager.shutdown()
    message = str(err.value)
    assert message.startswith("cannot compile the ebnf: xgrammar: ")
    assert "; llguidance: not a valid EBNF grammar: " in message
    assert "; outlines: outlines-core cannot compile EBNF" in message


def _grammars_at_three_points(manager, tokenizer, kinds):
    """A grammar per kind and cut: at the start of its output, inside it, where it may end."""
    grammars = []
    for kind in sorted(kinds):
        spec, good, _ = CASES[kind]
        ids = tokenizer.encode(good, add_special_tokens=False)
        for cut in (0, len(ids) // 2, len(ids)):
            grammar = RequestGrammar(manager.compile(spec), QWEN_END_IDS)
            for tid in ids[:cut]:
                assert grammar.accept(tid)
            grammars.append(grammar)
    return grammars


@pytest.mark.parametrize("backend", [*SUPPORTED, "all at once"])
def test_a_batched_fill_equals_row_by_row_fills(managers, qwen_tokenizer, backend):
    """Grammars some tokens into their outputs, filled in one call (each backend's parallel
    batch; the backends' batches side by side) into scattered rows: every row, with its
    end-token bits, as filled alone."""
    names = list(SUPPORTED) if backend == "all at once" else [backend]
    grammars = [
        g
        for name in names
        for g in _grammars_at_three_points(managers[name], qwen_tokenizer, SUPPORTED[name])
    ]
    rows = [2 * i + i % 2 for i in range(len(grammars))]
    manager = managers[names[0]]
    batched = allocate_bitmask(2 * len(rows) + 1, QWEN_VOCAB)
    manager.fill(grammars, batched, rows)
    for grammar, row in zip(grammars, rows, strict=True):
        alone = allocate_bitmask(1, QWEN_VOCAB)
        manager.fill([grammar], alone, [0])
        assert torch.equal(batched[row], alone[0]), (grammar.backend_name, row)
    ends = sum(len(SUPPORTED[name]) for name in names)  # one cut per kind is a whole output
    assert sum(bit_is_set(batched, r, QWEN_END_IDS[0]) for r in rows) == ends
