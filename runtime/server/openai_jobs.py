"""An OpenAI request in flight and its answer: `ChatJob` (/v1/chat/completions, with tool calls)
and `CompletionJob` (/v1/completions, with echo), as a whole response or a stream of chunks.

Both share `Job`: the request's states (one per prompt, n samples each), usage, errors and the
stream loop; each kind says how a choice and a stream chunk look.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from weft.runtime.messages.common import LogprobEntry
from weft.runtime.server.reasoning import ReasoningParser, ReasoningPlan
from weft.runtime.server.request_state import ReqState, Sample, refused, request_error
from weft.runtime.server.responses import SSE_DONE, sse
from weft.runtime.server.tokenizer_manager import TokenizerManager
from weft.runtime.server.tool_calls import ToolPlan
from weft.runtime.server.tool_parser import ToolCallParser


def _finish_reason(sample: Sample) -> str | None:
    reason = sample.finish_reason
    return None if reason is None else str(reason["type"])


def _matched_stop(sample: Sample) -> int | str | None:
    return (sample.finish_reason or {}).get("matched")


def _cut_off(sample: Sample) -> bool:
    """The output did not end by itself (max_tokens, an abort): a tool call may be cut off."""
    return _finish_reason(sample) != "stop"


def _tool_finish(reason: str | None, called: bool) -> str | None:
    """A model that stopped after calling tools finished with "tool_calls" (not on "length")."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class Cursor:
    """How much of a sample a stream has sent."""

    chars: int = 0
    logprobs: int = 0
    started: bool = False
    done: bool = False
    parser: ToolCallParser | None = None  # chat with tools: text goes through it
    reasoning: ReasoningParser | None = None  # chat with a reasoning parser: first through it
    calls: int = 0  # tool calls sent


