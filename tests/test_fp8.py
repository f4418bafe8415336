"""FP8 (e4m3) linear weights: FP8Weight's matmuls, quantization 'fp8' at load, FP8 checkpoints as
published (fp8 with 128 x 128 blocks, per-channel compressed-tensors, per-tensor static fp8), and
what is refused. The CPU runs the rowwise torch._scaled_mm and the dequantize path; the CUDA
tests at the end (the scaled_mm, Triton and GEMV paths, a CUDA graph) skip without a GPU.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weft.runtime.config import EngineConfig
from weft.runtime.model_config import ModelConfig, fp8_checkpoint
from weft.runtime.models.fp8 import (
    FP8_GEMV_ONE_ROW,
    FP8_ROWS_MAX_ROWS,
    FP8Weight,
    dequantize,
    expand_scales,
    merge_shards,
    quantize_weight,
    scaled_mm_support,
)
from weft.runtime.models.layers import ColumnLinear

from conftest import make_engine
from hf_models import VOCAB, save_random_model

BF16 = torch.bfloat16
BLOCK = (128, 128)
HAS_CUDA = torch.cuda.is_available()
# the linears an FP8 checkpoint stores in e4m3 (not the embeddings, lm_head or norms)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the channel form's path on this CPU: torch 2.13's CPU _scaled_mm takes rowwise scales, 2.11's
# only per-tensor ones (then the dequantize path serves, and says why)
CPU_CHANNEL = "scaled_mm" if scaled_mm_support(torch.device("cpu")) is None else "dequant"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _fp8(w: torch.Tensor, block: tuple[int, int] | None) -> FP8Weight:
    q, scale = quantize_weight(w, block)
    group = (1, w.shape[1]) if block is None else block
    return FP8Weight(q, scale, group, dtype=BF16, origin="load")


# -- FP8Weight ---------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [None, BLOCK])
def test_weight_quantization_error(block):
    """e4m3 keeps 3 mantissa bits: each element within half a step (2^-4 relative) of the
    original, or of the block's smallest step for values near zero."""
    torch.manual_seed(0)
    w = torch.randn(200, 320)
    q, scale = quantize_weight(w, block)
    group = (1, 320) if block is None else block
    assert q.dtype == torch.float8_e4m3fn
    assert tuple(scale.shape) == ((200, 1) if block is None else (2, 3))
    back = dequantize(q, scale, group)
    err = (back - w).abs()
    # subnormal step of e4m3 is 2^-9 of the scale unit: amax / 448 * 2^-9
    floor = (w.abs().max() / 448) * 2.0**-9
    assert bool((err <= w.abs() * 2.0**-4 + floor).all())
    # near a group's amax the step is 32 / 448 of it: at most 16 / 448 = 0.036 of the amax
    amax = expand_scales(scale, group, (200, 320)) * 448
    print(f"weight error / group amax: max {float((err / amax).max()):.4f}")
    assert float((err / amax).max()) <= 16 / 448 + 1e-6


@pytest.mark.parametrize(("block", "path"), [(None, CPU_CHANNEL), (BLOCK, "dequant")])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_matmul_vs_dequantized_and_original(block, path, rows):
    """CPU: the channel form runs torch._scaled_mm (activations quantized per row), the block
    form the dequantize path (activations stay bfloat16)."""
    torch.manual_seed(rows)
    w = torch.randn(96, 256) * 0.05
    bias = torch.randn(96).to(BF16)
    weight = _fp8(w, block)
    assert weight.path == path, weight.why
    x = torch.randn(rows, 256).to(BF16)
    got = weight.matmul(x, bias)
    assert got.dtype == BF16 and got.shape == (rows, 96)
    dense = x.float() @ weight.dense().float().t() + bias.float()
    original = x.float() @ w.t() + bias.float()
    # max |error| / max |reference| over the outputs; vs the dequantized weight: only x's e4m3
    # rounding (scaled_mm) or the bf16 output rounding [measured max 0.0235 scaled_mm, 0.0033
    # dequant]; vs the original weight: the weight's rounding on top [measured max 0.0367
    # scaled_mm, 0.0218 dequant]
    print(
        f"{path} rows {rows}: vs dequantized {_rel(got, dense):.4f}, vs original {_rel(got, original):.4f}"
    )
    assert _rel(got, dense) < (0.04 if path == "scaled_mm" else 0.008)
    assert _rel(got, original) < 0.06


