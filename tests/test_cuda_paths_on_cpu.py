"""The decisions of the CUDA-only branches, run on the CPU (where CI runs): device, dtype and
attention backend, whether and up to which batch size decode steps run from CUDA graphs, the
graphs' padding and replay bookkeeping, the KV pool's size from GPU memory, the split host mirror
of req_to_token, and the scheduler's CUDA defaults.

CUDA graphs are stood in for by `_EagerGraph`: a replay reruns the model on the runner's static
buffers, which is what a captured graph computes; the bookkeeping around it is the product's.
NOTE: modules that import weft.kernels (Triton) are imported inside the tests: the kernel tests
set TRITON_INTERPRET before their first import (tests/test_kernels/conftest.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from weft.runtime.attention import TorchAttention
from weft.runtime.config import EngineConfig
from weft.runtime.core import ForwardBatch
from weft.runtime.cuda_graph import CudaGraphRunner
from weft.runtime.kv_pool import KVPool, ReqToTokenPool
from weft.runtime.model_config import ModelConfig
from weft.runtime.model_runner import (
    gpu_pool_tokens,
    graph_max_bs,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)

from conftest import make_engine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GIB = 2**30


def _model_config(torch_dtype: str | None) -> ModelConfig:
    return SimpleNamespace(torch_dtype=torch_dtype)  # type: ignore[return-value]


# ---- device, dtype, attention backend ------------------------------------------------------


def test_device_choice(monkeypatch):
    with pytest.raises(ValueError, match="device must be cpu, cuda"):
        EngineConfig(device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(EngineConfig(device="auto")) == CPU
    assert resolve_device(EngineConfig(device="cpu")) == CPU
    with pytest.raises(ValueError, match="'cuda:1' requested but CUDA is not available"):
        resolve_device(EngineConfig(device="cuda:1"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(EngineConfig(device="auto")) == CUDA
    assert resolve_device(EngineConfig(device="cuda:1")) == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("stored", "device", "want"),
    [
        ("float16", CUDA, torch.float16),
        ("float16", CPU, torch.bfloat16),  # fp16 matmuls are slow on CPUs
        ("bfloat16", CUDA, torch.bfloat16),
        ("float32", CUDA, torch.float32),
        (None, CUDA, torch.bfloat16),
        ("float64", CPU, torch.bfloat16),
    ],
)
def test_auto_dtype(stored, device, want):
    assert resolve_dtype(EngineConfig(), _model_config(stored), device) == want
    # an explicit dtype wins on every device
    assert resolve_dtype(EngineConfig(dtype="float16"), _model_config(stored), CPU) is torch.float16


def test_attention_backend_choice(monkeypatch):
    import weft.runtime.model_runner as model_runner

    monkeypatch.setattr(model_runner, "_has_triton", lambda: True)
    assert resolve_attention_backend("auto", CUDA) == "triton"
    assert resolve_attention_backend("auto", CPU) == "torch"
    assert resolve_attention_backend("torch", CUDA) == "torch"
    assert resolve_attention_backend("triton", CUDA) == "triton"
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        resolve_attention_backend("triton", CPU)
    monkeypatch.setattr(model_runner, "_has_triton", lambda: False)
    assert resolve_attention_backend("auto", CUDA) == "torch"


# ---- CUDA graphs: whether, which sizes, padding, replay ------------------------------------


def _pools(max_requests: int = 4, context: int = 64) -> tuple[KVPool, ReqToTokenPool]:
    return KVPool(128, 1, 1, 4, torch.float32, CPU), ReqToTokenPool(max_requests, context, CPU)


def test_graph_batch_sizes_and_when_graphs_are_used():
    from weft.runtime.triton_attention import TritonAttention

    triton = TritonAttention(*_pools())
    torch_attention = TorchAttention(*_pools())
    config = EngineConfig()
    assert graph_max_bs(config, CUDA, triton) == 256
    assert graph_max_bs(EngineConfig(max_running_requests=300), CUDA, triton) == 256
    assert graph_max_bs(EngineConfig(cuda_graph_max_bs=8), CUDA, triton) == 8
    assert graph_max_bs(EngineConfig(max_running_requests=3), CUDA, triton) == 3
    small = EngineConfig(cuda_graph_max_bs=64, max_running_requests=16)
    assert graph_max_bs(small, CUDA, triton) == 16
    big = EngineConfig(cuda_graph_max_bs=512, max_running_requests=1024)
    assert graph_max_bs(big, CUDA, triton) == 512
    # no graphs: disabled, off CUDA, or the torch backend (its decode gathers [B, context])
    assert graph_max_bs(EngineConfig(disable_cuda_graph=True), CUDA, triton) is None
    assert graph_max_bs(config, CPU, triton) is None
    assert graph_max_bs(config, CUDA, torch_attention) is None


def _decode_batch(
    rows: list[int], seq_lens: list[int], extend_lens: list[int] | None = None
) -> ForwardBatch:
    """A batch whose fields are told apart by value: ids 100 + i, slots 50 + i."""
    n = len(rows)
    ext = extend_lens or [1] * n
    tokens = sum(ext)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return ForwardBatch(
        input_ids=t([100 + i for i in range(tokens)]),
        positions=t([s - 1 for s in seq_lens]) if tokens == n else t(list(range(tokens))),
        out_cache_loc=t([50 + i for i in range(tokens)]),
        req_pool_indices=t(rows),
        seq_lens=t(seq_lens),
        prefix_lens=t([s - e for s, e in zip(seq_lens, ext, strict=True)]),
        extend_lens=t(ext),
        logits_indices=torch.arange(n),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=[s - e for s, e in zip(seq_lens, ext, strict=True)],
        extend_lens_cpu=ext,
    )


class _Recorder(nn.Module):
    """A model that records the static batch it runs on; its hidden row is [id, slot, row, len]."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, list[int]]] = []

    def forward(self, batch: ForwardBatch, attn: object) -> torch.Tensor:
        self.seen.append(
            {
                "ids": batch.input_ids.tolist(),
                "positions": batch.positions.tolist(),
                "loc": batch.out_cache_loc.tolist(),
                "rows": batch.req_pool_indices.tolist(),
                "lens": batch.seq_lens.tolist(),
                "seq_lens_cpu": list(batch.seq_lens_cpu),
                "logits_indices": batch.logits_indices.tolist(),
            }
        )
        fields = (batch.input_ids, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens)
        return torch.stack(fields, dim=1).float()


