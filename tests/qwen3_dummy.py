"""A Qwen3 model folder for tests, built at test time: the Qwen2 vocabulary fixture plus Qwen3's
added tokens (`<think>` / `</think>`), a Qwen3-style chat template with thinking, and a tiny
Qwen3 config served with dummy weights (`--load-format dummy`).

The added tokens and their ids are Qwen3's tokenizer_config.json (none special, so the text of
an output keeps them); the template follows Qwen3's hybrid one where it matters here: the
generation prompt leaves the thinking open, and enable_thinking false closes it at once
(`<think>\\n\\n</think>\\n\\n`), and tools are offered in the `<tool_call>` format.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken
from transformers import AutoTokenizer

from conftest import fixture_path

# id -> token added after the Qwen2 vocabulary's last one (151664), as Qwen3 has them
QWEN3_ADDED = {
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
}
THINK_END_ID = 151668
IM_END_ID = 151645

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nCall a function as <tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": IM_END_ID,
    "torch_dtype": "float32",
}


def build_qwen3_dummy(folder: Path) -> Path:
    """Write config.json and the Qwen3 tokenizer into `folder`; returns it."""
    tokenizer = AutoTokenizer.from_pretrained(fixture_path("tokenizers", "qwen2"))
    added = [
        AddedToken(text, special=False, normalized=False) for _, text in sorted(QWEN3_ADDED.items())
    ]
    tokenizer.add_tokens(added)
    for tid, text in QWEN3_ADDED.items():
        assert tokenizer.convert_tokens_to_ids(text) == tid, (text, tid)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder
