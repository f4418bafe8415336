"""The DSL's thin constructors: gen, select and the role helpers."""

from __future__ import annotations

import json
from typing import Any

from weft.frontend.choices import ChoicesSamplingMethod, choices_method_named
from weft.frontend.ir import (
    DType,
    Gen,
    ModelType,
    Node,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    Seq,
    flatten,
)
from weft.runtime.server.reasoning import reasoning_format

# gen() keyword -> SGLang sampling parameter
SAMPLING_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    **{k: k for k in ("stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p")},
    **{k: k for k in ("frequency_penalty", "presence_penalty", "ignore_eos")},
}
# gen() keywords sent as request options beside the sampling parameters
_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
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
    named = {"regex": regex, "json_schema": json_schema, "ebnf": ebnf, "dtype": dtype}
    given = {k: v for k, v in named.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"gen({name!r}): give one of {', '.join(given)}, not several")
    if not given:
        return {}
    key, value = next(iter(given.items()))
    if key == "dtype":
        return {"regex": value.regex}
    if key == "json_schema" and not isinstance(value, str):
        if _is_model(value):
            value = value.model_json_schema()
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ValueError(f"gen({name!r}): {key} must be a string")
    return {key: value}


def _is_model(value: Any) -> bool:
    """A pydantic model class (not an instance)."""
    return isinstance(value, type) and hasattr(value, "model_json_schema")


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
    choices_method: str | ChoicesSamplingMethod = "token_length_normalized",
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    n: int = 1,
) -> Node:
    """Generate text into variable `name` (the text, or what `dtype` / a pydantic `json_schema`
    reads from it); unset parameters take the run's defaults.

    - sampling: max_tokens, min_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p,
      frequency_penalty, presence_penalty, ignore_eos (SGLang's meanings).
    - one constraint at most: `regex`; `json_schema` (JSON text, a dict, or a pydantic model
      class: the variable then holds the validated instance); `ebnf`; `dtype` (int, float,
      bool or str: the variable holds the value); `choices` (the same as `select`, scored by
      `choices_method`).
    - logprobs, into the variable's meta info (`s.get_meta_info(name)`): return_logprob,
      logprob_start_len, top_logprobs_num, return_text_in_logprobs.
    - n: one sample per gen; for several, fork the state (`s.fork(n)`) and gen in each.
    """
    args = locals()  # the arguments only: read first, so SAMPLING_NAMES lists the sampling ones
    params = {
        SAMPLING_NAMES[k]: v for k, v in args.items() if k in SAMPLING_NAMES and v is not None
    }
    if n != 1:
        raise ValueError(f"gen({name!r}): n={n}: one sample per gen; fork the state for more")
    typed = None if dtype is None else _dtype(name, dtype)
    constraint = _constraint(name, regex, json_schema, ebnf, typed)
    reader: DType | ModelType | None = ModelType(json_schema) if _is_model(json_schema) else typed
    if choices is not None:
        return select(name, choices, choices_method)
    options = {k: args[k] for k in _OPTIONS if args[k] is not None}
    return Gen(name, {**params, **constraint}, reader, options)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    choices_method: str | ChoicesSamplingMethod = "token_length_normalized",
    temperature: float = 0.0,
) -> Node:
    """Pick one of `choices` by the likelihood the model gives it after the text so far.

    `choices_method`: `weft.token_length_normalized` (the mean token logprob; the default),
    `weft.greedy_token_selection`, `weft.unconditional_likelihood_normalized`, their names as
    strings, or an instance of a `weft.ChoicesSamplingMethod` subclass. The variable holds the
    choice; its meta info the scores and token logprobs. `temperature` must be 0 (selects are
    argmax, as in SGLang)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select({name!r}): choices must be a non-empty list of non-empty strings")
    if temperature != 0:
        raise ValueError(f"select({name!r}): temperature must be 0 (a select is an argmax)")
    method = choices_method_named(f"select({name!r})", choices_method)
    return Select(name, list(choices), method)


REASONING_SUFFIX = "_reasoning_content"  # s[name + REASONING_SUFFIX]: a gen's thinking


def separate_reasoning(
    expr: object = None,
    model_type: str | None = None,
    *,
    reasoning_start: str | None = None,
    reasoning_end: str | None = None,
) -> Node:
    """`expr`, then each of its named gens (and selects) split into the thinking and the
    answer: `s[name]` holds the answer, `s[name + "_reasoning_content"]` the thinking, and the
    program's text keeps only the answer where the gen wrote both (SGLang's API and effect:
    the next request does not see the thinking, as reasoning models' templates drop it from
    earlier turns).

    `model_type`: "qwen3" or "deepseek-r1" (`<think>` ... `</think>`), or "generic" with
    `reasoning_end` (and `reasoning_start`, else an output begins in the thinking): the
    server's --reasoning-parser names and split (weft.runtime.server.reasoning), so every
    backend splits the same way. Where the backend split the output itself (an OpenAI
    endpoint's `reasoning_content`), its split is kept.
    """
    if model_type is None:
        raise ValueError("separate_reasoning: model_type is required (qwen3, deepseek-r1, ...)")
    fmt = reasoning_format(model_type, reasoning_start, reasoning_end)
    nodes = flatten(expr) if expr is not None else []
    names = []
    for node in nodes:
        if isinstance(node, Gen | Select):
            if node.name is None:
                raise ValueError(f"separate_reasoning: {node!r} needs a name to store its parts")
            names.append(node.name)
    return Seq([*nodes, SeparateReasoning(names, fmt)])


def _role(role: str, content: object) -> Node:
    return Seq([RoleBegin(role), *flatten(content), RoleEnd(role)])


def system(content: object = "") -> Node:
    return _role("system", content)


def user(content: object = "") -> Node:
    return _role("user", content)


def assistant(content: object = "") -> Node:
    return _role("assistant", content)


def system_begin() -> Node:
    return RoleBegin("system")


def system_end() -> Node:
    return RoleEnd("system")


def user_begin() -> Node:
    return RoleBegin("user")


def user_end() -> Node:
    return RoleEnd("user")


def assistant_begin() -> Node:
    return RoleBegin("assistant")


def assistant_end() -> Node:
    return RoleEnd("assistant")


def gen_int(name: str | None = None, **kwargs: Any) -> Node:
    """gen(name, dtype=int, ...)"""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Node:
    """gen(name, dtype=str, ...): a quoted string literal; the variable holds the string"""
    return gen(name, dtype=str, **kwargs)
