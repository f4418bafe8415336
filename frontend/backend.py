"""The backend base class: what the interpreter needs from a model, whatever serves it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]
# the model's chat template: messages -> the prompt text they render to (no generation prompt)
ChatRenderer = Callable[[list[Message]], Awaitable[str]]
# (logprob or None for the first token, token id), one entry per prompt position from `start`
TokenLogprobs = list[tuple[float | None, int]]


class BackendError(RuntimeError):
    """A request the backend refused or failed; the message is the backend's own."""


@dataclass
class GenResult:
    text: str
    meta: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """Contract: `generate` continues a text prompt with SGLang sampling parameters;
    `generate_stream` yields results with the cumulative text (meta on the last one);
    `prompt_logprobs(prompt, start)` scores the prompt's own tokens from position `start`
    (max_new_tokens=0); `chat_renderer` is the model's chat template, or None when the backend
    cannot render it, in which case role programs go through `chat` (OpenAI messages)."""

    name = "backend"

    @abstractmethod
    async def generate(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> GenResult:
        """One continuation of `prompt`; `options`: return_logprob, logprob_start_len,
        top_logprobs_num, return_text_in_logprobs (the logprobs go into meta)."""

    @abstractmethod
    def generate_stream(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> AsyncIterator[GenResult]:
        """Cumulative results of one continuation; meta on the last."""

    async def prompt_logprobs(self, prompt: str, start: int) -> TokenLogprobs:
        raise BackendError(f"{self.name} cannot score prompts (no prompt logprobs)")

    def chat_renderer(self) -> ChatRenderer | None:
        return None

    async def chat_renderer_async(self) -> ChatRenderer | None:
        """`chat_renderer`, for backends that must ask a server first (asked on the loop, once
        a program opens its first role)."""
        return self.chat_renderer()

    async def chat(self, messages: list[Message], params: dict[str, Any]) -> GenResult:
        raise BackendError(f"{self.name} has no chat endpoint and no chat template")

    async def chat_stream(
        self, messages: list[Message], params: dict[str, Any]
    ) -> AsyncIterator[GenResult]:
        """Cumulative results of one chat reply; by default the whole reply at once."""
        yield await self.chat(messages, params)

    def flush_cache(self) -> bool:
        raise BackendError(f"{self.name} cannot flush a cache")

    def get_server_info(self) -> dict[str, Any]:
        raise BackendError(f"{self.name} has no server info")


def as_backend(obj: object) -> Backend:
    """A Backend, or an in-process weft.Engine wrapped as one (duck-typed: no torch import)."""
    if isinstance(obj, Backend):
        return obj
    if hasattr(obj, "async_generate") and hasattr(obj, "generate_stream"):
        from weft.frontend.engine_backend import EngineBackend

        return EngineBackend(obj)
    raise TypeError(f"not a weft backend: {type(obj).__name__} (Engine, RuntimeEndpoint, ...)")
