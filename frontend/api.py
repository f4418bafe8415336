"""The DSL's thin constructors: gen, select and the role helpers."""

from __future__ import annotations

import json
from typing import Any

from weft.frontend.ir import (
    ROLES,
    SELECT_METHODS,
    DType,
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
# gen(dtype=...): the value's Python spelling as a regex (SGLang's meaning; a str is a JSON string
# literal), and the variable holds the value it spells.
# NOTE: a number may end with one space or newline. Without it the model has no way to say the
# number is done but the end token, and a small model rather writes more digits ("340000..." to
# the token limit); with SGLang's `[ \n]*` it writes whitespace to the limit instead. After that
# one character the grammar can only end: the end token is all the mask allows, and the request
# ends on it. (True|False) and a closed string literal end the same way.
DTYPES = {
    dtype.name: dtype
    for dtype in (
        DType("int", r"[-+]?[0-9]+[ \n]?", int),
        DType("float", r"[-+]?[0-9]*\.?[0-9]+[ \n]?", float),
        DType("bool", r"(True|False)", lambda text: text == "True"),
        DType(
            "str",
            r'"([^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
            lambda text: json.loads(text, strict=False),
        ),
    )
}


def _constraint(
    name: str | None, regex: str | None, json_schema: Any, ebnf: str | None, dtype: DType | None
) -> dict[str, str]:
    """The one constraint of a gen as sampling params (json_schema as JSON text)."""
    given = {
        k: v
        for k, v in {
            "regex": regex,
            "json_schema": json_schema,
            "ebnf": ebnf,
            "dtype": dtype,
        }.items()
        if v is not None
    }
    if len(given) > 1:
        raise ValueError(f"gen({name!r}): give one of {', '.join(given)}, not several")
    if not given:
        return {}
    key, value = next(iter(given.items()))
    if key == "dtype":
        return {"regex": value.regex}
    if key == "json_schema" and not isinstance(value, str):
        if hasattr(value, "model_json_schema"):  # a pydantic model class
            value = value.model_json_schema()
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ValueError(f"gen({name!r}): {key} must be a string")
    return {key: value}


def _dtype(name: str | None, value: Any) -> DType:
    """gen(dtype=...): int, float, bool or str, as the type or its name."""
    key = value.__name__ if value in (int, float, bool, str) else value
    if not isinstance(key, str) or key not in DTYPES:
        raise ValueError(f"gen({name!r}): dtype must be int, float, bool or str, got {value!r}")
    return DTYPES[key]


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
    kind = None if dtype is None else _dtype(name, dtype)
    constraint = _constraint(name, regex, json_schema, ebnf, kind)
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
    return Gen(name, {**params, **constraint}, kind)


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
