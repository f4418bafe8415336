"""Constrained decoding in the scheduler: grammar compiles in flight, the step's token masks,
and the grammar's side of every token (accepts, jump-forward drafts).

A grammar backend that raises ends only the request it raised on, with a server error (a bug in
the backend, not the request's fault); the methods return such requests for the loop to end.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time

import torch

from weft.grammars.bitmask import allocate_bitmask, set_bits_rows
from weft.grammars.manager import Compiled, GrammarManager, RequestGrammar
from weft.grammars.mask_fill import FillJob
from weft.grammars.vocab import TokenVocab
from weft.runtime.config import EngineConfig
from weft.runtime.core import FinishReason, Req
from weft.runtime.histogram import BucketCounts
from weft.runtime.model_runner import ModelRunner
from weft.runtime.scheduler.output_processor import OutputProcessor
from weft.runtime.tokenizer import text_marker_ids

logger = logging.getLogger(__name__)

GRAMMAR_QUEUE_SLACK_S = 30.0  # beyond its race's longest run, a request's wait for its grammar
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
GRAMMAR_MASK_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)
# Jump-forward drafts (core.py): at most this many forced tokens verified in one step (each is a
# row of logits and a grammar mask).
MAX_DRAFT_TOKENS = 16

# (bitmask rows on the logits' device, the constrained rows) or None (no row is constrained)
DeviceMask = tuple[torch.Tensor, list[int]] | None


@dataclasses.dataclass
class MaskJob:
    """A step's masks being filled (`Constrained.start_masks`), by row of its requests."""

    rows: list[int]  # the rows that get a mask
    firsts: list[int]  # the grammar rows (a request's first row: before any draft token)
    forced: list[int]  # the rows a thinking phase forces one token on
    bitmask: torch.Tensor  # CPU rows, pinned on CUDA
    fill: FillJob | None
    host_s: float  # the caller's time in start_masks


def _masked(req: Req) -> bool:
    """Whether the request's row gets a mask: its grammar once past the thinking (or at the
    output's first token, with the start marker's first token beside it), or a marker token
    forced (a start marker begun, the end marker at the end of the thinking budget). A
    thinking row is free: no row at all (the cheapest for the batched fill, and the sampler
    skips rows it does not constrain)."""
    thinking = req.thinking
    if thinking is None or thinking.ended:
        return req.grammar is not None
    if thinking.forced() is not None:
        return True
    return thinking.opening and req.grammar is not None


def _ending(req: Req) -> bool:
    return req.finished or (req.grammar is not None and req.grammar.ended)


def _forced(req: Req) -> int | None:
    return req.thinking.forced() if req.thinking is not None else None


