"""Tokenizer loading (transformers only) and prompt encoding (the same for Engine and server)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from None


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
