"""SGLang's `sampling_params` dict -> weft `SamplingParams`.

SGLang clients send every field they know, often as explicit nulls ("regex": null) or as SGLang's
own spellings (`sampling_seed`, top_k = 1 << 30 for "off"). Null means "default"; a feature weft
does not have yet (grammars, regex stops, logit bias, beams) is a clear 400, never silently
ignored; a key nobody knows is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from weft.runtime.sampling_params import SamplingParams
from weft.runtime.server.errors import ApiError, bad_request, not_supported

MAX_STOP_STRINGS = 32
MAX_STOP_LEN = 1024

_OWN_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
# Accepted and without effect in weft (a delivery or bookkeeping hint, not a sampling change).
_IGNORED_FIELDS = frozenset({"stream_interval", "custom_params"})


def parse_sampling_params(
    values: Any, vocab_size: int, where: str = "sampling_params"
) -> tuple[SamplingParams, bool]:
    """Returns the params and whether max_new_tokens was given explicitly."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise bad_request(f"{where} must be an object, got {type(values).__name__}", where)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        if key in _GRAMMAR_FIELDS:
            if value == "":  # SGLang reads an empty constraint as "unset"
                continue
            raise not_supported(f"constrained decoding ({where}.{key})", f"{where}.{key}")
        if key == "stop_regex":
            if value in ("", []):
                continue
            raise not_supported(f"{where}.stop_regex", f"{where}.stop_regex")
        if key == "logit_bias":
            if value == {}:
                continue
            raise not_supported(f"{where}.logit_bias", f"{where}.logit_bias")
        if key == "beam_width":
            if value == 1:
                continue
            raise not_supported(f"beam search ({where}.beam_width)", f"{where}.beam_width")
        if key == "watermark":
            raise not_supported(f"{where}.watermark", f"{where}.watermark")
        if key in _IGNORED_FIELDS:
            continue
        if key == "sampling_seed":
            key = "seed"
        if key not in _OWN_FIELDS:
            raise bad_request(f"unknown sampling parameter {key!r}", f"{where}.{key}")
        kwargs[key] = value
    _check_lists(kwargs, where)
    try:
        params = SamplingParams(**kwargs)
        params.validate(vocab_size)
    except (ValueError, TypeError) as exc:
        raise ApiError(f"invalid {where}: {exc}", 400, param=where) from None
    return params, "max_new_tokens" in kwargs


def _check_lists(kwargs: dict[str, Any], where: str) -> None:
    stop = kwargs.get("stop")
    if stop is not None:
        kwargs["stop"] = check_stop(stop, f"{where}.stop")
    ids = kwargs.get("stop_token_ids")
    if ids is not None and not isinstance(ids, list):
        raise bad_request(
            f"{where}.stop_token_ids must be a list of token ids", f"{where}.stop_token_ids"
        )


def check_stop(stop: Any, param: str) -> list[str]:
    """A stop string or a list of them: non-empty strings, a bounded number."""
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"{param} must be a string or a list of strings", param)
    if any(s == "" for s in stops):
        raise bad_request(f"{param} must not contain empty strings", param)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"{param} has {len(stops)} entries; at most {MAX_STOP_STRINGS}", param)
    if any(len(s) > MAX_STOP_LEN for s in stops):
        raise bad_request(f"{param} entries must be at most {MAX_STOP_LEN} characters", param)
    return list(stops)
