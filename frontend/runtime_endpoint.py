"""A weft (or SGLang) server through its native API: POST /generate.

The native API does not expose the chat template, and the frontend never guesses one, so a role
program runs its gens through POST /v1/chat/completions with the conversation as OpenAI messages
(the server applies the model's own template). That covers gens at the start of an assistant
turn; text outside roles, a partly written assistant turn or a select inside a role program
need a backend that renders the template (weft.Engine).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from weft.frontend.backend import Backend, GenResult, Message, TokenLogprobs
from weft.frontend.http_client import get_json, post_json, post_sse
from weft.frontend.openai_backend import chat_body, chat_result


class RuntimeEndpoint(Backend):
    name = "RuntimeEndpoint"

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self._model: str | None = None

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.url!r})"

    async def generate(self, prompt: str, params: dict[str, Any]) -> GenResult:
        out = await post_json(
            self.url + "/generate", {"text": prompt, "sampling_params": params}, self.api_key
        )
        return GenResult(out["text"], out["meta_info"])

    async def generate_stream(
        self, prompt: str, params: dict[str, Any]
    ) -> AsyncIterator[GenResult]:
        body = {"text": prompt, "sampling_params": params, "stream": True}
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

    async def chat(self, messages: list[Message], params: dict[str, Any]) -> GenResult:
        if self._model is None:
            info = await get_json(self.url + "/get_model_info", self.api_key)
            self._model = str(info.get("served_model_name") or info["model_path"])
        body = chat_body(self._model, messages, params)
        out = await post_json(self.url + "/v1/chat/completions", body, self.api_key)
        return chat_result(out)
