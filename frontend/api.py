"""The DSL's thin constructors: gen, select and the role helpers."""

from __future__ import annotations

from typing import Any

from weft.frontend.ir import (
    ROLES,
    SELECT_METHODS,
    Gen,
    Node,
    RoleBegin,
    RoleEnd,
    Select,
    Seq,
    flatten,
)

# gen() keyword -> SGLang sampling parameter
SAMPLING_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "ignore_eos": "ignore_eos",
}
_CONSTRAINED = ("regex", "json_schema", "ebnf", "dtype")


class ConstrainedDecodingUnsupported(ValueError):
    """regex / json_schema / ebnf / dtype before weft has a grammar backend."""


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    ebnf: str | None = None,
    choices: list[str] | None = None,
    dtype: type | str | None = None,
) -> Node:
    """Generate text into variable `name`; unset parameters take the run's defaults."""
    given = {"regex": regex, "json_schema": json_schema, "ebnf": ebnf, "dtype": dtype}
    for key in _CONSTRAINED:
        if given[key] is not None:
            raise ConstrainedDecodingUnsupported(
                f"gen({name!r}): {key} is not supported yet — constrained decoding arrives with "
                "the grammar backends (the server answers 400 'not supported yet' as well)"
            )
    if choices is not None:
        return select(name, choices)
    local = {
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
    }
    params = {SAMPLING_NAMES[k]: v for k, v in local.items() if v is not None}
    return Gen(name, params)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    choices_method: str = "token_length_normalized",
) -> Node:
    """Pick one of `choices` by the likelihood the model gives it after the text so far."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select({name!r}): choices must be a non-empty list of non-empty strings")
    if choices_method not in SELECT_METHODS:
        raise ValueError(
            f"select({name!r}): unknown choices_method {choices_method!r}; "
            f"one of {', '.join(SELECT_METHODS)}"
        )
    return Select(name, list(choices), choices_method)


def _role(role: str, content: object) -> Node:
    assert role in ROLES
    return Seq([RoleBegin(role), *flatten(content), RoleEnd(role)])


def system(content: object = "") -> Node:
    return _role("system", content)


def user(content: object = "") -> Node:
    return _role("user", content)


def assistant(content: object = "") -> Node:
    return _role("assistant", content)
