"""Earlier tool calls and tool results, for chat templates that know neither (Gemma 3's: its roles
must alternate user / assistant, it has no "tool" role, and it never reads an assistant turn's
`tool_calls`: it raises on such a conversation).

The turns are rewritten into the ones such a model was shown in Google's Gemma function-calling
guide: an assistant turn's calls are written into its text as the model writes them (the format's
calls, `ToolFormat.begin` + the arguments + `end`, joined by its separator, after the turn's own
text); a tool result becomes a user turn holding it in a "```tool_output" fenced block; and turns
of one role that now follow each other merge into one (a blank line between), so the roles
alternate again.
"""

from __future__ import annotations

import json
from typing import Any

from weft.runtime.server.tool_formats import ToolFormat

TOOL_OUTPUT_FENCE = "```tool_output"
TURN_JOIN = "\n\n"  # between the texts of merged turns


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def fold_tool_turns(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """Template messages (chat._plain's shape) -> the same conversation in user / assistant
    turns only (a leading system message stays as it is)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, text = message["role"], message["content"]
        if role == "tool":
            role, text = "user", f"{TOOL_OUTPUT_FENCE}\n{text}\n```"
        elif message.get("tool_calls"):
            calls = fmt.separator.join(
                _call_text(c["function"], fmt) for c in message["tool_calls"]
            )
            text = f"{text}\n{calls}" if text else calls
        if out and out[-1]["role"] == role and role != "system":
            out[-1] = {"role": role, "content": out[-1]["content"] + TURN_JOIN + text}
        else:
            out.append({"role": role, "content": text})
    return out


def _call_text(function: dict[str, Any], fmt: ToolFormat) -> str:
    """A call as the model writes it; the arguments are a dict here (chat._tool_calls)."""
    arguments = json.dumps(function["arguments"], ensure_ascii=False)
    return fmt.begin(function["name"]) + arguments + fmt.end
