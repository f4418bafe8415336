"""Tool calls in model output: the call formats chat templates teach, and one left-to-right parse
(`ToolCallParser`) that the whole-text parse and the stream share, so a streamed answer yields
exactly the calls and content of the same text parsed at once. The request side (tools, the
structural tag) is `tool_calls`.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("weft")


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes a call: `open_tag` + a JSON object + `close_tag`.

    Without tags the JSON object itself is the call and `trigger` (the start of the object) marks
    where one begins in free text.
    """

    name: str
    trigger: str  # a call starts where this appears in the output
    open_tag: str  # before the JSON object ("" if none)
    close_tag: str  # after the JSON object ("" if none: the object ends the call)
    args_key: str  # the JSON key of the arguments object
    separator: str  # between calls when the output is nothing but calls

    def begin(self, name: str) -> str:
        """The text of a call up to its arguments object (the structure's `begin`)."""
        head = f"{self.open_tag}\n" if self.open_tag else ""
        return f'{head}{{"name": {json.dumps(name)}, "{self.args_key}": '

    @property
    def end(self) -> str:
        """The text of a call after its arguments object (the structure's `end`)."""
        return "}" + (f"\n{self.close_tag}" if self.close_tag else "")


QWEN25 = ToolFormat(
    name="qwen25",
    trigger="<tool_call>",
    open_tag="<tool_call>",
    close_tag="</tool_call>",
    args_key="arguments",
    separator="\n",
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    trigger='{"name": "',
    open_tag="",
    close_tag="",
    args_key="parameters",
    separator="; ",
)


def detect_format(template: str | None) -> ToolFormat | None:
    """The call format a chat template teaches, or None if it teaches none we know."""
    if not template:
        return None
    if "<tool_call>" in template:
        return QWEN25
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return LLAMA3_JSON
    return None


# ---- parsing calls ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


ParseEvent = str | ToolCall  # a piece of content, or a complete call


class _Trim:
    """Passes text through so that what comes out, joined, is the input joined and stripped."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""  # trailing whitespace: sent only if more text follows

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body


class ToolCallParser:
    """Splits model output into content and calls, fed any chunking of the text.

    Text is content until the format's trigger; a trigger starts a call that ends at the close
    tag (or where the JSON object closes, for formats without tags). A complete call whose JSON
    does not decode to {"name": <a tool>, <args key>: {...}} stays content. Between calls, and
    after the last one, whitespace and the separator are dropped. Content is stripped as a whole.
    Text that might still become part of a call (a prefix of the trigger, an unclosed call) is
    held back until it is decided or the output ends; then a call that never closed is dropped
    (max_tokens or a stop string cut it off: it is no content), and so is a prefix of the
    trigger at the end of an output that was cut off (the call it began is cut off too).
    """

    def __init__(self, fmt: ToolFormat, names: frozenset[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.pending = ""  # text not decided yet
        self.after_call = False  # pending starts right after a call
        self.trim = _Trim()
        self.num_calls = 0
        core = fmt.separator.strip()
        self._gap = re.compile(r"\s*" + (f"(?:{re.escape(core)})?\\s*" if core else ""))

    def feed(self, text: str) -> list[ParseEvent]:
        self.pending += text
        return self._advance(final=False)

    def finish(self, cut_off: bool = False) -> list[ParseEvent]:
        """The output ended: decide everything held back. `cut_off`: it did not end by itself
        (finish reason length, not stop)."""
        out = self._advance(final=True, cut_off=cut_off)
        if self.pending:
            logger.debug("tool call parser: a call cut off, dropped: %r", self.pending[:200])
            self.pending = ""
        return out

    def _advance(self, final: bool, cut_off: bool = False) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        while self.pending:
            if self.after_call and not self._skip_gap(final):
                break
            trigger = self.fmt.trigger
            start = self.pending.find(trigger)
            if start < 0:
                keep = 0 if final and not cut_off else _held_prefix(self.pending, trigger)
                self._content(out, self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            self._content(out, self.pending[:start])
            self.pending = self.pending[start:]
            end = self._call_end(self.pending)
            if end is None and not final:
                break
            segment = self.pending if end is None else self.pending[:end]
            call = self._decode(segment, closed=end is not None)
            if call is None and end is None:
                break  # an unclosed call: never content (finish drops it)
            if call is None:
                self._content(out, segment)
            else:
                out.append(call)
                self.num_calls += 1
                self.after_call = True
            self.pending = self.pending[len(segment) :]
        return out

    def _skip_gap(self, final: bool) -> bool:
        """After a call: drop a gap (whitespace, the separator) that precedes another call or
        ends the output. False: wait for more text."""
        match = self._gap.match(self.pending)
        gap = match.end() if match else 0
        rest = self.pending[gap:]
        if not rest:
            if not final:
                return False
            self.pending = ""  # the gap ends the output
            self.after_call = False
            return True
        if rest.startswith(self.fmt.trigger):
            self.pending = rest
            self.after_call = False
            return True
        if not final and self.fmt.trigger.startswith(rest):
            return False
        self.after_call = False  # the gap is content after all
        return True

    def _content(self, out: list[ParseEvent], text: str) -> None:
        piece = self.trim.add(text)
        if piece:
            if out and isinstance(out[-1], str):
                out[-1] += piece
            else:
                out.append(piece)

    def _call_end(self, text: str) -> int | None:
        """Where the call starting at text[0] ends (exclusive), None if it has not ended yet."""
        if self.fmt.close_tag:
            at = text.find(self.fmt.close_tag, len(self.fmt.trigger))
            return None if at < 0 else at + len(self.fmt.close_tag)
        return _object_end(text)

    def _decode(self, segment: str, closed: bool) -> ToolCall | None:
        body = segment
        if self.fmt.open_tag:
            body = body[len(self.fmt.open_tag) :]
            if closed:
                body = body[: -len(self.fmt.close_tag)]
        elif not closed:
            return None  # an unclosed JSON object is never a call
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            logger.debug("tool call parser: not JSON, kept as content: %r", segment[:200])
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            logger.debug("tool call parser: not a call of a known tool: %r", segment[:200])
            return None
        args = obj.get(self.fmt.args_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                args = None
        if not isinstance(args, dict):
            logger.debug("tool call parser: arguments are not an object: %r", segment[:200])
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, trigger: str) -> int:
    """The length of the longest end of `text` that begins `trigger` (it may become one)."""
    for size in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0


def _object_end(text: str) -> int | None:
    """text starts with "{": the index after the matching "}" (strings respected), or None."""
    depth = 0
    in_string = False
    escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def parse_tool_calls(
    text: str, fmt: ToolFormat, names: frozenset[str], cut_off: bool = False
) -> tuple[str | None, list[ToolCall]]:
    """Finished output -> (content outside the calls, stripped, None if empty; the calls).
    `cut_off`: the output did not end by itself (see ToolCallParser.finish)."""
    parser = ToolCallParser(fmt, names)
    events = parser.feed(text) + parser.finish(cut_off)
    content = "".join(e for e in events if isinstance(e, str))
    return content or None, [e for e in events if isinstance(e, ToolCall)]
