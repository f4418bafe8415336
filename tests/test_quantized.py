"""GGUF weights kept quantized on the CPU (loaders/gguf_quant.py, models/layers.QuantWeight).

Kernel checks use real tensors from the embedded default model's Q4_K_M file (Q4_K, Q6_K, Q5_0,
Q8_0; Q4_0 and Q4_1 made from one of its weights by gguf-py's quantizer); the model checks load
it both ways and compare logits, greedy tokens and perplexity.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_gguf import IDS, SPM_VOCAB, hf_weights, tiny_llama, write_gguf

from weft.kernels import cpu_native
from weft.runtime.loaders import gguf_convert
from weft.runtime.loaders.gguf_convert import _Entry, _entry_data, _outputs, convert_gguf
from weft.runtime.models.layers import QUANT_MAX_ROWS, QuantRows, QuantWeight, quant_rows

from conftest import fixture_path, gguf_reader, make_engine, require_default_model

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.usefixtures("gguf_tokenizers_once")
# Max |x @ W_kernel^T - x @ W_gguf^T| / max |x @ W_gguf^T| over 4 rows of unit-normal x, measured
# on the tensors of CASES (in brackets). int4: only the bf16 rounding of scales, zeros, x and the
# output; int8: the per-row requantization on top.
TOLERANCE = {
    Q.Q4_K: 0.01,  # [0.0068]
    Q.Q4_0: 0.01,  # [0.0027]
    Q.Q4_1: 0.01,  # [0.0034]
    Q.Q6_K: 0.03,  # [0.0165]
    Q.Q5_0: 0.03,  # [0.0146]
    Q.Q8_0: 0.03,  # [0.0184]
}


@pytest.fixture(scope="module")
def vocab() -> Path:
    return fixture_path(*SPM_VOCAB)


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    require_default_model()
    from weft.runtime.loaders.default_model import default_cache_root, default_model_gguf

    return default_model_gguf(default_cache_root())


@pytest.fixture(scope="module")
def tensors(default_gguf) -> dict[str, object]:
    return {t.name: t for t in gguf_reader(default_gguf).tensors}


def _quant_weight(source: object, form: str) -> QuantWeight:
    entry = _Entry("w.weight", tuple(reversed(source.shape.tolist())), source, form=form)
    stored = list(_entry_data(entry, torch.bfloat16))
    parts = {
        name.split(".")[-1]: t
        for (name, _, _), t in zip(_outputs(entry, torch.bfloat16), stored, strict=True)
    }
    return QuantWeight(form, parts, torch.bfloat16)


class _Requantized:
    """A real weight put through gguf-py's quantizer as `qtype` (the file has no Q4_0 / Q4_1)."""

    def __init__(self, source: object, qtype: Q):
        rows = gguf.quants.dequantize(source.data, source.tensor_type)
        self.data = gguf.quants.quantize(rows, qtype)
        self.tensor_type = qtype
        self.shape = source.shape
        self.name = f"{source.name} as {qtype.name}"


CASES = [
    ("blk.2.ffn_down.weight", None, "int4"),  # Q4_K
    ("blk.0.ffn_down.weight", None, "int8"),  # Q6_K
    ("blk.0.ffn_gate.weight", None, "int8"),  # Q5_0
    ("blk.0.attn_v.weight", None, "int8"),  # Q8_0
    ("blk.0.attn_output.weight", Q.Q4_0, "int4"),
    ("blk.0.attn_output.weight", Q.Q4_1, "int4"),
]


@pytest.fixture(params=["weft", "torch"])
def kernels(request):
    """Whose products QuantWeights take: weft's CPU kernels (kernels/cpu_native.py) or torch's."""
    if request.param == "weft" and cpu_native.native() is None:
        pytest.skip(f"weft's CPU kernels do not run here: {cpu_native.why_not()}")
    cpu_native.use(request.param == "weft")
    yield request.param
    cpu_native.use(True)


