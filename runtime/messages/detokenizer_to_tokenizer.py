"""Channel detokenizer -> tokenizer manager: client-facing text per step, plus forwarded control
messages from the scheduler. The scheduler process's heartbeat thread sends `Heartbeat` to the
same inbox directly (it must come while the scheduler's loop is busy or stuck)."""

from __future__ import annotations

from typing import Any

import msgspec

from weft.runtime.messages.common import (
    Fatal,
    GrammarReport,
    Heartbeat,
    LogprobEntry,
    Ready,
    Reply,
    SpecReport,
)


class TextUpdate(msgspec.Struct, array_like=True):
    rid: str  # the rid the caller knows
    index: int  # which of the caller's n samples
    text: str  # new text: never half a character, never a part of a stop string
    new_ids: list[int]
    cached_tokens: int
    finish_reason: dict[str, Any] | None = None
    output_logprobs: list[LogprobEntry] = []
    input_logprobs: list[LogprobEntry] | None = None
    grammar: GrammarReport | None = None
    spec: SpecReport | None = None


class TextStep(msgspec.Struct, tag="text"):
    updates: list[TextUpdate]


ToTokenizer = TextStep | Ready | Reply | Fatal | Heartbeat

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ToTokenizer)
