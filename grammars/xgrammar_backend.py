"""xgrammar: the default backend (JSON schema, regex, EBNF, choices, structural tags).

Its token masks come from a precomputed per-state cache, so filling a row costs microseconds; a
batch of rows is filled by one call on xgrammar's own thread pool.

It compiles some JSON-schema keywords without enforcing them (schema_keywords.XGRAMMAR lists
them: it refuses those schemas), and it says so for a few more in warnings, caught here: a spec
it warns about is refused too.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from weft.grammars.base import (
    COMPILE_THREADS,
    FILL_THREADS,
    GrammarBackend,
    GrammarUnsupported,
    Matcher,
)
from weft.grammars.bitmask import bit_is_set, bits_set
from weft.grammars.ebnf import choices_ebnf
from weft.grammars.schema_keywords import (
    MAX_LISTED,
    XGRAMMAR,
    Refusal,
    describe,
    spec_oneofs_disjoint,
    spec_refusals,
    spec_schemas,
)
from weft.grammars.schema_order import optional_keys_last
from weft.grammars.schema_walk import locate, map_subschemas, subschemas, types_of
from weft.grammars.spec import JSON_WHITESPACE_MAX, GrammarSpec
from weft.grammars.vocab import TokenVocab

T = TypeVar("T")


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

    def __init__(self, vocab: TokenVocab, compact_json: bool = False) -> None:
        super().__init__(vocab, compact_json)
        import xgrammar

        self.xgr = xgrammar
        encoded = [piece if piece is not None else b"" for piece in vocab.token_bytes]
        # NOTE: xgrammar reads an empty token as a special token (never allowed by a grammar)
        self.info = xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=vocab.size, stop_token_ids=vocab.end_ids
        )
        self.compiler = xgrammar.GrammarCompiler(
            self.info, max_threads=COMPILE_THREADS, cache_enabled=False
        )
        self._batch: Any = None

    def compile(self, spec: GrammarSpec) -> Any:
        found = spec_refusals(spec.kind, spec.value, XGRAMMAR)
        if found:
            raise GrammarUnsupported(describe(found))
        try:
            grammar, warnings = with_warnings(lambda: self._grammar(spec))
            warnings = [w for w in warnings if not _harmless(spec, w)]
            if warnings:
                raise GrammarUnsupported(_warned(spec, warnings))
            return self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarUnsupported(_first_line(exc)) from None

    def _grammar(self, spec: GrammarSpec) -> Any:
        """The spec as an xgrammar Grammar (the conversion, where xgrammar warns)."""
        G = self.xgr.Grammar
        if spec.kind in ("json_schema", "json_object"):
            layout: dict[str, Any] = (
                {"any_whitespace": False}
                if self.compact_json
                else {"any_whitespace": True, "max_whitespace_cnt": JSON_WHITESPACE_MAX}
            )
            return G.from_json_schema(_schema_text(spec), strict_mode=False, **layout)
        if spec.kind == "regex":
            return G.from_regex(spec.text)
        if spec.kind == "ebnf":
            return G.from_ebnf(spec.text)
        if spec.kind == "choices":
            return G.from_ebnf(choices_ebnf(spec.value))
        if spec.kind == "structural_tag":
            return G.from_structural_tag(json.dumps(_structural(spec.value, self._content)))
        raise GrammarUnsupported(f"xgrammar does not compile {spec.kind}")

    def _content(self, schema: Any) -> dict[str, Any]:
        """A structure's JSON under `schema`, laid out as the backend's JSON is."""
        schema = _for_xgrammar(schema)
        if self.compact_json:
            # NOTE: a json_schema content bounds whitespace (max_whitespace_cnt >= 1) but has
            # no compact layout: the grammar from_json_schema gives for one is the content
            G = self.xgr.Grammar
            grammar = G.from_json_schema(
                json.dumps(schema), strict_mode=False, any_whitespace=False
            )
            return {"type": "grammar", "grammar": str(grammar)}
        # NOTE: unbounded by default: a model could fill the context with whitespace
        return {
            "type": "json_schema",
            "json_schema": schema,
            "max_whitespace_cnt": JSON_WHITESPACE_MAX,
        }

    def matcher(self, compiled: Any) -> Matcher:
        return XGrammarMatcher(self.xgr.GrammarMatcher(compiled), self.vocab.end_ids[0])

    def fill_many(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill several rows in one call (xgrammar spreads them over its threads)."""
        if self._batch is None:
            self._batch = self.xgr.BatchGrammarMatcher(FILL_THREADS)
        inner = [m.inner for m in matchers]  # type: ignore[attr-defined]
        self._batch.batch_fill_next_token_bitmask(inner, bitmask, rows)

    def can_end_many(
        self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]
    ) -> list[bool]:
        """The stop token's bit in each filled row, read in one indexing (not row by row: this
        runs for every constrained row of every step)."""
        return bits_set(bitmask, rows, self.vocab.end_ids[0])


def _schema_text(spec: GrammarSpec) -> str:
    if spec.kind == "json_object":
        return spec.text
    value = spec.value
    schema = _for_xgrammar(value)
    return spec.text if schema is value else json.dumps(schema)


# one character of a JSON string written unescaped
JSON_CHAR = '[^"\\\\\\x00-\\x1f]'


