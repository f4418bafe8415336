"""One intake for both front doors: `weft.Engine` and the HTTP server build and check requests here.

Each front door reads its own surface (Engine keywords, a /generate body, an OpenAI body) into
prompt ids and `SamplingParams`; `Intake` checks them against the model and the server's limits
and builds the `GenerateRequest` the scheduler takes (`Req.from_message` on the other side, for
the Engine and the scheduler process alike). A bad value is a `RequestError` naming the field as
the caller spelled it: the Engine raises it (a ValueError), the server answers it with a 400.

NOTE: no torch and no model code here: the HTTP process imports this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import uuid
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from weft.grammars.spec import off_loop
from weft.runtime.messages.tokenizer_to_scheduler import GenerateRequest
from weft.runtime.sampling_params import (
    MAX_TOP_LOGPROBS_NUM,
    RequestError,
    RequestLimits,
    SamplingParams,
)
from weft.runtime.tokenizer import encode_prompt

MAX_RID_CHARS = 256
INLINE_TOKENIZE_CHARS = 16 * 1024  # longer texts are tokenized off the event loop
TRIM_AFTER_CHARS = 1 << 20  # after tokenizing a text this long, give the freed memory back


@dataclass(frozen=True)
class Bounds:
    """What one request may ask of this model and server."""

    vocab_size: int
    context_length: int  # prompt + output tokens of one request
    max_prompt_tokens: int | None = None  # the server's own cap (--max-prompt-tokens)
    limits: RequestLimits = field(default_factory=RequestLimits)

    @property
    def prompt_room(self) -> int:
        """The most tokens a prompt may have (the prompt and one new token must fit)."""
        context = self.context_length - 1
        return context if self.max_prompt_tokens is None else min(self.max_prompt_tokens, context)


def check_rid(rid: object) -> str:
    """A caller's rid: a non-empty string of printable characters (RequestError naming rid).

    NOTE: the scheduler names an n > 1 request's samples by joining the rid with a control
    character (`weft.runtime.core.RID_SEP`): no caller can name another's sample."""
    if not isinstance(rid, str) or not rid:
        raise RequestError("rid must be a non-empty string", "rid")
    if len(rid) > MAX_RID_CHARS:
        raise RequestError(
            f"rid is too long: {len(rid)} characters, at most {MAX_RID_CHARS}", "rid"
        )
    if not rid.isprintable():
        raise RequestError("rid must hold printable characters only (no control characters)", "rid")
    return rid


