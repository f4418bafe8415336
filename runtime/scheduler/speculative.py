"""Speculative decoding: drafts verified in one forward of the target.

A request's draft (`Req.draft`, core.py) is fed behind its last token, and the step samples a
token after each draft token too, each with its own position's grammar mask (`Constrained`
fills them and cuts the draft at the first token the grammar forbids). `take_draft` keeps the
draft tokens the model sampled itself, up to the first it did not, whose sample is taken
instead: 1 + (tokens kept) tokens per forward; the KV of the rest is freed at once, so the
prefix cache only ever sees kept tokens.

Why this keeps the model's distribution: the rejection rule of speculative sampling keeps a
draft token x ~ q with probability min(1, p(x) / q(x)) and, on rejection, samples from
norm(max(0, p - q)). These drafts are deterministic, q = the point mass on x: x is kept with
probability p(x), and a rejection samples p without x, renormalized. Sampling y ~ p and keeping x
iff y == x (else emitting y) is exactly that: P(y == x) = p(x), and y given y != x is p restricted
to the other tokens. Every position is sampled from p given the tokens kept before it, so the
output has plain decoding's distribution (tests/test_speculative.py measures it); greedy, y is
argmax p and the output is plain decoding's, token for token. (A seeded request draws one
uniform per sampled row, so its seed picks another sample than without speculation.)

Draft sources, in order: the grammar's forced tokens (jump-forward, `Constrained._draft`), then
the drafter of speculative_algorithm: ngram, what the text repeats (the tokens that followed the
latest earlier occurrence of the request's last NGRAM_MAX .. NGRAM_MIN tokens in its prompt and
output, or else of its last token where that occurred once, `NgramIndex`; under a grammar, cut
where it forbids the repeat and continued with what it forces there, `Speculative._ngram`); draft,
a small model of the same tokenizer (`draft_model.DraftModel`).
The draft model drafts greedily (argmax), so its drafts are deterministic too: q is a point mass
and the proof above holds as it stands. (A sampled draft would need the general rule, p and q
at every drafted position.)
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Collection

from weft.grammars.manager import RequestGrammar
from weft.runtime.config import EngineConfig
from weft.runtime.core import Req
from weft.runtime.scheduler.draft_model import DraftModel, Fill
from weft.runtime.scheduler.memory import MemoryManager
from weft.runtime.scheduler.output_processor import OutputProcessor

# A suffix of 2 to 4 tokens: one token matches nearly everywhere in a long text, mostly drafts
# the model rejects (1 measured 1.17x against 1.04x on JSON extraction, but 0.96x on text that
# does not repeat: benchmarks/RESULTS.md); past 4, the latest match seldom changes.
NGRAM_MIN = 2
NGRAM_MAX = 4
# Where no suffix of NGRAM_MIN tokens matches, a last token that occurred exactly once before
# drafts what followed it (a name or number the output copies after a context the text never
# had: a JSON value's first token after `": "`). Such a draft rejected whole changes neither
# the draft length nor the back-off: it only ever fills a step that had no draft.
# A request whose draft the model rejected whole goes 1, 2, 4 ... (consecutive such misses, up
# to this) tokens without a draft: a text that does not repeat costs a verify step now and then.
MAX_MISS_BACKOFF = 16
# A draft the model cut short makes the next one at most this much longer than the part it kept
# (at least MIN_DRAFT); one kept whole doubles it, up to speculative_num_draft_tokens. Rows the
# model rejects cost forward rows and, under a grammar, a mask fill each.
MIN_DRAFT = 2
# speculative_max_step_rows unset. CPU: each row of a step costs weft's kernels its products
# (compute-bound past a few rows): a batch of 4 drafting 7 each (32 rows) ran a story 0.87x and
# JSON 0.69x of no speculation (RESULTS.md). CUDA: a verify step of an 8B model on an H100
# costs 1.18 decode steps at 1 + 7 rows and 1.76 at 32 x 8 rows (graphs replayed), ~3 steps
# eagerly (RESULTS.md); past 512 rows the GEMMs are compute-bound.
STEP_ROWS = {"cpu": 8, "cuda": 512}
# A draft row's cost, as a share of a one-row decode step, until steps of several row counts
# are timed (StepCost): on this CPU a row adds ~15 % (a step of 1 row 25 ms, of 8 rows 51 ms:
# int4 products are compute-bound past one row, RESULTS.md); a GPU's small steps are bound by
# reading the weights, so rows cost ~nothing there (H100, 8B: 224 more rows at batch 32 add
# 0.76 of a step, ~0.3 % a row; not timed: the overlap schedule).
ROW_COST_PRIOR = {"cpu": 0.15, "cuda": 0.0}
# A request's chance that its next draft token is kept: (K + 1) / (K + R + 2) over its kept
# tokens K and rejections R, each decayed by this at every verify (drafts come in bursts: a
# copied span is kept whole, a new sentence rejected)
KEEP_DECAY = 0.7
# ... and by this at every step the request drafts nothing for want of rows or of chance: its
# chance drifts back towards 1/2, so a request whose drafts stopped paying tries again (after
# ~13 steps from one rejection at a 4-request batch here), as a text may start repeating later
IDLE_DECAY = 0.97


class NgramIndex:
    """Where each n-gram (1 .. NGRAM_MAX tokens) of a request's tokens last occurred, as the
    position after it, and how often each single token did. Kept up with the tokens: each new
    token adds its n-grams, O(1) per token (the prompt's once)."""

    def __init__(self) -> None:
        self.after: dict[tuple[int, ...], int] = {}  # single tokens too (propose_unique)
        self.count_one: dict[int, int] = {}  # how often each token occurred (followed)
        self.indexed = 0  # positions < indexed are in `after` as continuations

    def update(self, req: Req) -> None:
        """Index the n-grams followed by a token of the request (not its suffix: that is
        looked up, and indexed once a token follows it)."""
        end = len(req.input_ids) + len(req.output_ids)
        if end <= self.indexed:
            return
        lo = max(self.indexed - NGRAM_MAX, 0)
        window = req.tokens(lo, end)
        for pos in range(max(self.indexed, 1), end):
            at = pos - lo
            token = window[at - 1]
            self.count_one[token] = self.count_one.get(token, 0) + 1
            for n in range(1, min(NGRAM_MAX, pos) + 1):
                self.after[tuple(window[at - n : at])] = pos
        self.indexed = end

    def propose(self, req: Req, tail: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        suffix of fill_ids + tail found in the index ([] where none is)."""
        end = len(req.input_ids) + len(req.output_ids)
        recent = req.tokens(max(end - NGRAM_MAX, 0), end) + tail
        for n in range(min(NGRAM_MAX, len(recent)), NGRAM_MIN - 1, -1):
            pos = self.after.get(tuple(recent[-n:]))
            if pos is not None:
                return req.tokens(pos, min(pos + limit, end))
        return []

    def propose_unique(self, req: Req, tail: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the last token of fill_ids + tail where it
        occurred once before ([] where it occurred never or more often)."""
        end = len(req.input_ids) + len(req.output_ids)
        last = tail[-1] if tail else req.tokens(end - 1, end)[0]
        if self.count_one.get(last) != 1:
            return []
        pos = self.after[(last,)]
        return req.tokens(pos, min(pos + limit, end))


@dataclasses.dataclass
class Speculation:
    """A speculating request's drafter state and its counts (meta_info's spec_* keys)."""

    limit: int  # drafted tokens the next draft may have (adapts to what was kept)
    index: NgramIndex = dataclasses.field(default_factory=NgramIndex)
    forced: int = 0  # leading tokens of the request's draft that its grammar forces
    unique: bool = False  # the drafter's tokens follow a single earlier token (propose_unique)
    proposed: int = 0  # the drafter's tokens after them (before the grammar's cut)
    # the draft model's tokens once its token is on the host (drafting now is wasted: the step
    # under way feeds that token without a draft); admission sits the request out for them
    deferred: int = 0
    misses: int = 0  # drafts rejected whole in a row
    skip: int = 0  # tokens to go before the next draft (after misses)
    verify_ct: int = 0  # forwards that verified a draft of this request
    draft_tokens: int = 0  # draft tokens verified (after the grammar's cut)
    accepted_tokens: int = 0  # of those, the ones the model kept
    recent_kept: float = 0.0  # kept tokens and rejections, decayed by KEEP_DECAY a verify
    recent_rejected: float = 0.0

    @property
    def keep_chance(self) -> float:
        """The chance the next draft token is kept, after those before it were."""
        return (self.recent_kept + 1) / (self.recent_kept + self.recent_rejected + 2)


class StepCost:
    """What a decode step's rows cost, from the latest timed steps: seconds = a + b * rows, fitted
    by least squares; with one row count seen so far, b from the prior (b = prior * a)."""

    def __init__(self, prior: float, window: int = 64) -> None:
        self.prior = prior
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, rows: int, seconds: float) -> None:
        self.steps.append((rows, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before any step."""
        if not self.steps:
            return None
        n = len(self.steps)
        mean_rows = sum(r for r, _ in self.steps) / n
        mean_s = sum(t for _, t in self.steps) / n
        spread = sum((r - mean_rows) ** 2 for r, _ in self.steps)
        if spread > 0:
            b = sum((r - mean_rows) * (t - mean_s) for r, t in self.steps) / spread
            b = max(b, 0.0)
            a = mean_s - b * mean_rows
            if a > 0:
                return a, b
        a = mean_s / (1 + self.prior * mean_rows)
        return a, self.prior * a

    def row_cost(self, batch: int) -> float:
        """A drafted row's cost in tokens of a step of `batch` rows without drafts."""
        fit = self.fit()
        return _in_tokens(self.prior if fit is None else fit[1] / fit[0], batch)


def _in_tokens(share: float, batch: int) -> float:
    """A row costing `share` of a one-row step (a + b rows: share = b / a), in tokens of a step of
    `batch` rows: b / ((a + b * batch) / batch)."""
    return share * batch / (1 + share * batch)


class Speculative:
    """The generic side of drafts: which requests speculate, their drafts (n-gram, or the draft
    model's), and taking a verified draft (the grammar's side stays in `Constrained`)."""

    def __init__(
        self,
        config: EngineConfig,
        memory: MemoryManager,
        output: OutputProcessor,
        draft_model: DraftModel | None = None,
        *,
        device_type: str = "cpu",
    ):
        self.config = config
        self.device_type = device_type
        self.cost = StepCost(ROW_COST_PRIOR.get(device_type, 0.0))
        self.memory = memory
        self.output = output
        self.draft_model = draft_model  # with speculative_algorithm draft
        self.graph_rows: int | None = None  # the largest CUDA graph's rows (None: no graphs)
        self.verify_ct = 0  # over all requests, for /metrics
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def step_rows(self, batch: int) -> int:
        """Most rows a speculating decode step of `batch` requests feeds
        (speculative_max_step_rows; unset, within the rows a CUDA graph replays where they are
        captured and the batch alone fits them)."""
        if self.config.speculative_max_step_rows:
            return self.config.speculative_max_step_rows
        rows = STEP_ROWS.get(self.device_type, 512)
        if self.graph_rows is None or batch > self.graph_rows:
            return rows
        return min(rows, self.graph_rows)

    @property
    def times_steps(self) -> bool:
        """Whether decode steps are timed for the row cost: on a CPU (a GPU's small steps are
        bound by reading the weights; its rows keep the prior, 0), unless it is set."""
        return (
            self.enabled and self.device_type == "cpu" and self.config.speculative_row_cost is None
        )

    @property
    def enabled(self) -> bool:
        return self.config.speculative_algorithm is not None

    def speculates(self, req: Req) -> bool:
        """Whether drafts extend this request's (where the server speculates): unless it
        opted out; not with logprobs asked for (a draft token has none), penalties
        or min_new_tokens still to reach (the draft rows would share the request's penalties and
        token count as they stand before the draft), nor in a thinking phase (its end marker
        switches the grammar on: drafts begin with the answer)."""
        p = req.params
        thinking = req.thinking
        return (
            p.speculative
            and req.logprob is None
            and not p.has_penalties
            and len(req.output_ids) >= p.min_new_tokens
            and (thinking is None or (thinking.ended and not thinking.in_gap))
        )

    def propose(
        self, reqs: list[Req], *, fill: Fill | None = None, defer: Collection[Req] = ()
    ) -> None:
        """After the requests' tokens: each one's draft (the grammar's, if any) extended by the
        drafter, cut before any end token (the grammar would take it for good). The draft
        model drafts for all at once, under each request's grammar (`fill` writes the masks),
        but not for those in `defer`: a step that feeds them without a draft is under way
        (overlap schedule); `Speculation.deferred` says what they would have drafted."""
        wants = [(req, limit) for req in reqs if (limit := self._limit(req)) > 0]
        # NOTE: after `_limit`, which clears the drafts of requests without a grammar
        forced = sum(len(req.draft) for req in reqs)
        rows = self.step_rows(len(reqs)) - len(reqs) - forced
        shared = _share(wants, rows, self._row_cost(len(reqs) + forced))
        drafting = {req for req, _ in shared}
        for req, _ in wants:
            if req not in drafting:
                req.spec.recent_kept *= IDLE_DECAY
                req.spec.recent_rejected *= IDLE_DECAY
        wants = shared
        if self.config.speculative_algorithm == "draft":
            assert self.draft_model is not None, "speculative_algorithm draft: no draft model"
            for req, limit in wants:
                req.spec.deferred = limit if req in defer else 0
            wants = [(req, limit) for req, limit in wants if req not in defer]
            drafts = self.draft_model.propose(wants, fill=fill)
        else:
            # rows the shares leave: for the tokens a grammar forces after a request's repeat
            spare = rows - sum(limit for _, limit in wants)
            drafts = []
            for req, limit in wants:
                grammar = req.grammar if req not in defer else None
                cap = limit + max(min(spare, self._room(req) - limit), 0)
                drafts.append(self._ngram(req, limit, cap, grammar))
                spare -= max(len(drafts[-1]) - limit, 0)
        for (req, _), draft in zip(wants, drafts, strict=True):
            del draft[self._before_end(req, draft) :]
            req.spec.proposed = len(draft)
            req.draft = req.draft + draft

    def _before_end(self, req: Req, draft: list[int]) -> int:
        """How many of the draft's tokens come before its first end or stop token."""
        stops = req.params.stop_token_ids
        ends = self.output.end_ids
        return next((i for i, tid in enumerate(draft) if tid in ends or tid in stops), len(draft))

    def _row_cost(self, batch: int) -> float:
        """A drafted row's cost in tokens of a step of `batch` rows (speculative_row_cost)."""
        share = self.config.speculative_row_cost
        return self.cost.row_cost(batch) if share is None else _in_tokens(share, batch)

    def _limit(self, req: Req) -> int:
        """How many tokens the drafter may add to the request's draft now (0: none)."""
        if req.grammar is None:
            req.draft = []
        if not self.speculates(req):
            return 0
        spec = req.spec
        if spec is None:
            spec = req.spec = Speculation(limit=self.config.speculative_num_draft_tokens)
        spec.forced = len(req.draft)
        spec.proposed = spec.deferred = 0
        spec.unique = False
        if spec.skip > 0:
            spec.skip -= 1
            return 0
        return min(self._room(req), spec.limit)

    def _room(self, req: Req) -> int:
        """Most tokens the drafter may add to the request's draft: within its token limit and
        speculative_num_draft_tokens, with room for the model's token after them."""
        room = min(req.remaining_new_tokens, self.output.max_seq_len - req.seq_len) - 1
        return min(room, self.config.speculative_num_draft_tokens) - len(req.draft)

    def _ngram(self, req: Req, limit: int, cap: int, grammar: RequestGrammar | None) -> list[int]:
        """Up to `limit` tokens of what the text repeats after the request's draft so far. Under
        a grammar, they are walked through it: cut at the first it forbids, and each cut or end
        of a repeat followed by the tokens the grammar then forces (`RequestGrammar.draft`),
        whereupon the text may repeat again; `cap` tokens in all. (A JSON value copied from the
        prompt, cut by the grammar at its closing quote, goes on with the next key the schema
        forces: those rows would otherwise be fed and rejected, and the key cost a step.)"""
        spec = req.spec
        spec.index.update(req)
        draft = spec.index.propose(req, req.draft, limit)
        if not draft:
            draft = spec.index.propose_unique(req, req.draft, limit)
            spec.unique = bool(draft)
        if grammar is None:
            return draft
        taken = 0  # tokens the grammar took, to roll back
        out: list[int] = []
        try:
            for tid in req.draft:  # (its own forced tokens: it takes them)
                if not grammar.accept(tid):
                    return []
                taken += 1
            while draft:
                for tid in draft[: self._before_end(req, draft)]:
                    if not grammar.accept(tid):
                        break
                    taken += 1
                    out.append(tid)
                forced = grammar.draft(cap - len(out))
                forced = forced[: self._before_end(req, forced)]
                for tid in forced:
                    if not grammar.accept(tid):
                        raise RuntimeError(f"the grammar forced token {tid}, then refused it")
                    taken += 1
                    out.append(tid)
                if not forced or len(out) >= min(limit, cap):
                    break
                draft = self._repeat(req, req.draft + out, limit - len(out))
        except Exception:  # NOTE: a backend's bug: the step's mask fill meets it, ends the request
            return []
        finally:
            grammar.rollback(taken)
        return out

    @staticmethod
    def _repeat(req: Req, tail: list[int], limit: int) -> list[int]:
        """The n-gram drafter's tokens after the request's tokens and `tail`."""
        index = req.spec.index
        return index.propose(req, tail, limit) or index.propose_unique(req, tail, limit)

    def forget(self, req: Req) -> None:
        """The request is done, aborted or retracted: the draft model frees its KV of it."""
        if self.draft_model is not None:
            self.draft_model.forget(req)

    def take_draft(self, req: Req, draft: list[int], ids: list[int]) -> int:
        """How many draft tokens the model picked itself (ids[j] was sampled after draft[:j]);
        the KV of the rest is freed. The caller takes them through the request's grammar into
        its output, then the model's token after them, ids[taken]."""
        taken = 0
        while taken < len(draft) and ids[taken] == draft[taken]:
            taken += 1
        self.memory.truncate(req, req.seq_len + taken)  # (its token is read: none pending)
        spec = req.spec
        if spec is None:
            return taken
        drafted, kept = len(draft) - spec.forced, max(taken - spec.forced, 0)
        if drafted > 0:
            self._count(spec, drafted, kept)
        # NOTE: the draft model's tokens the grammar cut count as rejected: each costs a forward
        # of the draft model (n-gram drafts cost nothing until verified)
        if self.config.speculative_algorithm == "draft" and spec.proposed > 0:
            self._adapt(spec, spec.proposed, kept)
        elif drafted > 0 and not (spec.unique and kept == 0):
            self._adapt(spec, drafted, kept)
        return taken

    def _count(self, spec: Speculation, drafted: int, kept: int) -> None:
        """A verified draft's counts (meta_info, /metrics, the next drafts' share)."""
        spec.recent_kept = KEEP_DECAY * spec.recent_kept + kept
        spec.recent_rejected = KEEP_DECAY * spec.recent_rejected + (kept < drafted)
        spec.verify_ct += 1
        spec.draft_tokens += drafted
        spec.accepted_tokens += kept
        self.verify_ct += 1
        self.draft_tokens += drafted
        self.accepted_tokens += kept

    def _adapt(self, spec: Speculation, drafted: int, kept: int) -> None:
        """How the request drafts next, after `kept` of the `drafted` tokens were kept."""
        if kept == drafted:
            spec.limit = min(2 * spec.limit, self.config.speculative_num_draft_tokens)
        else:
            spec.limit = max(kept + 1, MIN_DRAFT)
        if kept == 0:
            spec.misses += 1
            spec.skip = min((1 << spec.misses) // 2, MAX_MISS_BACKOFF)
        else:
            spec.misses = 0


def _share(wants: list[tuple[Req, int]], rows: int, row_cost: float) -> list[tuple[Req, int]]:
    """The drafter's tokens of each request within `rows` for the step. A request's k-th draft
    token is kept with chance c ** k (c: its `keep_chance`); it is drafted where that beats
    `row_cost` (a row's cost in tokens), the likeliest first, each request up to its limit, the
    order of `wants` among equals. Those left without rows draft nothing this step."""
    chances = []
    for i, (req, limit) in enumerate(wants):
        c = req.spec.keep_chance if req.spec is not None else 0.5
        gain = c
        for k in range(1, limit + 1):
            if gain <= row_cost:
                break
            chances.append((-gain, i, k))
            gain *= c
    shares = [0] * len(wants)
    for _, i, _ in sorted(chances)[: max(rows, 0)]:
        shares[i] += 1
    return [(req, shares[i]) for i, (req, _) in enumerate(wants) if shares[i] > 0]
