"""Loading paths: sharded safetensors, dummy weights, dtypes; namespaces; the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from weft.runtime.model_config import ModelConfig

from conftest import make_engine
from hf_models import hf_greedy, save_random_model

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PROMPT = [3, 17, 42, 99, 5, 8]


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    hf = save_random_model("qwen2-bias", tmp_path)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    engine = make_engine(sharded, dtype="float32", max_total_tokens=1024)
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == hf_greedy(
        hf, PROMPT, 10
    )
    engine.shutdown()


def test_dummy_weights_from_a_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 300,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
                "torch_dtype": "bfloat16",
            }
        )
    )
    a = make_engine(tmp_path, load_format="dummy", max_total_tokens=512)
    b = make_engine(tmp_path, load_format="dummy", max_total_tokens=512)
    assert a.runner.dtype == torch.bfloat16 and a.tokenizer is None
    out_a = a.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert out_a["output_ids"] == b.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    assert len(out_a["output_ids"]) == 10 and out_a["text"] == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        a.generate("text needs a tokenizer")
    a.shutdown()
    b.shutdown()


def test_qwen3_dummy_weights_from_a_hub_style_config(tmp_path):
    """No head_dim or attention_bias in config.json: transformers' Qwen3 defaults apply (head_dim
    128, no qkv bias); dummy weights leave the q/k norms at one, like the other norms."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "vocab_size": 300,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
            }
        )
    )
    engine = make_engine(tmp_path, load_format="dummy", max_total_tokens=512)
    model = engine.runner.model
    attn = model.layers[1].self_attn
    assert (model.config.head_dim, model.config.attention_bias) == (128, False)
    assert attn.qkv_proj.weight.shape == ((4 + 2 + 2) * 128, 64) and attn.qkv_proj.bias is None
    for norm in (attn.q_norm, attn.k_norm):
        assert torch.equal(norm.weight.float().cpu(), torch.ones(128))
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert len(out["output_ids"]) == 10
    engine.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stays_close_to_fp32(stories_dir, dtype):
    golden = json.loads((stories_dir / "GOLDEN.json").read_text())
    engine = make_engine(stories_dir, dtype=dtype, max_total_tokens=1024)
    assert engine.runner.dtype == getattr(torch, dtype)
    assert engine.runner.kv_pool.dtype == getattr(torch, dtype)
    out = engine.generate(input_ids=[1], sampling_params={**GREEDY, "max_new_tokens": 20})
    # a 260K-parameter model in 16-bit: the first greedy tokens agree with the fp32 golden run
    assert out["output_ids"][:8] == golden["greedy_ids_including_prompt"][1:9]
    engine.shutdown()


def test_namespaces_never_share_kv(stories_dir):
    engine = make_engine(stories_dir, max_total_tokens=2048)
    prompt = [1] + list(range(300, 340))
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY, namespace="tenant-a")
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY, namespace="tenant-a")
    other = engine.generate(input_ids=prompt, sampling_params=GREEDY, namespace="tenant-b")
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert other["meta_info"]["cached_tokens"] == 0
    assert first["output_ids"] == again["output_ids"] == other["output_ids"]
    engine.shutdown()


def test_cli_generate(stories_dir):
    cmd = [
        sys.executable,
        "-m",
        "weft",
        "generate",
        "--model-path",
        str(stories_dir),
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "12",
        "--json",
        "--no-show-progress",
        "--log-level",
        "warning",
        "--max-total-tokens",
        "1024",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["meta_info"]["completion_tokens"] == 12 and out["text"].startswith(",")
    bad = subprocess.run(
        cmd[:5] + ["/nonexistent"] + cmd[6:], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert bad.returncode == 2 and "does not exist" in bad.stderr


_SHAPE = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}


@pytest.mark.parametrize(
    ("extra", "windows"),
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, [4096] * 4),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, [None] * 4),
        # transformers' MistralConfig defaults the key to 4096; Qwen's use_sliding_window to false
        ({"architectures": ["MistralForCausalLM"]}, [4096] * 4),
        ({"architectures": ["Qwen3ForCausalLM"], "sliding_window": 16}, [None] * 4),
        # Mistral's window holds in every layer, as in transformers (it ignores layer_types)
        (
            {
                "architectures": ["MistralForCausalLM"],
                "sliding_window": 8,
                "layer_types": ["full_attention", "sliding_attention"] * 2,
            },
            [8] * 4,
        ),
        # Qwen2.5 checkpoints state a window that applies only with use_sliding_window
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 32768,
                "use_sliding_window": False,
                "max_window_layers": 2,
            },
            [None] * 4,
        ),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 16,
                "use_sliding_window": True,
                "max_window_layers": 2,
            },
            [None, None, 16, 16],
        ),
        (
            {
                "architectures": ["Qwen3ForCausalLM"],
                "sliding_window": 16,
                "use_sliding_window": True,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            [16, None, 16, None],
        ),
    ],
    ids=[
        "mistral",
        "mistral-null",
        "mistral-absent",
        "qwen3-no-use-sliding-window",
        "mistral-layer-types",
        "qwen2-off",
        "qwen2-max-window-layers",
        "qwen3-layer-types",
    ],
)
def test_sliding_window_per_layer_from_config(tmp_path, extra, windows):
    """config.json's sliding window reaches each layer's attention options (dummy weights)."""
    (tmp_path / "config.json").write_text(json.dumps({**_SHAPE, **extra}))
    engine = make_engine(tmp_path, load_format="dummy", max_total_tokens=256)
    model = engine.runner.model
    assert [layer.self_attn.options.sliding_window for layer in model.layers] == windows
    out = engine.generate(input_ids=PROMPT * 4, sampling_params=GREEDY)
    assert len(out["output_ids"]) == 10
    engine.shutdown()