def test_paths_refuse_what_they_cannot_run():
    """A channel-form weight whose sizes are not multiples of 16 falls back to dequantizing and
    says why; so does a block form whose blocks are not 128 columns wide (CPU: always)."""
    odd = _fp8(torch.randn(40, 100), None)
    why = "multiples of 16" if CPU_CHANNEL == "scaled_mm" else "_scaled_mm has no rowwise"
    assert odd.path == "dequant" and why in odd.why
    x = torch.randn(3, 100).to(BF16)
    assert _rel(odd.matmul(x, None), x.float() @ odd.dense().float().t()) < 0.01
    assert "block scales" in _fp8(torch.randn(64, 64), (32, 32)).why


def test_merge_shards_scales():
    torch.manual_seed(0)
    k = 256
    shards = [torch.randn(n, k) for n in (256, 128, 128)]
    parts = [quantize_weight(s, BLOCK) for s in shards]
    names = ["q_proj", "k_proj", "v_proj"]
    weight, scale, group = merge_shards(
        [q for q, _ in parts], [s for _, s in parts], BLOCK, names, scale_name="weight_scale_inv"
    )
    # whole blocks of rows: the block scales concatenate
    assert group == BLOCK and tuple(scale.shape) == (4, 2)
    assert torch.equal(
        dequantize(weight, scale, group), torch.cat([dequantize(q, s, BLOCK) for q, s in parts])
    )
    # q of 200 rows ends mid-block: each row gets its block's scales (groups of 1 x 128)
    shards = [torch.randn(n, k) for n in (200, 72, 72)]
    parts = [quantize_weight(s, BLOCK) for s in shards]
    weight, scale, group = merge_shards(
        [q for q, _ in parts], [s for _, s in parts], BLOCK, names, scale_name="weight_scale_inv"
    )
    assert group == (1, 128) and tuple(scale.shape) == (344, 2)
    assert torch.equal(
        dequantize(weight, scale, group), torch.cat([dequantize(q, s, BLOCK) for q, s in parts])
    )
    # per tensor ([] and [1]) and per row ([n] and [n, 1]) scales become one per row
    q = torch.ones(16, k).to(torch.float8_e4m3fn)
    scales = [
        torch.tensor(2.0),
        torch.tensor([3.0]),
        torch.full((16,), 4.0),
        torch.full((16, 1), 5.0),
    ]
    _, scale, group = merge_shards(
        [q] * 4, scales, None, ["a", "b", "c", "d"], scale_name="weight_scale"
    )
    assert (
        group == (1, k)
        and scale.view(-1).tolist() == [2.0] * 16 + [3.0] * 16 + [4.0] * 16 + [5.0] * 16
    )
    with pytest.raises(ValueError, match=r"k_proj: weight_scale_inv of shape \(2, 2\)"):
        merge_shards(
            [q, q],
            [torch.ones(1, 2), torch.ones(2, 2)],
            BLOCK,
            names[:2],
            scale_name="weight_scale_inv",
        )
    with pytest.raises(ValueError, match=r"b: weight_scale of shape \(3,\)"):
        merge_shards(
            [q, q], [torch.ones(1), torch.ones(3)], None, ["a", "b"], scale_name="weight_scale"
        )


# -- engines: quantization 'fp8', FP8 checkpoints ------------------------------------------------


