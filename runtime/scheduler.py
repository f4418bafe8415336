"""The scheduler: continuous batching with chunked prefill mixed into decode steps.

One `step()` = pick work (every running request decodes one token or prefills a chunk; new
requests are admitted within the chunk budget and the memory budget), run the forward, sample,
report. When decode runs out of KV, the request with the least progress is retracted: its KV goes
to the prefix cache and it waits to resume (recomputing only what the cache lost).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import math
import time

import torch
from transformers import PreTrainedTokenizerBase

from weft.grammars.bitmask import allocate_bitmask
from weft.grammars.manager import GrammarManager, RequestGrammar
from weft.grammars.vocab import TokenVocab
from weft.runtime.batch_builder import RowPlan, build_batch
from weft.runtime.config import EngineConfig
from weft.runtime.core import FinishReason, Req, child_rid
from weft.runtime.histogram import BucketCounts
from weft.runtime.memory import MemoryManager
from weft.runtime.model_runner import ModelRunner
from weft.runtime.output_processor import OutputProcessor
from weft.runtime.sampler import Sampled, read_back, sample_on_device

logger = logging.getLogger(__name__)

# Share of a running request's remaining max_new_tokens reserved when admitting new requests;
# decays while decoding goes well, jumps back after a retraction (as in SGLang).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
LPM_MAX_QUEUE = 128  # past this, prefix matching the whole queue costs more than it saves
PROMPT_LOGITS_CHUNK = 256  # rows of [rows, vocab] float32 logits computed at once
SMALL_CHUNK = 2048  # default prompt tokens per step (CPUs, small GPUs)
LARGE_CHUNK = 8192  # ... on GPUs of at least LARGE_CHUNK_MIN_BYTES
LARGE_CHUNK_MIN_BYTES = 35 * 2**30
GRAMMAR_QUEUE_SLACK_S = 30.0  # beyond the compile timeouts, a request's wait for its grammar
IN_BATCH_SHARE_MIN = 32  # defer a request sharing this many uncached tokens with one admitted
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
GRAMMAR_MASK_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)
# Jump-forward drafts (core.py): at most this many forced tokens verified in one step (each is a
# row of logits and a grammar mask).
MAX_DRAFT_TOKENS = 16
# Under the overlap schedule a request whose token is still on the device cannot feed a draft
# behind it; it sits out one step for the read-back if its draft is at least this long (a
# shorter one saves no step: the model's own next tokens check it as fast).
OVERLAP_MIN_DRAFT = 3


@dataclasses.dataclass
class _InFlight:
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


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase | None,
        end_ids: frozenset[int],
    ) -> None:
        self.config = config
        self.runner = runner
        self.chunk_size = config.chunked_prefill_size or default_chunk_size(runner.device)
        self.memory = MemoryManager(
            runner.kv_pool, runner.req_to_token, use_cache=not config.disable_radix_cache
        )
        self.max_seq_len = min(runner.context_length, runner.kv_pool.size)
        self.output = OutputProcessor(tokenizer, end_ids, self.max_seq_len)
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self._end_list = sorted(end_ids)  # the grammar backends take them as a list
        self._grammars: GrammarManager | None = None
        self._bitmask: torch.Tensor | None = None  # CPU rows filled per step (pinned on CUDA)
        self.grammar_wait: list[Req] = []  # waiting for their grammar to compile
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._reported: list[Req] = []  # finished outside a step (aborts), reported next step
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._seeds = itertools.count(config.random_seed * 1_000_003)
        self.num_retractions = 0
        self.num_steps = 0
        self.num_tokens_computed = 0  # tokens through the model (prefill + decode)
        self.peak_running = 0
        self.grammar_compile_s = BucketCounts(GRAMMAR_COMPILE_BUCKETS)  # per constrained request
        self.grammar_mask_s = BucketCounts(GRAMMAR_MASK_BUCKETS)  # per step with constrained rows
        self.overlap = overlap_schedule(config, runner.device)
        self._inflight: _InFlight | None = None
        self._resolved: list[Req] = []  # got a token or finished since the last step returned
        self.num_overlapped_steps = 0  # forwards launched before the previous tokens were read

    # ---- intake -------------------------------------------------------------------------

    def add(self, req: Req) -> list[Req]:
        """Queue a request; n > 1 becomes n sampled children sharing one prompt prefill.
        A constrained request first waits (in `grammar_wait`) for its grammar to compile."""
        grammar_job = None
        constraint = req.params.constraint
        if constraint is not None:
            try:
                # NOTE: the JSON schema meta-validation is skipped (SamplingParams.validate ran it
                # in the HTTP process or Engine): up to a second of Python, which even on a
                # worker thread would stall the loop (each torch op waits for the GIL)
                grammar_job = self.grammars.submit_field(
                    *constraint, self.config.max_grammar_chars, validated=True
                )
            except ValueError as exc:  # no tokenizer to build the grammars' vocabulary from
                self._enqueue(req, None)
                self._fail(req, str(exc))
                return [req]
        children = [req]
        if req.params.n > 1:
            children = [self._child(req, i) for i in range(req.params.n)]
            scores_prompt = req.logprob is not None and req.logprob.start_len >= 0
            if self.memory.cache.enabled and not scores_prompt:
                shared = Req(
                    rid=child_rid(req.rid, "prompt"),
                    input_ids=req.input_ids,
                    params=dataclasses.replace(req.params, max_new_tokens=0, min_new_tokens=0, n=1),
                    namespace=req.namespace,
                    hidden=True,
                    group_rid=req.rid,
                )
                self._enqueue(shared, self.waiting)
                for child in children:
                    child.blocked_by = shared
        for child in children:
            child.grammar_future = grammar_job
            self._enqueue(child, self.waiting if grammar_job is None else self.grammar_wait)
        return children

    def _child(self, req: Req, i: int) -> Req:
        seed = None if req.params.seed is None else req.params.seed + i
        params = dataclasses.replace(req.params, n=1, seed=seed)
        return dataclasses.replace(
            req,
            rid=child_rid(req.rid, i),
            params=params,
            group_rid=req.rid,
            index=i,
            output_ids=[],
            input_logprobs=[],
            output_logprobs=[],  # NOTE: replace() would share the lists
        )

    def _enqueue(self, req: Req, queue: list[Req] | None) -> None:
        seed = req.params.seed if req.params.seed is not None else next(self._seeds) % 2**63
        req.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        self.output.start(req)
        if queue is not None:
            queue.append(req)

    def _fail(self, req: Req, message: str, status: int = 400) -> None:
        """End a request for its own fault (a bad grammar): reported next step."""
        self.output.finish(req, FinishReason("abort", message=message, status=status))
        self._reported.append(req)

    @property
    def grammars(self) -> GrammarManager:
        """Created on the first constrained request (the vocabulary takes ~1 s to convert)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("constrained decoding needs the model's tokenizer")
            tokenizer, vocab_size = self.tokenizer, self.runner.model_config.vocab_size
            end_ids = self._end_list
            self._grammars = GrammarManager(
                lambda: TokenVocab.from_tokenizer(tokenizer, vocab_size, end_ids),
                order=self.config.grammar_backends,
                timeout_s=self.config.grammar_compile_timeout,
                compact_json=self.config.constrained_json_disable_any_whitespace,
            )
        return self._grammars

    def _poll_grammars(self) -> None:
        """Move requests whose grammar is ready to the waiting queue (or fail them); a request
        that waited past `grammar_wait_limit_s` fails (a 503: the compiles are backed up)."""
        limit = self.grammar_wait_limit_s
        now = time.perf_counter()
        for req in [r for r in self.grammar_wait if now - r.created > limit]:
            if not req.grammar_future.done():
                self.grammar_wait.remove(req)
                self._forget_grammar_job(req)
                message = f"the request's grammar did not compile within {limit:g} s"
                self._fail(req, message + " (the grammar compiles are backed up)", status=503)
        for req in [r for r in self.grammar_wait if r.grammar_future.done()]:
            self.grammar_wait.remove(req)
            try:
                compiled = req.grammar_future.result()
                if req.index == 0:  # n > 1 samples share one compile
                    self.grammar_compile_s.observe(compiled.compile_s)
                req.grammar = RequestGrammar(compiled, self._end_list)
            except Exception as exc:  # GrammarError, or a matcher the backend cannot build
                self._fail(req, str(exc))
                continue
            finally:
                req.grammar_future = None
            self.waiting.append(req)

    def _forget_grammar_job(self, req: Req) -> None:
        """The request no longer waits for its grammar: a compile nobody else waits for (n > 1
        samples share one) is cancelled, if it has not started, so that it frees its place."""
        job, req.grammar_future = req.grammar_future, None
        if job is not None and not any(r.grammar_future is job for r in self.grammar_wait):
            job.cancel()

    @property
    def grammar_wait_limit_s(self) -> float:
        """How long a request may wait for its grammar: every backend of the chain at its compile
        timeout, plus GRAMMAR_QUEUE_SLACK_S in the compile queue.

        NOTE: a compile future that never resolves (a deadlocked grammar worker once held 31
        requests forever) must not hold a request without bound."""
        backends = len(self.config.grammar_backends)
        return backends * self.config.grammar_compile_timeout + GRAMMAR_QUEUE_SLACK_S

    def _wait_for_grammars(self, timeout_s: float = 0.01) -> None:
        """Nothing to run but compiles in flight: block briefly instead of spinning."""
        futures = [r.grammar_future for r in self.grammar_wait]
        concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def abort(self, rid: str) -> bool:
        """Abort by rid (or every child of an n > 1 group). Returns whether anything matched."""
        queues = (self.running, self.waiting, self.grammar_wait)
        hit = [r for q in queues for r in q if rid in (r.rid, r.group_rid)]
        if hit and self._inflight is not None:
            self._resolve()  # release() needs every token of the request on the host
            hit = [r for r in hit if not r.finished]
        # NOTE: a request a read-back gave a token went to _resolved; the abort reports it (that
        # token included). Listed in both, it was reported twice, and the server's scheduler
        # process died on the second update (KeyError). The read-back may be an earlier abort's
        # of this same step (a client that leaves a batch aborts its rids one by one).
        self._resolved = [r for r in self._resolved if r not in hit]
        for req in hit:
            next(q for q in queues if req in q).remove(req)
            self._forget_grammar_job(req)
            self.memory.release(req)
            self.output.finish(req, FinishReason("abort", message="aborted by request"))
            self._reported.append(req)
        return bool(hit)

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self._reported
            or self.grammar_wait
            or self._inflight is not None
            or self._resolved
        )

    # ---- the loop body --------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Req]:
        """One iteration; returns the (visible) requests that got a token or finished.

        Overlap schedule (CUDA): the step's forward is launched before the previous step's
        sampled tokens are read back; reading them (and appending, detokenizing, grammar
        accepts) then runs while the device computes. The forward takes a decode request's
        pending token from the device (`build_batch`'s pending_ids).
        """
        updates = [r for r in self._reported if not r.hidden]
        for req in updates:
            self.output.mark_reported(req)
        self._reported = []
        if self._inflight is not None and self._inflight.drafts:
            self._resolve()  # which of its drafts the model took decides what is fed next
        if self.grammar_wait:
            self._poll_grammars()
        work = self._schedule()
        if not work:
            if self._inflight is not None:
                self._resolve()
            elif self.grammar_wait and not updates:
                self._wait_for_grammars()
            return updates + self._take_resolved()
        prev = self._inflight
        batch, plans = build_batch(
            work, self.memory, self.runner.device, prev.ids if prev is not None else None
        )
        hidden = self.runner.forward(batch)
        for plan in plans:
            plan.req.kv_len += plan.num_tokens
        self.num_steps += 1
        self.num_tokens_computed += batch.num_tokens
        if prev is not None:
            self.num_overlapped_steps += 1
            self._resolve()  # the previous step's tokens, while the device runs this forward
        self._launch(hidden, plans)
        if not self.overlap:
            self._resolve()
        self.peak_running = max(self.peak_running, len(self.running))
        self.new_token_ratio = max(
            self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO
        )
        return updates + self._take_resolved()

    def _launch(self, hidden: torch.Tensor, plans: list[RowPlan]) -> None:
        """Prompt logprobs, prefill progress into the cache, then sampling (not read back)."""
        for plan in plans:
            req = plan.req
            if plan.prompt_rows:
                self._score_prompt(hidden, plan)
            if plan.sample_row is None and req.kv_len == req.seq_len and not req.finished:
                self._end(req, FinishReason("length"))  # max_new_tokens == 0
            elif plan.num_tokens > 1 and not plan.draft and not req.finished:
                self.memory.cache_progress(req)  # others may share this prefill from now on
        # NOTE: a row is sampled only if its request is still live and fully computed: under the
        # overlap schedule it may have finished, or grown by jump-forward text, since this step
        # was built.
        sampling = [
            p
            for p in plans
            if p.sample_row is not None
            and not p.req.finished
            and p.req.kv_len == p.req.seq_len + len(p.draft)
        ]
        if not sampling:
            return
        rows: list[int] = []
        reqs: list[Req] = []
        drafts: dict[Req, list[int]] = {}
        for p in sampling:  # a drafting request samples after each draft token too
            assert p.sample_row is not None
            rows += range(p.sample_row, p.sample_row + 1 + len(p.draft))
            reqs += [p.req] * (1 + len(p.draft))
            if p.draft:
                drafts[p.req] = p.draft
        if rows != list(range(hidden.shape[0])):  # a decode step samples every row, in order
            hidden = hidden[torch.tensor(rows, device=hidden.device)]
        logits = self.runner.logits(hidden)
        # NOTE: filled while the device computes the forward and the logits (launched, not awaited)
        logits, reqs, bitmask = self._fill_bitmask(logits, reqs, drafts)
        if not reqs:
            return  # every row's grammar backend failed
        ids, raw_logprobs = sample_on_device(
            logits, reqs, self.end_ids, bitmask, fused=not self.config.disable_fused_sampling
        )
        step = self.num_steps
        flight = _InFlight(step, reqs, ids, raw_logprobs)
        for i, req in enumerate(reqs):
            if i == 0 or reqs[i - 1] is not req:  # its first row
                req.pending = (step, i)
                if req in drafts:
                    flight.drafts[i] = drafts[req]
        if self.overlap and raw_logprobs is not None:
            flight.read()  # rare (logprobs wanted): this step does not overlap
        elif self.overlap and ids.is_cuda:
            # NOTE: queue the copy to the host right behind the sampling: a read-back queued
            # later (.tolist() in _resolve) would wait behind the next step's forward as well
            flight.host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            flight.host_ids.copy_(ids, non_blocking=True)
            flight.ready = torch.cuda.Event()
            flight.ready.record()
        self._inflight = flight

    def _resolve(self) -> None:
        """Read back the in-flight step's tokens and append them (the requests that got one or
        finished go to `_resolved`)."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        result = flight.read()
        for i, req in enumerate(flight.reqs):
            if req.pending != (flight.step, i):
                continue  # aborted or retracted meanwhile
            req.pending = None
            logprob = result.logprobs[i] if result.logprobs and req.logprob else None
            top = result.top[i] if result.top else None
            token = result.token_ids[i]
            draft = flight.drafts.get(i)
            if draft is not None:
                token = self._take_draft(req, draft, result.token_ids[i : i + 1 + len(draft)])
            if draft is not None and req.finished:
                pass  # it ended among the draft tokens it kept
            elif req.grammar is None:
                self.output.append_token(req, token, logprob, top)
            else:
                # NOTE: the step launched just before this read-back may have fed the token to
                # the model already (its KV is being written)
                fed = req.kv_len > req.seq_len  # (pending is cleared: seq_len counts no token)
                self._append_constrained(req, token, logprob, top)
                if fed and req.finished and req.kv_len > req.seq_len:
                    # NOTE: ended without its token (rejected, or the backend failed), which has
                    # KV already: keep it, so that release() caches as many tokens as slots
                    req.output_ids.append(token)
            if req.finished:
                self._end(req, None)
            elif not req.hidden:
                self.output.mark_reported(req)
                self._resolved.append(req)

    def _end(self, req: Req, reason: FinishReason | None) -> None:
        """A running request is done: free its KV and report it."""
        if reason is not None:
            self.output.finish(req, reason)
        if req in self.running:
            self.running.remove(req)
            self.memory.release(req)
        if not req.hidden:
            self.output.mark_reported(req)
            self._resolved.append(req)

    def _take_resolved(self) -> list[Req]:
        done, self._resolved = self._resolved, []
        return done

    def _fill_bitmask(
        self, logits: torch.Tensor, reqs: list[Req], drafts: dict[Req, list[int]]
    ) -> tuple[torch.Tensor, list[Req], tuple[torch.Tensor, list[int]] | None]:
        """(logits, reqs, (bitmask rows [len(reqs), W] on the logits' device, the constrained
        rows) or None). A request whose grammar backend raises is ended, and its rows dropped.

        A drafting request has a row per draft token after its first: masked as its grammar
        stands after that token. A draft the grammar does not take whole is cut in place."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return logits, reqs, None
        vocab_size = self.runner.model_config.vocab_size
        if self._bitmask is None or self._bitmask.shape[0] < len(reqs):
            size = max(len(reqs), self.config.max_running_requests)
            self._bitmask = allocate_bitmask(
                size, vocab_size, pin=self.runner.device.type == "cuda"
            )
        bitmask = self._bitmask[: len(reqs)]
        start = time.perf_counter()
        firsts = [i for i in rows if i == 0 or reqs[i - 1] is not reqs[i]]
        failed: set[Req] = set()
        try:
            self.grammars.fill([reqs[i].grammar for i in firsts], bitmask, firsts)
        except Exception:  # NOTE: a backend's bug: find the rows that raise, one by one
            failed = self._fill_rows_apart(reqs, firsts, bitmask)
        for i in firsts:
            draft = drafts.get(reqs[i])
            if draft and reqs[i] not in failed:
                try:
                    del draft[self.grammars.fill_draft(reqs[i].grammar, draft, bitmask, i) :]
                except Exception as exc:
                    self._grammar_failed(reqs[i], exc)
                    self._end(reqs[i], None)
                    failed.add(reqs[i])
        if failed:
            keep = [i for i, r in enumerate(reqs) if r not in failed]
            logits = logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]
            bitmask = bitmask[keep]
            reqs = [reqs[i] for i in keep]
            rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
            if not rows:
                return logits, reqs, None
        self.grammar_mask_s.observe(time.perf_counter() - start)
        return logits, reqs, (bitmask.to(self.runner.device, non_blocking=True), rows)

    def _fill_rows_apart(self, reqs: list[Req], rows: list[int], bitmask: torch.Tensor) -> set[Req]:
        """The batched fill raised: fill row by row to find the culprits, and end them. Returns
        them (the other rows are filled)."""
        failed: set[Req] = set()
        for i in rows:
            try:
                self.grammars.fill([reqs[i].grammar], bitmask, [i])
            except Exception as exc:
                self._grammar_failed(reqs[i], exc)
                self._end(reqs[i], None)
                failed.add(reqs[i])
        return failed

    def _grammar_failed(self, req: Req, exc: Exception) -> None:
        """A grammar backend raised on this request (a bug in the backend, not the request's
        fault): only this request ends, with a server error; the caller frees its KV."""
        name = req.grammar.backend_name
        logger.error("grammar backend %s failed on request %s", name, req.rid, exc_info=exc)
        message = f"the grammar backend {name} failed: {type(exc).__name__}: {exc}"
        self.output.finish(req, FinishReason("abort", message=message, status=500))

    def _take_draft(self, req: Req, draft: list[int], ids: list[int]) -> int:
        """Keep the draft tokens the model picked itself (ids[j] was sampled after draft[:j])
        and free the KV of the rest. Returns the model's token after those kept; the request
        may have ended among them (a stop string, its token limit), and its release then frees
        the KV of draft tokens it did not keep (MemoryManager.release)."""
        taken = 0
        while taken < len(draft) and ids[taken] == draft[taken]:
            taken += 1
        self.memory.truncate(req, req.seq_len + taken)  # (its token is read: none pending)
        grammar: RequestGrammar = req.grammar
        try:
            for tid in draft[:taken]:  # NOTE: taken when the masks were filled: cannot fail
                if not grammar.accept(tid):
                    raise RuntimeError(f"the grammar took draft token {tid}, then refused it")
        except Exception as exc:  # NOTE: a backend's bug ends this request, not the scheduler
            self._grammar_failed(req, exc)
            return ids[taken]
        grammar.jump_forward_tokens += taken
        for tid in draft[:taken]:
            self.output.append_token(req, tid, None, None)
            if req.finished:
                break
        return ids[taken]

    def _append_constrained(
        self,
        req: Req,
        token: int,
        logprob: float | None,
        top: list[tuple[float, int]] | None,
    ) -> None:
        grammar: RequestGrammar = req.grammar
        req.draft = []
        try:
            accepted = token >= 0 and grammar.accept(token)
        except Exception as exc:  # NOTE: a backend's bug ends this request, not the scheduler
            self._grammar_failed(req, exc)
            return
        if not accepted:
            self.output.finish(
                req, FinishReason("abort", message=f"the grammar rejected token {token}")
            )
            return
        self.output.append_token(req, token, logprob, top)
        if grammar.ended and not req.finished:  # ignore_eos cannot outlast the grammar
            self.output.finish(req, FinishReason("stop", matched=token))
        if req.finished or not self._drafts_for(req):
            return
        try:
            req.draft = grammar.draft(self._draft_limit(req))
        except Exception as exc:
            self._grammar_failed(req, exc)

    def _drafts_for(self, req: Req) -> bool:
        """Whether jump-forward drafts this request. Not where CUDA graphs replay the decode
        steps, unless enable_jump_forward (a draft's step runs eagerly, for the whole batch:
        slower than the steps it saves, benchmarks/RESULTS.md); not with logprobs asked for (a
        draft token has none), penalties or min_new_tokens still to reach (the draft rows would
        share the request's penalties and token count as they stand before the draft)."""
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
        room = min(req.remaining_new_tokens, self.max_seq_len - req.seq_len) - 1
        return min(room, MAX_DRAFT_TOKENS)

    def _score_prompt(self, hidden: torch.Tensor, plan: RowPlan) -> None:
        for lo in range(0, len(plan.prompt_rows), PROMPT_LOGITS_CHUNK):
            rows = plan.prompt_rows[lo : lo + PROMPT_LOGITS_CHUNK]
            index = torch.tensor(rows, device=hidden.device)
            logprobs = torch.log_softmax(self.runner.logits(hidden[index]), dim=-1)
            positions = plan.prompt_positions[lo : lo + PROMPT_LOGITS_CHUNK]
            self.output.record_prompt_logprobs(plan.req, logprobs, positions)

    # ---- choosing the work of a step --------------------------------------------------------

    def _schedule(self) -> list[tuple[Req, int]]:
        """[(request, tokens to process this step)]; memory for all of them is guaranteed."""
        self._make_room_for_decode()
        budget = self.chunk_size
        work: list[tuple[Req, int]] = []
        committed = 0
        spare = self.memory.available - self._decoding()  # KV for drafts, past one per decode
        for req in self.running:
            remaining = req.seq_len - req.kv_len
            if remaining != 1 or self._ends_with_pending(req):
                continue
            if req.pending is not None and len(req.draft) >= OVERLAP_MIN_DRAFT:
                continue  # its draft follows the token on the device: read that back first
            n = 1
            if req.pending is None and 0 < len(req.draft) <= spare:
                n += len(req.draft)  # build_batch feeds the draft behind the token
                spare -= len(req.draft)
            work.append((req, n))
            committed += n
        for req in self.running:  # partially prefilled requests continue first
            remaining = req.seq_len - req.kv_len
            if remaining > 1 and budget > 0:
                n = min(remaining, budget, self.memory.available - committed)
                if n <= 0:
                    break
                work.append((req, n))
                budget -= n
                committed += n
        work += self._admit(budget, committed)
        if not work and self._inflight is not None:
            return work  # the in-flight step's tokens come first (they may end requests)
        if not work and len(self.running) > 1:
            # NOTE: prefills that hold all memory and cannot progress: free the least advanced.
            self._retract(min(self.running, key=lambda r: r.kv_len))
            return self._schedule()
        return work

    def _decoding(self) -> int:
        """Running requests that decode a token next step (one new KV slot each)."""
        return sum(1 for r in self.running if r.seq_len - r.kv_len == 1)

    def _ends_with_pending(self, req: Req) -> bool:
        """Whether the pending token is known to be the request's last (no step for it)."""
        return req.pending is not None and (
            req.remaining_new_tokens == 0 or req.seq_len >= self.max_seq_len
        )

    def _make_room_for_decode(self) -> None:
        if self._inflight is not None and self._decoding() > self.memory.available:
            self._resolve()  # a retracted request must have its tokens on the host
        need = self._decoding()
        while need > self.memory.available and len(self.running) > 1:
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            need -= 1 if victim.seq_len - victim.kv_len == 1 else 0
            self._retract(victim)

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.memory.release(req)  # computed KV goes to the cache: a resume recomputes less
        req.retractions += 1
        self.num_retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def _reserved(self) -> int:
        """KV the running requests will still need (prompt rest + a share of new tokens)."""
        return sum(
            r.seq_len - r.kv_len + math.ceil(self._future_tokens(r) * self.new_token_ratio)
            for r in self.running
        )

    def _future_tokens(self, req: Req) -> int:
        """New tokens the request may still produce (max_new_tokens capped by the context)."""
        return min(req.remaining_new_tokens, self.max_seq_len - req.seq_len)

    def _admit(self, budget: int, committed: int) -> list[tuple[Req, int]]:
        work: list[tuple[Req, int]] = []
        if (
            not self.waiting
            or budget <= 0
            or len(self.running) >= self.config.max_running_requests
            or not self.memory.has_row()
        ):
            return work  # NOTE: nothing can be admitted: skip ordering (it walks the cache)
        self._order_waiting()
        sharing = _StepPrefixes(self.memory.cache.enabled)
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if req.blocked_by is not None and not req.blocked_by.finished:
                continue
            if not self.memory.has_row():
                break
            if sharing.shares(req):
                continue  # wait one step: it will match the prefix being computed now
            self.memory.admit(req)
            remaining = req.seq_len - req.kv_len
            n = min(remaining, budget)
            need = remaining + math.ceil(self._future_tokens(req) * self.new_token_ratio)
            free = self.memory.available - committed
            if n > free or (self.running and need > free - self._reserved()):
                self.memory.release(req)
                break
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = req.prefix_len
            self.waiting.remove(req)
            self.running.append(req)
            sharing.add(req)
            work.append((req, n))
            budget -= n
            committed += n
        return work

    def _order_waiting(self) -> None:
        """Longest cached prefix first (policy lpm) while the queue is short enough to match."""
        if (
            self.config.schedule_policy != "lpm"
            or not self.memory.cache.enabled
            or not 1 < len(self.waiting) <= LPM_MAX_QUEUE
        ):
            return
        cache = self.memory.cache

        def cached(req: Req) -> int:
            return cache.match_prefix(
                req.fill_ids[: req.prefix_match_limit()], req.namespace
            ).length

        self.waiting.sort(key=lambda r: -cached(r))

    # ---- audits ---------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running."""
        if self.has_work:
            return False
        self.memory.cache.reset()
        return True

    def check_integrity(self) -> None:
        self.memory.check_integrity(self.running)

    def memory_stats(self) -> dict[str, int]:
        return self.memory.stats(self.running)


