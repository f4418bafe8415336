"""The overlap schedule: step N + 1's forward is launched before step N's sampled tokens are
read back; reading them (and appending, detokenizing, grammar accepts) then runs while the
device computes.

A request whose token is still on the device has `Req.pending = (step, row)`: the token counts
in seq_len, and the next forward takes it from the device (`ForwardBatch.feed_pending`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from weft.runtime.config import EngineConfig
from weft.runtime.core import Req
from weft.runtime.sampler import Sampled, read_back
from weft.runtime.scheduler.constrained import Constrained
from weft.runtime.scheduler.speculative import Speculative


def overlap_schedule(config: EngineConfig, device: torch.device) -> bool:
    """On by default on CUDA only: on a CPU the "device" is this thread, and overlapping would
    only delay the outputs (--enable-overlap-schedule forces it, to test its logic there)."""
    if config.enable_overlap_schedule:
        return True
    return device.type == "cuda" and not config.disable_overlap_schedule


@dataclasses.dataclass
class InFlight:
    """A step whose sampled tokens are still on the device."""

    step: int
    reqs: list[Req]  # row i of `ids` is reqs[i]'s token
    ids: torch.Tensor  # [K] int64, on the device
    raw_logprobs: torch.Tensor | None
    # the drafts verified, by the row of their request's first token: rows row .. row + len(draft)
    # are its samples after each draft token (row itself: after none)
    drafts: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # overlap on CUDA: `ids` copied to pinned memory right behind the sampling, and its event
    host_ids: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    result: Sampled | None = None

    def read(self) -> Sampled:
        """The sampled tokens on the host (waits for the device the first time)."""
        if self.result is None:
            if self.ready is not None:
                self.ready.synchronize()
            ids = self.ids if self.host_ids is None else self.host_ids
            self.result = read_back(ids, self.raw_logprobs, self.reqs)
        return self.result


def launch(
    step: int,
    reqs: list[Req],
    sampled: tuple[torch.Tensor, torch.Tensor | None],
    drafts: dict[Req, list[int]],
    *,
    overlap: bool,
) -> InFlight:
    """The step's sampled (ids, raw logprobs), not read back: each request's token pending at
    its first row. Read back at once where logprobs are wanted (rare: no overlap then)."""
    ids, raw_logprobs = sampled
    flight = InFlight(step, reqs, ids, raw_logprobs)
    mark_pending(step, reqs)
    for i, req in enumerate(reqs):
        if req.pending == (step, i) and req in drafts:
            flight.drafts[i] = drafts[req]
    if overlap and raw_logprobs is not None:
        flight.read()
    elif overlap and ids.is_cuda:
        # NOTE: queue the copy to the host right behind the sampling: a read-back queued later
        # (.tolist() in read_tokens) would wait behind the next step's forward as well
        flight.host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        flight.host_ids.copy_(ids, non_blocking=True)
        flight.ready = torch.cuda.Event()
        flight.ready.record()
    return flight


def mark_pending(step: int, reqs: list[Req]) -> None:
    """Each live request's token of the step is pending at its first row; a finished one's
    (its grammar backend failed while its mask was filled) is dropped."""
    for i, req in enumerate(reqs):
        if i == 0 or reqs[i - 1] is not req:
            req.pending = None if req.finished else (step, i)


def read_tokens(
    flight: InFlight,
    constrained: Constrained,
    speculative: Speculative,
    accepted: Callable[[], None] | None = None,
) -> list[Req]:
    """Read the step's tokens back and append them: a drafting request's kept draft tokens
    first, a constrained request's tokens through its grammar; then each live request's next
    draft (the grammar's; the caller adds the drafter's, `Speculative.propose`). Returns the
    requests that got a token or finished, by row (not those aborted or retracted since the
    launch).

    In two passes: first every token that moves a grammar or a thinking phase, then `accepted()`
    (the scheduler starts the next step's mask fill there, on the fill's threads), then the
    output of the rest (detokenizing, stop checks: most of the time, now beside the fill). A
    request that drafts is done whole in the first pass: its draft reads the matcher. A step
    with no such token calls no `accepted()` (nothing to fill early)."""
    result = flight.read()
    rows = [i for i, req in enumerate(flight.reqs) if req.pending == (flight.step, i)]
    later: list[tuple[int, bool]] = []  # (row, its token accepted by the grammar: emit it)
    # NOTE: a token emitted later stays pending until then: seq_len counts it throughout, as the
    # fill's choice of rows to sample expects
    for i in rows:  # (the others were aborted or retracted meanwhile)
        req = flight.reqs[i]
        if req.grammar is None and req.thinking is None and i not in flight.drafts:
            later.append((i, False))
        elif i in flight.drafts or req.thinking is not None or constrained.drafts_for(req):
            req.pending = None
            _take(flight, i, result, constrained, speculative)
        elif constrained.accept(req, result.token_ids[i]):
            later.append((i, True))
        else:
            req.pending = None
            _keep_fed(req, req.kv_len > req.seq_len, result.token_ids[i])  # (see _take)
    plain = sum(not emit for _, emit in later)  # rows no grammar or thinking phase takes
    if accepted is not None and plain < len(rows):
        accepted()
    for i, emit in later:
        req = flight.reqs[i]
        req.pending = None
        logprob = result.logprobs[i] if result.logprobs and req.logprob else None
        top = result.top[i] if result.top else None
        if emit:
            constrained.emit(req, result.token_ids[i], logprob, top)
        else:
            constrained.output.append_token(req, result.token_ids[i], logprob, top)
    got = [flight.reqs[i] for i in rows]
    return got


def _take(
    flight: InFlight, i: int, result: Sampled, constrained: Constrained, speculative: Speculative
) -> None:
    """Row i's token (and its kept draft tokens), through its grammar or thinking phase."""
    req = flight.reqs[i]
    logprob = result.logprobs[i] if result.logprobs and req.logprob else None
    top = result.top[i] if result.top else None
    token = result.token_ids[i]
    draft = flight.drafts.get(i)
    if draft is not None:
        taken = speculative.take_draft(req, draft, result.token_ids[i : i + 1 + len(draft)])
        token = result.token_ids[i + taken]
        forced = req.spec.forced if req.spec is not None else len(draft)
        constrained.keep_draft(req, draft[:taken], forced)
    if draft is not None and req.finished:
        pass  # it ended among the draft tokens it kept
    elif (
        req.thinking is not None
        and req.thinking.opening
        and constrained.open(req, token, logprob, top)
    ):
        pass  # a start marker token (else the answer begins with it: appended below)
    elif req.thinking is not None and req.thinking.free:
        # NOTE: the marker's last token switches the phase here, before the next step's
        # masks are filled (`Scheduler._run` reads back before it launches the sampling)
        constrained.think(req, token, logprob, top)
    elif req.grammar is None:
        constrained.output.append_token(req, token, logprob, top)
    else:
        # NOTE: the step launched just before this read-back may have fed the token to the
        # model already (its KV is being written)
        fed = req.kv_len > req.seq_len  # (pending is cleared: seq_len counts no token)
        constrained.append(req, token, logprob, top)
        _keep_fed(req, fed, token)


def _keep_fed(req: Req, fed: bool, token: int) -> None:
    if fed and req.finished and req.kv_len > req.seq_len:
        # NOTE: ended without its token (rejected, or the backend failed), which has KV
        # already: keep it, so that release() caches as many tokens as slots
        req.output_ids.append(token)
