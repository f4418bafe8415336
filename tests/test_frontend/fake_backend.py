"""A scripted backend for interpreter tests: one token per character, logprobs from a table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from weft.frontend.backend import Backend, BackendError, GenResult


class FakeBackend(Backend):
    name = "Fake"

    def __init__(
        self,
        replies: dict[str, str] | None = None,
        char_logprob: dict[str, float] | None = None,
        delay: float = 0.0,
        template: bool = False,
        fail_on: str | None = None,
    ) -> None:
        self.replies = replies or {}
        self.char_logprob = char_logprob or {}
        self.delay = delay
        self.template = template
        self.fail_on = fail_on
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def reply(self, prompt: str) -> str:
        # the reply of the longest key that ends the prompt, else "ok"
        keys = [k for k in self.replies if prompt.endswith(k)]
        return self.replies[max(keys, key=len)] if keys else "ok"

    async def _enter(self) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1

    async def generate(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> GenResult:
        self.calls.append(("generate", prompt, dict(params)))
        await self._enter()
        if self.fail_on is not None and self.fail_on in prompt:
            raise BackendError("HTTP 400 from /generate: boom")
        if params.get("max_new_tokens") == 0:
            return GenResult("", {"finish_reason": "length", "prompt_tokens": len(prompt)})
        text = self.reply(prompt)[: params.get("max_new_tokens", 1000)]
        return GenResult(text, {"completion_tokens": len(text)})

    async def generate_stream(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> AsyncIterator[GenResult]:
        self.calls.append(("stream", prompt, dict(params)))
        text = self.reply(prompt)
        for i in range(1, len(text) + 1):
            await asyncio.sleep(0)
            yield GenResult(text[:i], {"completion_tokens": i})

    async def prompt_logprobs(self, prompt: str, start: int) -> list[tuple[float | None, int]]:
        self.calls.append(("score", prompt, {"start": start}))
        await self._enter()
        return [
            (None if i == 0 else self.char_logprob.get(prompt[i], -1.0), ord(prompt[i]))
            for i in range(start, len(prompt))
        ]

    def chat_renderer(self):  # type: ignore[no-untyped-def]
        if not self.template:
            return None

        async def render(messages: list[dict[str, str]]) -> str:
            return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)

        return render

    async def chat(self, messages: list[dict[str, str]], params: dict[str, Any]) -> GenResult:
        self.calls.append(("chat", [dict(m) for m in messages], dict(params)))
        return GenResult(self.reply(messages[-1]["content"]))
