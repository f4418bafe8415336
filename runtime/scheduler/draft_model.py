"""Speculative decoding with a draft model: a small model of the target's tokenizer drafts,
greedily, the tokens the target then verifies (speculative.py: the verify, and why it stays
exact).

The draft model has a runner of its own beside the target's (weights, a KV pool of as many
tokens as the target's, req_to_token rows; the same device and dtype; run eagerly, no CUDA
graphs; no prefix cache). Per speculating request it holds the KV of some of the request's
tokens (`DraftKV`), freed when the request finishes, is aborted or retracted (`forget`):

    | 0 .......... synced | ............... len(tokens) |
    | the request's own   | fed while drafting: the     |
    | tokens (checked)    | grammar's forced tokens and |
    |                     | the draft but its last      |

A round (`DraftModel.propose`, after a step's tokens are read back) cuts each request's draft KV
back to the longest prefix that is still the request's text (the draft tokens the target kept
stay; the rest is freed), feeds the tokens the draft has not seen (the first time the whole
prompt and output, as a prefill in chunks of at most chunk_size tokens a forward), then the
grammar's forced tokens, and proposes up to `limit` tokens: one forward of the draft model per
draft position over all drafting requests, each taking the argmax under its grammar's mask (the
grammar takes the forced and proposed tokens meanwhile, and is rolled back after).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from weft.grammars.bitmask import allocate_bitmask, allowed_tokens
from weft.runtime.config import EngineConfig
from weft.runtime.core import ForwardBatch, Req
from weft.runtime.loaders.end_tokens import end_token_ids
from weft.runtime.loaders.source import ModelSource, resolve_source
from weft.runtime.model_config import ModelConfig
from weft.runtime.model_runner import ModelRunner, resolve_device, resolve_dtype
from weft.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("weft")

# fills bitmask rows with the grammars' masks (GrammarManager.fill): (grammars, bitmask, rows)
Fill = Callable[[list[Any], torch.Tensor, list[int]], None]


@dataclasses.dataclass
class DraftKV:
    """The draft model's KV of one request (module docstring)."""

    row: int  # of the draft's req_to_token
    tokens: list[int]  # the tokens whose KV the draft holds, by position
    synced: int = 0  # tokens[:synced] are the request's own


@dataclasses.dataclass
class DraftJob:
    """One request's part of a round."""

    req: Req
    kv: DraftKV
    limit: int  # tokens to propose
    feed: list[int]  # tokens still to feed before the first proposal
    grammar: Any  # RequestGrammar masking the proposals, or None
    proposed: list[int] = dataclasses.field(default_factory=list)
    accepted: int = 0  # tokens the grammar took this round (rolled back at its end)


