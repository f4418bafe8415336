"""Tokenizer loading (transformers only) and the model's end-of-generation tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from weft.runtime.model_config import ModelConfig

# Special tokens that end a turn or a document in the model families we serve (a GGUF names
# one eos id; its conversion adds the control tokens with these texts).
END_TOKEN_TEXTS = frozenset(
    {
        "</s>",
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<EOT>",
        "<|return|>",
    }
)


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


def end_token_ids(
    tokenizer: PreTrainedTokenizerBase | None, model: ModelConfig, folder: Path
) -> frozenset[int]:
    """Every id that ends generation: config.json, generation_config.json, the tokenizer's eos,
    and the tokenizer's end specials such as <|im_end|> and <|endoftext|>."""
    ids: set[int] = set(model.eos_token_ids)
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.is_file():
        ids.update(_ids(json.loads(gen_cfg.read_text()).get("eos_token_id")))
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        for tid, added in tokenizer.added_tokens_decoder.items():
            if added.special and added.content in END_TOKEN_TEXTS:
                ids.add(int(tid))
    return frozenset(i for i in ids if 0 <= i < model.vocab_size)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
