"""llguidance: JSON schema, regex, EBNF (GBNF through Lark), choices, structural tags without
free text. Compiles in milliseconds (an Earley parser over a lexer, nothing precomputed)."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from weft.grammars.base import FILL_THREADS, GrammarBackend, GrammarUnsupported, Matcher
from weft.grammars.ebnf import choices_lark, ebnf_literal
from weft.grammars.schema_keywords import (
    LLGUIDANCE,
    MAX_LISTED,
    describe,
    spec_oneofs_disjoint,
    spec_refusals,
    spec_schemas,
)
from weft.grammars.schema_order import optional_keys_last, optional_keys_last_text
from weft.grammars.schema_walk import locate
from weft.grammars.spec import JSON_WHITESPACE, GrammarSpec
from weft.grammars.vocab import TokenVocab

try:
    from llguidance.gbnf_to_lark import gbnf_to_lark as _gbnf_to_lark
except ImportError:  # pragma: no cover - the backend is then unavailable anyway
    _gbnf_to_lark = None  # type: ignore[assignment]

# Whitespace as the other backends allow it (spec.JSON_WHITESPACE), around bare separators; or
# compact JSON (", " and ": ").
JSON_OPTIONS: Any = dict(whitespace_pattern=JSON_WHITESPACE, item_separator=",", key_separator=":")
COMPACT_JSON_OPTIONS: Any = dict(whitespace_flexible=False, item_separator=", ", key_separator=": ")


def _one_of_as_any_of(spec: GrammarSpec) -> bool:
    """llguidance refuses a oneOf it cannot prove disjoint, unless told to read it as anyOf:
    exact where weft proves it disjoint (a tagged union, say)."""
    return (
        spec.kind == "json_schema"
        and '"oneOf"' in spec.text
        and spec_oneofs_disjoint(spec.kind, spec.value)
    )


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")


def _located(spec: GrammarSpec, message: str) -> str:
    """llguidance's error, with the pointers of the keywords it says it does not implement."""
    message = message.strip().splitlines()[0][:500] if message.strip() else "invalid grammar"
    match = _UNIMPLEMENTED.search(message)
    if match is None:
        return message
    try:
        keys = json.loads(match.group(1))
    except ValueError:
        return message
    schemas = spec_schemas(spec.kind, spec.value)
    pointers = [p for k in keys for base, s in schemas for p in locate(s, str(k), base=base)]
    return f"{message} (at {', '.join(pointers[:MAX_LISTED])})" if pointers else message