class Constrained:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        output: OutputProcessor,
    ) -> None:
        self.config = config
        self.runner = runner
        self.output = output  # its tokenizer, end ids and max_seq_len are the grammars' too
        self.end_list = sorted(output.end_ids)  # the grammar backends take them as a list
        self._grammars: GrammarManager | None = None
        self._bitmask: torch.Tensor | None = None  # CPU rows filled per step (pinned on CUDA)
        self._whitespace_ids: frozenset[int] | None = None  # built on the first gap
        self._whitespace_row: torch.Tensor | None = None
        self.compile_s = BucketCounts(GRAMMAR_COMPILE_BUCKETS)  # per constrained request
        self.served_by: collections.Counter[str] = collections.Counter()  # backend -> requests
        self.cache_hits = 0  # constrained requests whose grammar was cached when they came
        self.mask_s = BucketCounts(GRAMMAR_MASK_BUCKETS)  # per step with constrained rows

    @property
    def grammars(self) -> GrammarManager:
        """Created on the first constrained request (the vocabulary takes ~1 s to convert)."""
        if self._grammars is None:
            tokenizer, vocab_size = self.output.tokenizer, self.runner.model_config.vocab_size
            if tokenizer is None:
                raise ValueError("constrained decoding needs the model's tokenizer")
            end_ids = self.end_list
            markers = text_marker_ids(tokenizer)
            self._grammars = GrammarManager(
                lambda: TokenVocab.from_tokenizer(tokenizer, vocab_size, end_ids, markers),
                order=self.config.grammar_backends,
                timeout_s=self.config.grammar_compile_timeout,
                compact_json=self.config.constrained_json_disable_any_whitespace,
                race_budget_s=self.config.grammar_race_budget,
            )
        return self._grammars

    def prepare(self) -> concurrent.futures.Future[None] | None:
        """The grammar backends built in the background from the start (a model without a
        tokenizer has no constrained requests to build them for): the build's future."""
        if self.output.tokenizer is None:
            return None
        return self.grammars.prepare()

    # ---- compiles in flight ---------------------------------------------------------------

    def submit(self, req: Req) -> concurrent.futures.Future[Compiled] | None:
        """Start compiling the request's grammar (None: unconstrained). ValueError: no tokenizer
        to build the grammars' vocabulary from."""
        if req.params.grammar is not None:  # parsed where the request came in
            return self.grammars.submit(req.params.grammar)
        if req.params.constraint is None:
            return None
        # NOTE: a request built without validation; the JSON schema meta-validation is skipped (SamplingParams.validate ran it in
        # the HTTP process or Engine): up to a second of Python, which even on a worker thread
        # would stall the loop (each torch op waits for the GIL)
        return self.grammars.submit_field(
            *req.params.constraint, self.config.max_grammar_chars, validated=True
        )

    def poll(self, wait: list[Req]) -> tuple[list[Req], list[Req]]:
        """Take the requests whose grammar is ready out of `wait`: (ready, failed). A request
        that waited past `wait_limit_s` fails (a 503: the compiles are backed up); so does one
        whose grammar did not compile (a 400)."""
        limit = self.wait_limit_s
        now = time.perf_counter()
        failed = []
        for req in [r for r in wait if now - r.created > limit]:
            if not req.grammar_future.done():
                wait.remove(req)
                self.forget_job(req, wait)
                message = f"the request's grammar did not compile within {limit:g} s"
                message += " (the grammar compiles are backed up)"
                self.output.finish(req, FinishReason("abort", message=message, status=503))
                failed.append(req)
        ready = []
        for req in [r for r in wait if r.grammar_future.done()]:
            wait.remove(req)
            try:
                compiled = req.grammar_future.result()
                if req.index == 0:  # n > 1 samples share one compile
                    self.compile_s.observe(compiled.compile_s)
                    self.served_by[compiled.backend.name] += 1
                    self.cache_hits += compiled.cached
                req.grammar = RequestGrammar(compiled, self.end_list)
                ready.append(req)
            except Exception as exc:  # GrammarError, or a matcher the backend cannot build
                self.output.finish(req, FinishReason("abort", message=str(exc), status=400))
                failed.append(req)
            finally:
                req.grammar_future = None
        return ready, failed

    def forget_job(self, req: Req, wait: list[Req]) -> None:
        """The request no longer waits for its grammar: a compile nobody else in `wait` waits
        for (n > 1 samples share one) is cancelled, if it has not started, to free its place."""
        job, req.grammar_future = req.grammar_future, None
        if job is not None and not any(r.grammar_future is job for r in wait):
            job.cancel()

    @property
    def wait_limit_s(self) -> float:
        """How long a request may wait for its grammar: its race's longest run (each backend
        joins at most a race budget, or a timeout, after the one before; the last runs to its
        timeout), plus GRAMMAR_QUEUE_SLACK_S in the chain queue.

        NOTE: a compile future that never resolves (a deadlocked grammar worker once held 31
        requests forever) must not hold a request without bound."""
        timeout = self.config.grammar_compile_timeout
        joins = (len(self.config.grammar_backends) - 1) * min(
            self.config.grammar_race_budget, timeout
        )
        return joins + timeout + GRAMMAR_QUEUE_SLACK_S

    @staticmethod
    def wait(wait: list[Req], timeout_s: float = 0.01) -> None:
        """Nothing to run but compiles in flight: block briefly instead of spinning."""
        futures = [r.grammar_future for r in wait]
        concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    # ---- the step's masks -----------------------------------------------------------------

    def start_masks(
        self, reqs: list[Req], drafts: dict[Req, list[int]], *, wait: bool
    ) -> MaskJob | None:
        """Start filling the mask rows for the requests by row (None: no row gets one). The
        grammars' batches run on their native threads until `finish_masks`; a request's grammar
        must not be touched (accepts, drafts) meanwhile. wait: the caller finishes them next
        (some of the fill then runs on this thread).

        A drafting request has a row per draft token after its first: masked as its grammar
        stands after that token (filled in `finish_masks`)."""
        # (a request the read-back finished, or whose grammar took an end token, is sampled and
        # dropped unmasked: overlap.read_tokens starts this fill before it emits the tokens)
        rows = [i for i, r in enumerate(reqs) if _masked(r) and not _ending(r)]
        if not rows:
            return None
        start = time.perf_counter()
        vocab_size = self.runner.model_config.vocab_size
        if self._bitmask is None or self._bitmask.shape[0] < len(reqs):
            size = max(len(reqs), self.config.max_running_requests)
            self._bitmask = allocate_bitmask(
                size, vocab_size, pin=self.runner.device.type == "cuda"
            )
        # NOTE: one pinned buffer for every step: the previous step's copy from it to the device
        # is done, as its sampled tokens (sampled after the copy) were read back before this
        bitmask = self._bitmask[: len(reqs)]
        firsts = [i for i in rows if i == 0 or reqs[i - 1] is not reqs[i]]
        forced = [i for i in firsts if _forced(reqs[i]) is not None]
        firsts = [i for i in firsts if i not in forced]
        grammars = [reqs[i].grammar for i in firsts]
        fill = self.grammars.fills.start(grammars, bitmask, firsts, inline=wait) if firsts else None
        host_s = time.perf_counter() - start
        return MaskJob(rows, firsts, forced, bitmask, fill, host_s)

    def finish_masks(
        self, job: MaskJob | None, reqs: list[Req], drafts: dict[Req, list[int]]
    ) -> tuple[DeviceMask, list[Req]]:
        """Wait for the fill of `start_masks(reqs, drafts)`, add the thinking's and the drafts'
        rows, and copy the bitmask to the device: (the mask, the requests whose grammar backend
        failed). Those are finished (a server error) and their rows left unmasked: the caller
        drops their tokens and ends them. A draft the grammar does not take whole is cut in
        place."""
        if job is None:
            return None, []
        start = time.perf_counter()
        bitmask = job.bitmask
        failed: list[Req] = []
        try:
            if job.fill is not None:
                job.fill.join()
        except Exception:  # NOTE: a backend's bug: find the rows that raise, one by one
            failed = self._fill_rows_apart(reqs, job.firsts, bitmask)
        self._fill_thinking(reqs, job.firsts, job.forced, bitmask)
        for i in job.firsts:
            draft = drafts.get(reqs[i])
            if draft and reqs[i] not in failed:
                try:
                    del draft[self.grammars.fill_draft(reqs[i].grammar, draft, bitmask, i) :]
                except Exception as exc:
                    self._failed(reqs[i], exc)
                    failed.append(reqs[i])
        rows = [i for i in job.rows if reqs[i] not in failed] if failed else job.rows
        self.mask_s.observe(job.host_s + time.perf_counter() - start)
        if not rows:
            return None, failed
        return (bitmask.to(self.runner.device, non_blocking=True), rows), failed

    def _fill_thinking(
        self, reqs: list[Req], grammar_rows: list[int], forced: list[int], bitmask: torch.Tensor
    ) -> None:
        """The thinking phase's rows: a request writing a start marker, or past its thinking
        budget, may sample only the marker's next token; one at the output's first token may
        also open the thinking (the start marker's first token); one in the gap after the end
        marker may also write whitespace (weft.runtime.thinking)."""
        if forced:
            bitmask[forced] = 0
            for i in forced:
                token = _forced(reqs[i])
                assert token is not None
                set_bits_rows(bitmask, [i], [token], [True])
        gap: list[int] = []
        for i in grammar_rows:  # NOTE: one pass: this runs for every constrained row each step
            thinking = reqs[i].thinking
            if thinking is None:
                continue
            start = thinking.may_open()
            if start is not None:
                set_bits_rows(bitmask, [i], [start], [True])
            if thinking.in_gap:
                gap.append(i)
        if gap:
            bitmask[gap] |= self.whitespace_row

    @property
    def whitespace_row(self) -> torch.Tensor:
        """A bitmask row of the whitespace-only tokens (the gap after a thinking's end)."""
        if self._whitespace_row is None:
            row = allocate_bitmask(1, self.runner.model_config.vocab_size)
            row.zero_()
            set_bits_rows(row, [0], sorted(self.whitespace_ids), [True])
            self._whitespace_row = row[0]
        return self._whitespace_row

    @property
    def whitespace_ids(self) -> frozenset[int]:
        if self._whitespace_ids is None:
            texts = self.grammars.vocab.token_bytes
            self._whitespace_ids = frozenset(
                i
                for i, b in enumerate(texts)
                if b and not b.strip() and i not in self.output.end_ids
            )
        return self._whitespace_ids

    def _fill_rows_apart(
        self, reqs: list[Req], rows: list[int], bitmask: torch.Tensor
    ) -> list[Req]:
        """The batched fill raised: fill row by row to find the culprits, and end them. Returns
        them (the other rows are filled)."""
        failed = []
        for i in rows:
            if reqs[i].finished:
                continue  # (since the fill began: its token is dropped)
            try:
                self.grammars.fill([reqs[i].grammar], bitmask, [i])
            except Exception as exc:
                self._failed(reqs[i], exc)
                failed.append(reqs[i])
        return failed

    def _failed(self, req: Req, exc: Exception) -> None:
        """A grammar backend raised on this request: it ends with a server error."""
        name = req.grammar.backend_name
        logger.error("grammar backend %s failed on request %s", name, req.rid, exc_info=exc)
        message = f"the grammar backend {name} failed: {type(exc).__name__}: {exc}"
        self.output.finish(req, FinishReason("abort", message=message, status=500))

    # ---- tokens through the grammar -------------------------------------------------------

    def keep_draft(self, req: Req, kept: list[int], forced: int) -> None:
        """The draft tokens the model picked itself (`Speculative.take_draft`) through the
        request's grammar, if any, into its output; the first `forced` of the draft are the
        grammar's own (jump-forward). The request may end among them (a stop string, its token
        limit); its release then frees the KV of draft tokens it did not keep
        (MemoryManager.release)."""
        grammar: RequestGrammar | None = req.grammar
        if grammar is not None:
            try:
                for tid in kept:  # NOTE: taken when the masks were filled: cannot fail
                    if not grammar.accept(tid):
                        raise RuntimeError(f"the grammar took draft token {tid}, then refused it")
            except Exception as exc:  # NOTE: a backend's bug ends this request, not the scheduler
                self._failed(req, exc)
                return
            grammar.jump_forward_tokens += min(len(kept), forced)
            if kept and req.thinking is not None:
                req.thinking.close_gap()  # the draft is the grammar's: the answer has begun
        for tid in kept:
            self.output.append_token(req, tid, None, None)
            if req.finished:
                break

    def think(
        self, req: Req, token: int, logprob: float | None, top: list[tuple[float, int]] | None
    ) -> None:
        """A token of the thinking: output as it is, watched for the end marker. The marker's
        last token starts the answer: the grammar (if any) from its initial state, and its
        draft of the tokens it forces first."""
        thinking = req.thinking
        assert thinking is not None and thinking.free
        self.output.append_token(req, token, logprob, top)
        if req.finished or not thinking.observe(token) or req.grammar is None:
            return
        self._draft(req)

    def open(
        self, req: Req, token: int, logprob: float | None, top: list[tuple[float, int]] | None
    ) -> bool:
        """A token of the opening phase (weft.runtime.thinking): the start marker's is output
        as it is (True; the thinking begins after its last); any other ends the phase without
        thinking (False), and the caller appends it as the answer's first token."""
        thinking = req.thinking
        assert thinking is not None and thinking.opening
        if not thinking.open(token):
            return False
        self.output.append_token(req, token, logprob, top)
        return True

    def append(
        self, req: Req, token: int, logprob: float | None, top: list[tuple[float, int]] | None
    ) -> None:
        """The model's token through the grammar (a refused one ends the request), then the
        grammar's draft of the tokens it forces next. Whitespace in the gap after a thinking's
        end is output without the grammar (weft.runtime.thinking)."""
        req.draft = []
        thinking = req.thinking
        if thinking is not None and token >= 0 and thinking.take_gap(token in self.whitespace_ids):
            self.output.append_token(req, token, logprob, top)
            if not req.finished:
                self._draft(req)
            return
        if self.accept(req, token):
            self.emit(req, token, logprob, top)

    def accept(self, req: Req, token: int) -> bool:
        """The model's token through the grammar, not output yet (`emit` does that). False: the
        grammar refused it, or its backend failed; the request is finished."""
        req.draft = []
        try:
            if token >= 0 and req.grammar.accept(token):
                return True
        except Exception as exc:  # NOTE: a backend's bug ends this request, not the scheduler
            self._failed(req, exc)
            return False
        self.output.finish(
            req, FinishReason("abort", message=f"the grammar rejected token {token}")
        )
        return False

    def emit(
        self, req: Req, token: int, logprob: float | None, top: list[tuple[float, int]] | None
    ) -> None:
        """An accepted token into the output; the request stops where its grammar ended, else
        the grammar drafts the tokens it forces next (where this request drafts: `drafts_for`).

        NOTE: reads no matcher unless it drafts: the read-back emits while the next step's masks
        are filled (overlap.read_tokens)."""
        self.output.append_token(req, token, logprob, top)
        if req.grammar.ended and not req.finished:  # ignore_eos cannot outlast the grammar
            self.output.finish(req, FinishReason("stop", matched=token))
        if not req.finished:
            self._draft(req)

    def _draft(self, req: Req) -> None:
        """The grammar's draft of the tokens it forces next, where this request drafts."""
        req.draft = []
        if not self.drafts_for(req):
            return
        try:
            req.draft = req.grammar.draft(self._draft_limit(req))
        except Exception as exc:
            self._failed(req, exc)

    def drafts_for(self, req: Req) -> bool:
        """Whether jump-forward drafts this request. Not where CUDA graphs replay the decode
        steps, unless enable_jump_forward: a step that feeds drafts now replays a graph too (its
        draft tokens as rows of a decode batch, batch_builder.verify_rows_apart), but it reads
        its tokens back before the next step is laid out (no overlap), and that trade has not
        been measured on a GPU since (benchmarks/bench_grammar.py decode; before, eagerly, it
        ran 0.36x at batch 1). Not with logprobs asked for (a draft token has none), penalties
        or min_new_tokens still to reach (the draft rows would share the request's penalties
        and token count as they stand before the draft)."""
        p = req.params
        return (
            not self.config.disable_jump_forward
            and (self.config.enable_jump_forward or self.runner.graphs is None)
            and req.logprob is None
            and not p.has_penalties
            and len(req.output_ids) >= p.min_new_tokens
        )

    def _draft_limit(self, req: Req) -> int:
        """Draft tokens that leave room for the model's token after them."""
        room = min(req.remaining_new_tokens, self.output.max_seq_len - req.seq_len) - 1
        return min(room, MAX_DRAFT_TOKENS)
