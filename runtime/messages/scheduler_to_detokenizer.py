"""Channel scheduler -> detokenizer: new token ids per step, plus forwarded control messages."""

from __future__ import annotations

from typing import Any

import msgspec

from weft.runtime.messages.common import (
    Fatal,
    GrammarReport,
    LogprobEntry,
    Ready,
    Reply,
    SpecReport,
)


class DecodeStart(msgspec.Struct, array_like=True):
    """A new sample: how to decode it."""

    rid: str  # the sample's own rid (a child rid for n > 1)
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop_hold: int  # characters held back while a stop string may still match (longest - 1)


class Finish(msgspec.Struct, array_like=True):
    reason: dict[str, Any]  # FinishReason.to_dict()
    # NOTE: the scheduler never decodes the end token that stopped a sample, and cuts the text at
    # a matched stop string; the detokenizer must do the same to return the same text.
    decode_last: bool  # False: the last id of this update is an end token, not part of the text
    text_len: int  # >= 0: the text ends here (a stop string matched); -1: flush the decoder


class TokenUpdate(msgspec.Struct, array_like=True):
    rid: str  # the sample's own rid
    caller_rid: str  # the rid the caller knows
    index: int  # which of the caller's n samples
    new_ids: list[int]
    cached_tokens: int
    finish: Finish | None = None
    output_logprobs: list[LogprobEntry] = []  # entries of new_ids
    input_logprobs: list[LogprobEntry] | None = None  # on the first update, when asked for
    grammar: GrammarReport | None = None  # constrained requests: on every update
    spec: SpecReport | None = None  # speculating requests: on every update


class Step(msgspec.Struct, tag="step"):
    starts: list[DecodeStart]
    updates: list[TokenUpdate]


ToDetokenizer = Step | Ready | Reply | Fatal

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ToDetokenizer)
