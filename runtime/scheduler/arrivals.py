"""Requests in: each gets its seeded generator and text decoder, a constrained one its grammar
compile, and n > 1 becomes n sampled children that share one prompt prefill."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from weft.runtime.core import FinishReason, Req, child_rid
from weft.runtime.scheduler.constrained import Constrained


@dataclasses.dataclass
class Queued:
    """Where `Arrivals.add` put a request's parts."""

    children: list[Req]  # what the caller follows: the request itself unless n > 1
    ready: list[Req]  # for the waiting queue (with the hidden shared-prompt request first)
    compiling: list[Req]  # to wait for their grammar
    failed: list[Req]  # ended at once (a 400: no tokenizer to build grammars from)


class Arrivals:
    def __init__(self, seed: int, constrained: Constrained, share_prompts: bool) -> None:
        self._seeds = itertools.count(seed * 1_000_003)
        self.constrained = constrained
        self.output = constrained.output
        self.device = constrained.runner.device
        self.share_prompts = share_prompts  # through the prefix cache

    def add(self, req: Req) -> Queued:
        try:
            job = self.constrained.submit(req)
        except ValueError as exc:
            self._start(req)
            self.output.finish(req, FinishReason("abort", message=str(exc), status=400))
            return Queued([req], [], [], [req])
        children, ready = [req], []
        if req.params.n > 1:
            children = [self._child(req, i) for i in range(req.params.n)]
            scores_prompt = req.logprob is not None and req.logprob.start_len >= 0
            if self.share_prompts and not scores_prompt:
                shared = Req(
                    rid=child_rid(req.rid, "prompt"),
                    input_ids=req.input_ids,
                    params=dataclasses.replace(req.params, max_new_tokens=0, min_new_tokens=0, n=1),
                    namespace=req.namespace,
                    hidden=True,
                    group_rid=req.rid,
                )
                self._start(shared)
                ready.append(shared)
                for child in children:
                    child.blocked_by = shared
        for child in children:
            child.grammar_future = job
            self._start(child)
        if job is None:
            return Queued(children, ready + children, [], [])
        return Queued(children, ready, children, [])

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
            thinking=req.thinking.fresh() if req.thinking is not None else None,
        )

    def _start(self, req: Req) -> None:
        seed = req.params.seed if req.params.seed is not None else next(self._seeds) % 2**63
        req.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.output.start(req)