def test_qwen3_moe_dummy_weights_from_a_hub_style_config(tmp_path):
    """Qwen3-30B-A3B's keys, small: decoder_sparse_step 2 makes layers 1 and 3 sparse, and
    mlp_only_layers takes layer 3 back; the experts get dummy weights like any parameter."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                **_SHAPE,
                "architectures": ["Qwen3MoeForCausalLM"],
                "head_dim": 16,
                "num_key_value_heads": 2,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 24,
                "norm_topk_prob": True,
                "decoder_sparse_step": 2,
                "mlp_only_layers": [3],
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": 4,
            }
        )
    )
    engine = make_engine(tmp_path, load_format="dummy", max_total_tokens=256)
    model = engine.runner.model
    sparse = [hasattr(layer.mlp, "experts") for layer in model.layers]
    assert sparse == [False, True, False, False]
    experts = model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (8, 48, 32) and experts.down_proj.shape == (8, 32, 24)
    assert model.layers[0].mlp.gate_up_proj.weight.shape == (128, 32)
    assert [layer.self_attn.options.sliding_window for layer in model.layers] == [None] * 4
    assert float(experts.down_proj.float().std()) > 0.01  # drawn, not left empty
    out = engine.generate(input_ids=PROMPT * 4, sampling_params=GREEDY)
    assert len(out["output_ids"]) == 10
    engine.shutdown()


def test_qwen3_moe_stacked_expert_tensors_load_like_per_expert_ones(tmp_path):
    """A checkpoint with transformers 5's stacked `mlp.experts.gate_up_proj` / `down_proj`
    gives the outputs of the per-expert checkpoint that save_pretrained writes."""
    from safetensors.torch import load_file, save_file

    hf = save_random_model("qwen3-moe-4x3-tied", tmp_path)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (tmp_path / name).is_file():
            (stacked / name).write_text((tmp_path / name).read_text())
    tensors = {
        k: v for k, v in load_file(tmp_path / "model.safetensors").items() if ".experts." not in k
    }
    for name, param in hf.state_dict().items():
        if ".mlp.experts." in name:
            tensors[name] = param.contiguous()
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, stacked / "model.safetensors")
    want = hf_greedy(hf, PROMPT, 10)
    for folder in (tmp_path, stacked):
        engine = make_engine(folder, dtype="float32", max_total_tokens=512)
        assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == want
        engine.shutdown()


_GEMMA3 = {**_SHAPE, "num_hidden_layers": 12, "architectures": ["Gemma3ForCausalLM"]}


def test_gemma3_config_both_layouts():
    """Gemma 3's config.json as the released checkpoints write it (rope_theta, rope_local_base_freq,
    sliding_window_pattern) and as transformers 5 saves it (rope_parameters per layer type)."""
    old = ModelConfig.from_dict(
        {**_GEMMA3, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 64}
    )
    assert old.full_attention_layers == {5, 11}  # every 6th layer is global (the default pattern)
    assert [old.layer_window(i) for i in (0, 5)] == [4096, None]  # transformers' default window
    assert (old.rope_theta, old.local_rope_theta, old.rope_scaling) == (1e6, 1e4, None)
    assert old.attn_scale == 64**-0.5 and old.head_dim == 256 and old.tie_word_embeddings
    assert old.hidden_act == "gelu_pytorch_tanh"  # Gemma3TextConfig's default
    new = ModelConfig.from_dict(
        {
            **_GEMMA3,
            "_sliding_window_pattern": 3,
            "sliding_window": 512,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        }
    )
    assert new.full_attention_layers == {2, 5, 8, 11} and new.layer_window(0) == 512
    assert new.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (new.local_rope_theta, new.local_rope_scaling, new.attn_scale) == (1e4, None, 256**-0.5)
    with pytest.raises(ValueError, match="text model only"):
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"]})
