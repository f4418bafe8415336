"""Reasoning output: the thinking a model writes before its answer, split from the answer.

`--reasoning-parser` names the markers: qwen3 and deepseek-r1 use `<think>` … `</think>`;
generic takes `--reasoning-start` / `--reasoning-end`. The OpenAI chat API returns the thinking
as `reasoning_content` beside `content` (streamed as `reasoning_content` deltas); the native
/generate returns it as `reasoning_text` beside `text` with `separate_reasoning`.

The split of one output (`ReasoningParser`, fed any chunking of the text):

    [ws] [start marker] thinking [end marker [ws]] answer
    '-- dropped ---'  stripped  '--- dropped ---'   as written

An output that opens with the start marker thinks; one that does not starts where the request
starts (`ReasoningFormat.starts_in_reasoning`): in the thinking when the prompt left a block open
(a template that writes `<think>\\n` itself), when the parser is forced (deepseek-r1, a generic
parser without a start marker) or for qwen3 unless thinking is off — so output before `</think>`
is thinking though the model never wrote `<think>` (SGLang's qwen3 with thinking on); in the
answer when the prompt closed the block (Qwen3's template with enable_thinking false writes
`<think>\\n\\n</think>\\n\\n`). An output that never closes its thinking is all thinking (max_tokens
cut it off). After the end marker everything is answer, markers included.

Markers may arrive split across deltas: text that may still begin a marker is held back until
it is decided or the output ends. The whole-text split is the stream's, fed at once.

Generation follows the same split (`thinking_phase`): a request whose output begins in the
thinking carries the end marker's token ids to the scheduler, where a constraint (json_schema,
regex, response_format, tool_choice required ...) holds only the answer after the marker and
thinking_budget bounds the thinking (weft.runtime.thinking). With the generic parser's start
marker, an output that does not begin in the thinking may open it, as the split reads a marker
at its start: such a request carries the start marker's ids too, and its first token is the
marker's (which opens the thinking, the rest of the marker forced) or the constraint's (the
answer, no thinking). A chat request has the phase where the rendered prompt leaves the thinking
open, or may open it (whatever separate_reasoning says: it only chooses how the text comes
back); a native /generate one only where it asks for the split (separate_reasoning) or a
thinking_budget: otherwise a native constraint holds the whole output, as it always did. A
request with neither a constraint nor a budget goes without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from weft.runtime.sampling_params import SamplingParams
from weft.runtime.server.errors import bad_request

if TYPE_CHECKING:  # NOTE: the launcher imports this before its children start (launch.py)
    from transformers import PreTrainedTokenizerBase

REASONING_PARSERS = ("qwen3", "deepseek-r1", "generic")
THINK = ("<think>", "</think>")
# where an output begins: in the thinking; before it, free to open it with the start marker;
# in the answer
OutputStart = Literal["thinking", "opens", "answer"]


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str  # "": none (the output begins in the thinking)
    end: str
    forced: bool  # an output without the start marker begins in the thinking
    thinking_switch: bool = False  # chat_template_kwargs enable_thinking false: not forced
    # an output that does not begin in the thinking may open it with the start marker, and
    # generation lets it (the generic parser with a start marker)
    opens: bool = False

    def __post_init__(self) -> None:
        if not self.end:
            raise ValueError("a reasoning format needs an end marker")

    def starts_in_reasoning(self, prompt: str, thinking: bool | None = None) -> bool:
        """Whether an output of this prompt begins in the thinking (before any start marker).
        `thinking`: the request's enable_thinking (None: not given)."""
        tail = prompt.rstrip()
        end, start = self.end.strip(), self.start.strip()
        # NOTE: the end marker first: a closed block ends with it, an empty start matches all
        if end and tail.endswith(end):
            return False
        if start and tail.endswith(start):
            return True
        if self.thinking_switch and thinking is False:
            return False
        return self.forced

    def output_start(self, prompt: str, thinking: bool | None = None) -> OutputStart:
        """Where an output of this prompt begins, for generation (`thinking_phase`)."""
        if self.starts_in_reasoning(prompt, thinking):
            return "thinking"
        return "opens" if self.opens else "answer"


