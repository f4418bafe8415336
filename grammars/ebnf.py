"""Small grammar-text builders shared by the backends: choices as EBNF / Lark / regex."""

from __future__ import annotations

import json

_REGEX_SPECIAL = set("\\.^$|?*+()[]{}-/#&~ \t\n\r")


def ebnf_literal(text: str) -> str:
    """A double-quoted EBNF (GBNF / Lark) string literal."""
    return json.dumps(text, ensure_ascii=False)


def choices_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


def choices_lark(choices: list[str]) -> str:
    return "start: " + " | ".join(ebnf_literal(c) for c in choices)


def regex_escape(text: str) -> str:
    """Escape for the regex dialects of the backends (Rust regex, xgrammar's ECMAScript-like):
    only punctuation that is special somewhere is escaped; control characters as \\xHH."""
    out = []
    for ch in text:
        if ch in "\t\n\r":
            out.append(f"\\x{ord(ch):02x}")
        elif ch in _REGEX_SPECIAL and ch != " ":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def choices_regex(choices: list[str]) -> str:
    return "(" + "|".join(regex_escape(c) for c in choices) + ")"
