"""OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Requests become the same `GenerateRequest`s as the native API (n samples share one prompt
prefill in the scheduler); responses and stream chunks follow OpenAI's shapes, with usage
including prompt_tokens_details.cached_tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from weft.runtime.messages.common import LogprobEntry
from weft.runtime.messages.tokenizer_to_scheduler import GenerateRequest
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.server.chat import ChatRenderer
from weft.runtime.server.errors import ApiError, bad_request, from_decode_error, not_supported
from weft.runtime.server.native_api import SSE_DONE, client_gone, json_response, sse
from weft.runtime.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from weft.runtime.server.sglang_params import check_stop
from weft.runtime.server.tokenizer_manager import ReqState, Sample, TokenizerManager

MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# OpenAI field -> weft SamplingParams field, copied when not null
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "stop_token_ids": "stop_token_ids",
}


def _decode(body: bytes, cls: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None


def _check_model(tm: TokenizerManager, model: str | None) -> str:
    if model is None or model in (tm.served_model_name, tm.source.display_path):
        return tm.served_model_name
    raise ApiError(
        f"The model `{model}` does not exist; this server serves `{tm.served_model_name}`",
        404,
        param="model",
        code="model_not_found",
    )


def _sampling(
    req: _SamplingFields,
    tm: TokenizerManager,
    prompt_len: int,
    max_tokens: int | None,
    default_max: int | None,
) -> tuple[SamplingParams, bool]:
    """(params, max_tokens given explicitly); errors name the OpenAI field."""
    for name in ("regex", "json_schema", "ebnf"):
        if getattr(req, name):
            raise not_supported(f"constrained decoding ({name})", name)
    if req.logit_bias:
        raise not_supported("logit_bias", "logit_bias")
    if max_tokens is not None and max_tokens < 0:
        raise bad_request(f"max_tokens must be >= 0, got {max_tokens}", "max_tokens")
    values: dict[str, Any] = {}
    for src, dst in _SAMPLING_FIELDS.items():
        value = getattr(req, src)
        if value is not None:
            values[dst] = value
    if req.stop is not None:
        values["stop"] = check_stop(req.stop, "stop")
    explicit = max_tokens is not None
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else tm.info.context_length - prompt_len
    values["max_new_tokens"] = max(max_tokens, 0)
    try:
        params = SamplingParams(**values)
        params.validate(tm.info.vocab_size)
    except (ValueError, TypeError) as exc:
        message = (
            str(exc).replace("max_new_tokens", "max_tokens").replace("min_new_tokens", "min_tokens")
        )
        param = message.split(" ", 1)[0]
        raise ApiError(
            message, 400, param=param if param in values or param == "max_tokens" else None
        ) from None
    return params, explicit


def _finish_reason(sample: Sample) -> str | None:
    reason = sample.finish_reason
    return None if reason is None else str(reason["type"])


def _matched_stop(sample: Sample) -> int | str | None:
    reason = sample.finish_reason or {}
    return reason.get("matched")


@dataclass
class _Cursor:
    """How much of a sample a stream has sent."""

    chars: int = 0
    logprobs: int = 0
    started: bool = False
    done: bool = False


@dataclass
class _Job:
    """One OpenAI request in flight: its states (one per prompt) and how to format them."""

    tm: TokenizerManager
    model: str
    kind: str  # "chat" | "text"
    states: list[ReqState]
    top_logprobs: int | None  # None: no logprobs
    echo_prompts: list[str] = field(default_factory=list)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def samples(self) -> list[tuple[int, Sample]]:
        """(choice index, sample) for every choice, in order."""
        out = []
        for state in self.states:
            out.extend(state.samples)
        return list(enumerate(out))

    def usage(self) -> dict[str, Any]:
        prompt = sum(s.prompt_tokens for s in self.states)
        completion = sum(len(x.output_ids) for s in self.states for x in s.samples)
        cached = sum(min(x.cached_tokens for x in s.samples) for s in self.states)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ---- logprobs -------------------------------------------------------------------------

    def logprobs(self, entries: list[LogprobEntry], text_offset: int = 0) -> Any:
        if self.top_logprobs is None:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = text_offset
        for lp, tid, top in entries:
            text = self.tm.token_text(tid)
            tokens.append(text)
            token_lps.append(lp)
            tops.append({self.tm.token_text(t): v for v, t in top} if self.top_logprobs else None)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, e: LogprobEntry) -> dict[str, Any]:
        lp, tid, top = e
        text = self.tm.token_text(tid)
        return {
            "token": text,
            "logprob": lp,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := self.tm.token_text(i)), "logprob": v, "bytes": list(t.encode())}
                for v, i in top
            ],
        }

    # ---- whole responses ------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        choices = []
        for index, s in self.samples:
            choice: dict[str, Any] = {"index": index}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": s.text}
            else:
                prompt = (
                    self.echo_prompts[index // len(self.states[0].samples)]
                    if self.echo_prompts
                    else ""
                )
                choice["text"] = prompt + s.text
            choice["logprobs"] = self.logprobs(s.output_logprobs)
            choice["finish_reason"] = _finish_reason(s)
            choice["matched_stop"] = _matched_stop(s)
            choices.append(choice)
        return {
            "id": ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    # ---- streams --------------------------------------------------------------------------

    def _chunk(
        self, choices: list[dict[str, Any]], usage: Any = None, with_usage: bool = False
    ) -> bytes:
        body: dict[str, Any] = {
            "id": ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if with_usage:
            body["usage"] = usage
        return sse(body)

    def _stream_choice(self, index: int, s: Sample, cur: _Cursor) -> dict[str, Any] | None:
        text = s.text[cur.chars :]
        entries = s.output_logprobs[cur.logprobs :]
        finished = s.finished and not cur.done
        first = not cur.started and (self.kind == "chat" or bool(self.echo_prompts))
        if not text and not entries and not finished and not first:
            return None
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if not cur.started:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            echo = ""
            if not cur.started and self.echo_prompts:
                echo = self.echo_prompts[index // len(self.states[0].samples)]
            choice["text"] = echo + text
        choice["logprobs"] = self.logprobs(entries, cur.chars) if entries else None
        choice["finish_reason"] = _finish_reason(s) if finished else None
        if finished:
            choice["matched_stop"] = _matched_stop(s)
        cur.chars = len(s.text)
        cur.logprobs = len(s.output_logprobs)
        cur.started = True
        cur.done = s.finished
        return choice

    async def stream(self, include_usage: bool) -> AsyncIterator[bytes]:
        listener = self.states[0].listener
        samples = self.samples
        cursors = [_Cursor() for _ in samples]
        try:
            while True:
                listener.clear()
                for (index, s), cur in zip(samples, cursors, strict=True):
                    if not s.dirty and cur.started:
                        continue
                    s.dirty = False
                    choice = self._stream_choice(index, s, cur)
                    if choice is not None:
                        yield self._chunk([choice], None, include_usage)
                errors = [s.error for s in self.states if s.error is not None]
                if errors:
                    yield sse(errors[0].body())
                    break
                if all(s.finished for s in self.states):
                    if include_usage:
                        yield self._chunk([], self.usage(), True)
                    break
                await listener.wait()
            yield SSE_DONE
        finally:
            # NOTE: runs when the client disconnects mid-stream (the generator is cancelled).
            self.tm.abort_unfinished(self.states)


# ---- building requests ----------------------------------------------------------------------


def _logprob_settings(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _chat_job(req: ChatCompletionRequest, tm: TokenizerManager, chat: ChatRenderer) -> _Job:
    model = _check_model(tm, req.model)
    if req.tools:
        raise not_supported("tools", "tools")
    fmt = req.response_format
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in (None, "text")):
        raise not_supported(
            "response_format other than text (constrained decoding)", "response_format"
        )
    top = _logprob_settings(req)
    prompt = chat.render(req.messages)
    # NOTE: the rendered template carries its own BOS (if any): add no special tokens.
    ids = tm.tokenize(prompt, "messages", add_special_tokens=False)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    params, explicit = _sampling(req, tm, len(ids), max_tokens, None)
    gen = tm.build_request(
        ids,
        params,
        explicit,
        -1 if top is not None else None,
        top or 0,
        req.rid,
        param="messages",
        max_tokens_param="max_tokens",
    )
    return _Job(tm, model, "chat", tm.submit([gen], stream=bool(req.stream)), top)


def _completion_prompts(prompt: Any, tm: TokenizerManager) -> tuple[list[list[int]], list[str]]:
    """(token ids per prompt, prompt texts for echo)."""
    if isinstance(prompt, str):
        return [tm.tokenize(prompt, "prompt")], [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tm.tokenize(p, f"prompt[{i}]") for i, p in enumerate(prompt)], list(prompt)
        if all(isinstance(p, list) for p in prompt):
            ids = [tm.check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
            return ids, [tm.tokenizer.decode(x) if tm.tokenizer else "" for x in ids]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            ids = tm.check_ids(prompt, "prompt")
            return [ids], [tm.tokenizer.decode(ids) if tm.tokenizer else ""]
    raise bad_request(
        "prompt must be a non-empty string, list of strings, list of token ids, or list of "
        "token-id lists",
        "prompt",
    )


def _completion_job(req: CompletionRequest, tm: TokenizerManager) -> _Job:
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
    for ids in ids_list:
        params, explicit = _sampling(
            req, tm, len(ids), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS
        )
        gens.append(
            tm.build_request(
                ids,
                params,
                explicit,
                -1 if top is not None else None,
                top or 0,
                None,
                param="prompt",
                max_tokens_param="max_tokens",
            )
        )
    if req.rid is not None and len(gens) == 1:
        gens[0].rid = req.rid
    return _Job(
        tm,
        model,
        "text",
        tm.submit(gens, stream=bool(req.stream)),
        top,
        echo_prompts=texts if req.echo else [],
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
        req = _decode(await request.body(), ChatCompletionRequest)
        job = _chat_job(req, tm, chat)
        return await _respond(job, bool(req.stream), req.stream_options, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = _decode(await request.body(), CompletionRequest)
        job = _completion_job(req, tm)
        return await _respond(job, bool(req.stream), req.stream_options, request)

    async def _respond(job: _Job, stream: bool, options: Any, request: Request) -> Response:
        if stream:
            include_usage = bool(options is not None and options.include_usage)
            return StreamingResponse(job.stream(include_usage), media_type="text/event-stream")
        await tm.wait(job.states, partial(client_gone, request))
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