class DraftModel:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        chunk_size: int,
        num_tokens: int,
        mask_vocab: int,
        end_ids: frozenset[int],
    ) -> None:
        self.runner = runner
        self.kv_pool = runner.kv_pool
        self.req_to_token = runner.req_to_token
        self.chunk_size = chunk_size
        # NOTE: a padded lm_head may have more rows than the tokenizer has tokens (and the
        # target fewer than the draft): the argmax is taken over the tokenizer's ids only
        self.num_tokens = num_tokens
        self.mask_vocab = mask_vocab  # the grammars' bitmask width: the target's vocab size
        self.end_ids = end_ids
        self.kvs: dict[Req, DraftKV] = {}

    # ---- a round --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, wants: list[tuple[Req, int]], *, fill: Fill | None) -> list[list[int]]:
        """Up to `limit` greedy tokens after each request's tokens and draft so far (`req.draft`:
        the grammar's forced tokens), by request of `wants` ([] where the draft pool has no
        room for it: its draft KV is dropped). A request's grammar masks its proposals (`fill`
        writes the masks)."""
        jobs: dict[Req, DraftJob] = {}
        reserved = 0
        for req, limit in wants:
            kv = self._synced(req)
            if kv is None:
                continue
            end = len(req.input_ids) + len(req.output_ids)
            feed = req.tokens(len(kv.tokens), end) + req.draft
            need = len(feed) + limit - 1  # (the last proposal is never fed)
            if need > self.kv_pool.num_free - reserved:
                self.forget(req)
                continue
            reserved += need
            kv.synced = end
            masked = fill is not None and req.grammar is not None
            jobs[req] = DraftJob(req, kv, limit, feed, req.grammar if masked else None)
        try:
            self._draft(list(jobs.values()), fill)
        except Exception:  # NOTE: a grammar backend's bug: the verify's mask fill ends its request
            logger.exception("the draft model's round failed: no drafts for its requests")
            for req in jobs:
                self.forget(req)  # (KV of tokens whose forward failed must not be kept)
            return [[] for _ in wants]
        finally:
            self._roll_back(list(jobs.values()))
        return [jobs[req].proposed if req in jobs else [] for req, _ in wants]

    def _roll_back(self, jobs: list[DraftJob]) -> None:
        """The grammars as they were before the round."""
        for job in jobs:
            try:
                if job.accepted:
                    job.grammar.rollback(job.accepted)
            except Exception:  # (the request's next mask fill reports the backend's failure)
                logger.exception("grammar rollback failed after a draft of request %s", job.req.rid)

    def _draft(self, jobs: list[DraftJob], fill: Fill | None) -> None:
        for job in jobs:
            if job.grammar is not None:
                self._take(job, job.req.draft)  # the forced tokens, ahead of the proposals
        self._catch_up(jobs, fill)
        drafting = [j for j in jobs if not self._done(j)]
        while drafting:
            logits = self._forward([(j.kv, j.proposed[-1:]) for j in drafting])
            self._pick(drafting, logits, fill)
            drafting = [j for j in drafting if not self._done(j)]

    def _synced(self, req: Req) -> DraftKV | None:
        """The request's draft KV cut back to the request's own tokens (a new, empty one on its
        first round; None: no req_to_token row is free)."""
        kv = self.kvs.get(req)
        if kv is None:
            if self.req_to_token.num_free == 0:
                return None
            kv = self.kvs[req] = DraftKV(self.req_to_token.allocate(), [])
            return kv
        end = len(req.input_ids) + len(req.output_ids)
        ours = req.tokens(kv.synced, min(len(kv.tokens), end))
        keep = kv.synced
        for fed, own in zip(kv.tokens[kv.synced :], ours, strict=False):
            if fed != own:
                break
            keep += 1
        # NOTE: the last token is fed again where its KV is there (a draft token the target
        # sampled itself, under the overlap schedule): its logits give the first proposal
        self._truncate(kv, min(keep, end - 1))
        return kv

    def _catch_up(self, jobs: list[DraftJob], fill: Fill | None) -> None:
        """Feed every job's unseen tokens, at most chunk_size tokens a forward; a job's last
        chunk gives its first proposal."""
        while True:
            parts: list[tuple[DraftJob, list[int]]] = []
            budget = self.chunk_size
            for job in jobs:
                if job.feed and budget > 0:
                    parts.append((job, job.feed[:budget]))
                    budget -= len(parts[-1][1])
            if not parts:
                return
            logits = self._forward([(job.kv, chunk) for job, chunk in parts])
            fed = []
            for i, (job, chunk) in enumerate(parts):
                del job.feed[: len(chunk)]
                if not job.feed:
                    fed.append(i)
            if fed:
                self._pick([parts[i][0] for i in fed], logits[fed], fill)

    def _pick(self, jobs: list[DraftJob], logits: torch.Tensor, fill: Fill | None) -> None:
        """Each job's next proposal: the argmax of its row of logits, under its grammar's mask
        where it has one (the grammar takes the token then)."""
        masked = [i for i, job in enumerate(jobs) if job.grammar is not None]
        if masked and fill is not None:
            bitmask = allocate_bitmask(len(jobs), self.mask_vocab)
            fill([jobs[i].grammar for i in masked], bitmask, masked)
            constrained = torch.zeros(len(jobs), dtype=torch.bool)
            constrained[masked] = True
            allowed = allowed_tokens(bitmask, constrained, self.num_tokens)
            assert allowed is not None
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        tokens = logits.argmax(dim=-1).tolist()  # NOTE: a host sync per draft position
        for job, token in zip(jobs, tokens, strict=True):
            job.proposed.append(token)
            if job.grammar is not None and not self._ends(job, token):
                self._take(job, [token])

    def _take(self, job: DraftJob, tokens: list[int]) -> None:
        """Tokens through the job's grammar; one it refuses ends the job's draft (the verify
        cuts the draft there too)."""
        for token in tokens:
            if not job.grammar.accept(token):
                job.limit = len(job.proposed)
                return
            job.accepted += 1

    def _ends(self, job: DraftJob, token: int) -> bool:
        return token in self.end_ids or token in job.req.params.stop_token_ids

    def _done(self, job: DraftJob) -> bool:
        """Proposed enough, or an end token (the drafts are cut before it: none after it)."""
        return len(job.proposed) >= job.limit or self._ends(job, job.proposed[-1])

    def _forward(self, parts: list[tuple[DraftKV, list[int]]]) -> torch.Tensor:
        """One forward of the draft model feeding each part's tokens behind its KV: the logits
        [len(parts), num_tokens] after each part's last token."""
        ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        seq_lens: list[int] = []
        prefix_lens: list[int] = []
        ext_lens: list[int] = []
        logits_rows: list[int] = []
        for kv, tokens in parts:
            start, n = len(kv.tokens), len(tokens)
            ids += tokens
            positions += range(start, start + n)
            token_rows += [kv.row] * n
            seq_lens.append(start + n)
            prefix_lens.append(start)
            ext_lens.append(n)
            logits_rows.append(len(ids) - 1)
            kv.tokens += tokens
        slots = self.kv_pool.allocate(len(ids))
        self.req_to_token.write_tokens(token_rows, positions, slots)
        device = self.runner.device

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        batch = ForwardBatch(
            input_ids=column(ids),
            positions=column(positions),
            out_cache_loc=slots.to(device, non_blocking=True),
            req_pool_indices=column([kv.row for kv, _ in parts]),
            seq_lens=column(seq_lens),
            prefix_lens=column(prefix_lens),
            extend_lens=column(ext_lens),
            logits_indices=column(logits_rows),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=ext_lens,
        )
        self.req_to_token.scatter(column(token_rows), batch.positions, batch.out_cache_loc)
        hidden = self.runner.forward(batch)
        return self.runner.logits(hidden)[:, : self.num_tokens]

    # ---- memory ---------------------------------------------------------------------------

    def _truncate(self, kv: DraftKV, keep: int) -> None:
        if keep < len(kv.tokens):
            self.kv_pool.free(self.req_to_token.read(kv.row, keep, len(kv.tokens)))
            del kv.tokens[keep:]

    def forget(self, req: Req) -> None:
        """The request is done (finished, aborted, retracted): free its draft KV and row."""
        kv = self.kvs.pop(req, None)
        if kv is not None:
            self._truncate(kv, 0)
            self.req_to_token.free(kv.row)

    @property
    def in_use(self) -> int:
        return sum(len(kv.tokens) for kv in self.kvs.values())

    def check_integrity(self) -> None:
        """free + in use == total in the draft pool, no slot both free and in use."""
        free, used, total = self.kv_pool.num_free, self.in_use, self.kv_pool.size
        if free + used != total:
            raise AssertionError(
                f"draft KV pool integrity broken: free {free} + in-use {used} != total {total}"
            )
        owned = [self.req_to_token.read(kv.row, 0, len(kv.tokens)) for kv in self.kvs.values()]
        slots = torch.cat([self.kv_pool.free_slots(), *owned])
        if slots.unique().numel() != slots.numel():
            raise AssertionError("draft KV pool integrity broken: a slot is both free and in use")

    def stats(self) -> dict[str, int]:
        return {
            "draft_total": self.kv_pool.size,
            "draft_free": self.kv_pool.num_free,
            "draft_in_use": self.in_use,
        }


