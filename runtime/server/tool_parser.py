"""Tool calls in model output: one left-to-right parse (`ToolCallParser`) that the whole-text
parse and the stream share, so a streamed answer yields exactly the calls and content of the same
text parsed at once. How each model family spells a call is `tool_formats`; the request side
(tools, the structural tag) is `tool_calls`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from weft.runtime.server.tool_formats import FENCE, ToolFormat

logger = logging.getLogger("weft")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str  # ToolFormat.call_id: Mistral's templates take only their own shape back

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

    Text is content until the format's trigger; a trigger starts a call that ends where the
    format says (`ToolFormat.call_end`: a close tag, the JSON that closes). A complete call that
    the format does not decode to calls of known tools with object arguments stays content (one
    Mistral array holds several calls: all of them, or it is content). Between calls, and
    after the last one, whitespace and the separator are dropped. Content is stripped as a whole.
    Text that might still become part of a call (a prefix of the trigger, an unclosed call) is
    held back until it is decided or the output ends; then a call that never closed is dropped
    (max_tokens or a stop string cut it off: it is no content), and so is a prefix of the
    trigger at the end of an output that was cut off (the call it began is cut off too).

    Fences (formats whose `fences` name openers, Gemma's "```json"): an opener right before a
    call (whitespace between) and the "```" right after the calls it holds are no content
    either; an opener is held back like a trigger prefix until the text after it decides.
    NOTE: only openers with a language: a bare "```" before a call may close another block.
    """

    def __init__(self, fmt: ToolFormat, names: frozenset[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.pending = ""  # text not decided yet
        self.after_call = False  # pending starts right after a call
        self.in_fence = False  # the calls before pending are inside a code fence
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
                keep = self._held(final, cut_off)
                self._content(out, self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            # a fence that opens right before the call stays with it until the call decides
            fence = self._fence_at(self.pending[:start])
            head = start if fence is None else fence
            self._content(out, self.pending[:head])
            self.pending = self.pending[head:]
            start -= head
            end = self.fmt.call_end(self.pending[start:])
            if end is None and not final:
                break
            segment = self.pending[start:] if end is None else self.pending[start : start + end]
            calls = self._decode(segment, closed=end is not None)
            if calls is None and end is None:
                break  # an unclosed call: never content (finish drops it, its fence too)
            if calls is None:
                self._content(out, self.pending[: start + len(segment)])
                self.in_fence = False
            else:  # the fence that holds the call (or the calls before it) is no content
                out.extend(calls)
                self.num_calls += len(calls)
                self.after_call = True
                self.in_fence = self.in_fence or fence is not None
            self.pending = self.pending[start + len(segment) :]
        return out

    def _held(self, final: bool, cut_off: bool) -> int:
        """How much of the end of pending (no trigger in it) to hold back: what may begin a
        call (a prefix of the trigger), and a fence that may hold it. At the end of an output:
        nothing, or what begins a call that was cut off, with its fence."""
        if final and not cut_off:
            return 0
        keep = _held_prefix(self.pending, self.fmt.trigger)
        if final and not keep:
            return 0
        return keep + self._held_fence(self.pending[: len(self.pending) - keep])

    def _fence_at(self, text: str) -> int | None:
        """Where a fence opener that ends `text` (but for whitespace) starts, if one does."""
        body = text.rstrip()
        for opener in self.fmt.fences:
            if body.endswith(opener):
                return len(body) - len(opener)
        return None

    def _held_fence(self, text: str) -> int:
        """The length of the end of `text` that opens a fence, or may still become an opener."""
        at = self._fence_at(text)
        if at is not None:
            return len(text) - at
        if not self.fmt.fences or text.rstrip() != text:
            return 0
        return max(_held_prefix(text, opener) for opener in self.fmt.fences)

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
            self.after_call = self.in_fence = False
            return True
        if rest.startswith(self.fmt.trigger):
            self.pending = rest
            self.after_call = False
            return True
        if self.in_fence and rest.startswith(FENCE):
            self.pending = rest[len(FENCE) :]  # the fence that held the calls closes
            self.after_call = self.in_fence = False
            return True
        if not final and (
            self.fmt.trigger.startswith(rest) or (self.in_fence and FENCE.startswith(rest))
        ):
            return False
        self.after_call = self.in_fence = False  # the gap is content after all
        return True

    def _content(self, out: list[ParseEvent], text: str) -> None:
        piece = self.trim.add(text)
        if piece:
            if out and isinstance(out[-1], str):
                out[-1] += piece
            else:
                out.append(piece)

    def _decode(self, segment: str, closed: bool) -> list[ToolCall] | None:
        parsed = self.fmt.decode(segment, closed)
        if parsed is None:
            logger.debug("tool call parser: no call, kept as content: %r", segment[:200])
            return None
        if any(name not in self.names for name, _ in parsed):
            logger.debug("tool call parser: not a call of a known tool: %r", segment[:200])
            return None
        return [
            ToolCall(name, json.dumps(args, ensure_ascii=False), self.fmt.call_id())
            for name, args in parsed
        ]


def _held_prefix(text: str, trigger: str) -> int:
    """The length of the longest end of `text` that begins `trigger` (it may become one)."""
    for size in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(
    text: str, fmt: ToolFormat, names: frozenset[str], cut_off: bool = False
) -> tuple[str | None, list[ToolCall]]:
    """Finished output -> (content outside the calls, stripped, None if empty; the calls).
    `cut_off`: the output did not end by itself (see ToolCallParser.finish)."""
    parser = ToolCallParser(fmt, names)
    events = parser.feed(text) + parser.finish(cut_off)
    content = "".join(e for e in events if isinstance(e, str))
    return content or None, [e for e in events if isinstance(e, ToolCall)]
