"""outlines-core: JSON schema (through a regex), regex, choices, structural tags without free
text. A regex compiles to a token-level automaton over the whole vocabulary: compiling is slow
(seconds for large schemas) but a mask is a table lookup. It has no EBNF (context-free) support.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from weft.grammars.base import GrammarBackend, GrammarUnsupported, Matcher
from weft.grammars.ebnf import choices_regex, regex_escape
from weft.grammars.schema_keywords import OUTLINES, describe, spec_refusals
from weft.grammars.spec import JSON_WHITESPACE, GrammarSpec
from weft.grammars.vocab import TokenVocab

MAX_ROLLBACK = 64  # tokens a matcher can undo (jump-forward re-tokenizes a few at most)


class OutlinesMatcher(Matcher):
    def __init__(self, guide: Any, index: Any) -> None:
        self.guide = guide
        self.index = index
        self.ended = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # NOTE: writes numel int32 words at the row's address: the row must be contiguous
        target = bitmask[row]
        self.guide.write_mask_into(target.data_ptr(), target.numel(), 4)

    def can_end(self, bitmask: torch.Tensor, row: int) -> bool:
        return bool(self.index.is_final_state(self.guide.get_state()))

    def accept(self, token: int) -> bool:
        if not self.guide.accepts_tokens([token]):
            return False
        self.guide.advance(token, return_tokens=False)
        return True

    def rollback(self, n: int) -> None:
        if n:
            self.guide.rollback_state(n)

    def is_terminated(self) -> bool:
        return bool(self.guide.is_finished()) and not self.guide.get_tokens()


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, vocab: TokenVocab, compact_json: bool = False) -> None:
        super().__init__(vocab, compact_json)
        # compact: outlines-core's own, a space or none around separators
        self._whitespace = None if compact_json else JSON_WHITESPACE
        import outlines_core

        self.oc = outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.regex_from_schema = build_regex_from_schema
        tokens: dict[bytes, list[int]] = {}
        for tid, piece in enumerate(vocab.token_bytes):
            if piece:
                tokens.setdefault(piece, []).append(tid)
        # NOTE: outlines-core knows one end token; weft's matcher wrapper handles all of them
        self.vocabulary = outlines_core.Vocabulary(vocab.end_ids[0], tokens)

    def compile(self, spec: GrammarSpec) -> Any:
        found = spec_refusals(spec.kind, spec.value, OUTLINES)
        if found:
            raise GrammarUnsupported(describe(found))
        regex = self._regex(spec)
        try:
            return self.oc.Index(regex, self.vocabulary)
        except (ValueError, RuntimeError) as exc:
            raise GrammarUnsupported(str(exc).splitlines()[0][:500]) from None

    def _regex(self, spec: GrammarSpec) -> str:
        if spec.kind == "ebnf":
            raise GrammarUnsupported("outlines-core cannot compile EBNF (context-free) grammars")
        try:
            if spec.kind in ("json_schema", "json_object"):
                return str(self.regex_from_schema(spec.text, self._whitespace))
            if spec.kind == "regex":
                return spec.text
            if spec.kind == "choices":
                return choices_regex(spec.value)
            if spec.kind == "structural_tag":
                return self._structural_regex(spec.value)
        except (ValueError, RuntimeError, TypeError, KeyError) as exc:
            raise GrammarUnsupported(str(exc).splitlines()[0][:500]) from None
        raise GrammarUnsupported(f"outlines-core does not compile {spec.kind}")

    def _structural_regex(self, tag: dict[str, Any]) -> str:
        if tag["free_text"]:
            raise GrammarUnsupported("outlines-core: free text around structures is not supported")
        calls = []
        for s in tag["structures"]:
            inner = self.regex_from_schema(json.dumps(s["schema"]), self._whitespace)
            calls.append(f"{regex_escape(s['begin'])}({inner}){regex_escape(s['end'])}")
        call = "(" + "|".join(calls) + ")"
        body = f"{call}({regex_escape(tag['separator'])}{call})*" if tag["repeat"] else call
        return body if tag["at_least_one"] else f"({body})?"

    def matcher(self, compiled: Any) -> Matcher:
        return OutlinesMatcher(self.oc.Guide(compiled, max_rollback=MAX_ROLLBACK), compiled)
