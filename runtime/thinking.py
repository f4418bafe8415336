"""A request's thinking phase: the tokens before the reasoning end marker are free, a grammar
(if any) holds the answer after it, and a thinking budget forces the marker.

The phases of one output (a request whose output begins in the thinking):

    | thinking ............. | end marker | gap        | answer .................. |
    | no grammar row, no     | watched    | whitespace | the grammar from its      |
    | drafts; counted        | (forced    | tokens,    | initial state, drafts on  |
    | against the budget     | when over) | not fed    |                           |

A request may instead begin before the thinking and open it itself (a generic parser with a
start marker, where the prompt does not leave a block open): the opening phase comes first.

    | start marker: opening ............. | thinking ... (as above)
    | 1st token: the grammar's row plus   |
    | the marker's 1st token; the rest of |
    | the marker forced once begun        |

A first token other than the marker's first is the answer's (no thinking): the grammar holds
from it on, no gap. NOTE: a marker begun is finished (its later tokens are forced), so every
token sampled is the marker's or the grammar's; the marker's first token opens the thinking
even where the grammar allows it too (the server's parser reads a marker at the output's start
as thinking, so generation must as well). Marker tokens are not counted against the budget.

The end marker is matched on the token ids of its canonical tokenization (one id for Qwen3's
`</think>`). NOTE: a model may spell a multi-token marker with other tokens (`</` `think>` where
the tokenizer makes `</think>` one piece; "." inside "..."): the text parser on the server side
then sees the thinking end where the grammar still thinks it goes on. A special token marker
has one spelling only. The start marker likewise: spelled with other tokens (or behind
whitespace) it is the answer's, if the grammar allows it, where the parser reads thinking (no
JSON schema or tool call allows an answer that begins with a marker).

The gap: after `</think>` Qwen3 writes "\\n\\n" before its answer, which a regex (and xgrammar's
JSON) would refuse, forcing the model off its habit. So up to MAX_GAP_TOKENS whitespace-only
tokens right after the marker are allowed beside what the grammar allows, and are not fed to
it: the grammar starts at the first other token. The server's parser drops that whitespace from
the answer (`ReasoningParser`), so the content is what the grammar accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_GAP_TOKENS = 4  # whitespace-only tokens allowed between the marker and the answer


@dataclass
class Thinking:
    end_ids: tuple[int, ...]  # the end marker's tokens
    budget: int | None = None  # thinking tokens before the marker is forced (None: no limit)
    tokens: int = 0  # output tokens sampled in the thinking, the marker's included
    matched: list[int] = field(default_factory=list)  # the output's end: a marker prefix
    ended: bool = False  # the whole marker was sampled: the answer phase
    gap: int = -1  # answer phase: whitespace tokens taken after the marker; -1: gap closed
    # the start marker's tokens where the output may open the thinking (opening phase); empty:
    # the output begins in the thinking
    start_ids: tuple[int, ...] = ()
    opened: int = 0  # opening phase: the start marker's tokens written so far

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise ValueError("a thinking phase needs the end marker's token ids")

    def fresh(self) -> Thinking:
        """The same phase for another sample of the request (n > 1), from its start."""
        return Thinking(self.end_ids, self.budget, start_ids=self.start_ids)

    @property
    def opening(self) -> bool:
        """Before the thinking: the output may open it (or is writing the start marker)."""
        return not self.ended and self.opened < len(self.start_ids)

    @property
    def free(self) -> bool:
        """Thinking: no grammar row (unless forced), no drafts."""
        return not self.ended and not self.opening

    def may_open(self) -> int | None:
        """At the output's first token: the start marker's first token, which its row allows
        beside the grammar's; else None."""
        if self.opening and self.opened == 0:
            return self.start_ids[0]
        return None

    def open(self, token: int) -> bool:
        """A token sampled in the opening phase. Returns whether it is the start marker's (the
        thinking begins after its last); otherwise the answer begins with it, without thinking."""
        assert self.opening
        if token == self.start_ids[self.opened]:
            self.opened += 1
            return True
        # NOTE: a marker begun is forced to its end (`forced`): only its first token is a choice
        assert self.opened == 0, f"start marker token {self.opened} was forced, got {token}"
        self.ended = True  # gap stays -1: the grammar holds from this token on
        return False

    @property
    def in_gap(self) -> bool:
        return self.ended and self.gap >= 0

    def forced(self) -> int | None:
        """The token the next sample must be (the start marker's next, once begun; the budget
        is spent: the end marker's next token), or None. Tokens of the end marker the model
        began itself count as marker, not thinking."""
        if self.opening:
            return self.start_ids[self.opened] if self.opened else None
        if self.ended or self.budget is None:
            return None
        if self.tokens - len(self.matched) < self.budget:
            return None
        return self.end_ids[len(self.matched)]

    def observe(self, token: int) -> bool:
        """A token sampled in the thinking. Returns whether it completed the marker (the answer
        phase begins with the next token)."""
        assert self.free
        self.tokens += 1
        self.matched.append(token)
        if tuple(self.matched) == self.end_ids:
            self.ended, self.gap, self.matched = True, 0, []
            return True
        # the longest end of the output that may still grow into the marker
        while self.matched and tuple(self.matched) != self.end_ids[: len(self.matched)]:
            self.matched.pop(0)
        return False

    def take_gap(self, whitespace: bool) -> bool:
        """An answer-phase token: whether it falls in the gap (not fed to the grammar). The gap
        closes at the first other token, or after MAX_GAP_TOKENS."""
        if not self.in_gap:
            return False
        if not whitespace:
            self.gap = -1
            return False
        self.gap += 1
        if self.gap >= MAX_GAP_TOKENS:
            self.gap = -1
        return True

    def close_gap(self) -> None:
        """A grammar token came another way (a jump-forward draft kept): the answer has begun."""
        if self.ended:
            self.gap = -1
