"""SGLang's `sampling_params` dict -> weft `SamplingParams`.

SGLang clients send every field they know, often as explicit nulls ("regex": null) or as SGLang's
own spellings (`sampling_seed`, top_k = 1 << 30 for "off"). Null means "default"; a feature weft
does not have yet (regex stops, logit bias, beams) is a clear 400, never silently ignored; a key
nobody knows is a 400 naming it. The extra keys and what each means: `SGLANG_EXTRAS`.

Output constraints (regex, json_schema, ebnf, structural_tag; at most one) are checked here, in
the HTTP process, with `weft.grammars.spec.parse_spec`: a spec that is not valid JSON, not a valid
JSON schema, or too large is a 400 before the scheduler sees it.
"""

from __future__ import annotations

import json
from typing import Any

from weft.grammars.spec import MAX_SPEC_CHARS, InvalidSpec, parse_spec
from weft.runtime.sampling_params import (
    CONSTRAINT_FIELDS,
    SAMPLING_FIELDS,
    SGLANG_EXTRAS,
    RequestError,
    RequestLimits,
    SamplingParams,
)
from weft.runtime.server.errors import ApiError, bad_request, not_supported

_JSON_FIELDS = frozenset({"json_schema", "structural_tag"})  # may also come as a JSON object


def parse_sampling_params(
    values: Any,
    vocab_size: int,
    where: str = "sampling_params",
    limits: RequestLimits | None = None,
) -> tuple[SamplingParams, bool]:
    """Returns the params and whether max_new_tokens was given explicitly. Without it, the
    default is lowered to the server's cap (a request that asked for nothing is not refused)."""
    limits = limits or RequestLimits()
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise bad_request(f"{where} must be an object, got {type(values).__name__}", where)
    kwargs: dict[str, Any] = {}
    constraints: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        if key in CONSTRAINT_FIELDS:
            text = check_constraint(key, value, f"{where}.{key}", limits.max_grammar_chars)
            if text is None:
                continue
            if constraints:
                raise bad_request(
                    f"give at most one of {', '.join(CONSTRAINT_FIELDS)}; got {constraints[0]} "
                    f"and {key}",
                    f"{where}.{key}",
                )
            constraints.append(key)
            kwargs[key] = text
            continue
        extra = SGLANG_EXTRAS.get(key)
        if extra is not None:
            if extra.alias is None:
                if extra.unsupported is not None and value not in extra.accepts:
                    param = f"{where}.{key}"
                    raise not_supported(extra.unsupported.format(param=param), param)
                continue
            key = extra.alias
        if key not in SAMPLING_FIELDS:
            raise bad_request(f"unknown sampling parameter {key!r}", f"{where}.{key}")
        kwargs[key] = value
    explicit = "max_new_tokens" in kwargs
    cap = limits.max_new_tokens
    if not explicit and cap is not None:
        kwargs["max_new_tokens"] = min(SamplingParams.max_new_tokens, cap)
    try:
        params = SamplingParams(**kwargs)
        params.validate(vocab_size, limits)
    except RequestError as exc:
        param = f"{where}.{exc.param}" if exc.param in kwargs else where
        raise ApiError(f"invalid {where}: {exc}", 400, param=param) from None
    return params, explicit


def check_constraint(
    field: str, value: Any, param: str, max_chars: int = MAX_SPEC_CHARS
) -> str | None:
    """One constraint field's value -> its spec text (None: unset, as null or "" are).

    json_schema and structural_tag may come as JSON objects; they are sent on as JSON text. The
    spec is checked with parse_spec (InvalidSpec -> a 400 naming `param`); the text stays as the
    client sent it.
    """
    if value is None or value == "":  # SGLang reads an empty constraint as "unset"
        return None
    if field in _JSON_FIELDS and isinstance(value, dict):
        try:
            text = json.dumps(value, ensure_ascii=False)
        except RecursionError:  # the body decoder goes a little deeper than json does
            raise bad_request(f"invalid {param}: nested too deeply", param) from None
    elif isinstance(value, str):
        text = value
    else:
        kinds = "a string or a JSON object" if field in _JSON_FIELDS else "a string"
        raise bad_request(f"{param} must be {kinds}, got {type(value).__name__}", param)
    try:
        parse_spec(field, text, max_chars)
    except InvalidSpec as exc:
        raise bad_request(f"invalid {param}: {exc}", param) from None
    return text