def _prompt_logprobs(engine, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, VOCAB] log-probabilities of every token at each prompt position."""
    out = engine.generate(
        input_ids=prompt,
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=VOCAB,
    )
    rows = []
    for top in out["meta_info"]["input_top_logprobs"][1:]:
        row = torch.zeros(VOCAB, dtype=torch.float64)
        for lp, tid, _ in top:
            row[tid] = lp
        rows.append(row)
    return torch.stack(rows)


PROMPT = [(7 * i + 3) % VOCAB for i in range(40)]


def _greedy(engine, n: int = 12) -> list[int]:
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    return engine.generate(input_ids=PROMPT[:9], sampling_params=params)["output_ids"]


def _run(
    folder: Path, device: str = "cpu", **kwargs
) -> tuple[torch.Tensor, list[int], list[FP8Weight]]:
    engine = make_engine(folder, max_total_tokens=1024, device=device, **kwargs)
    fp8 = [m for m in engine.runner.model.modules() if isinstance(m, FP8Weight)]
    result = (_prompt_logprobs(engine, PROMPT), _greedy(engine), fp8)
    engine.shutdown()
    return result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    save_random_model("llama-gqa-untied", folder)  # 3 layers, hidden 64, GQA 8 / 2 heads
    return folder


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """A tiny llama whose linears are whole 128 x 128 blocks: q 256, k and v 128 rows each,
    gate and up 384, hidden 256 (the published block form without per-row scales)."""
    import transformers

    folder = tmp_path_factory.mktemp("wide")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def dense_run(tiny):
    return _run(tiny, dtype="bfloat16")


def test_quantization_fp8_vs_bf16(tiny, dense_run, caplog):
    with caplog.at_level(logging.INFO, logger="weft"):
        lp, greedy, fp8 = _run(tiny, dtype="bfloat16", quantization="fp8", log_level="info")
    lp_ref, greedy_ref, none = dense_run
    assert not none
    # 3 layers x (qkv, o, gate_up, down); the lm_head and embeddings stay bfloat16
    assert len(fp8) == 12 and {(w.form, w.origin, w.path) for w in fp8} == {
        ("channel", "load", CPU_CHANNEL)
    }
    assert "12 fp8 e4m3 (per channel, quantized at load" in caplog.text
    # log-probabilities over the whole vocabulary at 39 positions [measured max 0.030, mean
    # 0.0056]
    diff = (lp - lp_ref).abs()
    print(f"fp8 vs bf16 logprobs: max {float(diff.max()):.4f} mean {float(diff.mean()):.5f}")
    assert float(diff.max()) < 0.15 and float(diff.mean()) < 0.02, (diff.max(), diff.mean())
    # greedy tokens: the first 9 of 12 agree [measured], where a random model's top two
    # logits come within the quantization error of each other
    print(f"fp8 vs bf16 greedy: {greedy} vs {greedy_ref}")
    assert greedy[:6] == greedy_ref[:6]


def _write_fp8_checkpoint(
    src: Path, dst: Path, qc: dict, block: tuple[int, int] | None, per_tensor: bool = False
) -> Path:
    """An FP8 checkpoint made from a dense HF folder the way published ones are stored, and beside
    it (dst / "ref") the dense folder of its dequantized weights, the reference."""
    ref = dst / "ref"
    ref.mkdir(parents=True)
    tensors = load_file(src / "model.safetensors")
    fp8, dense = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            w = t.float()
            if per_tensor:
                scale = (w.abs().max() / 448).reshape(1)
                q = (w / scale).to(torch.float8_e4m3fn)
                group = tuple(w.shape)
                back = dequantize(q, scale.view(1, 1), group)
            else:
                q, scale = quantize_weight(w, block)
                back = dequantize(q, scale, (1, w.shape[1]) if block is None else block)
            base = name.removesuffix(".weight")
            fp8[name] = q
            if block is not None:
                fp8[f"{base}.weight_scale_inv"] = scale
            else:
                fp8[f"{base}.weight_scale"] = scale
            if qc.get("activation_scheme") == "static":
                fp8[f"{base}.input_scale"] = torch.tensor([0.01])
            dense[name] = back.to(BF16)
        else:
            fp8[name] = dense[name] = t.to(BF16)
    save_file(fp8, str(dst / "model.safetensors"))
    save_file(dense, str(ref / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (ref / "config.json").write_text(json.dumps(config))
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return dst


BLOCK_QC = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CHANNEL_QC = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}
STATIC_QC = {"quant_method": "fp8", "activation_scheme": "static"}


# form -> (quantization_config, weight_block_size, one scale per tensor)
FORMS = {
    "block": (BLOCK_QC, BLOCK, False),
    "channel": (CHANNEL_QC, None, False),
    "tensor": (STATIC_QC, None, True),
}


@pytest.fixture(scope="module")
def checkpoint(wide, tmp_path_factory):
    """form -> (the FP8 checkpoint of `wide` in that form, the run of its dequantized twin),
    each written and run once per module."""
    made: dict[str, tuple[Path, tuple]] = {}

    def get(form: str) -> tuple[Path, tuple]:
        if form not in made:
            qc, block, per_tensor = FORMS[form]
            folder = tmp_path_factory.mktemp(form)
            _write_fp8_checkpoint(wide, folder, qc, block, per_tensor)
            made[form] = (folder, _run(folder / "ref"))
        return made[form]

    return get


@pytest.mark.parametrize(
    ("form", "path", "max_diff"),
    [
        # the published 128 x 128 block form; CPU: the dequantize path, the same bf16 weights
        # as the reference, so the same logits [measured max 0.0]
        ("block", "dequant", 1e-3),
        # per channel, activations per token through scaled_mm [measured max 0.068, mean 0.013]
        ("channel", CPU_CHANNEL, 0.15),
        # per tensor, a static scheme (input_scale not read) [measured max 0.071, mean 0.014]
        ("tensor", CPU_CHANNEL, 0.15),
    ],
)
def test_fp8_checkpoint_matches_its_dequantized_weights(checkpoint, form, path, max_diff):
    folder, (lp_ref, greedy_ref, _) = checkpoint(form)
    # dtype auto: the config's bfloat16; on a CPU only quantization fp8 keeps them FP8
    lp, greedy, fp8 = _run(folder, quantization="fp8")
    assert len(fp8) == 8 and {(w.origin, w.path) for w in fp8} == {("checkpoint", path)}
    want = {BLOCK} if form == "block" else {(1, 256), (1, 384)}
    assert {w.group for w in fp8} == want
    diff = (lp - lp_ref).abs()
    print(
        f"{form} checkpoint vs dequantized: max {float(diff.max()):.4f} mean {float(diff.mean()):.5f}"
    )
    assert float(diff.max()) < max_diff, (form, float(diff.max()), float(diff.mean()))
    print(f"{form}: greedy {greedy} vs dequantized {greedy_ref}")
    if path == "dequant":
        assert greedy == greedy_ref


def test_block_checkpoint_with_shards_off_the_blocks(tiny, tmp_path):
    """k and v of 16 rows, gate and up of 96: the merged weights' block scales go per row
    (groups of 1 x 128, here 1 x in as in is 64: the channel form, scaled_mm on the CPU)."""
    folder = _write_fp8_checkpoint(tiny, tmp_path / "b", BLOCK_QC, BLOCK)
    lp, _, fp8 = _run(folder, quantization="fp8")
    lp_ref, _, _ = _run(folder / "ref")
    assert len(fp8) == 12
    qkv = fp8[0]
    assert qkv.group == (1, 64) and tuple(qkv.scale.shape) == (96, 1)
    # [measured max 0.018]
    diff = float((lp - lp_ref).abs().max())
    print(f"block checkpoint off the blocks vs dequantized: max {diff:.4f}")
    assert diff < 0.15


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_fp8_checkpoint_dequantized_by_none_and_by_auto_on_a_cpu(checkpoint, quantization):
    """none dequantizes anywhere; auto on a CPU too (FP8 matmuls are ~30x slower there)."""
    folder, (lp_ref, _, _) = checkpoint("block")
    lp, _, fp8 = _run(folder, quantization=quantization)
    assert not fp8 and float((lp - lp_ref).abs().max()) < 1e-3


def test_dummy_weights_take_the_checkpoint_form(wide, checkpoint):
    """load_format dummy: quantization fp8 gives per-channel weights; an FP8 config.json's
    block form gives blocks (what a benchmark of that checkpoint should read)."""
    for path, kwargs, form in [
        (wide, {"quantization": "fp8", "dtype": "bfloat16"}, "channel"),
        (checkpoint("block")[0], {"quantization": "fp8"}, "block"),
    ]:
        engine = make_engine(
            path, load_format="dummy", max_total_tokens=256, device="cpu", **kwargs
        )
        fp8 = [m for m in engine.runner.model.modules() if isinstance(m, FP8Weight)]
        assert len(fp8) == 8 and {w.form for w in fp8} == {form}
        assert len(_greedy(engine, 4)) == 4
        engine.shutdown()


# -- refusals ----------------------------------------------------------------------------------


def test_refusals(tiny, tmp_path):
    from weft.runtime.loaders.source import gguf_quantized

    with pytest.raises(ValueError, match="quantization 'fp8' quantizes an HF safetensors folder"):
        gguf_quantized(EngineConfig(quantization="fp8", device="cpu"), BF16)
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        fp8_checkpoint({"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="fmt 'e5m2'"):
        fp8_checkpoint({"quant_method": "fp8", "fmt": "e5m2"})
    int8 = json.loads(json.dumps(CHANNEL_QC))
    int8["config_groups"]["group_0"]["weights"].update(type="int")
    with pytest.raises(ValueError, match="weights 8-bit int by channel"):
        fp8_checkpoint(int8)
    with pytest.raises(ValueError, match="format 'pack-quantized'"):
        fp8_checkpoint({**CHANNEL_QC, "format": "pack-quantized"})
    # through config.json: the message names the file and the field
    config = json.loads((tiny / "config.json").read_text())
    with pytest.raises(ValueError, match=r"config\.json: invalid value.*quant_method 'awq'"):
        ModelConfig.from_dict({**config, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="quantization 'fp8': FP8 weights compute with bfloat16"):
        make_engine(tiny, quantization="fp8", dtype="float32", device="cpu")
    folder = _write_fp8_checkpoint(tiny, tmp_path / "b", BLOCK_QC, BLOCK)
    with pytest.raises(ValueError, match=r"the fp8 checkpoint: .* dtype is float32"):
        make_engine(folder, dtype="float32", quantization="fp8", device="cpu")
    # an e4m3 weight without its scale, and e4m3 tensors under a config that names no scheme
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight_scale_inv"]
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj: it has only"):
        make_engine(broken, device="cpu")
    (broken / "config.json").write_text((folder / "ref" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"an FP8 tensor, but config\.json has no quantization"):
        make_engine(broken, device="cpu")
    # a v_proj of 8 rows where the model has 16: the merged weight names its shards
    tensors = load_file(folder / "model.safetensors")
    v = "model.layers.0.self_attn.v_proj"
    tensors[f"{v}.weight"] = tensors[f"{v}.weight"][:8].contiguous()
    short = tmp_path / "short"
    shutil.copytree(folder, short)
    save_file(tensors, str(short / "model.safetensors"))
    with pytest.raises(ValueError, match=r"q_proj \+ .*k_proj \+ .*v_proj is \[88, 64\]"):
        make_engine(short, device="cpu", quantization="fp8")


def test_fp8_expert_weights_are_refused(tmp_path):
    src = tmp_path / "moe"
    save_random_model("qwen3-moe-4x3-tied", src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = BLOCK_QC
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FP8 expert weights are not supported"):
        make_engine(src, dtype="bfloat16", device="cpu")


# -- CUDA: the paths the CPU cannot run ----------------------------------------------------------

cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("block", [None, BLOCK])
@pytest.mark.parametrize("rows", [1, 2, 16, 200])
def test_cuda_paths(block, rows):
    """sm89+: channel -> scaled_mm, block -> the Triton matmul, one row -> the GEMV, a decode
    batch -> the weight-only split-K matmul; each vs the bf16 matmul of the dequantized weight."""
    torch.manual_seed(0)
    w = torch.randn(4096, 1024, device="cuda") * 0.02
    weight = _fp8(w, block)
    if torch.cuda.get_device_capability() >= (8, 9):
        assert weight.path == ("scaled_mm" if block is None else "triton"), weight.why
        assert weight.gemv and weight.rows
    x = torch.randn(rows, 1024, device="cuda").to(BF16)
    bias = torch.randn(4096, device="cuda").to(BF16)
    got = weight.matmul(x, bias)
    dense = x.float() @ weight.dense().float().t() + bias.float()
    # the GEMV and the split-K matmul read x in bf16 (output rounding only); the others
    # quantize x to e4m3
    weight_only = FP8_GEMV_ONE_ROW if rows == 1 else rows <= FP8_ROWS_MAX_ROWS
    tol = 0.01 if weight_only else 0.04
    assert _rel(got, dense) < tol
    torch.cuda.synchronize()


@cuda
@pytest.mark.parametrize("block", [None, BLOCK])
@pytest.mark.parametrize("rows", [1, 8])
def test_cuda_graph_captures_an_fp8_linear(block, rows):
    torch.manual_seed(0)
    layer = ColumnLinear(1024, [1024, 256, 256], bias=False, dtype=BF16).cuda()
    layer.weight.data.normal_(0, 0.02)
    layer.quantize_fp8(block)
    x = torch.randn(rows, 1024, device="cuda").to(BF16)
    eager = layer(x)  # NOTE: compiles the Triton kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, layer(x)) < 1e-3  # the replay computed the new x, as eager does
    assert _rel(out, eager) > 0.1


def _worst_gap(folder: Path, greedy: list[int], **kwargs) -> float:
    """Teacher-forced along the greedy tokens of another engine: the largest gap, in nats,
    between this model's best token and the one taken (0 where they agree)."""
    engine = make_engine(folder, max_total_tokens=1024, **kwargs)
    lp = _prompt_logprobs(engine, PROMPT[:9] + greedy)  # row r: the token at r + 1
    engine.shutdown()
    return max(float(lp[8 + i].max() - lp[8 + i][t]) for i, t in enumerate(greedy))


