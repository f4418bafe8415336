"""Tokenizer loading (transformers only) and prompt encoding (the same for Engine and server)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from weft.runtime.server.tool_formats import TOOL_MARKERS


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from None


def text_marker_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The special tokens that are text all the same: the tool-call markers (TOOL_MARKERS, e.g.
    Mistral's `[TOOL_CALLS]`, a control token). A property of the vocabulary, not of a request:
    the grammar vocabulary (grammars/vocab.py) and every output's text (`skipped_special_ids`)
    agree on it, so the text of a constrained output is the text its grammar matched.

    NOTE: so any grammar may emit a marker where its text fits (inside a JSON string, say),
    and a chat without tools shows a marker the model writes (as Qwen's `<tool_call>` shows).
    Other special tokens (`</s>`, `[INST]`) stay textless: no grammar can spell them."""
    return frozenset(
        tid
        for tid, token in tokenizer.added_tokens_decoder.items()
        if token.special and token.content in TOOL_MARKERS
    )


def skipped_special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int] | None:
    """What skip_special_tokens drops where some special tokens are text (`text_marker_ids`):
    every other special token; None where none is text (the tokenizer's own skipping)."""
    kept = text_marker_ids(tokenizer)
    if not kept:
        return None
    special = {tid for tid, token in tokenizer.added_tokens_decoder.items() if token.special}
    return frozenset(special.union(tokenizer.all_special_ids) - kept)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True
) -> list[int]:
    """A text prompt's ids, the same for the Engine and the server.

    A text that begins with the BOS token's text already (a chat template's rendering: Llama's
    templates write it) gets no second BOS: the tokenizer would add one in front of the one the
    text spells, and the model would read `<s><s>`, which no chat request sends (the chat
    endpoint renders the template and adds no special tokens).
    """
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    bos = tokenizer.bos_token_id
    bos_text = tokenizer.bos_token
    doubled = len(ids) > 1 and ids[0] == bos and ids[1] == bos
    if not (add_special_tokens and bos is not None and doubled and bos_text):
        return ids
    # only the BOS the tokenizer added goes: a "<s><s>" the text writes out stays two
    if text.startswith(bos_text) and ids[1:] == tokenizer.encode(text, add_special_tokens=False):
        del ids[0]
    return ids