class _EagerGraph:
    """A captured graph's stand-in: a replay reruns the model on the runner's static buffers and
    writes its output where the capture left it (what replaying a CUDA graph amounts to)."""

    def __init__(self, graphs: CudaGraphRunner, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        g = self.graphs
        g._outputs[self.bs].copy_(g.model(g._static_batch(self.bs), g.attention))


def _capture_on_cpu(graphs: CudaGraphRunner) -> CudaGraphRunner:
    """`capture` without CUDA: one eager run per size (largest first) gives the static output."""
    with torch.inference_mode():
        for bs in reversed(graphs.sizes):
            graphs._outputs[bs] = graphs.model(graphs._static_batch(bs), graphs.attention)
            graphs._graphs[bs] = _EagerGraph(graphs, bs)  # type: ignore[assignment]
    return graphs


def test_padded_size_and_can_run():
    kv, table = _pools()
    graphs = CudaGraphRunner(_Recorder(), TorchAttention(kv, table), 20, 64, kv.scratch_slot, CPU)
    assert graphs.sizes == [1, 2, 4, 8, 16, 20] and graphs.max_bs == 20
    want = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 20, 20: 20}
    assert {bs: graphs.padded_size(bs) for bs in want} == want
    assert graphs.can_run(_decode_batch([0] * 20, [5] * 20))
    assert graphs.can_run(_decode_batch([1], [1]))
    assert not graphs.can_run(_decode_batch([0] * 21, [5] * 21))  # past the largest graph
    assert not graphs.can_run(_decode_batch([1, 2], [4, 9], [1, 3]))  # an extend step
    # max_bs not on the 8-grid is captured as itself
    assert CudaGraphRunner(_Recorder(), None, 6, 64, 0, CPU).sizes == [1, 2, 4, 6]  # type: ignore[arg-type]


