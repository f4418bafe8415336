"""The pieces behind "no silent weakening" (grammars/schema_keywords.py and the backends): JSON
pointers, the $ref analysis, the oneOf proof, xgrammar's length rewrite and its warnings, and
the refusals of specs other than a plain schema (structural tags, regexes)."""

from __future__ import annotations

import json
import os

import pytest

from weft.grammars.manager import GrammarError, GrammarManager
from weft.grammars.schema_keywords import LLGUIDANCE, XGRAMMAR, oneof_disjoint, refusals
from weft.grammars.schema_rules import regex_features
from weft.grammars.spec import parse_spec


def _refused(schema, profile=LLGUIDANCE) -> list[str]:
    return [f"{r.keyword} at {r.pointer}" for r in refusals(schema, profile)]


def test_pointers_escape_names_and_follow_refs_to_their_targets():
    schema = {
        "type": "object",
        "properties": {"a/b": {"type": "array", "uniqueItems": True}, "c~d": {"$ref": "#/$defs/x"}},
        "$defs": {"x": {"type": "array", "contains": {}}, "unused": {"not": {}}},
    }
    assert _refused(schema, XGRAMMAR) == [
        "uniqueItems at /properties/a~1b/uniqueItems",
        "contains at /$defs/x/contains",  # reached through /properties/c~0d/$ref
    ]


@pytest.mark.parametrize(
    ("schema", "unfounded"),
    [
        # a tree: the recursion is optional
        ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}, []),
        # null ends it
        ({"type": ["object", "null"], "properties": {"n": {"$ref": "#"}}, "required": ["n"]}, []),
        # one anyOf branch ends it
        ({"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#"}}]}, []),
        # an array that must hold one of itself
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, ["/items/$ref"]),
        ({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}, ["/prefixItems/0/$ref"]),
        # allOf of itself, and a ref to a ref to itself
        ({"allOf": [{"$ref": "#"}]}, ["/allOf/0/$ref"]),
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, ["/$ref", "/$defs/a/$ref"]),
        # a required property an additionalProperties cycle must fill
        (
            {"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#"}},
            ["/additionalProperties/$ref"],
        ),
        # a cycle nobody refers to is no refusal
        ({"type": "integer", "$defs": {"a": {"$ref": "#/$defs/a"}}}, []),
    ],
)
def test_a_ref_cycle_is_refused_only_without_a_base_case(schema, unfounded):
    assert _refused(schema) == [f"$ref at {p}" for p in unfounded]


@pytest.mark.parametrize(
    ("branches", "disjoint"),
    [
        ([{"type": "integer"}, {"type": "string"}], True),
        ([{"type": "integer"}, {"type": "number"}], False),  # 1 matches both
        ([{"const": 1}, {"const": 1.0}], False),  # one value
        ([{"enum": ["a", "b"]}, {"enum": ["c"]}], True),
        ([{"type": "string", "maxLength": 3}, {"type": "string", "minLength": 2}], False),
        (
            [
                {"type": "object", "properties": {"t": {"const": "a"}}, "required": ["t"]},
                {"type": "object", "properties": {"t": {"const": "b"}}, "required": ["t"]},
            ],
            True,
        ),
        (  # the tag is optional in one branch: {} matches both
            [
                {"type": "object", "properties": {"t": {"const": "a"}}, "required": ["t"]},
                {"type": "object", "properties": {"t": {"const": "b"}}},
            ],
            False,
        ),
    ],
)
def test_oneof_disjoint(branches, disjoint):
    assert oneof_disjoint({"oneOf": branches}) is disjoint
    refs = {"$defs": {f"b{i}": b for i, b in enumerate(branches)}}
    refs["oneOf"] = [{"$ref": f"#/$defs/b{i}"} for i in range(len(branches))]
    assert oneof_disjoint(refs) is disjoint


@pytest.mark.parametrize(
    ("pattern", "features"),
    [
        ("^[a-z]+$", set()),
        (r"^\^a\$$", set()),
        ("^[$^]+$", set()),
        ("^(?!a)b$", {"lookaround"}),
        ("a(?<=a)", {"lookaround"}),
        ("(?:a|b)", set()),
        ("a^b", {"inner anchor"}),
        ("a|^b", {"inner anchor"}),
        ("a$|b", {"inner anchor"}),
        ("^.{1,128}$", set()),
        ("^.{1,129}$", {"JSON escaping of the repetition {1,129}"}),
        (r"^\{1,200}[a-z]{3,200}$", {"JSON escaping of the repetition {3,200}"}),
        ("^[{1,200}]$", set()),
    ],
)
def test_regex_features(pattern, features):
    assert regex_features(pattern) == features


