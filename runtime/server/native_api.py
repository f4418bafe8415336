"""SGLang's native API: POST /generate (single or batch, text or input_ids, stream or not).

Responses have SGLang's shape: {"text", "output_ids", "meta_info"} per sample (a list for a
batch or n > 1); a stream sends `data: {...}` events with the cumulative text and `data: [DONE]`.
Logprob lists hold [logprob, token_id, text-or-null] entries.

With --reasoning-parser, `separate_reasoning: true` splits each output: `text` is the answer and
`reasoning_text` the thinking (cumulative in a stream, like `text`; with `stream_reasoning:
false` the thinking comes once it has ended). Where an output begins (in the thinking or not) is
read from the prompt's end (runtime/server/reasoning.py).

A request the scheduler ends for its own fault (a grammar that does not compile) finishes with
an abort reason carrying `status_code`: it is answered as that error (an error event in a
stream), naming the constraint field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from weft.grammars.spec import parse_off_loop
from weft.runtime.intake import per_prompt
from weft.runtime.messages.tokenizer_to_scheduler import GenerateRequest
from weft.runtime.results import sample_result
from weft.runtime.server.errors import ApiError, bad_request, decode_body, not_supported
from weft.runtime.server.middleware import is_admin, tenant_of
from weft.runtime.server.reasoning import (
    ReasoningParser,
    ReasoningPlan,
    plan_reasoning,
    thinking_phase,
)
from weft.runtime.server.request_state import ReqState, refused, request_error
from weft.runtime.server.responses import SSE_DONE, client_gone, json_response, sse
from weft.runtime.server.sglang_params import parse_sampling_params
from weft.runtime.server.tokenizer_manager import TokenizerManager


class GenerateReqInput(msgspec.Struct):
    """The body of /generate; fields that take a scalar or a per-prompt list are typed Any and
    checked by hand (msgspec unions cannot hold two array types)."""

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    rid: Any = None
    return_logprob: Any = None
    logprob_start_len: Any = None
    top_logprobs_num: Any = None
    return_text_in_logprobs: bool | None = None
    stream: bool | None = None
    cache_salt: Any = None  # prefix-cache namespace: no cache hit across different salts
    separate_reasoning: bool | None = None  # with --reasoning-parser: reasoning_text apart
    stream_reasoning: bool | None = None  # false: the thinking in one piece once it ends
    # SGLang features weft does not have, UNSUPPORTED_FIELDS: accepted while null or false
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = None


_FIELDS = GenerateReqInput.__struct_fields__
UNSUPPORTED_FIELDS = _FIELDS[_FIELDS.index("image_data") :]


@dataclass
class _Parsed:
    reqs: list[GenerateRequest]
    single: bool
    stream: bool
    text_in_logprobs: bool
    constraint_params: dict[str, str]  # rid -> the sampling_params field of its constraint
    reasoning: dict[str, ReasoningPlan]  # rid -> how its outputs are split (separate_reasoning)


def parse_generate(body: bytes, tm: TokenizerManager, tenant: str | None = None) -> _Parsed:
    obj = decode_body(body, GenerateReqInput)
    for name in UNSUPPORTED_FIELDS:
        value = getattr(obj, name)
        if value not in (None, False, [], {}):
            raise not_supported(name, name)
    ids_list, single = tm.intake.prompts(obj.text, obj.input_ids)
    count = len(ids_list)
    params = per_prompt(obj.sampling_params, count, single, "sampling_params", list_of=dict)
    rids = per_prompt(obj.rid, count, single, "rid", list_of=str, broadcast=False)
    want = per_prompt(obj.return_logprob, count, single, "return_logprob", list_of=bool)
    starts = per_prompt(obj.logprob_start_len, count, single, "logprob_start_len", list_of=int)
    tops = per_prompt(obj.top_logprobs_num, count, single, "top_logprobs_num", list_of=int)
    reqs = []
    constraint_params = {}
    reasoning = {}
    fmt = tm.config.reasoning_format
    for i, ids in enumerate(ids_list):
        where = "sampling_params" + (f"[{i}]" if isinstance(obj.sampling_params, list) else "")
        sp, explicit = parse_sampling_params(
            params[i], tm.info.vocab_size, where, tm.config.request_limits
        )
        if want[i] not in (None, True, False):
            raise bad_request("return_logprob must be a bool", "return_logprob")
        start = (-1 if starts[i] is None else starts[i]) if want[i] else None
        # the prompt's end is a decode per prompt: only where the split or a budget asks for it
        budget = sp.thinking_budget
        asks = bool(obj.separate_reasoning) or budget is not None
        prompt_end = _prompt_end(tm, ids) if fmt and asks else ""
        begins = fmt.output_start(prompt_end) if fmt is not None and asks else "answer"
        phase = thinking_phase(tm.reasoning_ids, begins, sp, f"{where}.thinking_budget")
        reqs.append(
            tm.build_request(
                ids,
                sp,
                max_tokens_explicit=explicit,
                logprob_start_len=start,
                top_logprobs_num=0 if tops[i] is None else tops[i],
                rid=rids[i],
                prompt_param="input_ids" if obj.text is None else "text",
                cache_salt=obj.cache_salt,
                tenant=tenant,
                reasoning_end_ids=phase.end if phase else None,
                reasoning_start_ids=phase.start if phase else None,
            )
        )
        rid = reqs[-1].rid
        if sp.constraint is not None:
            constraint_params[rid] = f"{where}.{sp.constraint[0]}"
        plan = plan_reasoning(
            fmt,
            prompt_end,
            separate=obj.separate_reasoning,
            stream_reasoning=obj.stream_reasoning,
            default=False,
        )
        if plan is not None:
            reasoning[rid] = plan
    return _Parsed(
        reqs,
        single,
        bool(obj.stream),
        bool(obj.return_text_in_logprobs),
        constraint_params,
        reasoning,
    )


PROMPT_END_TOKENS = 64  # enough for any marker the prompt may end with


def _prompt_end(tm: TokenizerManager, ids: list[int]) -> str:
    """The text of a prompt's last tokens (where a template opens or closes the thinking)."""
    if tm.tokenizer is None:
        return ""
    return str(tm.tokenizer.decode(ids[-PROMPT_END_TOKENS:]))