def reasoning_format(
    name: str, start: str | None = None, end: str | None = None
) -> ReasoningFormat:
    """--reasoning-parser NAME (and, for generic, --reasoning-start / --reasoning-end)."""
    if name == "qwen3":
        return ReasoningFormat(name, *THINK, forced=True, thinking_switch=True)
    if name == "deepseek-r1":  # R1 writes no <think> (its template opens it); R1-0528 does
        return ReasoningFormat(name, *THINK, forced=True)
    if name == "generic":
        if not end:
            raise ValueError("reasoning_parser generic needs reasoning_end (the end marker)")
        return ReasoningFormat(name, start or "", end, forced=not start, opens=bool(start))
    raise ValueError(
        f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {name!r}"
    )


def _held(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """One output's split into (reasoning, content) pieces, fed its text in any chunking.

    `stream_reasoning` false: the thinking comes out in one piece, once it has ended (or the
    output has). Joined, the pieces are those of `split_reasoning` on the whole text.
    """

    def __init__(
        self, fmt: ReasoningFormat, in_reasoning: bool, stream_reasoning: bool = True
    ) -> None:
        self.fmt = fmt
        self.initial = in_reasoning
        self.stream_reasoning = stream_reasoning
        # start: the start marker may come; reasoning; content: after the end marker (leading
        # whitespace dropped); plain: an output without thinking, as written
        self.phase = "start" if fmt.start else ("reasoning" if in_reasoning else "plain")
        self.pending = ""  # text not decided yet
        self.started = False  # reasoning: non-whitespace sent (leading whitespace is dropped)
        self.ws = ""  # reasoning: trailing whitespace, sent only if more thinking follows
        self.unsent = ""  # reasoning held back while stream_reasoning is false
        self.content_started = False  # content after the end marker: leading whitespace dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """New text -> (reasoning, content) that can be sent now; `final`: the output ended with
        it, so everything held back comes too."""
        self.pending += text
        reasoning, content = self._advance(final=False)
        if final:
            more, rest = self._advance(final=True)
            reasoning, content = reasoning + more, content + rest
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The output ended: everything held back."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        if self.phase == "start":
            head = self.pending.lstrip()
            if head.startswith(self.fmt.start):
                self.pending = head[len(self.fmt.start) :]
                self.phase = "reasoning"
            elif self.fmt.start.startswith(head) and not final:
                return "", ""  # may still become the start marker
            else:
                self.phase = "reasoning" if self.initial else "plain"
        if self.phase == "reasoning":
            at = self.pending.find(self.fmt.end)
            if at >= 0:
                reasoning = self._think(self.pending[:at])
                self.pending = self.pending[at + len(self.fmt.end) :]
                self.phase = "content"
                reasoning += self._release()
            else:
                keep = 0 if final else _held(self.pending, self.fmt.end)
                reasoning = self._think(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                if final:
                    reasoning += self._release()
                return reasoning, ""
        if self.phase == "content" and not self.content_started:
            self.pending = self.pending.lstrip()
            self.content_started = bool(self.pending)
        content, self.pending = self.pending, ""
        return reasoning, content

    def _think(self, text: str) -> str:
        """Thinking text, stripped as a whole: leading whitespace dropped, trailing held."""
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.ws + text
        body = text.rstrip()
        self.ws = text[len(body) :]
        if self.stream_reasoning:
            return body
        self.unsent += body
        return ""

    def _release(self) -> str:
        """The thinking has ended: what stream_reasoning false held back."""
        self.ws = ""
        out, self.unsent = self.unsent, ""
        return out


def split_reasoning(fmt: ReasoningFormat, text: str, in_reasoning: bool) -> tuple[str, str]:
    """A whole output -> (reasoning, content), as a stream of it would send them."""
    return ReasoningParser(fmt, in_reasoning).feed(text, final=True)


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's outputs are split: the markers and where its outputs begin."""

    format: ReasoningFormat
    in_reasoning: bool  # an output begins in the thinking (starts_in_reasoning)
    stream_reasoning: bool = True

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.format, self.in_reasoning, self.stream_reasoning)

    def split(self, text: str) -> tuple[str, str]:
        return split_reasoning(self.format, text, self.in_reasoning)


