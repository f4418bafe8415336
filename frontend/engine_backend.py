"""The in-process weft.Engine as a backend (no HTTP; the engine thread does the work)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from weft.frontend.backend import (
    Backend,
    BackendError,
    ChatRenderer,
    GenResult,
    Message,
    TokenLogprobs,
)


class EngineBackend(Backend):
    name = "Engine"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(self, prompt: str, params: dict[str, Any]) -> GenResult:
        try:
            out = await self.engine.async_generate(prompt, dict(params))
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        return GenResult(out["text"], out["meta_info"])

    async def generate_stream(
        self, prompt: str, params: dict[str, Any]
    ) -> AsyncIterator[GenResult]:
        try:
            async for chunk in self.engine.generate_stream(prompt, dict(params)):
                yield GenResult(chunk["text"], chunk["meta_info"])
        except ValueError as exc:
            raise BackendError(str(exc)) from exc

    async def prompt_logprobs(self, prompt: str, start: int) -> TokenLogprobs:
        try:
            out = await self.engine.async_generate(
                prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start
            )
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        return [(lp, tid) for lp, tid, _ in out["meta_info"]["input_token_logprobs"]]

    def chat_renderer(self) -> ChatRenderer | None:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return None

        def render(messages: list[Message]) -> str:
            return str(tok.apply_chat_template(messages, tokenize=False))

        return render

    async def chat(self, messages: list[Message], params: dict[str, Any]) -> GenResult:
        raise BackendError("the model has no chat template, so a role program cannot run on it")