# llguidance spells a forced special token as 0xFF "[id]" in forced bytes
_TOKEN_REF = re.compile(rb"\xff\[(\d+)\]")


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher: Any, vocab: TokenVocab) -> None:
        self.inner = matcher
        self.vocab = vocab

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # NOTE: a fresh view per row: the row pointer and its size in bytes
        target = bitmask[row]
        self.inner.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def can_end(self, bitmask: torch.Tensor, row: int) -> bool:
        return bool(self.inner.is_accepting())

    def accept(self, token: int) -> bool:
        # NOTE: consume_token on a forbidden token puts the matcher in a permanent error state
        return bool(self.inner.try_consume_tokens([token]) == 1)

    def rollback(self, n: int) -> None:
        if n:
            self.inner.rollback(n)

    def is_terminated(self) -> bool:
        return bool(self.inner.is_stopped())

    def jump_forward(self) -> bytes:
        parts = _TOKEN_REF.split(bytes(self.inner.compute_ff_bytes()))
        out = parts[0]
        for ref, text in zip(parts[1::2], parts[2::2], strict=True):  # text, id, text, id, ...
            token = self.vocab.token_bytes[int(ref)]
            if token is None:
                break  # a control token: the forced text stops before it
            out += token + text
        return out


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, vocab: TokenVocab, compact_json: bool = False) -> None:
        super().__init__(vocab, compact_json)
        import llguidance

        self.llg = llguidance
        if vocab.tokenizer is None or not hasattr(vocab.tokenizer, "backend_tokenizer"):
            raise GrammarUnsupported("llguidance needs a fast (tokenizers) tokenizer")
        backend = vocab.tokenizer.backend_tokenizer
        # NOTE: llguidance reads tokenizer.json itself (byte-level and SentencePiece alike)
        self.tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab.size, eos_token=list(vocab.end_ids)
        )
        # NOTE: llguidance reads every added token as special: text that spells one that has
        # text (Qwen's "<tool_call>", Mistral's "[TOOL_CALLS]": vocab.py) must name the token in
        # a grammar, not its characters.
        self.added_texts = {
            t.content: tid
            for tid, t in vocab.tokenizer.added_tokens_decoder.items()
            if tid < vocab.size and vocab.token_bytes[tid] is not None
        }
        self._executor: Any = None

    def compile(self, spec: GrammarSpec) -> Any:
        found = spec_refusals(spec.kind, spec.value, LLGUIDANCE)
        if found:
            raise GrammarUnsupported(describe(found))
        grammar = self._grammar(spec)
        is_error, messages = self.llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            raise GrammarUnsupported(_located(spec, messages[0]) if messages else "invalid grammar")
        warnings = [m for m in messages if not self._harmless(spec, m)]
        if warnings:  # what it says it does not do, it lets through
            raise GrammarUnsupported(f"llguidance warned: {warnings[0][:500]}")
        # NOTE: a matcher built from the grammar's text parses it and builds its lexer again:
        # 1-19 ms, which on the scheduler thread stalled every running request once per new
        # constrained request. One is built here (on the compile thread) and never advanced;
        # each request's is a copy of it (~20 us).
        template = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarUnsupported(template.get_error()[:500])
        return template

    @staticmethod
    def _harmless(spec: GrammarSpec, warning: str) -> bool:
        """A warning about nothing lost: oneOf read as anyOf where weft proved the branches
        disjoint (and asked for it: `_json_options`)."""
        return warning.startswith("oneOf not fully supported") and _one_of_as_any_of(spec)

    def _grammar(self, spec: GrammarSpec) -> str:
        M = self.llg.LLMatcher
        try:
            if spec.kind in ("json_schema", "json_object"):
                layout = COMPACT_JSON_OPTIONS if self.compact_json else JSON_OPTIONS
                options: Any = {**layout, "coerce_one_of": _one_of_as_any_of(spec)}
                text = optional_keys_last_text(spec.text, spec.value)
                return str(M.grammar_from_json_schema(text, overrides=options))
            if spec.kind == "regex":
                return str(M.grammar_from_regex(spec.text))
            if spec.kind == "ebnf":
                if _gbnf_to_lark is None:
                    raise GrammarUnsupported("this llguidance has no GBNF reader")
                try:
                    lark = _gbnf_to_lark(spec.text)
                except Exception as exc:  # NOTE: the converter raises bare Exception subclasses
                    raise GrammarUnsupported(f"not a valid EBNF grammar: {exc}") from None
                return str(M.grammar_from_lark(lark))
            if spec.kind == "choices":
                return str(M.grammar_from_lark(choices_lark(spec.value)))
            if spec.kind == "structural_tag":
                return str(M.grammar_from_lark(self._structural_lark(spec.value)))
        except (ValueError, RuntimeError) as exc:
            raise GrammarUnsupported(str(exc).splitlines()[0][:500]) from None
        raise GrammarUnsupported(f"llguidance does not compile {spec.kind}")

    def fill_many(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill several rows in one call, spread over llguidance's threads (without the GIL)."""
        if self._executor is None:
            self._executor = self.llg.LLExecutor(FILL_THREADS)
        # NOTE: the executor writes row K at data_ptr + K * row bytes: rows of one contiguous
        # int32 tensor, as allocate_bitmask makes them (a row slice of it stays contiguous)
        assert bitmask.is_contiguous() and bitmask.dtype == torch.int32 and not bitmask.is_cuda
        pairs = [(m.inner, row) for m, row in zip(matchers, rows, strict=True)]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )

    def matcher(self, compiled: Any) -> Matcher:
        """A copy of the compile's pristine matcher (`compile`): the grammar's start state."""
        return LLGuidanceMatcher(compiled.deep_copy(), self.vocab)

    def _lark_text(self, text: str) -> str:
        """A Lark sequence spelling `text`, with added tokens as token references."""
        parts: list[str] = []
        rest = text
        while rest:
            hits = [(rest.find(t), t) for t in self.added_texts if t in rest]
            if not hits:
                parts.append(ebnf_literal(rest))
                break
            at, token = min(hits)
            if at:
                parts.append(ebnf_literal(rest[:at]))
            parts.append(f"<[{self.added_texts[token]}]>")
            rest = rest[at + len(token) :]
        return " ".join(parts) if parts else '""'

    def _structural_lark(self, tag: dict[str, Any]) -> str:
        if tag["free_text"]:
            raise GrammarUnsupported(
                "llguidance: free text around structures is not supported here"
            )
        calls = []
        for i, s in enumerate(tag["structures"]):
            begin, end = self._lark_text(s["begin"]), self._lark_text(s["end"])
            # NOTE: the JSON layout travels in the schema: %json takes no overrides
            layout = COMPACT_JSON_OPTIONS if self.compact_json else JSON_OPTIONS
            schema = {**optional_keys_last(s["schema"]), "x-guidance": layout}
            calls.append(f"call_{i}: {begin} %json {json.dumps(schema)} {end}")
        alternatives = " | ".join(f"call_{i}" for i in range(len(calls)))
        sep = self._lark_text(tag["separator"])
        body = f"call ({sep} call)*" if tag["repeat"] else "call"
        start = f"start: {body}" if tag["at_least_one"] else f"start: ({body})?"
        return "\n".join([start, f"call: {alternatives}", *calls])
