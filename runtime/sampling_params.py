"""Per-request sampling parameters, validated so that a bad field is named in the error.

The table at the top (RANGES, ALIASES, SGLANG_EXTRAS) is the one statement of what a request may
ask: `SamplingParams.validate` checks the ranges, the server maps OpenAI's and SGLang's spellings
and SGLang's extra keys by it (`server.openai_api`, `server.sglang_params`), and `server.openapi`
documents all of it from the same entries.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weft.grammars.spec import MAX_SPEC_CHARS, GrammarSpec, InvalidSpec, parse_spec

# NOTE: the field names follow SGLang's sampling_params so that its clients work unchanged.

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy
MAX_N = 128  # samples per request (OpenAI's cap)
MAX_SEED = 2**63 - 1 - MAX_N  # seeds of the n samples are seed .. seed + n - 1
MAX_TOP_K = 1 << 30  # SGLang's "off" value; the sampling kernel takes k as an int32
MAX_INT = 2**63 - 1  # ints travel to the scheduler as msgpack int64
MAX_STOP_STRINGS = 32
MAX_STOP_LEN = 1024  # characters of one stop string
MAX_TOP_LOGPROBS_NUM = 1024  # alternatives per position (the OpenAI API allows 20)
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


@dataclass(frozen=True)
class Range:
    """The values a numeric field takes: [low, high], or (low, high] with `open_low`."""

    low: float
    high: float | None = None  # None: no bound (an int still fits msgpack's int64)
    integer: bool = False
    open_low: bool = False

    def check(self, name: str, value: Any) -> None:
        """RequestError naming `name` (the field as the caller spells it) when out of range."""
        low, high = self.low, self.high
        if self.integer:
            low, high = int(low), MAX_INT if high is None else int(high)
            if not isinstance(value, int) or isinstance(value, bool):
                raise RequestError(f"{name} must be an integer, got {value!r}", name)
            if value < low:
                raise RequestError(f"{name} must be >= {low}, got {value}", name)
            if value > high:
                raise RequestError(f"{name} must be <= {high}, got {value}", name)
        else:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise RequestError(f"{name} must be a number, got {value!r}", name)
            if (isinstance(value, int) and abs(value) > MAX_INT) or not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value}", name)
            if value < low or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise RequestError(f"{name} must be {bound}, got {value}", name)
        if self.open_low and value == self.low:
            raise RequestError(
                f"{name} must be in ({self.low:g}, {self.high:g}], got {value:g}", name
            )

    def schema(self) -> dict[str, Any]:
        """The range as JSON schema keywords (the OpenAPI document)."""
        low = int(self.low) if self.low == int(self.low) else self.low
        out: dict[str, Any] = {("exclusiveMinimum" if self.open_low else "minimum"): low}
        if self.high is not None:
            out["maximum"] = int(self.high) if self.high == int(self.high) else self.high
        return out


# The numeric fields, in the order `validate` checks them.
RANGES: dict[str, Range] = {
    "max_new_tokens": Range(0, integer=True),
    "min_new_tokens": Range(0, integer=True),
    "temperature": Range(0.0),
    "top_p": Range(0.0, 1.0, open_low=True),
    "top_k": Range(-1, MAX_TOP_K, integer=True),  # -1 (or 0): off
    "min_p": Range(0.0, 1.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.01, 2.0),
    "n": Range(1, MAX_N, integer=True),
    "seed": Range(0, MAX_SEED, integer=True),  # (None: unseeded)
}
THINKING_BUDGET = Range(0, integer=True)  # (None: no limit)
# Other APIs' names of SamplingParams fields (OpenAI's, SGLang's).
ALIASES: dict[str, str] = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "sampling_seed": "seed",
}


@dataclass(frozen=True)
class Extra:
    """A key of SGLang's sampling_params that is no SamplingParams field: another name of one
    (`alias`), a feature weft lacks (`unsupported`, how the 400 names it; the values in
    `accepts` ask for nothing and pass), or accepted and without effect (neither)."""

    schema: dict[str, Any]  # what the OpenAPI document says it takes
    alias: str | None = None
    unsupported: str | None = None  # "{param}": the key as sent (sampling_params.beam_width)
    accepts: tuple[Any, ...] = ()


SGLANG_EXTRAS: dict[str, Extra] = {
    "sampling_seed": Extra({"type": "integer"}, alias="seed"),
    "stop_regex": Extra(
        {"anyOf": [{"const": ""}, {"type": "array", "maxItems": 0}]},
        unsupported="{param}",
        accepts=("", []),
    ),
    "logit_bias": Extra(
        {"type": "object", "maxProperties": 0}, unsupported="{param}", accepts=({},)
    ),
    "beam_width": Extra({"const": 1}, unsupported="beam search ({param})", accepts=(1,)),
    "watermark": Extra({"type": "null"}, unsupported="{param}"),
    "stream_interval": Extra({"type": "integer"}),  # a delivery hint
    "custom_params": Extra({}),  # bookkeeping
}
_FLOAT_FIELDS = tuple(name for name, r in RANGES.items() if not r.integer)


class RequestError(ValueError):
    """A request the caller must fix: the message and the field it names (`param`, spelled as
    the caller's API spells it). The Engine raises it; the server answers it with a 400."""

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidConstraint(RequestError, InvalidSpec):
    """An output constraint that does not parse, naming the field it came in."""


@dataclass(frozen=True)
class RequestLimits:
    """A server's policy on what one request's sampling params may ask for
    (`EngineConfig.request_limits`; the prompt's length is checked where it is tokenized)."""

    max_new_tokens: int | None = None  # None: the context length bounds the output
    max_grammar_chars: int = MAX_SPEC_CHARS  # text of a regex / json_schema / ebnf / tag


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # constrained decoding: at most one of these (see weft.grammars)
    regex: str | None = None
    json_schema: str | None = None  # JSON text of a JSON schema
    ebnf: str | None = None
    structural_tag: str | None = None  # JSON text, see weft.grammars.spec
    # the constraint, parsed: by `validate` from the field above, or by an API that parsed it
    grammar: GrammarSpec | None = None
    # with a reasoning parser, an output that begins in the thinking: at most this many tokens
    # of thinking, then the end marker is forced (0: none). The server checks that the request
    # thinks (weft.runtime.thinking); None: no limit.
    thinking_budget: int | None = None
    # where the server speculates (--speculative-algorithm): false verifies no drafts of its own
    # for this request (a grammar's forced tokens still are, as jump-forward)
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # NOTE: a value of the wrong type is kept as it is, for `validate` to name the field
        if isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        for name in _FLOAT_FIELDS:  # an int given for a float is sent to the scheduler as one
            value = getattr(self, name)
            if type(value) is int and abs(value) <= MAX_INT:
                setattr(self, name, float(value))
        if self.top_k == 0:
            self.top_k = -1

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> SamplingParams:
        """Build from a request dict (not validated yet); explicit nulls mean "default"; unknown
        keys are an error."""
        kwargs = {}
        for key, value in (values or {}).items():
            if key not in SAMPLING_FIELDS:
                raise RequestError(f"unknown sampling parameter {key!r}", key)
            if value is not None:
                kwargs[key] = value
        return cls(**kwargs)

    @property
    def is_greedy(self) -> bool:
        # NOTE: a temperature this small overflows logits / temperature; it means greedy anyway
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field, spec text) of the output constraint as given, if any (`grammar`: parsed)."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(
        self,
        vocab_size: int | None = None,
        limits: RequestLimits | None = None,
        *,
        names: Mapping[str, str] | None = None,
    ) -> None:
        """Raise RequestError naming the first invalid field (spelled as in `names`, else as
        the field is). Parses the output constraint into `grammar`."""
        limits = limits or RequestLimits()
        spell = names or {}

        def name(field: str) -> str:
            return spell.get(field, field)

        for field_name, bounds in RANGES.items():
            value = getattr(self, field_name)
            if value is not None or field_name != "seed":
                bounds.check(name(field_name), value)
        cap = limits.max_new_tokens
        if cap is not None and self.max_new_tokens > cap:
            raise RequestError(
                f"{name('max_new_tokens')} must be <= {cap} on this server "
                f"(--max-new-tokens-cap), got {self.max_new_tokens}",
                name("max_new_tokens"),
            )
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(
                f"{name('min_new_tokens')} ({self.min_new_tokens}) must not exceed "
                f"{name('max_new_tokens')} ({self.max_new_tokens})",
                name("min_new_tokens"),
            )
        if self.thinking_budget is not None:
            THINKING_BUDGET.check(name("thinking_budget"), self.thinking_budget)
        self._validate_stops(vocab_size, name("stop"), name("stop_token_ids"))
        self._validate_constraint(limits, name)
        for flag in _BOOL_FIELDS:
            if not isinstance(getattr(self, flag), bool):
                raise RequestError(
                    f"{name(flag)} must be a bool, got {getattr(self, flag)!r}", name(flag)
                )

    def _validate_stops(self, vocab_size: int | None, stop: str, stop_ids: str) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise RequestError(f"{stop} must be a string or a list of strings", stop)
        if any(s == "" for s in self.stop):
            raise RequestError(f"{stop} must not contain empty strings", stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(
                f"{stop} has {len(self.stop)} entries; at most {MAX_STOP_STRINGS}", stop
            )
        if any(len(s) > MAX_STOP_LEN for s in self.stop):
            raise RequestError(f"{stop} entries must be at most {MAX_STOP_LEN} characters", stop)
        if not isinstance(self.stop_token_ids, list):
            raise RequestError(
                f"{stop_ids} must be a list of ints, got {self.stop_token_ids!r}", stop_ids
            )
        for tid in self.stop_token_ids:
            if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid <= MAX_INT:
                raise RequestError(f"{stop_ids} must be non-negative ints, got {tid!r}", stop_ids)
            if vocab_size is not None and tid >= vocab_size:
                raise RequestError(
                    f"{stop_ids} entry {tid} is outside the vocabulary ({vocab_size})", stop_ids
                )

    def _validate_constraint(self, limits: RequestLimits, name: Callable[[str], str]) -> None:
        """At most one constraint text, parsed once into `grammar` (kept if an API parsed it)."""
        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) is not None]
        for key in given:
            value = getattr(self, key)
            if not isinstance(value, str):
                raise RequestError(
                    f"{name(key)} must be a string, got {type(value).__name__}", name(key)
                )
        if len(given) > 1:
            raise RequestError(
                f"only one constraint may be given, got {', '.join(name(f) for f in given)}",
                name(given[1]),
            )
        if given:
            try:
                self.grammar = parse_spec(
                    given[0], getattr(self, given[0]), limits.max_grammar_chars
                )
            except InvalidSpec as exc:
                raise InvalidConstraint(str(exc), name(given[0])) from None


# the fields a caller sets (grammar is validate's parse of the constraint field); the flags
# among them, which `validate` checks are bools
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"grammar"}
_BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.type == "bool")
