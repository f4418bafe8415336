"""The scheduler: continuous batching with chunked prefill mixed into decode steps.

One `step()` = pick work (`admission`), lay it out and run the forward (`batch_builder`),
sample with the grammars' masks (`constrained`), report the tokens (`output_processor`); under
the overlap schedule the tokens are read back during the next step's forward (`overlap`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from weft.grammars.manager import GrammarManager
from weft.runtime.config import EngineConfig
from weft.runtime.core import FinishReason, Req
from weft.runtime.loaders.end_tokens import end_token_ids
from weft.runtime.loaders.source import ModelSource
from weft.runtime.model_config import ModelConfig
from weft.runtime.model_runner import ModelRunner
from weft.runtime.sampler import sample_on_device
from weft.runtime.scheduler.admission import Admission, default_chunk_size
from weft.runtime.scheduler.arrivals import Arrivals
from weft.runtime.scheduler.batch_builder import RowPlan, build_batch, verify_rows_apart
from weft.runtime.scheduler.constrained import Constrained, MaskJob
from weft.runtime.scheduler.draft_model import DraftModel, check_draft_model, load_draft_model
from weft.runtime.scheduler.memory import MemoryManager
from weft.runtime.scheduler.output_processor import OutputProcessor
from weft.runtime.scheduler.overlap import (
    InFlight,
    launch,
    mark_pending,
    overlap_schedule,
    read_tokens,
)
from weft.runtime.scheduler.speculative import Speculative
from weft.runtime.scheduler.step_profile import step_profile
from weft.runtime.tokenizer import load_tokenizer
from weft.runtime.tp_driver import TPDriver
from weft.runtime.tp_processes import Rank0, check_tp

PROMPT_LOGITS_CHUNK = 256  # rows of [rows, vocab] float32 logits computed at once


@dataclasses.dataclass
class Sampling:
    """A step's sampling, not launched yet: its masks are being filled (overlap schedule)."""

    step: int
    logits: torch.Tensor
    reqs: list[Req]  # by row of logits
    drafts: dict[Req, list[int]]
    masks: MaskJob | None


