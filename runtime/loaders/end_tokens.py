"""The model's end-of-generation tokens, gathered from the files of its folder and its tokenizer.

NOTE: no transformers or torch at import time (the GGUF converter and both scheduler hosts use it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
