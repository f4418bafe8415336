"""weft's C attention for output tokens on a CPU (csrc/attention.c, NativeCPU.attention, the
TorchAttention rows it takes): it matches SDPA over the same keys in both vector paths this CPU
runs, with grouped heads (1, 7 and more than 8 query heads a KV head), head sizes that are not a
multiple of the vector width, sliding windows and soft-capping; and a row gets the same bits
whatever comes with it: alone, among a request's drafts, in a batch, on 1 or 2 threads, and in
TorchAttention's decode and verify steps."""

from __future__ import annotations

import shutil

import pytest
import torch

from weft.kernels import cpu_native
from weft.kernels.cpu_native import RowSlots
from weft.runtime.attention import AttentionOptions, TorchAttention
from weft.runtime.core import ForwardBatch
from weft.runtime.hardware import cpu_flags
from weft.runtime.kv_pool import KVPool, ReqToTokenPool

pytestmark = pytest.mark.skipif(
    not {"avx2", "fma"} <= cpu_flags()
    or (shutil.which("cc") is None and shutil.which("gcc") is None),
    reason="weft's CPU kernels need AVX2 + FMA and a C compiler",
)
CPU = torch.device("cpu")


def _paths() -> list[tuple[str, ...]]:
    """AVX2 everywhere it runs, plus AVX-512 where the CPU has it."""
    return [("-mno-avx512f",), *([()] if "avx512f" in cpu_flags() else [])]


@pytest.fixture(scope="module", params=_paths(), ids=lambda flags: "avx2" if flags else "native")
def lib(request) -> cpu_native.NativeCPU:
    return cpu_native.build(request.param)


def _pool(lens: list[int], hkv: int, dim: int, dtype: torch.dtype, seed: int):
    """k, v [S, Hkv, D] of random values over shuffled slots, and the table rows of requests of
    `lens` tokens (row i + 1: rows need not start at 0)."""
    g = torch.Generator().manual_seed(seed)
    size = sum(lens) + 3
    k = torch.randn(size, hkv, dim, generator=g).to(dtype)
    v = torch.randn(size, hkv, dim, generator=g).to(dtype)
    table = torch.zeros(len(lens) + 1, max(lens) + 2, dtype=torch.int64)
    perm, used = torch.randperm(size, generator=g), 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[used : used + n]
        used += n
    return k, v, table


def _reference(q, k, v, table, row, lo, n, scale, cap):
    """SDPA (or soft-capped scores in torch ops) in float64 over the row's keys lo .. n - 1."""
    slots = table[row, lo:n]
    keys = k[slots].double().transpose(0, 1)  # [Hkv, L, D]
    values = v[slots].double().transpose(0, 1)
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = (q.double()[:, None] @ keys.transpose(-1, -2)) * scale  # [Hq, 1, L]
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    return (scores.softmax(-1) @ values)[:, 0]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(
    ("hq", "hkv", "dim"),
    [(14, 2, 64), (4, 4, 8), (18, 1, 24), (8, 2, 256)],
    ids=["qwen", "mha-d8", "g18-d24", "d256"],
)
@pytest.mark.parametrize(
    ("window", "cap", "scale"), [(None, None, None), (5, None, None), (None, 3.0, 0.2)]
)
def test_it_matches_attention_over_the_same_keys(lib, kv_dtype, hq, hkv, dim, window, cap, scale):
    lens = [1, 9, 16, 17, 40]  # a part block, whole blocks (8 / 16 lanes), and past them
    k, v, table = _pool(lens, hkv, dim, kv_dtype, seed=hq * dim)
    q = torch.randn(len(lens), hq, dim, generator=torch.Generator().manual_seed(dim))
    q = q.to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    lo = (lens_t - window).clamp(min=0).to(torch.int32) if window else torch.zeros_like(lens_t)
    rows = torch.arange(1, len(lens) + 1)
    scale = scale or dim**-0.5
    out = lib.attention(q, k, v, RowSlots(table, rows, lo, lens_t), scale=scale, logit_cap=cap)
    assert out.dtype == torch.float32 and out.shape == (len(lens), hq, dim)
    for t, n in enumerate(lens):
        expected = _reference(q[t], k, v, table, t + 1, int(lo[t]), n, scale, cap)
        torch.testing.assert_close(out[t].double(), expected, rtol=1e-5, atol=2e-6)


def test_a_row_gets_the_same_bits_whatever_comes_with_it(lib):
    """A request's 6 rows (a verify step's: positions 30 .. 35) in one call, one at a time,
    and shuffled among another request's rows, on 2 threads and on 1: the same bits."""
    hq, hkv, dim = 14, 2, 64
    k, v, table = _pool([36, 50], hkv, dim, torch.bfloat16, seed=7)
    q = torch.randn(6 + 3, hq, dim).to(torch.bfloat16)
    rows = torch.tensor([1] * 6 + [2] * 3)
    lens = torch.tensor([31, 32, 33, 34, 35, 36, 20, 48, 50], dtype=torch.int32)
    zeros = torch.zeros(9, dtype=torch.int32)
    together = lib.attention(q, k, v, RowSlots(table, rows, zeros, lens), scale=0.125)
    for t in range(9):
        one = RowSlots(table, rows[t : t + 1], zeros[:1], lens[t : t + 1])
        assert torch.equal(lib.attention(q[t : t + 1], k, v, one, scale=0.125)[0], together[t])
    order = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    shuffled = RowSlots(table, rows[order], zeros, lens[order])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = lib.attention(q[order], k, v, shuffled, scale=0.125)
            assert torch.equal(out, together[order])
    finally:
        torch.set_num_threads(threads)