def overlap_schedule(config: EngineConfig, device: torch.device) -> bool:
    """On by default on CUDA only: on a CPU the "device" is this thread, and overlapping would
    only delay the outputs (--enable-overlap-schedule forces it, to test its logic there)."""
    if config.enable_overlap_schedule:
        return True
    return device.type == "cuda" and not config.disable_overlap_schedule


def default_chunk_size(device: torch.device) -> int:
    """Prompt tokens per step when --chunked-prefill-size is unset: 8192 on a GPU of >= 35 GiB.

    Measured on an H100 (RESULTS.md, 4096-in / 2048-out workload): 8192 against 2048 gives the
    same offline throughput (+0.5 %) and a median TTFT of 65 ms instead of 78 at 1 request/s,
    since most prompts then take one step instead of two; the price is a longer stall of the
    running decodes when a full chunk lands (ITL p99 24 ms instead of 20).
    """
    if device.type == "cuda":
        return chunk_size_for_memory(torch.cuda.get_device_properties(device).total_memory)
    return SMALL_CHUNK


def chunk_size_for_memory(total_bytes: int) -> int:
    return LARGE_CHUNK if total_bytes >= LARGE_CHUNK_MIN_BYTES else SMALL_CHUNK


class _StepPrefixes:
    """The uncached prefixes that the requests admitted in a step compute. A request that shares
    IN_BATCH_SHARE_MIN tokens past one's cached prefix waits a step, then matches the cache.

    Request r shares with an admitted o iff their first o.prefix_len + IN_BATCH_SHARE_MIN + 1
    tokens agree; those prefixes are kept in sets by length, so a check costs one lookup per
    distinct length, O(prefix) each (comparing r with every admitted request cost O(n^2) per
    step: ~0.4 s for 120 programs of a 1,000-token few-shot prefix). Admitted requests with many
    different cached-prefix lengths make it O(n * lengths) again, still without numpy copies.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._by_len: dict[int, set[tuple[str, tuple[int, ...]]]] = {}

    def add(self, req: Req) -> None:
        n = req.prefix_len + IN_BATCH_SHARE_MIN + 1
        if self.enabled and len(req.fill_ids) >= n:
            self._by_len.setdefault(n, set()).add((req.namespace, tuple(req.fill_ids[:n])))

    def shares(self, req: Req) -> bool:
        if not self._by_len:
            return False
        ids = req.fill_ids[: req.prefix_match_limit()]
        return any(
            len(ids) >= n and (req.namespace, tuple(ids[:n])) in keys
            for n, keys in self._by_len.items()
        )
