"""Any OpenAI-compatible endpoint: /completions for plain text, /chat/completions for roles.

The OpenAI API returns no logprobs of the prompt's own tokens, so select cannot be scored here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from weft.frontend.backend import Backend, BackendError, GenResult, Message, TokenLogprobs
from weft.frontend.http_client import post_json, post_sse

# SGLang sampling name -> OpenAI name; the rest are sent under their own names (an extension
# weft, SGLang and vLLM accept)
_RENAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def openai_params(params: dict[str, Any]) -> dict[str, Any]:
    return {_RENAME.get(k, k): v for k, v in params.items()}


def chat_body(model: str, messages: list[Message], params: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "messages": messages, **openai_params(params)}


async def chat_stream(
    url: str, body: dict[str, Any], api_key: str | None
) -> AsyncIterator[GenResult]:
    """Cumulative results of a streamed chat completion (POST `url`, stream=True)."""
    text, thinking = "", None
    async for event in post_sse(url, {**body, "stream": True}, api_key):
        if not event.get("choices"):
            continue
        choice = event["choices"][0]
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
        if delta.get("reasoning_content") is not None:
            thinking = (thinking or "") + delta["reasoning_content"]
        meta = {"finish_reason": choice.get("finish_reason")}
        if thinking is not None:
            meta["reasoning_content"] = thinking
        yield GenResult(text, meta)


def chat_result(out: dict[str, Any]) -> GenResult:
    """The reply's content; the endpoint's `reasoning_content` (its reasoning parser split the
    thinking off) goes into meta, where separate_reasoning reads it."""
    choice = out["choices"][0]
    meta = {"finish_reason": choice.get("finish_reason"), "usage": out.get("usage")}
    message = choice["message"]
    if message.get("reasoning_content") is not None:
        meta["reasoning_content"] = message["reasoning_content"]
    return GenResult(message.get("content") or "", meta)


def _no_options(options: dict[str, Any] | None) -> None:
    if options:
        raise BackendError(
            f"OpenAIBackend: {', '.join(options)} not supported here (the OpenAI API has no "
            "prompt logprobs); use weft.Engine or weft.RuntimeEndpoint"
        )


class OpenAIBackend(Backend):
    """Any OpenAI-compatible server: `base_url` up to and including "/v1", the `model` to ask
    for, `api_key` if needed. Plain text goes to /completions, role programs to
    /chat/completions (each gen must start an assistant turn); select is refused (the API
    returns no logprobs of the prompt's tokens), and so are gen's logprob options."""

    name = "OpenAIBackend"

    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key

    def __repr__(self) -> str:
        return f"OpenAIBackend({self.base_url!r}, {self.model!r})"

    async def generate(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> GenResult:
        _no_options(options)
        body = {"model": self.model, "prompt": prompt, **openai_params(params)}
        out = await post_json(self.base_url + "/completions", body, self.api_key)
        choice = out["choices"][0]
        meta = {"finish_reason": choice.get("finish_reason"), "usage": out.get("usage")}
        return GenResult(choice["text"], meta)

    async def generate_stream(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> AsyncIterator[GenResult]:
        _no_options(options)
        body = {"model": self.model, "prompt": prompt, "stream": True, **openai_params(params)}
        text = ""
        async for event in post_sse(self.base_url + "/completions", body, self.api_key):
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            text += choice.get("text") or ""
            yield GenResult(text, {"finish_reason": choice.get("finish_reason")})

    async def prompt_logprobs(self, prompt: str, start: int) -> TokenLogprobs:
        raise BackendError(
            "OpenAIBackend cannot score select choices: the OpenAI API returns no logprobs of "
            "the prompt's tokens; use weft.RuntimeEndpoint or weft.Engine for select"
        )

    async def chat(self, messages: list[Message], params: dict[str, Any]) -> GenResult:
        body = chat_body(self.model, messages, params)
        return chat_result(await post_json(self.base_url + "/chat/completions", body, self.api_key))

    async def chat_stream(
        self, messages: list[Message], params: dict[str, Any]
    ) -> AsyncIterator[GenResult]:
        body = chat_body(self.model, messages, params)
        async for result in chat_stream(self.base_url + "/chat/completions", body, self.api_key):
            yield result