# ---- responses ------------------------------------------------------------------------------


def raise_request_errors(states: list[ReqState], params: dict[str, str]) -> None:
    for state in states:
        error = request_error(state, params.get(state.rid))
        if error is not None:
            raise error


def sample_output(
    tm: TokenizerManager,
    state: ReqState,
    i: int,
    text_in_logprobs: bool,
    split: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A sample's result; `split`: its (reasoning, answer) with separate_reasoning."""
    s = state.samples[i]
    out = sample_result(
        state.rid,
        i,
        text=s.text if split is None else split[1],
        output_ids=s.output_ids,
        prompt_tokens=state.prompt_tokens,
        cached_tokens=s.cached_tokens,
        finish_reason=s.finish_reason,
        e2e_latency=(s.finished_at - state.created) if s.finished_at is not None else None,
        grammar=s.grammar,
        spec=s.spec,
        logprobs=(s.output_logprobs, s.input_logprobs or []) if state.want_logprobs else None,
        token_text=tm.token_text if text_in_logprobs else None,
    )
    if split is not None:
        out["reasoning_text"] = split[0]
    return out


@dataclass
class _Split:
    """A streamed sample's (reasoning, answer) so far, sent cumulatively."""

    parser: ReasoningParser
    fed: int = 0
    reasoning: str = ""
    answer: str = ""

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        thought, answer = self.parser.feed(text[self.fed :], final=finished)
        self.fed = len(text)
        self.reasoning += thought
        self.answer += answer
        return self.reasoning, self.answer


async def _stream(
    tm: TokenizerManager, states: list[ReqState], parsed: _Parsed
) -> AsyncIterator[bytes]:
    listener = states[0].listener
    params = parsed.constraint_params
    flat = [(state, i) for state in states for i in range(len(state.samples))]
    splits = [
        _Split(plan.parser()) if (plan := parsed.reasoning.get(state.rid)) else None
        for state, _ in flat
    ]
    try:
        while True:
            listener.clear()
            for index, (state, i) in enumerate(flat):
                sample = state.samples[i]
                if sample.dirty and not refused(sample):
                    sample.dirty = False
                    split = splits[index]
                    parts = split.update(sample.text, sample.finished) if split else None
                    chunk = sample_output(tm, state, i, parsed.text_in_logprobs, parts)
                    chunk["index"] = index
                    yield sse(chunk)
            errors = [e for s in states if (e := request_error(s, params.get(s.rid))) is not None]
            if errors:
                yield sse(errors[0].body())
                break
            if all(s.finished for s in states):
                break
            await listener.wait()
        yield SSE_DONE
    finally:
        # NOTE: runs when the client disconnects mid-stream (the generator is cancelled).
        tm.abort_unfinished(states)


def register(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        tenant = tenant_of(request)
        parsed = await parse_off_loop(partial(parse_generate, await request.body(), tm, tenant))
        states = tm.submit(parsed.reqs, stream=parsed.stream, tenant=tenant)
        if parsed.stream:
            return StreamingResponse(_stream(tm, states, parsed), media_type="text/event-stream")
        await tm.wait(states, partial(client_gone, request))
        raise_request_errors(states, parsed.constraint_params)
        outs = []
        for state in states:
            plan = parsed.reasoning.get(state.rid)
            for i, s in enumerate(state.samples):
                split = plan.split(s.text) if plan is not None else None
                outs.append(sample_output(tm, state, i, parsed.text_in_logprobs, split))
        return json_response(outs[0] if parsed.single and len(outs) == 1 else outs)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = decode_body(await request.body() or b"{}", dict[str, Any])
        rid = body.get("rid")
        # with API keys, a tenant aborts its own requests only; the admin, anyone's
        tenant, anyone = tenant_of(request), is_admin(request)
        if body.get("abort_all"):
            tm.abort_all(tenant, any_tenant=anyone)
            return json_response({"success": True})
        if not isinstance(rid, str) or not rid:
            raise bad_request("rid must be a non-empty string", "rid")
        if not tm.abort(rid, tenant, any_tenant=anyone):
            raise ApiError(f"no running request has rid {rid!r}", 404, param="rid")
        return json_response({"success": True})