def test_replay_pads_to_the_next_size_and_resets_stale_rows():
    """A batch is copied into the first rows of the static buffers; the rows up to the graph's
    size point at row 0, length 1 and the scratch slot, also where a larger batch left its
    values (a stale slot there would be overwritten with padding K/V)."""
    kv, table = _pools()
    scratch = kv.scratch_slot
    model = _Recorder()
    graphs = _capture_on_cpu(CudaGraphRunner(model, TorchAttention(kv, table), 8, 64, scratch, CPU))
    capture_runs = len(model.seen)
    assert [r["loc"] for r in model.seen] == [[scratch] * bs for bs in (8, 4, 2, 1)]
    assert all(r["seq_lens_cpu"] == [64] * len(r["loc"]) for r in model.seen)  # the context

    big = _decode_batch([3, 1, 2, 0, 3, 1, 2, 0], [7, 8, 9, 10, 11, 12, 13, 14])
    out = graphs.replay(big)
    assert model.seen[-1]["loc"] == [50 + i for i in range(8)]  # no padding: all of them
    assert out.tolist() == [
        [100 + i, 50 + i, r, s]
        for i, (r, s) in enumerate(
            zip([3, 1, 2, 0, 3, 1, 2, 0], [7, 8, 9, 10, 11, 12, 13, 14], strict=True)
        )
    ]

    small = _decode_batch([2, 3, 1], [20, 21, 22])
    out = graphs.replay(small)  # the graph of 4: one padded row, over the 8-batch's row 3
    seen = model.seen[-1]
    assert seen["ids"][:3] == [100, 101, 102]
    assert seen["positions"][:3] == [19, 20, 21]
    assert seen["loc"] == [50, 51, 52, scratch]
    assert seen["rows"] == [2, 3, 1, 0]
    assert seen["lens"] == [20, 21, 22, 1]
    assert seen["logits_indices"] == [0, 1, 2, 3]
    assert out.shape == (3, 4) and out[:, 1].tolist() == [50, 51, 52]

    single = _decode_batch([1], [30])
    out = graphs.replay(single)  # the graph of 1: no padding
    assert model.seen[-1]["loc"] == [50] and model.seen[-1]["rows"] == [1]
    assert out.tolist() == [[100, 50, 1, 30]]
    assert graphs.num_replays == 3 and len(model.seen) == capture_runs + 3


# ---- CUDA graphs in the engine, against eager steps ----------------------------------------

PROMPTS = [
    "Once upon a time",
    "The cat",
    "Lily had a big red ball and she",
    "One day",
    "Tom and his dog went to the park to play. They",
]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def eager_engine(stories_dir):
    return make_engine(stories_dir, device="cpu", max_total_tokens=2048)


@pytest.fixture(scope="module")
def graph_engine(stories_dir):
    """A CPU engine whose decode steps replay 'graphs' of sizes 1, 2, 4 (see `_EagerGraph`).
    No prefix cache: a fully cached prompt's prefill (one token) would be a replay too."""
    engine = make_engine(stories_dir, device="cpu", max_total_tokens=2048, disable_radix_cache=True)
    r = engine.runner
    assert r.graphs is None  # never captured off CUDA
    r.graphs = _capture_on_cpu(
        CudaGraphRunner(r.model, r.attention, 4, r.context_length, r.kv_pool.scratch_slot, r.device)
    )
    return engine


def test_golden_greedy_output_from_graph_replays(graph_engine, stories_dir):
    golden = json.loads((stories_dir / "GOLDEN.json").read_text())["greedy_ids_including_prompt"]
    before = graph_engine.runner.graphs.num_replays
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    out = graph_engine.generate(input_ids=golden[:1], sampling_params=params)
    assert out["output_ids"] == golden[1:25]
    # every step: the 1-token prompt's prefill is decode-shaped too
    assert graph_engine.runner.graphs.num_replays - before == 24


