"""OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Requests become the same `GenerateRequest`s as the native API (n samples share one prompt
prefill in the scheduler); responses and stream chunks follow OpenAI's shapes, with usage
including prompt_tokens_details.cached_tokens.

Output constraints: SGLang's extension fields `regex` / `json_schema` / `ebnf`, chat's
`response_format` (json_object, json_schema) and chat's `tools` (a structural tag, see
`tool_calls`); at most one per request, each checked before it reaches the scheduler. A strict
json_schema or function holds the output to a closed schema (no properties beyond the listed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from weft.grammars.spec import JSON_OBJECT_SCHEMA, MAX_SPEC_CHARS, parse_off_loop
from weft.runtime.messages.tokenizer_to_scheduler import GenerateRequest
from weft.runtime.sampling_params import (
    ALIASES,
    CONSTRAINT_FIELDS,
    SAMPLING_FIELDS,
    RequestError,
    SamplingParams,
)
from weft.runtime.server.chat import ChatRenderer, check_template_kwargs
from weft.runtime.server.errors import ApiError, bad_request, decode_body, not_supported
from weft.runtime.server.middleware import tenant_of
from weft.runtime.server.openai_jobs import ChatJob, CompletionJob, Job
from weft.runtime.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from weft.runtime.server.reasoning import MarkerIds, plan_reasoning, thinking_phase
from weft.runtime.server.responses import client_gone, json_response
from weft.runtime.server.sglang_params import check_constraint
from weft.runtime.server.tokenizer_manager import TokenizerManager
from weft.runtime.server.tool_calls import check_flag, check_name, plan_tools, strict_schema

MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_EXTENSION_CONSTRAINTS = ("regex", "json_schema", "ebnf")  # SGLang's fields, same as native
RESPONSE_FORMATS = ("text", "json_object", "json_schema")

# OpenAI field -> weft SamplingParams field (ALIASES), copied when not null; max_tokens and the
# constraints are read by hand
_BY_HAND = frozenset({"max_tokens", "max_completion_tokens", *CONSTRAINT_FIELDS})
_SAMPLING_FIELDS = {
    name: ALIASES.get(name, name)
    for name in _SamplingFields.__struct_fields__
    if ALIASES.get(name, name) in SAMPLING_FIELDS and name not in _BY_HAND
}
# how an error names a SamplingParams field that OpenAI spells otherwise (max_tokens: as sent)
_OPENAI_NAMES = {field: name for name, field in _SAMPLING_FIELDS.items() if name != field}


def _check_model(tm: TokenizerManager, model: str | None) -> str:
    if model is None or model in (tm.served_model_name, tm.source.display_path):
        return tm.served_model_name
    raise ApiError(
        f"The model `{model}` does not exist; this server serves `{tm.served_model_name}`",
        404,
        param="model",
        code="model_not_found",
    )


def response_format_constraint(fmt: Any, max_chars: int = MAX_SPEC_CHARS) -> str | None:
    """Chat's `response_format` -> the JSON schema text it asks the output to match (None: free
    text); a strict json_schema is closed, as OpenAI's strict mode means (closed_schema). A 400
    names the bad part."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps(JSON_OBJECT_SCHEMA)
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}; got {kind!r}",
            "response_format.type",
        )
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object with name and schema", where)
    check_name(spec.get("name"), f"{where}.name")
    strict = check_flag(spec.get("strict"), f"{where}.strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        what = "is missing" if schema is None else "must be a JSON schema object"
        raise bad_request(f"{where}.schema {what}", f"{where}.schema")
    if strict:
        schema = strict_schema(schema, f"{where}.schema")
    return check_constraint("json_schema", schema, f"{where}.schema", max_chars)


def _constraint(
    req: _SamplingFields, extra: Sequence[tuple[str, str, str]], max_chars: int = MAX_SPEC_CHARS
) -> tuple[str, str] | None:
    """The request's one output constraint as (SamplingParams field, spec text), from the
    extension fields and `extra` ((field, text, OpenAI param) from response_format or tools)."""
    found = []
    for name in _EXTENSION_CONSTRAINTS:
        text = check_constraint(name, getattr(req, name), name, max_chars)
        if text is not None:
            found.append((name, text, name))
    found.extend(extra)
    if len(found) > 1:
        given = " and ".join(param for _, _, param in found)
        raise bad_request(f"give at most one output constraint; got {given}", found[-1][2])
    return (found[0][0], found[0][1]) if found else None


def _sampling(
    req: _SamplingFields,
    tm: TokenizerManager,
    prompt_len: int,
    max_tokens: int | None,
    default_max: int | None,
    extra_constraints: Sequence[tuple[str, str, str]] = (),
    max_tokens_param: str = "max_tokens",
) -> tuple[SamplingParams, bool]:
    """(params, max_tokens given explicitly); errors name the OpenAI field (`max_tokens_param`
    is the one the client set: max_tokens or max_completion_tokens)."""
    limits = tm.config.request_limits
    constraint = _constraint(req, extra_constraints, limits.max_grammar_chars)
    if req.logit_bias:
        raise not_supported("logit_bias", "logit_bias")
    if max_tokens is not None and max_tokens < 0:
        raise bad_request(f"{max_tokens_param} must be >= 0, got {max_tokens}", max_tokens_param)
    pairs = ((dst, getattr(req, src)) for src, dst in _SAMPLING_FIELDS.items())
    values: dict[str, Any] = {dst: value for dst, value in pairs if value is not None}
    if constraint is not None:
        values[constraint[0]] = constraint[1]
    explicit = max_tokens is not None
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else tm.info.context_length - prompt_len
        if limits.max_new_tokens is not None:  # a request that asked for nothing is not refused
            max_tokens = min(max_tokens, limits.max_new_tokens)
    values["max_new_tokens"] = max(max_tokens, 0)
    names = {**_OPENAI_NAMES, "max_new_tokens": max_tokens_param}
    try:
        params = SamplingParams(**values)
        params.validate(tm.info.vocab_size, limits, names=names)
    except RequestError as exc:
        given = (
            exc.param in _SAMPLING_FIELDS or exc.param in values or exc.param == max_tokens_param
        )
        raise ApiError(exc.message, 400, param=exc.param if given else None) from None
    return params, explicit


# ---- building requests ----------------------------------------------------------------------


def _logprob_settings(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _chat_job(
    req: ChatCompletionRequest,
    tm: TokenizerManager,
    chat: ChatRenderer,
    tenant: str | None = None,
) -> Job:
    model = _check_model(tm, req.model)
    chat = chat.for_request(req.chat_template, tm.config.trust_request_chat_template)
    chat.check_available()
    json_schema = response_format_constraint(
        req.response_format, tm.config.request_limits.max_grammar_chars
    )
    if json_schema is not None and req.tools:
        raise bad_request("response_format cannot be combined with tools", "response_format")
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, chat.template_text)
    extra = []
    if plan is not None:
        extra.append(("structural_tag", plan.structural_tag, "tools"))
    if json_schema is not None:
        extra.append(("json_schema", json_schema, "response_format"))
    top = _logprob_settings(req)
    kwargs = check_template_kwargs(req.chat_template_kwargs)
    prompt = chat.render(req.messages, plan.tools if plan is not None else None, True, kwargs)
    enable = kwargs.get("enable_thinking")
    thinking = enable if isinstance(enable, bool) else None
    fmt = tm.config.reasoning_format
    reasoning = plan_reasoning(
        fmt,
        prompt,
        separate=req.separate_reasoning,
        stream_reasoning=req.stream_reasoning,
        thinking=thinking,
    )
    # NOTE: the rendered template carries its own BOS (if any): add no special tokens.
    ids = tm.tokenize(prompt, "messages", add_special_tokens=False)
    max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
    params, explicit = _sampling(req, tm, len(ids), max_tokens, None, extra, max_tokens_param)
    param = "tools" if plan else "response_format" if json_schema else _constraint_param(params)
    # NOTE: the thinking is free (a tool call written inside it is thinking, never parsed); the
    # constraint (the tools' structural tag too) holds the answer after the end marker. The
    # phase does not depend on separate_reasoning, which only chooses how the text comes back.
    begins = fmt.output_start(prompt, thinking) if fmt is not None else "answer"
    phase = thinking_phase(tm.reasoning_ids, begins, params, "thinking_budget")
    gen = tm.build_request(
        ids,
        params,
        max_tokens_explicit=explicit,
        logprob_start_len=-1 if top is not None else None,
        top_logprobs_num=top or 0,
        rid=req.rid,
        prompt_param="messages",
        max_tokens_param=max_tokens_param,
        cache_salt=req.cache_salt,
        tenant=tenant,
        reasoning_end_ids=phase.end if phase else None,
        reasoning_start_ids=phase.start if phase else None,
    )
    # NOTE: submitted after every spec check: parse_off_loop may run this twice
    states = tm.submit([gen], stream=bool(req.stream), api="openai.chat", tenant=tenant)
    return ChatJob(tm, model, states, top, constraint_param=param, tools=plan, reasoning=reasoning)


def _constraint_param(params: SamplingParams) -> str | None:
    """The OpenAI field of an extension constraint (named as SamplingParams names it)."""
    return params.constraint[0] if params.constraint is not None else None


def _echo_text(tm: TokenizerManager, ids: list[int]) -> str:
    return str(tm.tokenizer.decode(ids)) if tm.tokenizer else ""


def _completion_prompts(prompt: Any, tm: TokenizerManager) -> tuple[list[list[int]], list[str]]:
    """(token ids per prompt, prompt texts for echo)."""
    if isinstance(prompt, str):
        return [tm.tokenize(prompt, "prompt")], [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            names = [f"prompt[{i}]" for i in range(len(prompt))]
            return tm.intake.encode_many(prompt, names), list(prompt)
        if all(isinstance(p, list) for p in prompt):
            many = [tm.intake.check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
            return many, [_echo_text(tm, x) for x in many]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            one = tm.intake.check_ids(prompt, "prompt")
            return [one], [_echo_text(tm, one)]
    raise bad_request(
        "prompt must be a non-empty string, list of strings, list of token ids, or list of "
        "token-id lists",
        "prompt",
    )


def _completion_job(req: CompletionRequest, tm: TokenizerManager, tenant: str | None = None) -> Job:
    model = _check_model(tm, req.model)
    if req.suffix:
        raise not_supported("suffix", "suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise not_supported("best_of other than n", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    if req.prompt is None:
        raise bad_request("prompt is required", "prompt")
    ids_list, texts = _completion_prompts(req.prompt, tm)
    top = req.logprobs
    gens: list[GenerateRequest] = []
    param = None
    for ids in ids_list:
        params, explicit = _sampling(
            req, tm, len(ids), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS
        )
        thinking_phase(MarkerIds([], []), "answer", params, "thinking_budget")  # no split here
        gens.append(
            tm.build_request(
                ids,
                params,
                max_tokens_explicit=explicit,
                logprob_start_len=-1 if top is not None else None,
                top_logprobs_num=top or 0,
                rid=req.rid if len(ids_list) == 1 else None,
                prompt_param="prompt",
                max_tokens_param="max_tokens",
                cache_salt=req.cache_salt,
                tenant=tenant,
            )
        )
        param = _constraint_param(params)
    # NOTE: submitted after every spec check: parse_off_loop may run this twice
    states = tm.submit(gens, stream=bool(req.stream), api="openai.completions", tenant=tenant)
    return CompletionJob(
        tm, model, states, top, constraint_param=param, echo_prompts=texts if req.echo else []
    )


def register(app: FastAPI, tm: TokenizerManager, chat: ChatRenderer) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [_model_card(tm)]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        _check_model(tm, model)
        return json_response(_model_card(tm))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = decode_body(await request.body(), ChatCompletionRequest)
        job = await parse_off_loop(partial(_chat_job, req, tm, chat, tenant_of(request)))
        return await _respond(job, bool(req.stream), req.stream_options, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = decode_body(await request.body(), CompletionRequest)
        job = await parse_off_loop(partial(_completion_job, req, tm, tenant_of(request)))
        return await _respond(job, bool(req.stream), req.stream_options, request)

    async def _respond(job: Job, stream: bool, options: Any, request: Request) -> Response:
        if stream:
            include_usage = bool(options is not None and options.include_usage)
            return StreamingResponse(job.stream(include_usage), media_type="text/event-stream")
        await tm.wait(job.states, partial(client_gone, request))
        job.raise_errors()
        return json_response(job.response())


def _model_card(tm: TokenizerManager) -> dict[str, Any]:
    return {
        "id": tm.served_model_name,
        "object": "model",
        "created": int(tm.started_at),
        "owned_by": "weft",
        "root": tm.source.display_path,
        "max_model_len": tm.info.context_length,
    }
