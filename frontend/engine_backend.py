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

    async def generate(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> GenResult:
        asked, with_text = _engine_options(options)
        try:
            out = await self.engine.async_generate(prompt, dict(params), **asked)
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        return GenResult(out["text"], self._meta(out["meta_info"], with_text))

    async def generate_stream(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> AsyncIterator[GenResult]:
        asked, with_text = _engine_options(options)
        try:
            async for chunk in self.engine.generate_stream(prompt, dict(params), **asked):
                yield GenResult(chunk["text"], self._meta(chunk["meta_info"], with_text))
        except ValueError as exc:
            raise BackendError(str(exc)) from exc

    def _meta(self, meta: dict[str, Any], with_text: bool) -> dict[str, Any]:
        """The engine's meta info, with each logprob entry's text filled in when asked for
        (as the server's return_text_in_logprobs does)."""
        if not with_text or self.engine.tokenizer is None:
            return meta
        decode = self.engine.tokenizer.decode

        def entry(e: Any) -> tuple[Any, int, str]:
            return (e[0], e[1], decode([e[1]]))

        out = dict(meta)
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if meta.get(key):
                out[key] = [entry(e) for e in meta[key]]
        for key in ("input_top_logprobs", "output_top_logprobs"):
            if meta.get(key):
                out[key] = [None if top is None else [entry(e) for e in top] for top in meta[key]]
        return out

    async def prompt_logprobs(self, prompt: str, start: int) -> TokenLogprobs:
        try:
            out = await self.engine.async_generate(
                prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start
            )
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        return [(lp, tid) for lp, tid, _ in out["meta_info"]["input_token_logprobs"]]

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return {"config": self.engine.config, "memory": self.engine.memory_stats()}

    def chat_renderer(self) -> ChatRenderer | None:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return None

        async def render(messages: list[Message]) -> str:
            return str(tok.apply_chat_template(messages, tokenize=False))

        return render

    async def chat(self, messages: list[Message], params: dict[str, Any]) -> GenResult:
        raise BackendError("the model has no chat template, so a role program cannot run on it")


def _engine_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """(the Engine's keyword arguments, whether entries want their text)."""
    asked = dict(options or {})
    with_text = bool(asked.pop("return_text_in_logprobs", False))
    return asked, with_text