@cuda
def test_engine_on_cuda(wide, checkpoint):
    """The whole engine on CUDA (decode from CUDA graphs): quantization fp8 (scaled_mm; the
    GEMV at batch 1, the split-K matmul on the 9-token prefill) vs bf16, and the published block
    form (the Triton matmul) as loaded by auto vs its dequantized twin. Tolerances: the CPU's
    bounds (unmeasured on a GPU). Each greedy token of the FP8 model must be the reference's, or
    within those bounds of its best: this random model's near-ties flip under any rounding
    (measured on an H100: the fourth token, at a gap the check below prints)."""
    sm89 = torch.cuda.get_device_capability() >= (8, 9)
    lp_ref, greedy_ref, _ = _run(wide, device="cuda", dtype="bfloat16")
    lp, greedy, fp8 = _run(wide, device="cuda", dtype="bfloat16", quantization="fp8")
    assert len(fp8) == 8
    if sm89:
        assert {(w.path, w.gemv) for w in fp8} == {("scaled_mm", True)}
    diff = (lp - lp_ref).abs()
    gap = _worst_gap(wide, greedy, device="cuda", dtype="bfloat16")
    print(f"cuda fp8 vs bf16: max {float(diff.max()):.4f}, greedy {greedy} vs {greedy_ref}")
    print(f"worst gap of the fp8 greedy tokens under bf16: {gap:.4f}")
    assert float(diff.max()) < 0.15 and greedy[0] == greedy_ref[0] and gap < 0.15
    folder, _ = checkpoint("block")
    lp_ref, greedy_ref, _ = _run(folder / "ref", device="cuda")
    lp, greedy, fp8 = _run(folder, device="cuda")
    assert len(fp8) == 8 and {w.group for w in fp8} == {BLOCK}
    if sm89:
        assert {(w.path, w.gemv) for w in fp8} == {("triton", True)}
    diff = (lp - lp_ref).abs()
    gap = _worst_gap(folder / "ref", greedy, device="cuda")
    print(f"cuda block checkpoint vs dequantized: max {float(diff.max()):.4f}, gap {gap:.4f}")
    assert float(diff.max()) < 0.15 and greedy[0] == greedy_ref[0] and gap < 0.15
