"""A weft (or SGLang) server through its native API: POST /generate.

Role programs run as they do on weft.Engine: a weft server renders the model's chat template
for the client (POST /render_chat; `has_chat_template` in /get_model_info says it can), so gens
and selects anywhere in a role program go over /generate and score there, and `s.text()` is
the rendered conversation. A server that renders nothing for clients (an SGLang server) gets
each gen of a role program through POST /v1/chat/completions instead, which covers gens at the
start of an assistant turn (the frontend never guesses a template).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from weft.frontend.backend import Backend, ChatRenderer, GenResult, Message, TokenLogprobs
from weft.frontend.http_client import get_json, get_json_sync, post_json, post_sse, post_sync
from weft.frontend.openai_backend import chat_body, chat_result, chat_stream


class RuntimeEndpoint(Backend):
    """A running `weft serve` (or SGLang server) at `url`, e.g. "http://127.0.0.1:30000";
    `api_key` when the server wants one. Programs run on it as on weft.Engine (see the module
    docstring); `get_model_info()`, `get_server_info()` and `flush_cache()` ask the server."""

    name = "RuntimeEndpoint"

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self._info: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.url!r})"

    async def generate(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> GenResult:
        body = {"text": prompt, "sampling_params": params, **(options or {})}
        out = await post_json(self.url + "/generate", body, self.api_key)
        return GenResult(out["text"], out["meta_info"])

    async def generate_stream(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> AsyncIterator[GenResult]:
        body = {"text": prompt, "sampling_params": params, "stream": True, **(options or {})}
        async for event in post_sse(self.url + "/generate", body, self.api_key):
            yield GenResult(event["text"], event["meta_info"])

    async def prompt_logprobs(self, prompt: str, start: int) -> TokenLogprobs:
        body = {
            "text": prompt,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": start,
        }
        out = await post_json(self.url + "/generate", body, self.api_key)
        return [(e[0], int(e[1])) for e in out["meta_info"]["input_token_logprobs"]]

    def get_model_info(self) -> dict[str, Any]:
        """The server's /get_model_info (fetched once)."""
        if self._info is None:
            self._info = dict(get_json_sync(self.url + "/get_model_info", self.api_key))
        return self._info

    async def _model_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = dict(await get_json(self.url + "/get_model_info", self.api_key))
        return self._info

    def get_server_info(self) -> dict[str, Any]:
        """The server's /get_server_info (its configuration and state)."""
        return dict(get_json_sync(self.url + "/get_server_info", self.api_key))

    def flush_cache(self) -> bool:
        """Empty the server's prefix cache; False while requests are running."""
        return post_sync(self.url + "/flush_cache", self.api_key)

    def chat_renderer(self) -> ChatRenderer | None:
        return self._renderer(self.get_model_info())

    async def chat_renderer_async(self) -> ChatRenderer | None:
        return self._renderer(await self._model_info())

    def _renderer(self, info: dict[str, Any]) -> ChatRenderer | None:
        """POST /render_chat where the server says it renders (a weft server with a template)."""
        if not info.get("has_chat_template"):
            return None

        async def render(messages: list[Message]) -> str:
            body = {"messages": messages, "add_generation_prompt": False}
            out = await post_json(self.url + "/render_chat", body, self.api_key)
            return str(out["text"])

        return render

    async def chat(self, messages: list[Message], params: dict[str, Any]) -> GenResult:
        body = chat_body(await self._served_model(), messages, params)
        out = await post_json(self.url + "/v1/chat/completions", body, self.api_key)
        return chat_result(out)

    async def chat_stream(
        self, messages: list[Message], params: dict[str, Any]
    ) -> AsyncIterator[GenResult]:
        body = chat_body(await self._served_model(), messages, params)
        async for result in chat_stream(self.url + "/v1/chat/completions", body, self.api_key):
            yield result

    async def _served_model(self) -> str:
        info = await self._model_info()
        return str(info.get("served_model_name") or info["model_path"])
