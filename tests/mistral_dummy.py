"""A Mistral model folder for tests, built at test time: the Llama-2 vocabulary fixture (the
SentencePiece vocabulary Mistral's v1-v3 tokenizers extend) plus Mistral's control tokens as
special added tokens, Mistral-Nemo's chat template (the fixture), and a tiny Mistral config
served with dummy weights (`--load-format dummy`).

Real Mistral tokenizers have `[INST]`, `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`, ... as control
tokens (special: skip_special_tokens drops them); here they follow the Llama-2 vocabulary's last
id (31999) in the order below, and the model's vocabulary is padded past them to 32768 (the
size of Mistral v3's).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken
from transformers import AutoTokenizer

from conftest import fixture_path

CONTROL_TOKENS = (
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[CALL_ID]",
    "[ARGS]",
)
FIRST_ID = 32000
TOOL_CALLS_ID = FIRST_ID + CONTROL_TOKENS.index("[TOOL_CALLS]")
EOS_ID = 2

CONFIG = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 32768,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
}


def mistral_tokenizer() -> AutoTokenizer:
    """The Llama-2 tokenizer with Mistral's control tokens (special) and Nemo's template."""
    tokenizer = AutoTokenizer.from_pretrained(fixture_path("tokenizers", "llama2"))
    specials = [AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    for i, text in enumerate(CONTROL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(text) == FIRST_ID + i, text
    tokenizer.chat_template = nemo_template()
    return tokenizer


def nemo_template() -> str:
    path = fixture_path(
        "tokenizers", "chat-templates", "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    )
    return path.read_text()


def build_mistral_dummy(folder: Path) -> Path:
    """Write config.json and the tokenizer into `folder`; returns it."""
    mistral_tokenizer().save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder
