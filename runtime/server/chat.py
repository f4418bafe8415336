"""Chat messages -> prompt text, through the model's own chat template (or --chat-template)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from weft.runtime.server.errors import ApiError, bad_request, not_supported
from weft.runtime.server.openai_protocol import ChatMessage

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    return value


class ChatRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, override: str | None) -> None:
        self.tokenizer = tokenizer
        self.template = load_chat_template(override)

    @property
    def available(self) -> bool:
        return self.tokenizer is not None and bool(
            self.template or getattr(self.tokenizer, "chat_template", None)
        )

    def render(self, messages: list[ChatMessage]) -> str:
        if not self.available or self.tokenizer is None:
            raise bad_request(
                "this model has no chat template: start the server with --chat-template, or use "
                "/v1/completions",
                "messages",
            )
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        plain = [_plain(m, i) for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(
                plain, tokenize=False, add_generation_prompt=True, chat_template=self.template
            )
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise ApiError(
                f"the chat template failed on these messages: {exc}", 400, param="messages"
            ) from None
        assert isinstance(text, str)
        return text


def _plain(message: ChatMessage, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if message.role not in ROLES:
        raise bad_request(
            f"{where}.role must be one of {', '.join(sorted(ROLES))}; got {message.role!r}",
            f"{where}.role",
        )
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise not_supported(
                    f"{where}.content[{j}] of type {part.type!r}", f"{where}.content"
                )
            texts.append(part.text)
        content = "".join(texts)
    if content is None:
        if message.role != "assistant":
            raise bad_request(f"{where}.content is missing", f"{where}.content")
        content = ""
    if message.tool_calls:
        raise not_supported(f"{where}.tool_calls", f"{where}.tool_calls")
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
