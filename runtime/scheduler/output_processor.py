"""After sampling: append the token, report logprobs and text, decide whether the request ends."""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedTokenizerBase

from weft.runtime.core import FinishReason, Req
from weft.runtime.detokenize import IncrementalDecoder
from weft.runtime.sampler import top_logprobs
from weft.runtime.tokenizer import skipped_special_ids


class OutputProcessor:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, end_ids: frozenset[int], max_seq_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self.max_seq_len = max_seq_len
        # the tool-call markers are text: the detokenizer's text and this one agree on it
        self.skipped = skipped_special_ids(tokenizer) if tokenizer is not None else None

    def start(self, req: Req) -> None:
        if self.tokenizer is not None and req.decoder is None:
            p = req.params
            req.decoder = IncrementalDecoder(
                self.tokenizer,
                p.skip_special_tokens,
                p.spaces_between_special_tokens,
                self.skipped,
            )
        if req.logprob is not None and req.logprob.start_len == 0 and not req.input_logprobs:
            req.input_logprobs.append((None, req.input_ids[0], []))

    def record_prompt_logprobs(
        self, req: Req, logprobs: torch.Tensor, positions: list[int]
    ) -> None:
        """logprobs: [R, V] log-softmaxed rows; positions[i] = the prompt position row i scores."""
        assert req.logprob is not None
        targets = torch.tensor([req.input_ids[p] for p in positions], device=logprobs.device)
        picked = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        for i, p in enumerate(positions):
            top = top_logprobs(logprobs[i], req.logprob.top_k)
            req.input_logprobs.append((picked[i], req.input_ids[p], top))

    def append_token(
        self, req: Req, token: int, logprob: float | None, top: list[tuple[float, int]] | None
    ) -> None:
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append((logprob, token, top or []))
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.end_ids):
            self.finish(req, FinishReason("stop", matched=token))
            return
        if req.decoder is not None:
            req.decoder.push([token])
            if p.stop and self._match_stop_string(req):
                return
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.max_seq_len:
            self.finish(req, FinishReason("length"))

    def _match_stop_string(self, req: Req) -> bool:
        text = req.decoder.text
        longest = max(len(s) for s in req.params.stop)
        window_start = max(req.sent_len - longest, 0)
        best: tuple[int, str] | None = None
        for stop in req.params.stop:
            at = text.find(stop, window_start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        cut = at + len(stop) if req.params.no_stop_trim else at
        req.decoder.text = text[:cut]
        self.finish(req, FinishReason("stop", matched=stop), flush=False)
        return True

    def finish(self, req: Req, reason: FinishReason, flush: bool = True) -> None:
        if req.finish is not None:
            return
        req.finish = reason
        req.finished_at = time.perf_counter()
        if flush and req.decoder is not None:
            req.decoder.flush()

    def mark_reported(self, req: Req) -> None:
        """Advance `sent_len`, the text a caller may see now: a possible stop-string prefix is
        held back until it is decided."""
        if req.decoder is None:
            return
        end = len(req.decoder.text)
        if not req.finished and req.params.stop:
            end = max(end - (max(len(s) for s in req.params.stop) - 1), req.sent_len)
        req.sent_len = end