@dataclass
class Job:
    """One OpenAI request in flight: its states (one per prompt) and how to format them."""

    tm: TokenizerManager
    model: str
    states: list[ReqState]
    top_logprobs: int | None  # None: no logprobs
    constraint_param: str | None = None  # the field an output-constraint error names
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    ID_PREFIX: ClassVar[str]
    OBJECT: ClassVar[str]  # of the whole response
    CHUNK_OBJECT: ClassVar[str]  # of a stream chunk
    CHUNK_KEY: ClassVar[str]  # what a stream choice carries: "delta" or "text"

    @property
    def samples(self) -> list[tuple[int, Sample]]:
        """(choice index, sample) for every choice, in order."""
        return list(enumerate(s for state in self.states for s in state.samples))

    def raise_errors(self) -> None:
        """A finished job whose request failed answers with that error."""
        for state in self.states:
            error = request_error(state, self.constraint_param)
            if error is not None:
                raise error

    def usage(self) -> dict[str, Any]:
        prompt = sum(s.prompt_tokens for s in self.states)
        completion = sum(s.completion_tokens for s in self.states)
        cached = sum(s.cached_tokens for s in self.states)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ---- what each kind says ----------------------------------------------------------------

    def logprobs(self, entries: list[LogprobEntry], text_offset: int = 0) -> Any:
        raise NotImplementedError

    def _choice(self, index: int, s: Sample) -> tuple[dict[str, Any], str | None]:
        """A whole response's choice body and its finish reason."""
        raise NotImplementedError

    def _first_chunk(self) -> bool:
        """Whether a sample's first chunk goes out before it has new text."""
        raise NotImplementedError

    def _bodies(self, index: int, s: Sample, cur: Cursor, text: str, finished: bool) -> list[Any]:
        """The chunk bodies for new text (none: the tool-call parser holds it back)."""
        raise NotImplementedError

    # ---- whole responses --------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        choices = []
        for index, s in self.samples:
            body, finish_reason = self._choice(index, s)
            choice: dict[str, Any] = {"index": index, **body}
            choice["logprobs"] = self.logprobs(s.output_logprobs)
            choice["finish_reason"] = finish_reason
            choice["matched_stop"] = _matched_stop(s)
            choices.append(choice)
        return {**self._head(self.OBJECT, choices), "usage": self.usage()}

    def _head(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.ID_PREFIX + self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # ---- streams ----------------------------------------------------------------------------

    def _chunk(
        self, choices: list[dict[str, Any]], usage: Any = None, with_usage: bool = False
    ) -> bytes:
        body = self._head(self.CHUNK_OBJECT, choices)
        if with_usage:
            body["usage"] = usage
        return sse(body)

    def _stream_choices(self, index: int, s: Sample, cur: Cursor) -> list[dict[str, Any]]:
        """The choices (one per chunk) that send what is new in a sample."""
        text = s.text[cur.chars :]
        entries = s.output_logprobs[cur.logprobs :]
        finished = s.finished and not cur.done
        first = not cur.started and self._first_chunk()
        if not text and not entries and not finished and not first:
            return []
        bodies = self._bodies(index, s, cur, text, finished)
        logprobs = self.logprobs(entries, cur.chars) if entries else None
        cur.chars = len(s.text)
        cur.logprobs = len(s.output_logprobs)
        cur.done = s.finished
        if not bodies:
            if not (entries or finished or first):
                return []  # the tool-call parser holds all of the new text back
            bodies = [{"role": "assistant", "content": ""} if first else {}]
        cur.started = True
        choices = []
        for k, body in enumerate(bodies):
            choice: dict[str, Any] = {
                "index": index,
                self.CHUNK_KEY: body,
                "logprobs": logprobs if k == 0 else None,
                "finish_reason": None,
            }
            if finished and k == len(bodies) - 1:
                choice["finish_reason"] = _tool_finish(_finish_reason(s), cur.calls > 0)
                choice["matched_stop"] = _matched_stop(s)
            choices.append(choice)
        return choices

    def _cursor(self) -> Cursor:
        return Cursor()

    async def stream(self, include_usage: bool) -> AsyncIterator[bytes]:
        listener = self.states[0].listener
        samples = self.samples
        cursors = [self._cursor() for _ in samples]
        try:
            while True:
                listener.clear()
                for (index, s), cur in zip(samples, cursors, strict=True):
                    if (not s.dirty and cur.started) or refused(s):
                        continue
                    s.dirty = False
                    for choice in self._stream_choices(index, s, cur):
                        yield self._chunk([choice], None, include_usage)
                errors = [e for s in self.states if (e := request_error(s, self.constraint_param))]
                if errors:
                    yield sse(errors[0].body())
                    break
                if all(s.finished for s in self.states):
                    if include_usage:
                        yield self._chunk([], self.usage(), True)
                    break
                await listener.wait()
            yield SSE_DONE
        finally:
            # NOTE: runs when the client disconnects mid-stream (the generator is cancelled).
            self.tm.abort_unfinished(self.states)


@dataclass
class ChatJob(Job):
    tools: ToolPlan | None = None  # tools may be called: outputs are parsed for calls
    reasoning: ReasoningPlan | None = None  # the thinking is split off (reasoning_content)

    ID_PREFIX = "chatcmpl-"
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"
    CHUNK_KEY = "delta"

    def logprobs(self, entries: list[LogprobEntry], text_offset: int = 0) -> Any:
        if self.top_logprobs is None:
            return None
        return {"content": [self._entry(e) for e in entries]}

    def _entry(self, e: LogprobEntry) -> dict[str, Any]:
        lp, tid, top = e
        text = self.tm.token_text(tid)
        return {
            "token": text,
            "logprob": lp,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := self.tm.token_text(i)), "logprob": v, "bytes": list(t.encode())}
                for v, i in top
            ],
        }

    def _choice(self, index: int, s: Sample) -> tuple[dict[str, Any], str | None]:
        finish_reason = _finish_reason(s)
        text, reasoning = s.text, None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(s.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if self.tools is None:
            return {"message": message}, finish_reason
        # tool calls are parsed from the answer only
        content, calls = self.tools.parse(text, _cut_off(s))
        message["content"] = content
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return {"message": message}, _tool_finish(finish_reason, bool(calls))

    def _first_chunk(self) -> bool:
        return True  # the assistant's role

    def _cursor(self) -> Cursor:
        return Cursor(
            parser=self.tools.parser() if self.tools is not None else None,
            reasoning=self.reasoning.parser() if self.reasoning is not None else None,
        )

    def _bodies(self, index: int, s: Sample, cur: Cursor, text: str, finished: bool) -> list[Any]:
        """Chat deltas for new text: first through the reasoning parser (thinking deltas are
        `reasoning_content`), then the answer through the tool-call parser when tools are active
        (then possibly none: the parsers may hold the text back). A finished output that did not end
        by itself (`_cut_off`): what the parser holds back at its end may begin a call, dropped."""
        deltas: list[dict[str, Any]] = []
        if cur.reasoning is not None:
            thought, text = cur.reasoning.feed(text, final=finished)
            if thought:
                deltas.append({"reasoning_content": thought})
        if cur.parser is None:
            if text or cur.reasoning is None:
                deltas.append({"content": text})
        else:
            events = cur.parser.feed(text)
            if finished:
                events += cur.parser.finish(_cut_off(s))
            for event in events:
                if isinstance(event, str):
                    deltas.append({"content": event})
                    continue
                head = {"name": event.name, "arguments": ""}
                call = {"index": cur.calls, "id": event.id, "type": "function", "function": head}
                deltas.append({"tool_calls": [call]})
                args = {"index": cur.calls, "function": {"arguments": event.arguments}}
                deltas.append({"tool_calls": [args]})
                cur.calls += 1
        if deltas and not cur.started:
            deltas[0] = {"role": "assistant", **deltas[0]}
        return deltas


@dataclass
class CompletionJob(Job):
    echo_prompts: list[str] = field(default_factory=list)  # echo: each prompt's text

    ID_PREFIX = "cmpl-"
    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"
    CHUNK_KEY = "text"

    def logprobs(self, entries: list[LogprobEntry], text_offset: int = 0) -> Any:
        if self.top_logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = text_offset
        for lp, tid, top in entries:
            text = self.tm.token_text(tid)
            tokens.append(text)
            token_lps.append(lp)
            tops.append({self.tm.token_text(t): v for v, t in top} if self.top_logprobs else None)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _echo(self, index: int) -> str:
        """The prompt of choice `index`, when echoed."""
        if not self.echo_prompts:
            return ""
        return self.echo_prompts[index // len(self.states[0].samples)]

    def _choice(self, index: int, s: Sample) -> tuple[dict[str, Any], str | None]:
        return {"text": self._echo(index) + s.text}, _finish_reason(s)

    def _first_chunk(self) -> bool:
        return bool(self.echo_prompts)  # the echoed prompt

    def _bodies(self, index: int, s: Sample, cur: Cursor, text: str, finished: bool) -> list[Any]:
        return [(self._echo(index) if not cur.started else "") + text]
