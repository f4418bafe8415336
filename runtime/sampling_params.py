"""Per-request sampling parameters, validated so that a bad field is named in the error."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from weft.grammars.spec import MAX_SPEC_CHARS, parse_spec

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
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


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
        """Build from a request dict; explicit nulls mean "default"; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in (values or {}).items():
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
            if value is not None:
                kwargs[key] = value
        params = cls(**kwargs)
        params.validate()
        return params

    @property
    def is_greedy(self) -> bool:
        # NOTE: a temperature this small overflows logits / temperature; it means greedy anyway
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field, spec text) of the output constraint, if any."""
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

    def validate(self, vocab_size: int | None = None, limits: RequestLimits | None = None) -> None:
        """Raise ValueError naming the first invalid field (first word of the message)."""
        limits = limits or RequestLimits()
        _int("max_new_tokens", self.max_new_tokens, low=0)
        cap = limits.max_new_tokens
        if cap is not None and self.max_new_tokens > cap:
            raise ValueError(
                f"max_new_tokens must be <= {cap} on this server (--max-new-tokens-cap), "
                f"got {self.max_new_tokens}"
            )
        _int("min_new_tokens", self.min_new_tokens, low=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        _num("temperature", self.temperature, low=0.0)
        _num("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _int("top_k", self.top_k, low=-1, high=MAX_TOP_K)
        _num("min_p", self.min_p, low=0.0, high=1.0)
        _num("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _num("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _num("repetition_penalty", self.repetition_penalty, low=0.01, high=2.0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} entries; at most {MAX_STOP_STRINGS}")
        if any(len(s) > MAX_STOP_LEN for s in self.stop):
            raise ValueError(f"stop entries must be at most {MAX_STOP_LEN} characters")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        for tid in self.stop_token_ids:
            if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid <= MAX_INT:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {tid!r}")
            if vocab_size is not None and tid >= vocab_size:
                raise ValueError(
                    f"stop_token_ids entry {tid} is outside the vocabulary ({vocab_size})"
                )
        _int("n", self.n, low=1, high=MAX_N)
        constraints = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        for name in constraints:
            if not isinstance(getattr(self, name), str):
                raise ValueError(
                    f"{name} must be a string, got {type(getattr(self, name)).__name__}"
                )
        if len(constraints) > 1:
            raise ValueError(f"only one constraint may be given, got {', '.join(constraints)}")
        if constraints:
            parse_spec(constraints[0], getattr(self, constraints[0]), limits.max_grammar_chars)
        if self.seed is not None:
            _int("seed", self.seed, low=0, high=MAX_SEED)
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "no_stop_trim",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


def output_room_error(
    prompt_len: int, max_new_tokens: int, context_length: int, name: str = "max_new_tokens"
) -> str | None:
    """Why a max_new_tokens the caller set does not fit beside the prompt (None: it fits). The
    Engine raises it, the server answers it with a 400."""
    if prompt_len + max_new_tokens <= context_length:
        return None
    return (
        f"{name} is too large: the prompt has {prompt_len} tokens and {name} is "
        f"{max_new_tokens}, but the context length is {context_length}"
    )


def _int(name: str, value: Any, low: int, high: int = MAX_INT) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _num(name: str, value: Any, low: float, high: float | None = None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if (isinstance(value, int) and abs(value) > MAX_INT) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
