"""A sample's result in SGLang's shape: text, output_ids and meta_info.

NOTE: `sample_result` is the one builder of results for both paths: the in-process Engine reads
the values off its `Req` (`request_output`), the server off what the scheduler reported through
the detokenizer (`TokenUpdate` -> `TextUpdate` -> the tokenizer manager's `Sample`). A value the
scheduler knows reaches the server only if those messages carry it.

| key                   | value                                                                |
|-----------------------|----------------------------------------------------------------------|
| id                    | the rid the caller knows (its own, or one made for it)               |
| index                 | which of the request's n samples                                     |
| prompt_tokens         | tokens of the prompt                                                 |
| completion_tokens     | output tokens so far (an end token that stopped the sample included) |
| cached_tokens         | prompt tokens served from the prefix cache                           |
| finish_reason         | None while running; {"type": "stop", "matched": id or string},       |
|                       | {"type": "length"} or {"type": "abort", "message"[, "status_code"]}  |
| e2e_latency           | seconds from the request's arrival to its finish (None while running)|
| grammar_backend       | constrained requests only, once their grammar compiled: the backend  |
|                       | serving the constraint                                               |
| jump_forward_tokens   | with grammar_backend: forced tokens the model took from drafts       |
| spec_verify_ct        | speculating requests only (--speculative-algorithm): forwards that   |
|                       | verified a draft of the request (past a grammar's forced tokens)     |
| spec_accept_length    | with spec_verify_ct: mean tokens those forwards gave (kept + 1)       |
| spec_accept_rate      | with spec_verify_ct: draft tokens kept / draft tokens verified       |
| output_token_logprobs | return_logprob only: (logprob, id, text) per output token            |
| output_top_logprobs   | return_logprob only: per output token, (logprob, id, text) per       |
|                       | alternative, None without alternatives (top_logprobs_num 0)          |
| input_token_logprobs  | return_logprob only: per prompt position from logprob_start_len ([]  |
| input_top_logprobs    | for -1); the first prompt token has logprob None and no alternatives |

`text` in logprob entries is None unless the server is asked for it (return_text_in_logprobs).
Each side times e2e_latency itself: the Engine from the request's `Req` (built once the prompt is
tokenized), the server from its submission to the scheduler (likewise after tokenizing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from weft.runtime.messages.common import GrammarReport, LogprobEntry, SpecReport

if TYPE_CHECKING:  # NOTE: the HTTP process imports this module: no torch (weft.runtime.core)
    from weft.runtime.core import Req

TokenText = Callable[[int], str | None]


def sample_result(
    rid: str,
    index: int,
    *,
    text: str,
    output_ids: Sequence[int],
    prompt_tokens: int,
    cached_tokens: int,
    finish_reason: dict[str, Any] | None,
    e2e_latency: float | None,
    grammar: GrammarReport | None,
    logprobs: tuple[Sequence[LogprobEntry], Sequence[LogprobEntry]] | None,
    token_text: TokenText | None = None,
    spec: SpecReport | None = None,
) -> dict[str, Any]:
    """A sample's {text, output_ids, meta_info} (see the module docstring). logprobs: (output,
    input) entries, None when the request asked for none."""
    meta: dict[str, Any] = {
        "id": rid,
        "index": index,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": cached_tokens,
        "finish_reason": finish_reason,
        "e2e_latency": e2e_latency,
    }
    if grammar is not None:
        meta["grammar_backend"] = grammar.backend
        meta["jump_forward_tokens"] = grammar.jump_forward_tokens
        meta["grammar_wait_s"] = grammar.wait_s
        meta["grammar_cached"] = grammar.cached
    if spec is not None:
        verified = spec.verify_ct
        meta["spec_verify_ct"] = verified
        meta["spec_accept_length"] = 1.0 + spec.accepted_tokens / verified if verified else 1.0
        meta["spec_accept_rate"] = (
            spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else 0.0
        )
    if logprobs is not None:
        name = token_text or (lambda tid: None)
        outputs, inputs = logprobs
        meta["output_token_logprobs"] = [(e[0], e[1], name(e[1])) for e in outputs]
        meta["output_top_logprobs"] = [_top(e, name) for e in outputs]
        meta["input_token_logprobs"] = [(e[0], e[1], name(e[1])) for e in inputs]
        meta["input_top_logprobs"] = [_top(e, name) for e in inputs]
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


def request_output(req: Req, rid: str, text: str | None = None) -> dict[str, Any]:
    """The in-process Engine's result of one sample (`rid`: the one its caller knows; `text`:
    instead of the decoder's, e.g. without a held-back stop-string prefix)."""
    if text is None:
        text = req.decoder.text if req.decoder is not None else ""
    return sample_result(
        rid,
        req.index,
        text=text,
        output_ids=req.output_ids,
        prompt_tokens=len(req.input_ids),
        cached_tokens=req.cached_tokens,
        finish_reason=req.finish.to_dict() if req.finish else None,
        e2e_latency=req.finished_at - req.created if req.finished_at is not None else None,
        grammar=req.grammar_report(),
        spec=req.spec_report(),
        logprobs=None if req.logprob is None else (req.output_logprobs, req.input_logprobs),
    )


def _top(entry: LogprobEntry, text: TokenText) -> list[tuple[float, int, str | None]] | None:
    if not entry[2]:
        return None
    return [(lp, tid, text(tid)) for lp, tid in entry[2]]
