"""Request bodies of the OpenAI-compatible API, decoded (and type-checked) by msgspec.

Unknown fields are ignored, as OpenAI clients send fields that do not change generation
("user", "store", "metadata"). Fields below SGLang's extensions line are not OpenAI's but are
what SGLang accepts there too.
"""

from __future__ import annotations

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: Any = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stop_token_ids: list[int] | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None  # JSON text or the schema itself
    ebnf: str | None = None
    rid: str | None = None
    cache_salt: str | None = None  # prefix-cache namespace (as vLLM): no hit across salts
    # SGLang's (its custom param): with --reasoning-parser, tokens of thinking before the end
    # marker is forced
    thinking_budget: int | None = None
    # weft's: false, this request verifies no speculative drafts (--speculative-algorithm)
    speculative: bool | None = None


class RenderChatRequest(msgspec.Struct, kw_only=True):
    """POST /render_chat: the prompt the chat template makes of these messages (what a client
    that scores or continues a role program needs; SGLang's client renders it itself)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: Any = None  # checked by openai_api.response_format_constraint
    tools: list[Any] | None = None  # checked by tool_calls.check_tools
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's and SGLang's: extra chat template variables (e.g. Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: a Jinja chat template for this request (with --trust-request-chat-template)
    chat_template: str | None = None
    # SGLang's, with --reasoning-parser: the thinking as reasoning_content (default true), and
    # streamed as it comes (true) or in one delta once it ends (false)
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None


class CompletionRequest(_SamplingFields):
    prompt: Any = None  # a string, a list of strings, token ids, or a list of token-id lists
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
