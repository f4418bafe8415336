"""The few central types: a request (`Req`), its finish reason, and the forward batch.

Token bookkeeping of a request (all indices into `fill_ids = input_ids + output_ids`):

    | 0 .......... prefix_len | .......... kv_len | ........ len(fill_ids) |
    | slots owned by the     | slots owned by   | tokens without KV yet   |
    | prefix cache (locked)  | this request     | (next extend / decode)  |

A step processes fill_ids[kv_len : kv_len + n]; when it reaches the end of fill_ids the request
samples one token, which is appended to output_ids (decode is the case n == 1).

A request may carry a draft: the tokens its grammar forces after fill_ids (jump-forward), then
those that followed its last tokens earlier in its text (speculative decoding, `scheduler.
speculative`). A step then feeds the draft behind fill_ids and samples a token at every draft
position; the draft tokens the model itself picks are kept, up to the first it does not, where
the model's token is taken instead. Until that step is read back, kv_len runs past
len(fill_ids) by the draft's length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from weft.runtime.messages.common import GrammarReport, SpecReport
from weft.runtime.messages.tokenizer_to_scheduler import GenerateRequest
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.thinking import Thinking

# NOTE: the scheduler names the requests it makes for an n > 1 request (its samples, the shared
# prompt) by joining the caller's rid with this separator; a caller's rid may hold no control
# character (`intake.check_rid`), so no caller can name, abort or collide with another's sample.
RID_SEP = "\x1f"


def child_rid(rid: str, part: int | str) -> str:
    """The rid of sample `part` (or of the shared "prompt") of an n > 1 request."""
    return f"{rid}{RID_SEP}{part}"


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that matched
    message: str | None = None  # why an abort happened
    status: int | None = None  # an abort that is the request's fault: the HTTP status (400)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        if self.status is not None:
            out["status_code"] = self.status
        return out


@dataclass
class LogprobRequest:
    """What logprobs a request wants back."""

    start_len: int = -1  # first prompt position to score; -1 = output tokens only
    top_k: int = 0  # top alternatives per position


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    logprob: LogprobRequest | None = None
    namespace: str = ""
    output_ids: list[int] = field(default_factory=list)
    # memory state (see the module docstring)
    req_pool_idx: int | None = None
    prefix_len: int = 0
    kv_len: int = 0
    cache_node: object = None
    # progress
    finish: FinishReason | None = None
    cached_tokens: int = 0
    admitted: bool = False
    retractions: int = 0
    blocked_by: Req | None = None  # n > 1: children wait for the shared prompt's prefill
    hidden: bool = False  # internal request (the shared-prompt prefill of n > 1)
    group_rid: str | None = None  # n > 1: the rid the caller knows; index = which sample
    index: int = 0
    generator: torch.Generator | None = None
    # overlap schedule: (step, row) of the sampled token not yet read back from the device; it
    # counts in seq_len (the next step already feeds it to the model from the device)
    pending: tuple[int, int] | None = None
    # constrained decoding: the spec's compile job, then the request's matcher
    grammar_future: Any = None
    grammar: Any = None  # weft.grammars.manager.RequestGrammar
    draft: list[int] = field(default_factory=list)  # tokens to verify (module docstring)
    spec: Any = None  # speculative decoding: weft.runtime.scheduler.speculative.Speculation
    # the output begins in the thinking: its phase (the grammar holds the answer after it)
    thinking: Thinking | None = None
    # logprobs: per prompt position from start_len, and per output token
    input_logprobs: list[tuple[float | None, int, list[tuple[float, int]]]] = field(
        default_factory=list
    )
    output_logprobs: list[tuple[float, int, list[tuple[float, int]]]] = field(default_factory=list)
    # text state, owned by the scheduler's output processor
    decoder: Any = None
    sent_len: int = 0  # text characters already reported to the caller
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @classmethod
    def from_message(cls, msg: GenerateRequest) -> Req:
        """A request as the front doors send it (`weft.runtime.intake`): the scheduler process
        and the in-process Engine take it the same way."""
        logprob = None
        if msg.logprob_start_len is not None:
            logprob = LogprobRequest(start_len=msg.logprob_start_len, top_k=msg.top_logprobs_num)
        thinking = None
        if msg.reasoning_end_ids:
            thinking = Thinking(
                tuple(msg.reasoning_end_ids),
                msg.params.thinking_budget,
                start_ids=tuple(msg.reasoning_start_ids or ()),
            )
        return cls(
            rid=msg.rid,
            input_ids=msg.input_ids,
            params=msg.params,
            logprob=logprob,
            namespace=msg.namespace,
            thinking=thinking,
        )

    def grammar_report(self) -> GrammarReport | None:
        """What meta_info reports of constrained decoding (None: no grammar, or not compiled)."""
        if self.grammar is None:
            return None
        g = self.grammar
        # NOTE: the wait ends at the compile's end, not at the poll that saw it: a step that ran
        # meanwhile held up every request that came during it, constrained or not
        wait_s = max(g.compiled.ready_at - self.created, 0.0)
        return GrammarReport(g.backend_name, g.jump_forward_tokens, wait_s, g.compiled.cached)

    def spec_report(self) -> SpecReport | None:
        """What meta_info reports of speculative decoding (None: the request never drafted)."""
        s = self.spec
        if s is None:
            return None
        return SpecReport(s.verify_ct, s.draft_tokens, s.accepted_tokens)

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids (a decode step needs one token)."""
        prompt = len(self.input_ids)
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return self.input_ids[start:end] + self.output_ids[: max(end - prompt, 0)]

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids) + (self.pending is not None)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def remaining_new_tokens(self) -> int:
        done = len(self.output_ids) + (self.pending is not None)
        return max(self.params.max_new_tokens - done, 0)

    def prefix_match_limit(self) -> int:
        """How many leading tokens may come from the prefix cache.

        NOTE: at least the last token must be computed (its logits pick the next token), and prompt
        positions that must be scored cannot come from the cache (no logits are kept there).
        """
        limit = self.seq_len - 1
        if self.logprob is not None and self.logprob.start_len >= 0 and not self.output_ids:
            limit = min(limit, max(self.logprob.start_len - 1, 0))
        return max(limit, 0)