def test_a_prompts_rows_get_the_bits_of_rows_alone(lib):
    """40 rows of one request (a prompt of positions 10 .. 49: tiles of 16, 16 and 8 rows that
    share each block of keys), with a sliding window too (every row its own lo): each row as it
    is alone."""
    hq, hkv, dim = 8, 2, 24
    k, v, table = _pool([50], hkv, dim, torch.float32, seed=11)
    q = torch.randn(40, hq, dim).to(torch.bfloat16)
    rows = torch.ones(40, dtype=torch.int64)
    lens = torch.arange(11, 51, dtype=torch.int32)
    for lo in (torch.zeros(40, dtype=torch.int32), (lens - 20).clamp(min=0).to(torch.int32)):
        together = lib.attention(q, k, v, RowSlots(table, rows, lo, lens), scale=0.3)
        for t in range(40):
            one = RowSlots(table, rows[t : t + 1], lo[t : t + 1], lens[t : t + 1])
            assert torch.equal(lib.attention(q[t : t + 1], k, v, one, scale=0.3)[0], together[t])


# ---- in TorchAttention ----------------------------------------------------------------------

HQ, HKV, DIM = 14, 2, 64


def _batch(rows: list[int], seqs: list[int], exts: list[int], slots: torch.Tensor, *, decode: bool):
    n = sum(exts)
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.cat([torch.arange(s - e, s) for s, e in zip(seqs, exts, strict=True)]),
        out_cache_loc=slots,
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seqs),
        prefix_lens=torch.tensor([s - e for s, e in zip(seqs, exts, strict=True)]),
        extend_lens=torch.tensor(exts),
        logits_indices=torch.arange(n),
        seq_lens_cpu=seqs,
        prefix_lens_cpu=[s - e for s, e in zip(seqs, exts, strict=True)],
        extend_lens_cpu=exts,
        output_only_cpu=[] if decode else [True] * len(rows),
    )


@pytest.mark.parametrize("window", [None, 12])
def test_verify_and_batched_decode_rows_equal_decode_alone(window):
    """TorchAttention with the C attention: 5 drafts verified in one extend step give each row
    the bits of decoding it alone, and so does a decode step batched with a longer request, and
    the same rows as a prompt's after a cached prefix. SDPA (without the kernels) is close."""
    native = cpu_native.native()
    if native is None:
        pytest.skip(f"weft's CPU kernels do not run here: {cpu_native.why_not()}")
    pool = KVPool(256, 1, HKV, DIM, torch.bfloat16, CPU)
    table = ReqToTokenPool(4, 128, CPU)
    attention = TorchAttention(pool, table, native=native)
    options = AttentionOptions(sliding_window=window)
    g = torch.Generator().manual_seed(3)
    a, b = table.allocate(), table.allocate()
    slots_a, slots_b = pool.allocate(40), pool.allocate(60)
    table.write(a, 0, slots_a)
    table.write(b, 0, slots_b)
    q = torch.randn(40, HQ, DIM, generator=g).to(torch.bfloat16)
    kv = [torch.randn(40, HKV, DIM, generator=g).to(torch.bfloat16) for _ in range(2)]
    kv_b = [torch.randn(60, HKV, DIM, generator=g).to(torch.bfloat16) for _ in range(2)]
    pool.store(0, slots_b, *kv_b)
    pool.store(0, slots_a[:34], kv[0][:34], kv[1][:34])  # the prefix; positions 34 .. 39 next

    def run(batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        attention.prepare(batch)
        return attention.forward(q, k, v, 0, batch, options=options)

    verify = run(_batch([a], [40], [6], slots_a[34:], decode=False), q[34:], kv[0][34:], kv[1][34:])
    for i, pos in enumerate(range(34, 40)):
        step = _batch([a], [pos + 1], [1], slots_a[pos : pos + 1], decode=True)
        alone = run(step, q[pos : pos + 1], kv[0][pos : pos + 1], kv[1][pos : pos + 1])
        assert torch.equal(alone[0], verify[i])
        both = _batch(
            [b, a], [60, pos + 1], [1, 1], torch.stack([slots_b[59], slots_a[pos]]), decode=True
        )
        qb = torch.cat([torch.randn(1, HQ, DIM, generator=g).to(torch.bfloat16), q[pos : pos + 1]])
        ks = torch.cat([kv_b[0][59:], kv[0][pos : pos + 1]])
        vs = torch.cat([kv_b[1][59:], kv[1][pos : pos + 1]])
        assert torch.equal(run(both, qb, ks, vs)[1], verify[i])
    prompt = _batch([a], [40], [6], slots_a[34:], decode=False)
    prompt.output_only_cpu = [False]
    assert torch.equal(run(prompt, q[34:], kv[0][34:], kv[1][34:]), verify)
    attention = TorchAttention(pool, table)  # SDPA
    sdpa = run(prompt, q[34:], kv[0][34:], kv[1][34:])
    torch.testing.assert_close(sdpa.float(), verify.float(), rtol=0.02, atol=0.02)