class Intake:
    """Prompt checks and request building for one model (its tokenizer, if any, and bounds)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, bounds: Bounds) -> None:
        self.tokenizer = tokenizer
        self.bounds = bounds
        self._token_chars: int | None = None

    # ---- prompts ------------------------------------------------------------------------------

    def prompts(
        self, text: object, ids: object, *, text_param: str = "text"
    ) -> tuple[list[list[int]], bool]:
        """A request's prompts as ids, and whether it gave one prompt (not a batch): exactly one
        of `text` (a string or a list of them) and `ids` (token ids or a list of them)."""
        if (text is None) == (ids is None):
            raise RequestError(f"give exactly one of {text_param} and input_ids", text_param)
        if isinstance(text, str):
            return [self.encode(text, text_param)], True
        if text is not None:
            if not isinstance(text, list) or not text or not all(isinstance(t, str) for t in text):
                raise RequestError(
                    f"{text_param} must be a non-empty string or a non-empty list of strings",
                    text_param,
                )
            return self.encode_many(text, [f"{text_param}[{i}]" for i in range(len(text))]), False
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            return [self.check_ids(x, f"input_ids[{i}]") for i, x in enumerate(ids)], False
        return [self.check_ids(ids, "input_ids")], True

    def encode(self, text: object, param: str, *, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids. Special-token strings in it (a rendered chat template) become
        special tokens."""
        return self.encode_many([text], [param], add_special_tokens=add_special_tokens)[0]

    def encode_many(
        self, texts: list[object], params: list[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """The text prompts of one request (`params` names each one's field).

        A text that cannot fit is refused before any tokenizing. Inside `parse_off_loop`, long
        texts are tokenized on a worker thread (the tokenizer releases the GIL), all of a
        request's in one job: a 16 MB prompt once held the event loop, /health and every stream
        with it, for 26 s; and each job reruns the request's parse (a job per prompt made a
        batch of k long prompts parse k + 1 times)."""
        checked = [self._check_text(t, p) for t, p in zip(texts, params, strict=True)]
        tokenizer = self.tokenizer
        assert tokenizer is not None  # (checked)
        if sum(len(t) for t in checked) <= INLINE_TOKENIZE_CHARS:
            return [encode_prompt(tokenizer, t, add_special_tokens) for t in checked]
        key = ("tokenize", tuple(checked), add_special_tokens)
        return off_loop(key, lambda: _encode_and_trim(tokenizer, checked, add_special_tokens))

    def _check_text(self, text: object, param: str) -> str:
        if not isinstance(text, str):
            raise RequestError(f"{param} must be a string, got {type(text).__name__}", param)
        if self.tokenizer is None:
            raise RequestError(
                f"this model has no tokenizer: send input_ids instead of {param}", param
            )
        if not text:
            raise RequestError(f"{param} is empty", param)
        room = self.bounds.prompt_room
        if len(text) > room and len(text) > room * (chars := self.token_chars):
            limited = self.bounds.max_prompt_tokens is not None
            flag = ", --max-prompt-tokens" if limited else ""
            raise RequestError(
                f"{param} is too long: {len(text)} characters can only make more than {room} "
                f"tokens (the most a prompt may have here{flag}), since no token of this model "
                f"is longer than {chars} characters",
                param,
                code="prompt_too_long" if limited else "context_length_exceeded",
            )
        return text

    @property
    def token_chars(self) -> int:
        """The most characters one token stands for (the longest token string, special tokens
        included, plus one for a normalizer's added prefix): a longer text cannot fit."""
        if self._token_chars is None:
            tokenizer = self.tokenizer
            assert tokenizer is not None
            tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            self._token_chars = max(len(t) for t in tokens if t is not None) + 1
        return self._token_chars

    def check_ids(self, ids: object, param: str) -> list[int]:
        if not isinstance(ids, list):
            raise RequestError(f"{param} must be a non-empty list of token ids", param)
        if not ids:
            raise RequestError(f"prompt is empty ({param} has no token ids)", param)
        vocab = self.bounds.vocab_size
        for tid in ids:
            if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab:
                raise RequestError(f"{param} has {tid!r}, not a token id in [0, {vocab})", param)
        return ids

    # ---- requests -----------------------------------------------------------------------------

    def build(
        self,
        ids: list[int],
        params: SamplingParams,
        *,
        max_tokens_explicit: bool,
        logprob_start_len: int | None = None,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        namespace: str = "",
        prompt_param: str = "input_ids",
        max_tokens_param: str = "max_new_tokens",
        reasoning_end_ids: list[int] | None = None,
        reasoning_start_ids: list[int] | None = None,
    ) -> GenerateRequest:
        """The request for checked prompt ids and validated params: the checks that need the
        prompt's length (against the context and --max-prompt-tokens; an explicit max_new_tokens
        must fit beside it, a default one is capped by the scheduler). logprob_start_len None:
        no logprobs; -1: output tokens only."""
        bounds = self.bounds
        context = bounds.context_length
        if len(ids) >= context:
            raise RequestError(
                f"prompt is too long: {len(ids)} tokens, the context length is {context} "
                "(the prompt and at least one new token must fit)",
                prompt_param,
                code="context_length_exceeded",
            )
        limit = bounds.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise RequestError(
                f"prompt is too long: {len(ids)} tokens, at most {limit} here "
                "(max_prompt_tokens, --max-prompt-tokens)",
                prompt_param,
                code="prompt_too_long",
            )
        if max_tokens_explicit and len(ids) + params.max_new_tokens > context:
            raise RequestError(
                f"{max_tokens_param} is too large: the prompt has {len(ids)} tokens and "
                f"{max_tokens_param} is {params.max_new_tokens}, but the context length is "
                f"{context}",
                max_tokens_param,
                code="context_length_exceeded",
            )
        if logprob_start_len is not None:
            if not isinstance(logprob_start_len, int) or isinstance(logprob_start_len, bool):
                raise RequestError("logprob_start_len must be an integer", "logprob_start_len")
            if not -1 <= logprob_start_len < len(ids):
                raise RequestError(
                    f"logprob_start_len ({logprob_start_len}) must be -1 or below the prompt "
                    f"length ({len(ids)})",
                    "logprob_start_len",
                )
        top, top_max = top_logprobs_num, MAX_TOP_LOGPROBS_NUM
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= top_max:
            raise RequestError(
                f"top_logprobs_num must be an integer in [0, {top_max}], got {top!r}",
                "top_logprobs_num",
            )
        return GenerateRequest(
            rid=uuid.uuid4().hex if rid is None else check_rid(rid),
            input_ids=ids,
            params=params,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            namespace=namespace,
            reasoning_end_ids=reasoning_end_ids,
            reasoning_start_ids=reasoning_start_ids or None,
        )


def _encode_and_trim(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], add_special: bool
) -> list[list[int]]:
    ids = [encode_prompt(tokenizer, t, add_special) for t in texts]
    if sum(len(t) for t in texts) >= TRIM_AFTER_CHARS:
        # NOTE: glibc keeps the tokenizer's freed arenas (180 MiB once) otherwise
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    return ids


def per_prompt(
    value: Any, count: int, single: bool, name: str, list_of: type, broadcast: bool = True
) -> list[Any]:
    """A per-prompt list for a batch, or one value for every prompt."""
    if isinstance(value, list) and not single:
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries for {count} prompts", name)
        return value
    if value is not None and not broadcast and not single:
        raise RequestError(f"{name} must be a list with one entry per prompt", name)
    if isinstance(value, list):
        raise RequestError(f"{name} must be a single {list_of.__name__} for a single prompt", name)
    return [value] * count