@dataclasses.dataclass(frozen=True)
class DraftPlan:
    """A draft model checked against the target before either loads (`check_draft_model`)."""

    config: EngineConfig  # the draft's own (its path; no speculation, no CUDA graphs)
    source: ModelSource
    model: ModelConfig
    num_tokens: int  # the token ids it may propose


def check_draft_model(
    config: EngineConfig,
    target: ModelConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    end_ids: frozenset[int],
) -> DraftPlan:
    """The draft model of speculative_draft_model_path, refused (ValueError naming the field)
    unless its vocabulary and end tokens are the target's: before the target's weights load, so
    that a refusal costs no load (nor, on a GPU, a CUDA-graph capture)."""
    path = config.speculative_draft_model_path
    assert path is not None
    if not Path(path).expanduser().exists():
        raise FileNotFoundError(f"speculative_draft_model_path {path!r} does not exist")
    # the target's device and dtype as its runner will resolve them: a GGUF draft converts for
    # them (into bf16 where the target computes in float32, its quantized form would refuse)
    device = resolve_device(config)
    dtype = resolve_dtype(config, target, device)
    draft_config = config.replace(
        model_path=path,
        tokenizer_path=None,
        load_format="dummy" if config.load_format == "dummy" else "auto",
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        disable_cuda_graph=True,
        speculative_algorithm=None,
        speculative_draft_model_path=None,
    )
    source = resolve_source(draft_config)
    model = ModelConfig.from_folder(source.folder)
    num_tokens = _check_vocabulary(path, source, model, target, tokenizer, end_ids)
    return DraftPlan(draft_config, source, model, num_tokens)


