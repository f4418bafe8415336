"""Chat messages -> prompt text, through the model's own chat template (or --chat-template).

Tools and the tool parts of a conversation are passed in the shape Hugging Face templates
expect: `tools=[{"type": "function", "function": {...}}]`, assistant `tool_calls` whose
`function.arguments` is a dict (OpenAI sends it as JSON text), and `tool` messages with
`tool_call_id`.

A template that ignores `tools` (Gemma 3's) cannot teach them: where the call format has a
prompt of its own (tool_formats.ToolFormat.tool_prompt), that text goes into the conversation as
(the end of) its system message, which such templates render; and the conversation's earlier
calls and tool results are rewritten into plain turns (tool_history) that such templates take.

`chat_template_kwargs` (vLLM's and SGLang's field) are extra variables of the template, e.g.
Qwen3's `enable_thinking`; names that apply_chat_template takes itself are refused.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from weft.runtime.server.errors import ApiError, bad_request, not_supported
from weft.runtime.server.openai_protocol import ChatMessage
from weft.runtime.server.tool_formats import ToolFormat, detect_format, renders_tools
from weft.runtime.server.tool_history import fold_tool_turns, has_tool_turns

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# apply_chat_template's own parameters and the variables it sets: not template kwargs
RESERVED_KWARGS = frozenset(
    {"messages", "conversations", "self", "kwargs"}
    | set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
)


def check_template_kwargs(value: Any, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """A request's chat_template_kwargs: an object of extra template variables; a 400 names
    `param` (or the key) when it is not."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param)
    for key in value:
        if key in RESERVED_KWARGS:
            raise bad_request(
                f"{param}.{key} is not a template variable (it is set by the server)",
                f"{param}.{key}",
            )
    return value


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a template longer than a file name may be
        is_file = False
    if is_file:
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    return value


class ChatRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, override: str | None) -> None:
        self.tokenizer = tokenizer
        self.template = load_chat_template(override)

    def for_request(self, template: str | None, trusted: bool) -> ChatRenderer:
        """The renderer of a request that may bring its own template (vLLM's `chat_template`
        field); `trusted`: --trust-request-chat-template. A 400 when it may not."""
        if template is None:
            return self
        if not trusted:
            raise bad_request(
                "chat_template in a request needs the server's --trust-request-chat-template",
                "chat_template",
            )
        if not template.strip():
            raise bad_request("chat_template must not be empty", "chat_template")
        own = ChatRenderer(self.tokenizer, None)
        # NOTE: the text itself, never load_chat_template's "a file name" reading: a client
        # must not make the server read its files
        own.template = template
        return own

    @property
    def available(self) -> bool:
        return self.tokenizer is not None and bool(
            self.template or getattr(self.tokenizer, "chat_template", None)
        )

    def check_available(self) -> None:
        if not self.available or self.tokenizer is None:
            raise bad_request(
                "this model has no chat template: start the server with --chat-template, or use "
                "/v1/completions",
                "messages",
            )

    @property
    def template_text(self) -> str | None:
        """The Jinja text in use (every named template of the tokenizer, joined), if any."""
        if self.template:
            return self.template
        own = getattr(self.tokenizer, "chat_template", None)
        if isinstance(own, dict):
            return "\n".join(str(t) for t in own.values())
        return own if isinstance(own, str) else None

    def render(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt; `tools` (checked OpenAI tool dicts) are rendered by the template, and
        `template_kwargs` (checked by check_template_kwargs) are its extra variables."""
        self.check_available()
        assert self.tokenizer is not None
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        plain = [_plain(m, i) for i, m in enumerate(messages)]
        fmt = self._weft_teaches_tools()
        if fmt is not None and has_tool_turns(plain):
            plain = fold_tool_turns(plain, fmt)
        if tools and fmt is not None:
            plain = _with_tool_prompt(plain, fmt, tools)
        try:
            text = self.tokenizer.apply_chat_template(
                plain,
                tools=[*tools] if tools else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.template,
                **(template_kwargs or {}),
            )
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise ApiError(
                f"the chat template failed on these messages: {exc}", 400, param="messages"
            ) from None
        assert isinstance(text, str)
        return text

    def _weft_teaches_tools(self) -> ToolFormat | None:
        """The call format, where the template knows no tools and the format brings its own
        prompt (Gemma 3): weft then shows the tools and the tool turns itself."""
        template = self.template_text
        fmt = detect_format(template)
        if fmt is None or renders_tools(template) or fmt.tool_prompt([]) is None:
            return None
        return fmt


def _with_tool_prompt(
    plain: list[dict[str, Any]], fmt: ToolFormat, tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The messages, with the format's tool prompt in the system message."""
    prompt = fmt.tool_prompt(tools)
    if prompt is None:
        return plain
    if plain[0]["role"] == "system":
        own = plain[0]["content"]
        system = {**plain[0], "content": f"{own}\n\n{prompt}" if own else prompt}
        return [system, *plain[1:]]
    return [{"role": "system", "content": prompt}, *plain]


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
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content}
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request(
                f"{where}.tool_calls is only allowed in assistant messages", f"{where}.tool_calls"
            )
        out["tool_calls"] = _tool_calls(message.tool_calls, f"{where}.tool_calls")
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls of an earlier assistant turn -> the template's shape (arguments as a
    dict, not JSON text)."""
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise bad_request(f"{at} must be an object", at)
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"{at}.function.name must be a non-empty string", f"{at}.function")
        args = fn.get("arguments")
        if args is None or args == "":
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                raise bad_request(
                    f"{at}.function.arguments is not valid JSON", f"{at}.function.arguments"
                ) from None
        if not isinstance(args, dict):
            raise bad_request(
                f"{at}.function.arguments must be a JSON object", f"{at}.function.arguments"
            )
        item: dict[str, Any] = {
            "type": "function",
            "function": {"name": fn["name"], "arguments": args},
        }
        call_id = call.get("id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise bad_request(f"{at}.id must be a string", f"{at}.id")
            item["id"] = call_id
        out.append(item)
    return out