@pytest.mark.parametrize(("name", "requantize", "form"), CASES)
def test_quantized_matmul_matches_the_gguf_weight(tensors, kernels, name, requantize, form):
    source = tensors[name]
    if requantize is not None:
        source = _Requantized(source, requantize)
    qtype = source.tensor_type
    reference = torch.from_numpy(gguf.quants.dequantize(source.data, qtype))  # [out, in] f32
    weight = _quant_weight(source, form)
    assert weight.kernel == kernels
    torch.manual_seed(0)
    x = torch.randn(QUANT_MAX_ROWS, reference.shape[1])
    expected = x @ reference.t()
    got = weight.matmul(x.to(torch.bfloat16), None).float()  # the quantized kernel
    err = float((got - expected).abs().max() / expected.abs().max())
    assert err < TOLERANCE[qtype], (name, qtype.name, err)
    # prefill rows go through the dense copy of the same values [at most 0.0061]
    dense = weight.matmul(torch.cat([x, x]).to(torch.bfloat16), None).float()[:QUANT_MAX_ROWS]
    assert float((dense - got).abs().max() / expected.abs().max()) < 0.01


def test_int4_groups_are_exact(tensors):
    """Q4_K's super-blocks become int4 groups of 32 without any loss (before bf16 rounding)."""
    from weft.runtime.loaders.gguf_quant import int4_groups

    source = tensors["blk.2.ffn_down.weight"]
    q, scale, zero = int4_groups(source.data, source.tensor_type)
    n = q.shape[0]
    w = (q.astype(np.float32) - 8).reshape(n, -1, 32) * scale[..., None] + zero[..., None]
    reference = gguf.quants.dequantize(source.data, source.tensor_type)
    assert np.array_equal(w.reshape(reference.shape), reference)


# -- the default model, both ways --------------------------------------------------------------

TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
    "        return self.items.pop()\n\n\nThe quick brown fox jumps over the lazy dog. A stack "
    "is a last-in, first-out collection: push adds an item on top, pop removes the top one.\n"
)


def _score(engine, ids: list[int]) -> tuple[list[float], list[int]]:
    out = engine.generate(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )
    logprobs = [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]
    greedy = engine.generate(
        input_ids=ids[:24],
        sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
    )
    return logprobs, list(greedy["output_ids"])


@pytest.fixture(scope="module")
def both_ways(default_gguf):
    results = {}
    for quantization in ("none", "gguf"):
        engine = make_engine(
            default_gguf, quantization=quantization, dtype="bfloat16", max_total_tokens=2048
        )
        quantized = [m for m in engine.runner.model.modules() if isinstance(m, QuantWeight)]
        ids = engine.tokenizer.encode(TEXT)
        results[quantization] = (len(quantized), *_score(engine, ids))
        engine.shutdown()
    return results


def test_default_model_quantized_vs_dequantized(both_ways):
    n_dense, lp_dense, greedy_dense = both_ways["none"]
    n_quant, lp_quant, greedy_quant = both_ways["gguf"]
    # 24 layers x (qkv, o, gate_up, down) + lm_head
    assert (n_dense, n_quant) == (0, 24 * 4 + 1)
    assert len(lp_dense) == len(lp_quant) > 100
    diffs = [abs(a - b) for a, b in zip(lp_dense, lp_quant, strict=True)]
    ppl_dense = math.exp(-sum(lp_dense) / len(lp_dense))
    ppl_quant = math.exp(-sum(lp_quant) / len(lp_quant))
    stats = (max(diffs), sum(diffs) / len(diffs), ppl_dense, ppl_quant)
    # per-position log-probabilities of the text's tokens: measured max 0.70, mean 0.071;
    # perplexity 3.6563 -> 3.6684 (+0.33 %), the lm_head requantized to int4 (_LM_HEAD_INT4)
    assert max(diffs) < 1.0 and sum(diffs) / len(diffs) < 0.1, stats
    assert greedy_quant == greedy_dense
    assert abs(ppl_quant / ppl_dense - 1) < 0.02, stats


# -- what the quantized form refuses -----------------------------------------------------------