@dataclass
class ForwardBatch:
    """Everything a forward pass needs, in the paged layout the attention kernels take.

    T = total new tokens in the step, B = requests in the step.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: the KV slot each new token writes
    req_pool_indices: torch.Tensor  # [B] int64: rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64: KV length after this step (prefix + new)
    prefix_lens: torch.Tensor  # [B] int64: KV already present before this step
    extend_lens: torch.Tensor  # [B] int64: new tokens per request
    logits_indices: torch.Tensor  # [K] int64: rows of the T tokens whose logits are needed
    # host copies for Python-side logic (no device sync needed to read them)
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # tokens the previous step sampled and nobody read yet (overlap schedule): input_ids
    # positions, and their rows in that step's sampled ids (`feed_pending`)
    pending_at: torch.Tensor | None = None
    pending_rows: torch.Tensor | None = None
    # False where seq_lens_cpu only bounds the lengths (a CUDA graph's batch: the longest
    # possible request in every row), so no host decision may take them as the rows' own
    exact_lens: bool = True
    # per request: its new tokens are output tokens only (a decode step, drafts to verify, a
    # grammar's forced tokens), none of its prompt; empty: not known (one-off batches)
    output_only_cpu: list[bool] = field(default_factory=list)

    def feed_pending(self, sampled_ids: torch.Tensor | None) -> None:
        """Copy the pending tokens into input_ids, on the device (queued behind the sampling
        that writes them: launch that first)."""
        if self.pending_at is None:
            return
        assert sampled_ids is not None, "a request has a pending token but no ids were given"
        self.input_ids[self.pending_at] = sampled_ids[self.pending_rows]
        self.pending_at = self.pending_rows = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_cpu)
