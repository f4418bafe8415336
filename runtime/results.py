"""The result of a request in SGLang's shape: text, output_ids and meta_info."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from weft.runtime.core import Req


def request_output(req: Req, tokenizer: PreTrainedTokenizerBase | None, rid: str) -> dict[str, Any]:
    end = req.finished_at if req.finished_at is not None else None
    meta: dict[str, Any] = {
        "id": rid,
        "index": req.index,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish.to_dict() if req.finish else None,
        "e2e_latency": (end - req.created) if end is not None else None,
        **req.grammar_meta(),
    }
    if req.logprob is not None:
        meta["output_token_logprobs"] = [(lp, tid, None) for lp, tid, _ in req.output_logprobs]
        meta["output_top_logprobs"] = [_top(top) for _, _, top in req.output_logprobs]
        if req.logprob.start_len >= 0:
            meta["input_token_logprobs"] = [(lp, tid, None) for lp, tid, _ in req.input_logprobs]
            meta["input_top_logprobs"] = [_top(top) for _, _, top in req.input_logprobs]
    text = req.decoder.text if req.decoder is not None else ""
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


def _top(entries: list[tuple[float, int]]) -> list[tuple[float, int, None]]:
    return [(lp, tid, None) for lp, tid in entries]
