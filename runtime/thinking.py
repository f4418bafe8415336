"""A request's thinking phase: the tokens before the reasoning end marker are free, a grammar
(if any) holds the answer after it, and a thinking budget forces the marker.

The phases of one output (a request whose output begins in the thinking):

    | thinking ............. | end marker | gap        | answer .................. |
    | no grammar row, no     | watched    | whitespace | the grammar from its      |
    | drafts; counted        | (forced    | tokens,    | initial state, drafts on  |
    | against the budget     | when over) | not fed    |                           |

The marker is matched on the token ids of its canonical tokenization (one id for Qwen3's
`</think>`). NOTE: a model may spell a multi-token marker with other tokens (`</` `think>` where
the tokenizer makes `</think>` one piece; "." inside "..."): the text parser on the server side
then sees the thinking end where the grammar still thinks it goes on. A special token marker
has one spelling only.

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

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise ValueError("a thinking phase needs the end marker's token ids")

    def fresh(self) -> Thinking:
        """The same phase for another sample of the request (n > 1), from its start."""
        return Thinking(self.end_ids, self.budget)

    @property
    def free(self) -> bool:
        """Still thinking: no grammar row (unless forced), no drafts."""
        return not self.ended

    @property
    def in_gap(self) -> bool:
        return self.ended and self.gap >= 0

    def forced(self) -> int | None:
        """The token the next sample must be (the budget is spent: the marker's next token), or
        None. Tokens of the marker the model began itself count as marker, not thinking."""
        if self.ended or self.budget is None:
            return None
        if self.tokens - len(self.matched) < self.budget:
            return None
        return self.end_ids[len(self.matched)]

    def observe(self, token: int) -> bool:
        """A token sampled in the thinking. Returns whether it completed the marker (the answer
        phase begins with the next token)."""
        assert not self.ended
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
