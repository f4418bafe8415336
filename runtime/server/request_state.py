"""What the HTTP process knows of a request in flight: one `ReqState` per prompt, one `Sample`
per sample, filled in by the tokenizer manager from the detokenizer's text updates."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from weft.runtime.messages.common import GrammarReport, LogprobEntry, SpecReport
from weft.runtime.messages.detokenizer_to_tokenizer import TextUpdate
from weft.runtime.server.errors import ApiError, error_kind


@dataclass
class Sample:
    """One of a request's n samples, as received so far."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    output_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_logprobs: list[LogprobEntry] | None = None
    grammar: GrammarReport | None = None  # constrained requests: as of the last update
    spec: SpecReport | None = None  # speculating requests: as of the last update
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    # what the consumer has not seen yet (a stream sends one chunk per wake-up, not per token)
    dirty: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, u: TextUpdate, now: float) -> None:
        """One update of the detokenizer's (`now`: when it arrived)."""
        self.text += u.text
        self.output_ids.extend(u.new_ids)
        self.cached_tokens = u.cached_tokens
        if u.output_logprobs:
            self.output_logprobs.extend(u.output_logprobs)
        if u.input_logprobs is not None:
            self.input_logprobs = u.input_logprobs
        if u.grammar is not None:
            self.grammar = u.grammar
        if u.spec is not None:
            self.spec = u.spec
        self.dirty = True
        if u.finish_reason is not None:
            self.finish_reason = u.finish_reason
            self.finished_at = now


@dataclass
class ReqState:
    rid: str  # what the caller knows (its own rid, or one made for it)
    prompt_tokens: int
    samples: list[Sample]
    listener: asyncio.Event  # set on every update; may be shared by a batch's states
    created: float = field(default_factory=time.perf_counter)
    error: ApiError | None = None
    want_logprobs: bool = False
    stream: bool = False  # wake the listener on every update (else on finish only)
    api: str = "native"  # the API that took it (for the request log)
    tenant: str | None = None  # who sent it, where API keys name tenants
    prompt_ids: list[int] | None = None  # kept only for the request log's texts
    deadline: asyncio.TimerHandle | None = None  # --request-timeout's timer
    # NOTE: the scheduler knows the request by this id, made here: a caller's rid is scoped to
    # its tenant and never reaches the scheduler, so no caller can name another's request (or
    # an internal one), nor learn whether another tenant's rid is in use.
    sched_rid: str = ""

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.samples)

    def outcome(self) -> tuple[str, str | None]:
        """("ok", None), ("aborted", why), or (an error kind, its message)."""
        if self.error is not None:
            return error_kind(self.error.status), self.error.message
        for sample in self.samples:
            reason = sample.finish_reason or {}
            if reason.get("type") == "abort":
                status = reason.get("status_code")
                kind = error_kind(status) if isinstance(status, int) else "aborted"
                return kind, str(reason.get("message") or "aborted")
        return "ok", None

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (the least over the samples)."""
        return min(s.cached_tokens for s in self.samples)

    @property
    def e2e_latency(self) -> float | None:
        ends = [s.finished_at for s in self.samples if s.finished_at is not None]
        return max(ends) - self.created if len(ends) == len(self.samples) else None


def request_error(state: ReqState, param: str | None = None) -> ApiError | None:
    """Why a request failed: the server's error, or a finish reason with an error status (the
    scheduler refused the request, e.g. its grammar does not compile; `param` names the field)."""
    if state.error is not None:
        return state.error
    for sample in state.samples:
        if refused(sample):
            reason = sample.finish_reason or {}
            message = str(reason.get("message") or "the request failed")
            return ApiError(message, int(reason["status_code"]), param=param)
    return None


def refused(sample: Sample) -> bool:
    """The sample ended with an error status (it has no output to send)."""
    status = (sample.finish_reason or {}).get("status_code")
    return isinstance(status, int) and status >= 400


@dataclass
class Totals:
    """Token counts over the server's finished requests (/get_server_info, the cache hit rate)."""

    num_finished: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    completion_tokens_total: int = 0

    def add(self, prompt: int, cached: int, completion: int) -> None:
        self.num_finished += 1
        self.prompt_tokens_total += prompt
        self.cached_tokens_total += cached
        self.completion_tokens_total += completion

    @property
    def cache_hit_rate(self) -> float:
        """Cached / prompt tokens."""
        prompt = self.prompt_tokens_total
        return self.cached_tokens_total / prompt if prompt else 0.0
