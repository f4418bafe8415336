"""Incremental detokenization that never emits half a multi-byte character."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

_INCOMPLETE = "\ufffd"


def _backend_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str] | None:
    """The tokenizers library's own decode, where transformers' wrapper around it would return
    the same text: a fast tokenizer without clean_up_tokenization_spaces (the wrapper costs
    ~3x the decode itself, and this runs twice per token of every request).
    NOTE: spaces_between_special_tokens only matters to slow tokenizers; fast ones ignore it."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    decode = backend.decode
    return lambda ids: str(decode(ids, skip_special_tokens=skip_special_tokens))


class IncrementalDecoder:
    """Feeds token ids one step at a time and returns the newly stable text.

    Text is decoded over a short window (`prefix_offset` ..) so that tokenizers that drop a leading
    space when decoding mid-sequence (SentencePiece) still produce the right delta; a delta ending
    in U+FFFD is held back until the next token completes the character.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        skipped: frozenset[int] | None = None,
    ) -> None:
        """skipped: what skip_special_tokens drops where it is not every special token
        (tokenizer.skipped_special_ids: the tool-call markers stay text)."""
        self.tokenizer = tokenizer
        self._skipped = skipped if skip_special_tokens else None
        if self._skipped is not None:
            skip_special_tokens = False  # the ids are filtered before they are decoded
        self.kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self._fast = _backend_decode(tokenizer, skip_special_tokens)
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if self._skipped is not None:
            ids = [i for i in ids if i not in self._skipped]
        if self._fast is not None:
            return self._fast(ids)
        return str(self.tokenizer.decode(ids, **self.kwargs))

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        now = self._decode(self.ids[self._prefix_offset :])
        if len(now) <= len(before) or now.endswith(_INCOMPLETE):
            return ""
        delta = now[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is left, incomplete characters included."""
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        now = self._decode(self.ids[self._prefix_offset :])
        delta = now[len(before) :] if now.startswith(before) else ""
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += delta
        return delta


class TokenTexts:
    """The text a token adds after other text (logprob entries name tokens by it), cached.

    NOTE: decoding a lone token drops a SentencePiece token's leading space ("▁upon" ->
    "upon"); decoding it after an anchor token and cutting the anchor's text keeps it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._anchor: int | None = None

    def __call__(self, tid: int) -> str:
        text = self._texts.get(tid)
        if text is None:
            text = self._text(tid) if self.tokenizer is not None else ""
            self._texts[tid] = text
        return text

    def _text(self, tid: int) -> str:
        tokenizer = self.tokenizer
        assert tokenizer is not None
        if self._anchor is None:
            ids = tokenizer.encode("a", add_special_tokens=False)
            self._anchor = int(ids[-1]) if ids else 0
        anchor_text = str(tokenizer.decode([self._anchor]))
        both = str(tokenizer.decode([self._anchor, tid]))
        if both.startswith(anchor_text):
            return both[len(anchor_text) :]
        return str(tokenizer.decode([tid]))
