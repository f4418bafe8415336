"""The model's vocabulary as the bytes each token adds to the text: what grammar backends match.

Tokenizer kinds:
- byte-level BPE (GPT-2, Llama-3, Qwen2): token strings spell bytes with the GPT-2 byte-to-
  character table; every byte sequence is reachable.
- SentencePiece (Llama-2, Phi-3): "▁" is a space; `<0xAB>` tokens are raw bytes (byte fallback).
Special tokens (control tokens such as <|im_end|>) have no text: they are `None` here and no
grammar allows them, except the end tokens where the grammar may end. Added tokens that are not
special (Qwen's `<tool_call>`) keep their text: a grammar that spells "<tool_call>" may use them;
so do the special tokens in `text_ids` (the tool-call markers, runtime/tokenizer.text_marker_ids:
Mistral's `[TOOL_CALLS]`), which the output's text keeps too.
Ids past the tokenizer's vocabulary (lm_head padding) are `None` too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache, cached_property

from transformers import PreTrainedTokenizerBase

SPIECE_SPACE = "▁"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def byte_level_table() -> dict[str, int]:
    """GPT-2's printable character -> byte: printable bytes map to themselves, the other 68
    bytes to the characters 256.. in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 256
    for b in range(256):
        if b not in table.values():
            table[chr(shifted)] = b
            shifted += 1
    return table


@dataclass
class TokenVocab:
    token_bytes: list[bytes | None]  # indexed by token id, length = the model's vocab size
    end_ids: list[int]  # tokens that end the output (allowed where the grammar may end)
    kind: str  # "byte_level" | "sentencepiece"
    tokenizer: PreTrainedTokenizerBase | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    @cached_property
    def sorted_texts(self) -> list[bytes]:
        """Every token's text once, sorted (for prefix questions by bisection)."""
        return sorted({b for b in self.token_bytes if b})

    def text_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.token_bytes[i] or b"" for i in ids)

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        end_ids: list[int],
        text_ids: frozenset[int] = frozenset(),
    ) -> TokenVocab:
        """vocab_size: the model's (lm_head rows), which may exceed the tokenizer's; text_ids:
        special tokens that keep their text (module docstring)."""
        kind = tokenizer_kind(tokenizer)
        decode = _decode_byte_level if kind == "byte_level" else _decode_sentencepiece
        table: list[bytes | None] = [None] * vocab_size
        added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
        for piece, tid in tokenizer.get_vocab().items():
            if tid >= vocab_size:
                continue
            token = added.get(tid)
            if token is not None:
                text = not token.special or tid in text_ids
                table[tid] = token.content.encode() if text else None
            else:
                table[tid] = decode(piece)
        for tid in end_ids:
            if tid < vocab_size:
                table[tid] = None
        return cls(table, sorted(set(end_ids)), kind, tokenizer)


def tokenizer_kind(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        if _has_decoder(decoder, "ByteLevel"):
            return "byte_level"
        if any(_has_decoder(decoder, n) for n in ("ByteFallback", "Metaspace", "Replace")):
            return "sentencepiece"
    vocab = tokenizer.get_vocab()
    if any(piece.startswith(SPIECE_SPACE) for piece in vocab):
        return "sentencepiece"
    if "Ġ" in "".join(list(vocab)[:5000]):
        return "byte_level"
    raise ValueError(f"cannot tell the kind of tokenizer {type(tokenizer).__name__}")


def _has_decoder(decoder: dict, name: str) -> bool:
    if decoder.get("type") == name:
        return True
    return any(_has_decoder(d, name) for d in decoder.get("decoders") or [])


def _decode_byte_level(piece: str) -> bytes | None:
    table = byte_level_table()
    try:
        return bytes(table[c] for c in piece)
    except KeyError:
        return None  # not a byte-level spelling: an unusual control piece


def _decode_sentencepiece(piece: str) -> bytes | None:
    match = _BYTE_TOKEN.match(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if piece in ("<unk>", "<s>", "</s>", "<pad>"):
        return None
    return piece.replace(SPIECE_SPACE, " ").encode()