def build_scheduler(
    config: EngineConfig,
    source: ModelSource,
    *,
    on_rank_exit: Callable[[str], None] | None = None,
) -> Scheduler:
    """The scheduler with all it owns: tokenizer, model runner (weights, KV pool), end ids;
    with tp_size > 1, this host's other ranks too (this process is rank 0: `close` stops them;
    `on_rank_exit(why)` is called from a thread when one exits before that)."""
    model = ModelConfig.from_folder(source.folder)  # a bad config.json fails before any load
    tokenizer = load_tokenizer(source.tokenizer_folder) if source.tokenizer_folder else None
    end_ids = end_token_ids(tokenizer, model, source.folder)
    plan = None
    if config.speculative_algorithm == "draft":  # refused before any load
        plan = check_draft_model(config, model, tokenizer, end_ids)
    tp = None
    if config.tp_size == 1:
        runner = ModelRunner(config, source)
    else:
        check_tp(config, model)
        tp = Rank0(config, source, on_rank_exit)
        runner = tp.driver.runner
    draft = None
    if plan is not None:
        chunk_size = config.chunked_prefill_size or default_chunk_size(runner.device)
        draft = load_draft_model(config, plan, runner, end_ids, chunk_size=chunk_size)
    return Scheduler(config, runner, tokenizer, end_ids, tp=tp, draft=draft)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase | None,
        end_ids: frozenset[int],
        *,
        tp: Rank0 | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.runner = runner
        self.tp = tp
        # what runs the steps: the runner, or under tensor parallelism the driver that has the
        # other ranks run each step too
        self.executor: ModelRunner | TPDriver = runner if tp is None else tp.driver
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self.chunk_size = config.chunked_prefill_size or default_chunk_size(runner.device)
        self.max_seq_len = min(runner.context_length, runner.kv_pool.size)
        self.memory = MemoryManager(
            runner.kv_pool, runner.req_to_token, use_cache=not config.disable_radix_cache
        )
        self.output = OutputProcessor(tokenizer, end_ids, self.max_seq_len)
        self.constrained = Constrained(config, runner, self.output)
        self.speculative = Speculative(
            config, self.memory, self.output, draft, device_type=runner.device.type
        )
        # the grammar backends, built in the background from now (`wait_for_grammars`)
        self._grammars_built = self.constrained.prepare()
        self.arrivals = Arrivals(config.random_seed, self.constrained, self.memory.cache.enabled)
        self.admission = Admission(
            self.memory,
            chunk_size=self.chunk_size,
            max_running=config.max_running_requests,
            max_seq_len=self.max_seq_len,
            lpm=config.schedule_policy == "lpm",
        )
        self.overlap = overlap_schedule(config, runner.device)
        graphs = runner.graphs
        self.verify_graph_rows = graphs.max_bs if graphs is not None else None
        self.profile = step_profile(config.profile_steps, runner.device)  # a no-op when off
        self.grammar_wait: list[Req] = []  # waiting for their grammar to compile
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._updates: list[Req] = []  # got a token or finished since the last step returned
        self._inflight: InFlight | None = None
        self._sampling: Sampling | None = None  # launched once the next step is laid out
        # the step's sampling rows, requests and masks, started during the read-back (_resolve)
        self._early: tuple[list[int], list[Req], MaskJob] | None = None
        self.num_retractions = 0
        self.num_steps = 0
        self.num_tokens_computed = 0  # tokens through the model (prefill + decode)
        self.num_overlapped_steps = 0  # forwards launched before the previous tokens were read
        self.peak_running = 0
        self.grammar_compile_s = self.constrained.compile_s  # per constrained request
        self.grammar_mask_s = self.constrained.mask_s  # per step with constrained rows

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until the grammar backends are built (or `timeout` s passed; a build that
        failed was logged, and each constrained request will say why). The server waits before
        it says it is ready: on 2 CPU cores the build (~2.5 s for a 152k vocabulary) otherwise
        shares them with the first request, whose first token then took 2.6 s instead of
        0.3 s (benchmarks/RESULTS.md)."""
        if self._grammars_built is not None:
            concurrent.futures.wait([self._grammars_built], timeout)

    @property
    def config(self) -> EngineConfig:
        return self.constrained.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        # NOTE: tests and benchmarks swap it between runs (jump-forward, speculation, grammar
        # timeouts); the admission limits and the grammar manager stay as built
        self.constrained.config = config
        self.speculative.config = config
        self._cap_draft_rows()

    @property
    def verify_graph_rows(self) -> int | None:
        """Most rows of a step with drafts that a CUDA graph replays (None: such steps run
        eagerly); set (tests, benchmarks), it caps the drafts anew."""
        return self._verify_graph_rows

    @verify_graph_rows.setter
    def verify_graph_rows(self, rows: int | None) -> None:
        self._verify_graph_rows = rows
        self._cap_draft_rows()

    def _cap_draft_rows(self) -> None:
        """Where CUDA graphs replay decode steps, a step's drafts stay within the largest graph's
        rows: speculation's row budget, and the step admission lays out (or
        speculative_max_step_rows where set larger): a step past them runs eagerly. Admission
        does not cap them with enable_jump_forward: its drafts are fed at any batch, eagerly past
        the graphs (a full graph's batch would otherwise never draft)."""
        graph_rows = self._verify_graph_rows
        self.speculative.graph_rows = graph_rows
        explicit = self.config.speculative_max_step_rows or 0
        if graph_rows is None or self.config.enable_jump_forward:
            self.admission.draft_rows = None
        else:
            self.admission.draft_rows = max(graph_rows, explicit)

    @property
    def grammars(self) -> GrammarManager:
        return self.constrained.grammars

    # ---- requests in and out ----------------------------------------------------------------

    def add(self, req: Req) -> list[Req]:
        """Queue a request; n > 1 becomes n sampled children sharing one prompt prefill.
        A constrained request first waits (in `grammar_wait`) for its grammar to compile."""
        queued = self.arrivals.add(req)
        self.waiting += queued.ready
        self.grammar_wait += queued.compiling
        self._report(queued.failed)
        return queued.children

    def abort(self, rid: str) -> bool:
        """Abort by rid (or every child of an n > 1 group). Returns whether anything matched."""
        queues = (self.running, self.waiting, self.grammar_wait)
        hit = [r for q in queues for r in q if rid in (r.rid, r.group_rid)]
        if hit and self._unresolved:
            self._resolve()  # release() needs every token of the request on the host
            hit = [r for r in hit if not r.finished]
        # NOTE: a request a read-back gave a token is in _updates; the abort reports it (that
        # token included). Listed twice, it was reported twice, and the server's scheduler
        # process died on the second update (KeyError). The read-back may be an earlier abort's
        # of this same step (a client that leaves a batch aborts its rids one by one).
        self._updates = [r for r in self._updates if r not in hit]
        for req in hit:
            next(q for q in queues if req in q).remove(req)
            self.constrained.forget_job(req, self.grammar_wait)
            self.memory.release(req)
            self.speculative.forget(req)
            self.output.finish(req, FinishReason("abort", message="aborted by request"))
        self._report(hit)
        return bool(hit)

    @property
    def has_work(self) -> bool:
        queued = self.waiting or self.running or self.grammar_wait or self._updates
        return bool(queued) or self._unresolved

    @property
    def _unresolved(self) -> bool:
        """A step's tokens are not on the host yet (sampled, or still to be)."""
        return self._inflight is not None or self._sampling is not None

    # ---- the loop body --------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Req]:
        """One iteration; returns the (visible) requests that got a token or finished."""
        self.profile.begin()
        if self._inflight is not None and self._inflight.drafts:
            self._resolve()  # which of its drafts the model took decides what is fed next
        if self.grammar_wait:
            ready, failed = self.constrained.poll(self.grammar_wait)
            self.waiting += ready
            self._report(failed)
        if self._unresolved and self.admission.decode_short(self.running):
            self._resolve()  # a retracted request must have its tokens on the host
        decision = self.admission.schedule(self.running, self.waiting, in_flight=self._unresolved)
        self.num_retractions += len(decision.retracted)
        for req in decision.retracted:
            self.speculative.forget(req)
        if decision.work:
            self._run(decision.work)
        elif self._unresolved:
            self._resolve()
        elif self.grammar_wait and not self._updates:
            self.constrained.wait(self.grammar_wait)
        updates, self._updates = self._updates, []
        self.profile.end()
        return updates

    def _run(self, work: list[tuple[Req, int]]) -> None:
        """The forward of the step's work; the previous step's tokens are read back while it
        runs (overlap schedule), this step's right after it otherwise."""
        start = time.perf_counter()
        apart = verify_rows_apart(work, self.verify_graph_rows)
        batch, plans = build_batch(work, self.memory, self.runner.device, token_rows_apart=apart)
        self.profile.mark("sched")
        failed = self._sample()  # the previous step's: its masks were filled meanwhile
        prev = self._inflight
        batch.feed_pending(prev.ids if prev is not None else None)
        hidden = self.executor.forward(batch)
        self.profile.mark("forward")
        self.profile.count("tokens", batch.num_tokens)
        for plan in plans:
            plan.req.kv_len += plan.num_tokens
        self._end(failed)  # NOTE: not before: this step's slots must count as theirs to free
        self.num_steps += 1
        self.num_tokens_computed += batch.num_tokens
        if prev is not None:
            self.num_overlapped_steps += 1
            self._resolve(plans)
        self._launch(hidden, plans)
        if not self.overlap:
            self._resolve()
            if (
                self.speculative.times_steps
                and batch.output_only_cpu
                and all(batch.output_only_cpu)
            ):
                # a decode step's whole cost for its rows, what drafting weighs (StepCost)
                self.speculative.cost.record(batch.num_tokens, time.perf_counter() - start)
        self.peak_running = max(self.peak_running, len(self.running))
        self.admission.decay()

    def _launch(self, hidden: torch.Tensor, plans: list[RowPlan]) -> None:
        """Prompt logprobs, prefill progress into the cache, then sampling (not read back)."""
        for plan in plans:
            req = plan.req
            if plan.prompt_rows:
                self._score_prompt(hidden, plan)
            if plan.sample_row is None and req.kv_len == req.seq_len and not req.finished:
                self._end([req], FinishReason("length"))  # max_new_tokens == 0
            elif plan.num_tokens > 1 and not plan.draft and not req.finished:
                self.memory.cache_progress(req)  # others may share this prefill from now on
        early, self._early = self._early, None
        masks: MaskJob | None
        if early is not None:  # (its requests the read-back finished are sampled and dropped)
            rows, reqs, masks = early
            drafts: dict[Req, list[int]] = {}
        else:
            rows, reqs, drafts = self._sampling_rows(plans)
        if not reqs:
            return
        index = None
        if rows != list(range(hidden.shape[0])):  # a decode step samples every row, in order
            index = torch.tensor(rows, device=hidden.device)
        self.profile.mark("host")
        logits = self.executor.logits(hidden, index)
        self.profile.mark("logits")
        # NOTE: the masks are filled while the device computes the forward and the logits
        # (launched, not awaited), and under the overlap schedule while the host lays out the
        # next step too: this step samples right before that one's forward. Not with drafts:
        # which draft tokens the model takes decides what the next step feeds.
        defer = self.overlap and not drafts
        if early is None:
            start = time.perf_counter()
            masks = self.constrained.start_masks(reqs, drafts, wait=not defer)
            self.profile.host("fill_s", start)
        self.profile.count("rows", len(reqs))
        self.profile.count("masked_rows", len(masks.rows) if masks is not None else 0)
        self._sampling = Sampling(self.num_steps, logits, reqs, drafts, masks)
        if defer and masks is not None:
            mark_pending(self.num_steps, reqs)  # (the next step reads them from the device)
        else:
            self._end(self._sample())

    @staticmethod
    def _sampling_rows(
        plans: list[RowPlan],
    ) -> tuple[list[int], list[Req], dict[Req, list[int]]]:
        """The rows of the step's hidden states to sample, their requests (a drafting request
        samples after each draft token too) and the drafts.

        NOTE: a row is sampled only if its request is still live and fully computed: under the
        overlap schedule it may have finished, or grown by jump-forward text, since this step
        was built."""
        rows: list[int] = []
        reqs: list[Req] = []
        drafts: dict[Req, list[int]] = {}
        for p in plans:
            req = p.req
            if p.sample_row is None or req.finished or req.kv_len != req.seq_len + len(p.draft):
                continue
            rows += range(p.sample_row, p.sample_row + 1 + len(p.draft))
            reqs += [req] * (1 + len(p.draft))
            if p.draft:
                drafts[req] = p.draft
        return rows, reqs, drafts

    def _start_early(self, plans: list[RowPlan]) -> None:
        """The read-back's grammars have taken their tokens: start the step's mask fill now,
        before the tokens are emitted (overlap schedule, no drafts in the step). Which rows
        are sampled is settled here: the read-back only finishes requests (it grows none), and a
        finished one's row is sampled and dropped."""
        if not self.overlap:
            return
        rows, reqs, drafts = self._sampling_rows(plans)
        if not reqs or drafts:
            return
        start = time.perf_counter()
        masks = self.constrained.start_masks(reqs, {}, wait=False)
        self.profile.host("fill_s", start)
        if masks is not None:  # (else _launch picks the rows once the read-back is done)
            self._early = (rows, reqs, masks)

    def _sample(self) -> list[Req]:
        """Launch the sampling whose masks were being filled. Returns the requests whose grammar
        backend failed meanwhile: finished, their tokens dropped; the caller ends them (frees
        their KV)."""
        sampling, self._sampling = self._sampling, None
        if sampling is None:
            return []
        start = time.perf_counter()
        mask, failed = self.constrained.finish_masks(sampling.masks, sampling.reqs, sampling.drafts)
        self.profile.host("fill_s", start)
        self.profile.mark("mask")
        fused = not self.config.disable_fused_sampling
        sampled = sample_on_device(sampling.logits, sampling.reqs, self.end_ids, mask, fused=fused)
        self._inflight = launch(
            sampling.step, sampling.reqs, sampled, sampling.drafts, overlap=self.overlap
        )
        self.profile.mark("sampling")
        return failed

    def _score_prompt(self, hidden: torch.Tensor, plan: RowPlan) -> None:
        for lo in range(0, len(plan.prompt_rows), PROMPT_LOGITS_CHUNK):
            rows = plan.prompt_rows[lo : lo + PROMPT_LOGITS_CHUNK]
            index = torch.tensor(rows, device=hidden.device)
            logprobs = torch.log_softmax(self.executor.logits(hidden, index), dim=-1)
            positions = plan.prompt_positions[lo : lo + PROMPT_LOGITS_CHUNK]
            self.output.record_prompt_logprobs(plan.req, logprobs, positions)

    def _resolve(self, plans: list[RowPlan] | None = None) -> None:
        """Read back the in-flight step's tokens (launching its sampling first, if its masks
        were still being filled): report who got one, end who finished. plans: the step just
        launched, whose mask fill may start once the grammars have their tokens."""
        self._end(self._sample())
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        start = time.perf_counter()
        flight.read()  # (read_tokens reads it too: timed apart, the wait is not the accepts')
        self.profile.host("readback_s", start)
        self.profile.mark("readback")
        start = time.perf_counter()
        early = (lambda: self._start_early(plans)) if plans is not None else None
        got = read_tokens(flight, self.constrained, self.speculative, early)
        self.profile.host("accept_s", start)
        self.profile.mark("accept")
        if self.speculative.enabled:
            self._propose([req for req in got if not req.finished], plans or [])
        for req in got:
            if req.finished:
                self._end([req])
            else:
                self._report([req])

    def _propose(self, reqs: list[Req], launched: list[RowPlan]) -> None:
        """The requests' next drafts. The draft model defers those of the step just launched
        (overlap schedule): it feeds their token without a draft, and may be filling their
        masks already (`_start_early`: the draft model must leave those matchers alone)."""
        constrained = any(req.grammar is not None for req in reqs)
        fill = self.grammars.fill if constrained else None
        defer = {p.req for p in launched if p.sample_row is not None}
        self.speculative.propose(reqs, fill=fill, defer=defer)

    def _end(self, reqs: list[Req], reason: FinishReason | None = None) -> None:
        """Running requests are done: free their KV and report them."""
        for req in reqs:
            if reason is not None:
                self.output.finish(req, reason)
            if req in self.running:
                self.running.remove(req)
                self.memory.release(req)
            self.speculative.forget(req)
        self._report(reqs)

    def _report(self, reqs: list[Req]) -> None:
        for req in reqs:
            if not req.hidden:
                self.output.mark_reported(req)
                self._updates.append(req)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank)."""
        if self.tp is not None:
            self.tp.close()

    # ---- audits ---------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running."""
        if self.has_work:
            return False
        self.memory.cache.reset()
        return True

    def check_integrity(self) -> None:
        self.memory.check_integrity(self.running)
        if self.speculative.draft_model is not None:
            self.speculative.draft_model.check_integrity()

    def memory_stats(self) -> dict[str, int]:
        """The KV pool's counts (with a draft model, its pool's as draft_*)."""
        stats = self.memory.stats(self.running)
        if self.speculative.draft_model is not None:
            stats |= self.speculative.draft_model.stats()
        return stats