def test_exact_lengths_rewrites_only_plain_length_bounded_strings():
    from weft.grammars.xgrammar_backend import JSON_CHAR, exact_lengths

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "minLength": 1, "maxLength": 4},
            "b": {"type": ["string", "null"], "maxLength": 2, "enum": ["x", None]},
            "c": {"type": "string", "format": "date", "maxLength": 10},
            "d": {"type": "integer", "maxLength": 3},
        },
        "propertyNames": {"minLength": 1},
        "$defs": {"e": {"type": "string", "minLength": 5}},
    }
    rewritten = exact_lengths(schema)
    properties = rewritten["properties"]
    assert properties["a"] == {"type": "string", "pattern": f"^{JSON_CHAR}{{1,4}}$"}
    assert properties["b"] == {
        "type": ["string", "null"],
        "enum": ["x", None],
        "pattern": f"^{JSON_CHAR}{{0,2}}$",
    }
    assert properties["c"] == schema["properties"]["c"]  # refused beside a format instead
    assert properties["d"] == schema["properties"]["d"]  # not a string
    assert rewritten["propertyNames"] == {"pattern": f"^{JSON_CHAR}{{1,}}$"}  # keys are strings
    assert rewritten["$defs"]["e"] == {"type": "string", "pattern": f"^{JSON_CHAR}{{5,}}$"}
    assert schema["properties"]["a"]["maxLength"] == 4  # a copy
    plain = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert exact_lengths(plain) is plain


def test_xgrammar_warnings_are_caught_and_passed_on(capfd):
    from weft.grammars.xgrammar_backend import STDERR_TAP, with_warnings

    warning = b"[04:16:44] /project/cpp/json_schema_converter.cc:1161: Warning: ignoring it\n"

    def convert() -> int:
        os.write(2, warning)
        os.write(2, b"a line of another thread\n")
        return 7

    assert with_warnings(convert) == (7, ["ignoring it"])
    # two conversions at once: each sees what was written while it ran
    first = STDERR_TAP.start()
    os.write(2, b"one\n")
    second = STDERR_TAP.start()
    os.write(2, warning)
    assert STDERR_TAP.stop(first) == b"one\n" + warning
    os.write(2, b"two\n")
    assert STDERR_TAP.stop(second) == warning + b"two\n"
    os.write(2, b"after\n")  # fd 2 is stderr again
    assert capfd.readouterr().err == (
        f"{warning.decode()}a line of another thread\none\n{warning.decode()}two\nafter\n"
    )


@pytest.fixture(scope="module")
def stories_vocab(stories_tokenizer):
    from weft.grammars.vocab import TokenVocab

    return TokenVocab.from_tokenizer(stories_tokenizer, 512, [2])


def _compile(vocab, order, field, value):
    manager = GrammarManager(lambda: vocab, order=order)
    try:
        return manager.compile(parse_spec(field, value))
    finally:
        manager.shutdown()


def test_a_regex_xgrammar_would_weaken_is_refused(stories_vocab):
    # xgrammar ignores a ^ inside a regex, and says so: "ab" would match a^b
    with pytest.raises(GrammarError) as err:
        _compile(stories_vocab, ["xgrammar", "llguidance"], "regex", "a^b")
    message = str(err.value)
    assert message.startswith(
        "cannot compile the regex: xgrammar: xgrammar warned that it does not enforce the regex: "
    )
    assert "'^' should be at the start of the regex, but found in the middle" in message
    assert "; llguidance: " in message


TOOL = {
    "structures": [
        {
            "begin": '<tool_call>{"name": "lookup", "arguments": ',
            "schema": {
                "type": "object",
                "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 3}},
                "required": ["code"],
            },
            "end": "}</tool_call>",
        }
    ],
    "triggers": ["<tool_call>"],
}


def test_a_structural_tag_schema_is_checked_with_its_pointer(stories_vocab):
    with pytest.raises(GrammarError) as err:
        _compile(stories_vocab, ["xgrammar", "llguidance"], "structural_tag", json.dumps(TOOL))
    assert str(err.value).startswith(
        "cannot compile the structural_tag: xgrammar: xgrammar does not enforce maxLength at "
        "/structures/0/schema/properties/code/maxLength: it drops minLength/maxLength beside "
        "pattern; llguidance: "
    )
    # without free text around the calls, llguidance serves it
    tag = json.dumps({**TOOL, "free_text": False})
    compiled = _compile(stories_vocab, ["xgrammar", "llguidance"], "structural_tag", tag)
    assert compiled.backend.name == "llguidance"
    assert compiled.refused[0].startswith("xgrammar: xgrammar does not enforce maxLength at ")


@pytest.mark.parametrize(
    ("lengths", "refused"),
    [
        ({"minLength": 1, "maxLength": 128}, None),
        ({"maxLength": 127}, None),
        ({"minLength": 127}, None),
        (
            {"maxLength": 128},
            "xgrammar passes on maxLength at /properties/a/maxLength: a length range {0,128} "
            "wider than 127 costs it ~80 ms a mask",
        ),
        (
            {"minLength": 128},
            "xgrammar passes on minLength at /properties/a/minLength: a length range {128,} "
            "wider than 127 costs it ~80 ms a mask",
        ),
        ({"maxLength": 500, "pattern": "^a+$"}, "does not enforce"),  # lengths_beside's case
    ],
)
def test_xgrammar_passes_wide_length_ranges_on(lengths, refused):
    from weft.grammars.schema_keywords import XGRAMMAR, describe, spec_refusals

    schema = {"type": "object", "properties": {"a": {"type": "string", **lengths}}}
    found = describe(spec_refusals("json_schema", schema, XGRAMMAR))
    if refused is None:
        assert found == ""
    else:
        assert refused in found and ("passes on" in found) == ("passes on" in refused)