def plan_reasoning(
    fmt: ReasoningFormat | None,
    prompt: str,
    *,
    separate: bool | None,
    stream_reasoning: bool | None,
    thinking: bool | None = None,
    default: bool = True,
) -> ReasoningPlan | None:
    """A request's plan (None: its outputs are not split). `separate`: the request's
    separate_reasoning (None: `default`); `prompt`: the prompt's text (its end, at least);
    `thinking`: chat_template_kwargs' enable_thinking, if given."""
    if separate is None:
        separate = default and fmt is not None
    if not separate:
        return None
    if fmt is None:
        raise bad_request(
            "separate_reasoning needs a server started with --reasoning-parser",
            "separate_reasoning",
        )
    in_reasoning = fmt.starts_in_reasoning(prompt, thinking)
    return ReasoningPlan(fmt, in_reasoning, stream_reasoning is not False)


@dataclass(frozen=True)
class MarkerIds:
    """Reasoning markers as token ids: what a thinking request carries to the scheduler."""

    end: list[int]
    start: list[int]  # the output opens the thinking with these ([]: it begins in it)


def marker_ids(tokenizer: PreTrainedTokenizerBase | None, fmt: ReasoningFormat | None) -> MarkerIds:
    """The markers' token ids as the model writes them mid-text ([]: no parser, tokenizer or
    start marker)."""
    if fmt is None or tokenizer is None:
        return MarkerIds([], [])
    start = _text_ids(tokenizer, fmt.start) if fmt.start else []
    return MarkerIds(_text_ids(tokenizer, fmt.end), start)


def _text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """NOTE: tokenized behind a newline, then the newline's tokens cut off: a sentencepiece
    tokenizer encodes a text's start with a word-boundary prefix ("▁.") that a marker written
    after other text does not have. Qwen3's `</think>` is one special token either way."""
    base = tokenizer.encode("\n", add_special_tokens=False)
    ids = tokenizer.encode("\n" + text, add_special_tokens=False)
    if ids[: len(base)] == base and len(ids) > len(base):
        return list(ids[len(base) :])
    return list(tokenizer.encode(text, add_special_tokens=False))


def thinking_phase(
    markers: MarkerIds, start: OutputStart, params: SamplingParams, param: str
) -> MarkerIds | None:
    """The marker ids a request carries to the scheduler (None: no thinking phase). `start`:
    where its output begins (`ReasoningFormat.output_start`); one that "opens" carries the start
    marker's ids too, one in the "thinking" none. Only a constraint or a thinking_budget needs
    the phase (the scheduler watches every token of a thinking request); a thinking_budget
    (`param` as the caller spells it) without a thinking phase is a 400."""
    budget = params.thinking_budget
    needed = budget is not None or params.constraint is not None or params.grammar is not None
    if start == "thinking" and markers.end:
        return MarkerIds(markers.end, []) if needed else None
    if start == "opens" and markers.end and markers.start:
        return markers if needed else None
    if budget is not None:
        raise bad_request(
            f"{param} needs an output that begins in the thinking, or may open it: a server "
            "started with --reasoning-parser, and a prompt that leaves the thinking open (not "
            'Qwen3\'s chat_template_kwargs {"enable_thinking": false}; on /generate, with '
            "separate_reasoning or the budget, a prompt the parser reads as thinking), or a "
            "generic parser with a --reasoning-start the output may write",
            param,
        )
    return None