def test_unsupported_type_names_the_tensor_and_type(tmp_path, caplog, vocab, monkeypatch):
    model = tiny_llama(32000, head_dim=None, scaling=None, tied=False)
    path = tmp_path / "iq4.gguf"

    def qtype(gname: str) -> Q:
        if gname == "blk.1.attn_output.weight":
            return Q.IQ4_NL
        return Q.F32 if "norm" in gname else Q.Q8_0

    quantize = gguf.quants.quantize

    def iq4_nl_as_zeros(arr: np.ndarray, qtype: Q) -> np.ndarray:  # gguf-py cannot write IQ4_NL
        if qtype != Q.IQ4_NL:
            return quantize(arr, qtype)
        return np.zeros((arr.shape[0], arr.shape[1] // 32 * 18), np.uint8)  # 18 bytes / 32

    monkeypatch.setattr(gguf.quants, "quantize", iq4_nl_as_zeros)
    write_gguf(path, model, qtype, vocab=vocab)
    with pytest.raises(ValueError, match=r"'blk\.1\.attn_output\.weight' is IQ4_NL"):
        convert_gguf(path, tmp_path / "cache", torch.bfloat16, quantized=True)
    # dequantized, the same file loads; quantization auto keeps that weight dense and says so
    assert convert_gguf(path, tmp_path / "cache", torch.bfloat16).is_dir()
    with caplog.at_level(logging.WARNING, logger="weft"):
        folder = convert_gguf(
            path, tmp_path / "cache", torch.bfloat16, quantized=True, fallback=True
        )
    assert "blk.1.attn_output.weight: IQ4_NL" in caplog.text
    names = set(hf_weights(folder))
    assert "model.layers.1.self_attn.o_proj.weight" in names
    assert "model.layers.0.self_attn.o_proj.qweight" in names


def test_tiny_llama_quantized_through_weft(tmp_path, vocab):
    """A llama file (q/k rows permuted by llama.cpp) with int4 and int8 weights: weft's greedy
    tokens equal those of the same file dequantized."""
    model = tiny_llama(32000, head_dim=None, scaling=None, tied=False)
    path = tmp_path / "mixed.gguf"

    def qtype(gname: str) -> Q:
        if "norm" in gname or gname == "token_embd.weight":
            return Q.F32
        return Q.Q4_0 if "attn" in gname else Q.Q8_0

    write_gguf(path, model, qtype, vocab=vocab)
    prompt = IDS[0].tolist()
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    outputs = {}
    for quantization in ("none", "gguf"):
        engine = make_engine(
            path,
            quantization=quantization,
            dtype="bfloat16",
            device="cpu",  # quantized weights are a CPU path; on CUDA 'gguf' is refused
            cache_dir=str(tmp_path / "c"),
        )
        outputs[quantization] = engine.generate(input_ids=prompt, sampling_params=params)
        engine.shutdown()
    assert outputs["gguf"]["output_ids"] == outputs["none"]["output_ids"]


def test_quantization_gguf_refuses_float32(monkeypatch):
    from weft.runtime.config import EngineConfig
    from weft.runtime.loaders import source
    from weft.runtime.loaders.source import gguf_quantized

    config = EngineConfig(quantization="gguf", device="cpu")
    with pytest.raises(ValueError, match="bfloat16"):
        gguf_quantized(config, torch.float32)
    monkeypatch.setattr(source, "cpu_bf16_flags", lambda: ["amx_bf16"])
    assert not gguf_quantized(config.replace(quantization="auto"), torch.float32)
    assert gguf_quantized(config.replace(quantization="auto"), torch.bfloat16)
    # without bf16 in hardware, auto quantizes where weft's own CPU kernels run (they widen
    # bf16 in registers), else keeps them dense (explicit gguf still quantizes)
    monkeypatch.setattr(source, "cpu_bf16_flags", lambda: [])
    monkeypatch.setattr(cpu_native, "native", lambda: None)
    assert not gguf_quantized(config.replace(quantization="auto"), torch.bfloat16)
    assert gguf_quantized(config, torch.bfloat16)
    monkeypatch.setattr(cpu_native, "native", lambda: object())
    assert gguf_quantized(config.replace(quantization="auto"), torch.bfloat16)
    torch_kernels = config.replace(quantization="auto", cpu_kernels="torch")
    assert not gguf_quantized(torch_kernels, torch.bfloat16)


def test_shard_bytes_cover_quantized_outputs(monkeypatch, tensors):
    """The writer's byte count per entry is what _entry_data yields (the safetensors header)."""
    source = tensors["blk.2.ffn_down.weight"]
    entry = _Entry("w.weight", tuple(reversed(source.shape.tolist())), source, form="int4")
    written = sum(t.numel() * t.element_size() for t in _entry_data(entry, torch.bfloat16))
    assert written == gguf_convert._nbytes(entry, torch.bfloat16)


def test_decode_rows_get_the_bits_of_a_row_alone(tensors):
    """With weft's CPU kernels, a decode or verify step's rows (QuantRows) are multiplied as each
    row alone would be, whatever their count; other steps' rows go through the dense copy."""
    if cpu_native.native() is None:
        pytest.skip(f"weft's CPU kernels do not run here: {cpu_native.why_not()}")
    weight = _quant_weight(tensors["blk.0.ffn_gate.weight"], "int8")
    x = torch.randn(9, weight.in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    alone = torch.cat([weight.matmul(x[i : i + 1], None) for i in range(9)])
    dense = weight.matmul(x, None)  # no choice made: 9 rows take the dense copy
    assert not torch.equal(dense, alone)
    with quant_rows(QuantRows(9)):
        assert torch.equal(weight.matmul(x, None), alone)
    rows = torch.tensor([2, 5, 6])
    others = torch.tensor([0, 1, 3, 4, 7, 8])
    with quant_rows(QuantRows(9, rows)):
        mixed = weight.matmul(x, None)
    assert torch.equal(mixed[rows], alone[rows]) and torch.equal(mixed[others], dense[others])
    with quant_rows(QuantRows(10)):  # another row count than the step's: not its rows
        assert torch.equal(weight.matmul(x, None), dense)
    # prompt tokens take the dense copy however few: a prompt's last token computes alike in a
    # step of its own and beside a long prefill, wherever it sits in the product
    prompt = QuantRows(1, torch.tensor([], dtype=torch.long))
    for i in range(9):
        with quant_rows(prompt):
            assert torch.equal(weight.matmul(x[i : i + 1], None)[0], dense[i])
        assert torch.equal(weight._prompt(x[i:], None)[0], dense[i])
    assert torch.equal(weight.matmul(x[:1], None), alone[:1])  # undescribed: few rows quantized


@pytest.mark.parametrize(
    ("name", "form"), [("blk.0.ffn_gate.weight", "int8"), ("blk.2.ffn_down.weight", "int4")]
)
def test_without_the_copy_prompt_rows_take_the_float32_product(tensors, name, form):
    """With the bf16 copy dropped (quantized_prefill), a step's prompt rows are weft's float32
    product of the quantized weight, the same bits alone or among others; its decode rows keep
    the int16 kernels' bits."""
    if cpu_native.native() is None:
        pytest.skip(f"weft's CPU kernels do not run here: {cpu_native.why_not()}")
    weight = _quant_weight(tensors[name], form)
    dense = weight.dense
    assert dense is not None
    weight.drop_dense()
    x = torch.randn(9, weight.in_features, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    alone = torch.cat([weight.matmul(x[i : i + 1], None) for i in range(9)])  # decode rows
    prompt = weight.matmul(x, None)  # 9 rows, undescribed: a prompt's
    expected = x.float() @ dense.float().t()
    assert (prompt.float() - expected).abs().max() <= expected.abs().max() * 2**-7
    assert not torch.equal(prompt, alone)
    rows = torch.tensor([1, 4])
    with quant_rows(QuantRows(9, rows)):
        mixed = weight.matmul(x, None)
    others = torch.tensor([0, 2, 3, 5, 6, 7, 8])
    assert torch.equal(mixed[rows], alone[rows]) and torch.equal(mixed[others], prompt[others])
    with quant_rows(QuantRows(1, torch.tensor([], dtype=torch.long))):
        assert torch.equal(weight.matmul(x[3:4], None)[0], prompt[3])


def test_decode_rows_of_a_step():
    """The model runner's choice: the tokens of requests that add output tokens only."""
    from types import SimpleNamespace

    from weft.runtime.model_runner import ModelRunner

    runner = SimpleNamespace(row_invariant=True)

    def rows(lens: list[int], output_only: list[bool]) -> object:
        batch = SimpleNamespace(
            extend_lens_cpu=lens, output_only_cpu=output_only, input_ids=torch.zeros(sum(lens))
        )
        return ModelRunner._decode_rows(runner, batch)  # type: ignore[arg-type]

    assert rows([1, 9, 1], [True] * 3) == QuantRows(11)
    prompts = rows([3, 30], [False, False])  # a select's choices among them
    assert prompts.total == 33 and prompts.rows.tolist() == []
    mixed = rows([1, 30, 3], [True, False, True])
    assert mixed.total == 34 and mixed.rows.tolist() == [0, 31, 32, 33]
    assert rows([1, 1], []) is None  # a batch that does not say
    runner.row_invariant = False  # torch's kernels: the step's row count decides
    assert rows([1, 9, 1], [True] * 3) is None