def exact_lengths(schema: Any) -> Any:
    """The schema with each string's minLength/maxLength (no pattern or format beside them) as
    the pattern `^{JSON_CHAR}{min,max}$`: the same strings, which xgrammar then matches exactly
    (the schema itself when there is none).

    NOTE: xgrammar compiles a length-bounded string to `[^"\\\r\n]{min,max}`, which lets raw
    control characters (a tab, \x01) into the string: the output is not JSON. The class is
    spelled out, not ".": xgrammar drops a string's escaping inside a repetition wider than
    127 (schema_rules.WIDEST_EXACT_REPEAT), which would let a raw '"' end the string early.
    No escapes at all: stricter, not weaker.
    """
    if not isinstance(schema, dict):
        return schema
    names = {id(site.node) for site in subschemas(schema) if site.names}
    changed = False

    def rewrite(original: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
        nonlocal changed
        types = types_of(original)
        strings = "string" in types if types is not None else id(original) in names
        lengths = "minLength" in node or "maxLength" in node
        if not strings or not lengths or "pattern" in node or "format" in node:
            return node
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f"^{JSON_CHAR}{{{low},{high}}}$"
        changed = True
        return node

    rewritten = map_subschemas(schema, rewrite)
    return rewritten if changed else schema


def _for_xgrammar(schema: Any) -> Any:
    return optional_keys_last(exact_lengths(schema))


def _structural(tag: dict[str, Any], content: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """weft's structural tag (grammars/spec.py) -> xgrammar's structural-tag format; `content`
    gives a structure's JSON content from its schema."""
    tags = [
        {"type": "tag", "begin": s["begin"], "content": content(s["schema"]), "end": s["end"]}
        for s in tag["structures"]
    ]
    common = {"at_least_one": tag["at_least_one"], "stop_after_first": not tag["repeat"]}
    if tag["free_text"]:
        fmt = {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags, **common}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": tag["separator"], **common}
    return {"type": "structural_tag", "format": fmt}


# NOTE: xgrammar's C++ code writes its warnings ("ignoring minLength/maxLength", "falling back
# to anyOf semantics") straight to file descriptor 2: no Python warning, no log record, nothing
# to ask for. While any conversion runs, fd 2 points at a temporary file; each conversion reads
# the lines written while it ran, and every line goes on to the real stderr when a conversion
# ends (late by milliseconds: the conversion is the quick part of a compile; the token-level
# compile runs after it, outside). Conversions are not serialized: one slow hostile spec must
# not hold up the others. Two that overlap both see the warnings of either, so a spec may be
# refused for a neighbour's warning (it goes to the next backend): never the reverse.
_XGRAMMAR_WARNING = re.compile(rb"^\[[0-9:.]+\] \S+:\d+: Warning: (.*)$", re.MULTILINE)


class StderrTap:
    """fd 2 into a temporary file while at least one caller watches it (one per process: fd 2
    is the process's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers = 0
        self._file: Any = None
        self._stderr: int | None = None  # the real fd 2, while the file stands in for it
        self._forwarded = 0  # bytes of the file written on to the real stderr

    def start(self) -> int:
        """Start watching: returns the offset to pass to `stop`."""
        with self._lock:
            if self._watchers == 0:
                sys.stderr.flush()
                self._file = tempfile.TemporaryFile()  # noqa: SIM115 (closed by the last stop)
                try:
                    self._stderr = os.dup(2)
                except OSError:  # no stderr at all: catch into the file all the same
                    self._stderr = None
                os.dup2(self._file.fileno(), 2)
                self._forwarded = 0
            self._watchers += 1
            return os.lseek(self._file.fileno(), 0, os.SEEK_END)

    def stop(self, start: int) -> bytes:
        """Stop watching: returns what fd 2 got since `start`."""
        with self._lock:
            sys.stderr.flush()
            fd = self._file.fileno()
            end = os.lseek(fd, 0, os.SEEK_END)
            seen = os.pread(fd, end - start, start)
            if self._stderr is not None and end > self._forwarded:
                _write_all(self._stderr, os.pread(fd, end - self._forwarded, self._forwarded))
            self._forwarded = end
            self._watchers -= 1
            if self._watchers == 0:
                if self._stderr is None:
                    os.close(2)
                else:
                    os.dup2(self._stderr, 2)
                    os.close(self._stderr)
                self._file.close()
                self._file = self._stderr = None
            return seen


STDERR_TAP = StderrTap()


def with_warnings(convert: Callable[[], T]) -> tuple[T, list[str]]:
    """convert(), and the warnings xgrammar wrote while it ran."""
    start = STDERR_TAP.start()
    try:
        result = convert()
    finally:
        seen = STDERR_TAP.stop(start)
    return result, [w.decode(errors="replace") for w in _XGRAMMAR_WARNING.findall(seen)]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# warning text -> the keyword it is about
_WARNED_KEYWORDS = (
    ("oneOf", "oneOf"),
    ("allOf", "allOf"),
    ("multipleOf", "multipleOf"),
    ("minLength/maxLength", "minLength"),
    ("length constraints", "maxLength"),
    ("URI", "$ref"),
    ("regex", "pattern"),
)


def _harmless(spec: GrammarSpec, warning: str) -> bool:
    """A warning about nothing lost: the oneOf that xgrammar reads as anyOf (it cannot prove the
    branches disjoint, through $refs say) where weft can (a tagged union)."""
    return warning.startswith("oneOf with overlapping") and spec_oneofs_disjoint(
        spec.kind, spec.value
    )


def _warned(spec: GrammarSpec, warnings: list[str]) -> str:
    """The refusal for a spec xgrammar warned about: the keyword and its pointers where the
    warning names a keyword the spec's schemas use."""
    warning = warnings[0]
    schemas = spec_schemas(spec.kind, spec.value)
    for needle, keyword in _WARNED_KEYWORDS:
        if needle in warning:
            pointers = [p for base, s in schemas for p in locate(s, keyword, base=base)]
            if pointers:
                where = ", ".join(pointers[:MAX_LISTED])
                return str(Refusal("xgrammar", keyword, where, f"it warned: {warning}"))
    return f"xgrammar warned that it does not enforce the {spec.kind}: {warning}"


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[20:07:34] /path/file.cc:83: "


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:500]