@pytest.mark.parametrize("sizes", [[4, 3], [1, 5]], ids=["shrinking", "past-the-largest"])
def test_padded_replays_equal_eager_steps(graph_engine, eager_engine, sizes):
    """A smaller batch after a larger one replays with stale rows past its size: they must not
    write into live KV; 5 rows exceed the largest graph (4) and run eagerly."""
    graphs = graph_engine.runner.graphs
    for n in sizes:
        before = graphs.num_replays
        got = graph_engine.generate(PROMPTS[:n], GREEDY, return_logprob=True)
        want = eager_engine.generate(PROMPTS[:n], GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        for g, w in zip(got, want, strict=True):
            g_lp = [t[0] for t in g["meta_info"]["output_token_logprobs"]]
            w_lp = [t[0] for t in w["meta_info"]["output_token_logprobs"]]
            assert g_lp == pytest.approx(w_lp, abs=1e-4)
        replayed = graphs.num_replays - before
        assert replayed == (0 if n > graphs.max_bs else GREEDY["max_new_tokens"] - 1), replayed
    pool = graph_engine.runner.kv_pool
    assert not pool.k_buffers[0][0].any() and not pool.v_buffers[0][0].any()  # slot 0 untouched


# ---- the KV pool's size from GPU memory ----------------------------------------------------


def test_gpu_pool_tokens():
    per_token = 2 * 24 * 8 * 128 * 2  # 24 layers, 8 KV heads, head_dim 128, bf16: 96 KiB
    # 80 GiB GPU, 70 GiB free after the weights, keep 10% of the whole GPU back: 62 GiB of KV
    assert gpu_pool_tokens(70 * GIB, 80 * GIB, 0.9, per_token, 8192) == 62 * GIB // per_token
    assert gpu_pool_tokens(70 * GIB, 80 * GIB, 1.0, per_token, 8192) == 70 * GIB // per_token
    # the budget must exceed one full-context request (a quarter of 80 GiB kept back)
    exact = per_token * 8192 + 20 * GIB
    with pytest.raises(ValueError, match="not enough GPU memory for the KV cache"):
        gpu_pool_tokens(exact, 80 * GIB, 0.75, per_token, 8192)
    assert gpu_pool_tokens(exact + per_token, 80 * GIB, 0.75, per_token, 8192) == 8193
    with pytest.raises(ValueError, match="raise mem_fraction_static"):
        gpu_pool_tokens(10 * GIB, 80 * GIB, 0.75, per_token, 8192)  # less free than kept back


# ---- req_to_token's host mirror (separate from the device table on CUDA only) --------------


class _MirroredTable(ReqToTokenPool):
    """req_to_token as on CUDA: the device table and the host mirror are separate tensors (on a
    CPU they are one), so a write that reaches only one of them shows."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        super().__init__(max_requests, max_context, device)
        self._host = torch.zeros_like(self.req_to_token)


def test_split_host_mirror_matches_the_device_table(monkeypatch, stories_dir, eager_engine):
    """Chunked prefills, prefix-cache hits and decodes with the mirror split as on CUDA: the same
    tokens as the one-table engine, and the two tables equal at the end."""
    import weft.runtime.model_runner as model_runner

    monkeypatch.setattr(model_runner, "ReqToTokenPool", _MirroredTable)
    engine = make_engine(stories_dir, device="cpu", max_total_tokens=2048, chunked_prefill_size=16)
    try:
        table = engine.runner.req_to_token
        assert isinstance(table, _MirroredTable) and table._host is not table.req_to_token
        shared = "Once upon a time, there was a little girl named Lily. She liked to"
        prompts = [shared + " play", shared + " run", "The cat", shared + " sing"]
        for batch in ([prompts[0]], prompts[1:]):  # the second batch hits the cached prefix
            got = engine.generate(batch, GREEDY)
            want = eager_engine.generate(batch, GREEDY)
            assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert got[0]["meta_info"]["cached_tokens"] > 0
        assert table.req_to_token.any()
        assert torch.equal(table._host, table.req_to_token)
    finally:
        engine.shutdown()


# ---- the scheduler's CUDA defaults ---------------------------------------------------------


def test_overlap_schedule_by_device():
    from weft.runtime.scheduler import overlap_schedule

    assert overlap_schedule(EngineConfig(), CUDA)
    assert not overlap_schedule(EngineConfig(disable_overlap_schedule=True), CUDA)
    assert not overlap_schedule(EngineConfig(), CPU)
    assert overlap_schedule(EngineConfig(enable_overlap_schedule=True), CPU)
    assert overlap_schedule(EngineConfig(enable_overlap_schedule=True), CUDA)


@pytest.mark.parametrize(("total", "want"), [(80 * GIB, 8192), (35 * GIB, 8192), (24 * GIB, 2048)])
def test_default_chunk_size_reads_the_gpu_memory(monkeypatch, total, want):
    from weft.runtime.scheduler import default_chunk_size

    asked: list[torch.device] = []

    def properties(device):
        asked.append(device)
        return SimpleNamespace(total_memory=total)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert default_chunk_size(torch.device("cuda", 1)) == want
    assert asked == [torch.device("cuda", 1)]
    assert default_chunk_size(CPU) == 2048 and len(asked) == 1
