"""xgrammar: the default backend (JSON schema, regex, EBNF, choices, structural tags).

Its token masks come from a precomputed per-state cache, so filling a row costs microseconds; a
batch of rows is filled by one call on xgrammar's own thread pool.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from weft.grammars.base import GrammarBackend, GrammarUnsupported, Matcher, bit_is_set
from weft.grammars.ebnf import choices_ebnf
from weft.grammars.schema_keywords import XGRAMMAR_UNENFORCED, unenforced
from weft.grammars.spec import GrammarSpec
from weft.grammars.vocab import TokenVocab

# Threads xgrammar uses to fill a batch of masks (it parallelizes over rows).
FILL_THREADS = min(8, os.cpu_count() or 1)


class XGrammarMatcher(Matcher):
    def __init__(self, matcher: Any, end_id: int) -> None:
        self.inner = matcher
        self.end_id = end_id

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_next_token_bitmask(bitmask, row)

    def can_end(self, bitmask: torch.Tensor, row: int) -> bool:
        # xgrammar sets its stop tokens' bits exactly where the grammar may end
        return bit_is_set(bitmask, row, self.end_id)

    def accept(self, token: int) -> bool:
        return bool(self.inner.accept_token(token))

    def rollback(self, n: int) -> None:
        if n:
            self.inner.rollback(n)

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())

    def jump_forward(self) -> bytes:
        try:
            return str(self.inner.find_jump_forward_string()).encode()
        except UnicodeDecodeError:
            # NOTE: the forced bytes start inside a UTF-8 character (the last token ended
            # mid-character), which xgrammar cannot hand over as a str: no jump this step
            return b""


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, vocab: TokenVocab) -> None:
        super().__init__(vocab)
        import xgrammar

        self.xgr = xgrammar
        encoded = [piece if piece is not None else b"" for piece in vocab.token_bytes]
        # NOTE: xgrammar reads an empty token as a special token (never allowed by a grammar)
        self.info = xgrammar.TokenizerInfo(
            encoded,
            xgrammar.VocabType.RAW,
            vocab_size=vocab.size,
            stop_token_ids=vocab.end_ids,
        )
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self._batch: Any = None

    def compile(self, spec: GrammarSpec) -> Any:
        if spec.kind == "json_schema":
            refusal = unenforced(spec.value, "xgrammar", XGRAMMAR_UNENFORCED)
            if refusal:
                raise GrammarUnsupported(refusal)
        try:
            if spec.kind in ("json_schema", "json_object"):
                return self.compiler.compile_json_schema(
                    spec.text, any_whitespace=False, strict_mode=False
                )
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return self.compiler.compile_grammar(spec.text)
            if spec.kind == "choices":
                return self.compiler.compile_grammar(choices_ebnf(spec.value))
            if spec.kind == "structural_tag":
                return self.compiler.compile_structural_tag(json.dumps(_structural(spec.value)))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarUnsupported(_first_line(exc)) from None
        raise GrammarUnsupported(f"xgrammar does not compile {spec.kind}")

    def matcher(self, compiled: Any) -> Matcher:
        return XGrammarMatcher(self.xgr.GrammarMatcher(compiled), self.vocab.end_ids[0])

    def fill_many(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill several rows in one call (xgrammar spreads them over its threads)."""
        if self._batch is None:
            self._batch = self.xgr.BatchGrammarMatcher(FILL_THREADS)
        inner = [m.inner for m in matchers]  # type: ignore[attr-defined]
        self._batch.batch_fill_next_token_bitmask(inner, bitmask, rows)


def _structural(tag: dict[str, Any]) -> dict[str, Any]:
    """weft's structural tag (grammars/spec.py) -> xgrammar's structural-tag format."""
    tags = [
        {
            "type": "tag",
            "begin": s["begin"],
            "content": {"type": "json_schema", "json_schema": s["schema"]},
            "end": s["end"],
        }
        for s in tag["structures"]
    ]
    common = {"at_least_one": tag["at_least_one"], "stop_after_first": not tag["repeat"]}
    if tag["free_text"]:
        fmt = {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags, **common}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": tag["separator"], **common}
    return {"type": "structural_tag", "format": fmt}


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[20:07:34] /path/file.cc:83: "


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:500]
