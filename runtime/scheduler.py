"""The scheduler: continuous batching with chunked prefill mixed into decode steps.

One `step()` = pick work (every running request decodes one token or prefills a chunk; new
requests are admitted within the chunk budget and the memory budget), run the forward, sample,
report. When decode runs out of KV, the request with the least progress is retracted: its KV goes
to the prefix cache and it waits to resume (recomputing only what the cache lost).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from weft.runtime.batch_builder import RowPlan, build_batch
from weft.runtime.config import EngineConfig
from weft.runtime.core import FinishReason, Req
from weft.runtime.memory import MemoryManager
from weft.runtime.model_runner import ModelRunner
from weft.runtime.output_processor import OutputProcessor
from weft.runtime.sampler import sample

# Share of a running request's remaining max_new_tokens reserved when admitting new requests;
# decays while decoding goes well, jumps back after a retraction (as in SGLang).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
LPM_MAX_QUEUE = 128  # past this, prefix matching the whole queue costs more than it saves
PROMPT_LOGITS_CHUNK = 256  # rows of [rows, vocab] float32 logits computed at once
IN_BATCH_SHARE_MIN = 32  # defer a request sharing this many uncached tokens with one admitted
# NOTE: internal rids (n > 1 children, the shared prompt) join the caller's rid with a character
# that request ids in practice never contain, so they cannot collide with a caller's own rid.
RID_SEP = "\x1f"


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
        self.memory = MemoryManager(
            runner.kv_pool, runner.req_to_token, use_cache=not config.disable_radix_cache
        )
        self.max_seq_len = min(runner.context_length, runner.kv_pool.size)
        self.output = OutputProcessor(tokenizer, end_ids, self.max_seq_len)
        self.end_ids = end_ids
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._reported: list[Req] = []  # finished outside a step (aborts), reported next step
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._seeds = itertools.count(config.random_seed * 1_000_003)
        self.num_retractions = 0
        self.num_steps = 0
        self.peak_running = 0

    # ---- intake -------------------------------------------------------------------------

    def add(self, req: Req) -> list[Req]:
        """Queue a request; n > 1 becomes n sampled children sharing one prompt prefill."""
        children = [req]
        if req.params.n > 1:
            children = [self._child(req, i) for i in range(req.params.n)]
            scores_prompt = req.logprob is not None and req.logprob.start_len >= 0
            if self.memory.cache.enabled and not scores_prompt:
                shared = Req(
                    rid=f"{req.rid}{RID_SEP}prompt",
                    input_ids=req.input_ids,
                    params=dataclasses.replace(req.params, max_new_tokens=0, min_new_tokens=0, n=1),
                    namespace=req.namespace,
                    hidden=True,
                    group_rid=req.rid,
                )
                self._enqueue(shared)
                for child in children:
                    child.blocked_by = shared
        for child in children:
            self._enqueue(child)
        return children

    def _child(self, req: Req, i: int) -> Req:
        seed = None if req.params.seed is None else req.params.seed + i
        params = dataclasses.replace(req.params, n=1, seed=seed)
        return dataclasses.replace(
            req,
            rid=f"{req.rid}{RID_SEP}{i}",
            params=params,
            group_rid=req.rid,
            index=i,
            output_ids=[],
            input_logprobs=[],
            output_logprobs=[],  # NOTE: replace() would share the lists
        )

    def _enqueue(self, req: Req) -> None:
        seed = req.params.seed if req.params.seed is not None else next(self._seeds) % 2**63
        req.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        self.output.start(req)
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Abort by rid (or every child of an n > 1 group). Returns whether anything matched."""
        hit = [r for r in self.waiting + self.running if rid in (r.rid, r.group_rid)]
        for req in hit:
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self.memory.release(req)
            self.output.finish(req, FinishReason("abort", message="aborted by request"))
            self._reported.append(req)
        return bool(hit)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._reported)

    # ---- the loop body --------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Req]:
        """One iteration; returns the (visible) requests that got a token or finished."""
        updates = [r for r in self._reported if not r.hidden]
        for req in updates:
            self.output.mark_reported(req)
        self._reported = []
        work = self._schedule()
        if not work:
            return updates
        batch, plans = build_batch(work, self.memory, self.runner.device)
        hidden = self.runner.forward(batch)
        self._read_outputs(hidden, plans)
        self.num_steps += 1
        self.peak_running = max(self.peak_running, len(self.running))
        for plan in plans:
            req = plan.req
            if req.finished:
                self.running.remove(req)
                self.memory.release(req)
            elif plan.num_tokens > 1:
                self.memory.cache_progress(req)  # others may share this prefill from now on
            if not req.hidden and (plan.sample_row is not None or req.finished):
                self.output.mark_reported(req)
                updates.append(req)
        self.new_token_ratio = max(
            self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO
        )
        return updates

    def _read_outputs(self, hidden: torch.Tensor, plans: list[RowPlan]) -> None:
        for plan in plans:
            plan.req.kv_len += plan.num_tokens
            if plan.prompt_rows:
                self._score_prompt(hidden, plan)
            if plan.sample_row is None and plan.req.kv_len == plan.req.seq_len:
                self.output.finish(plan.req, FinishReason("length"))  # max_new_tokens == 0
        sampling = [p for p in plans if p.sample_row is not None]
        if not sampling:
            return
        rows = torch.tensor([p.sample_row for p in sampling], device=hidden.device)
        logits = self.runner.logits(hidden[rows])
        result = sample(logits, [p.req for p in sampling], self.end_ids)
        for i, plan in enumerate(sampling):
            logprob = result.logprobs[i] if result.logprobs and plan.req.logprob else None
            top = result.top[i] if result.top else None
            self.output.append_token(plan.req, result.token_ids[i], logprob, top)

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
        budget = self.config.chunked_prefill_size
        work: list[tuple[Req, int]] = []
        committed = 0
        for req in self.running:
            remaining = req.seq_len - req.kv_len
            if remaining == 1:
                work.append((req, 1))
                committed += 1
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
        if not work and len(self.running) > 1:
            # NOTE: prefills that hold all memory and cannot progress: free the least advanced.
            self._retract(min(self.running, key=lambda r: r.kv_len))
            return self._schedule()
        return work

    def _make_room_for_decode(self) -> None:
        need = sum(1 for r in self.running if r.seq_len - r.kv_len == 1)
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
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if req.blocked_by is not None and not req.blocked_by.finished:
                continue
            if not self.memory.has_row():
                break
            if self._shares_with(req, [r for r, _ in work]):
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
            work.append((req, n))
            budget -= n
            committed += n
        return work

    def _shares_with(self, req: Req, admitted: list[Req]) -> bool:
        """Whether req shares a long uncached prefix with a request admitted in this step."""
        if not self.memory.cache.enabled or not admitted:
            return False
        ids = req.fill_ids[: req.prefix_match_limit()]
        for other in admitted:
            if other.namespace != req.namespace:
                continue
            common = _common_prefix(ids, other.fill_ids)
            if common >= IN_BATCH_SHARE_MIN and common > other.prefix_len + IN_BATCH_SHARE_MIN:
                return True
        return False

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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
