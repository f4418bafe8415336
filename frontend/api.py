"""The DSL's thin constructors: gen, select and the role helpers."""

from __future__ import annotations

import json
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
# gen(dtype=...) as a regex over the value's Python spelling (SGLang's meaning)
DTYPE_REGEX = {int: r"[-+]?[0-9]+", float: r"[-+]?[0-9]+(\.[0-9]+)?", bool: r"(True|False)"}


def _constraint(
    name: str | None, regex: str | None, json_schema: Any, ebnf: str | None, dtype: Any
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
        kind = {"int": int, "float": float, "bool": bool}.get(value, value)
        if kind not in DTYPE_REGEX:
            raise ValueError(f"gen({name!r}): dtype must be int, float or bool, got {value!r}")
        return {"regex": DTYPE_REGEX[kind]}
    if key == "json_schema" and not isinstance(value, str):
        if hasattr(value, "model_json_schema"):  # a pydantic model class
            value = value.model_json_schema()
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ValueError(f"gen({name!r}): {key} must be a string")
    return {key: value}


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
    constraint = _constraint(name, regex, json_schema, ebnf, dtype)
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
    return Gen(name, {**params, **constraint})


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