def load_draft_model(
    config: EngineConfig,
    plan: DraftPlan,
    target: ModelRunner,
    end_ids: frozenset[int],
    *,
    chunk_size: int,
) -> DraftModel:
    """The checked draft model, loaded as the target was (same loaders, dummy weights where the
    target has them), on its device and dtype, with a KV pool of as many tokens as the
    target's."""
    draft_config = plan.config.replace(
        dtype=str(target.dtype).removeprefix("torch."),
        device=str(target.device),
        context_length=target.context_length,
    )
    pool = _pool_tokens(config, plan.model, target)
    runner = ModelRunner(draft_config.replace(max_total_tokens=pool), plan.source)
    return DraftModel(
        runner,
        chunk_size=chunk_size,
        num_tokens=plan.num_tokens,
        mask_vocab=target.model_config.vocab_size,
        end_ids=end_ids,
    )


def _pool_tokens(config: EngineConfig, model: ModelConfig, target: ModelRunner) -> int:
    """The draft's KV pool: as many tokens as the target's; on a GPU whose memory the target
    sized its pool from (no max_total_tokens), at most what half the memory left now holds
    (the rest: the draft's weights, activations)."""
    tokens = target.kv_pool.size
    if config.max_total_tokens is None and target.device.type == "cuda":
        per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim
        per_token *= target.kv_dtype.itemsize  # (the draft's pool takes the target's kv dtype)
        free, _ = torch.cuda.mem_get_info(target.device)
        tokens = min(tokens, free // 2 // per_token)
        if tokens < target.context_length:
            raise ValueError(
                f"speculative_draft_model_path: no GPU memory left for the draft model's KV "
                f"cache ({tokens} tokens): lower mem_fraction_static"
            )
    return tokens


def _check_vocabulary(
    path: str,
    source: ModelSource,
    model: ModelConfig,
    target: ModelConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    end_ids: frozenset[int],
) -> int:
    """The token ids the draft may propose (the tokenizer's, or the vocabulary's without one);
    ValueError where the draft's tokenizer or end tokens are not the target's. Model vocab
    sizes may differ where both cover the tokenizer (padded lm_heads: Qwen2.5-0.5B has 151936
    rows, Qwen2.5-7B 152064, one tokenizer)."""
    field = "speculative_draft_model_path"
    draft_tokenizer = load_tokenizer(source.tokenizer_folder) if source.tokenizer_folder else None
    if tokenizer is None or draft_tokenizer is None:
        if model.vocab_size != target.vocab_size:
            raise ValueError(
                f"{field} {path!r}: vocab size {model.vocab_size} differs from the model's "
                f"{target.vocab_size}"
            )
        num_tokens = target.vocab_size
    else:
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                f"{field} {path!r}: its tokenizer differs from the model's "
                f"({len(draft_tokenizer)} tokens against {len(tokenizer)})"
            )
        num_tokens = len(tokenizer)
        if min(model.vocab_size, target.vocab_size) < num_tokens:
            raise ValueError(
                f"{field} {path!r}: vocab size {model.vocab_size} (the model's "
                f"{target.vocab_size}) does not cover the tokenizer's {num_tokens} tokens"
            )
    draft_ends = end_token_ids(draft_tokenizer, model, source.folder)
    if draft_ends != end_ids:
        raise ValueError(
            f"{field} {path!r}: end tokens {sorted(draft_ends)} differ from the model's "
            f"{sorted(end_ids)}"
        )
    return num_tokens
