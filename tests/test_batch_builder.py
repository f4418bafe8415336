"""build_batch: the step's device fields hold the work list's values, each 16-byte aligned."""

from __future__ import annotations

import pytest
import torch

from weft.runtime.core import Req
from weft.runtime.kv_pool import KVPool, ReqToTokenPool
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.batch_builder import build_batch
from weft.runtime.scheduler.memory import MemoryManager


def _memory() -> MemoryManager:
    pool = KVPool(256, 1, 1, 4, torch.float32, torch.device("cpu"))
    return MemoryManager(pool, ReqToTokenPool(8, 64, torch.device("cpu")), use_cache=False)


@pytest.mark.parametrize("lengths", [[1], [3, 1, 1], [5, 2], [1, 1, 1, 1, 7]])
def test_fields_hold_the_work_and_start_16_byte_aligned(lengths):
    """NOTE: Triton specializes kernels on 16-byte pointer alignment: fields at shifting offsets
    of the step's one device buffer compiled kernels anew mid-serving."""
    memory = _memory()
    work = []
    for i, n in enumerate(lengths):
        req = Req(f"r{i}", [10 + i] * n, SamplingParams(max_new_tokens=4))
        memory.admit(req)
        work.append((req, n))
    batch, plans = build_batch(work, memory, torch.device("cpu"))
    assert batch.extend_lens.tolist() == lengths
    assert batch.seq_lens.tolist() == lengths
    assert batch.prefix_lens.tolist() == [0] * len(lengths)
    assert batch.input_ids.tolist() == [10 + i for i, n in enumerate(lengths) for _ in range(n)]
    assert batch.positions.tolist() == [p for n in lengths for p in range(n)]
    assert batch.req_pool_indices.tolist() == [r.req_pool_idx for r, _ in work]
    assert [p.sample_row for p in plans] == list(range(len(lengths)))
    ends = torch.tensor(lengths).cumsum(0) - 1
    assert batch.logits_indices.tolist() == ends.tolist()
    for name in (
        "input_ids",
        "positions",
        "out_cache_loc",
        "req_pool_indices",
        "seq_lens",
        "prefix_lens",
        "extend_lens",
        "logits_indices",
    ):
        assert getattr(batch, name).data_ptr() % 16 == 0, name


def test_output_only_marks_requests_past_their_prompts():
    """A request adds output tokens only (a decode step, drafts, forced tokens) once its KV holds
    the whole prompt; a prompt's tokens (a select's choices after a cached prefix too) do not."""
    memory = _memory()
    prompt = Req("prompt", [5] * 6, SamplingParams(max_new_tokens=4))
    decoding = Req("decoding", [7] * 3, SamplingParams(max_new_tokens=4))
    drafting = Req("drafting", [8] * 3, SamplingParams(max_new_tokens=4))
    for req in (prompt, decoding, drafting):
        memory.admit(req)
    first, _ = build_batch([(decoding, 3), (drafting, 3)], memory, torch.device("cpu"))
    assert first.output_only_cpu == [False, False]
    for req in (decoding, drafting):
        req.kv_len = 3
        req.output_ids.append(9)
    drafting.draft = [1, 2]
    batch, _ = build_batch([(prompt, 6), (decoding, 1), (drafting, 3)], memory, torch.device("cpu"))
    assert batch.extend_lens_cpu == [6, 1, 3]
    assert batch.output_only_cpu == [False, True, True]


def test_drafts_fed_as_token_rows_apart():
    """token_rows_apart: every token a one-token request (its req_to_token row, its position + 1
    as its length), so a step of decodes and drafts is a decode batch (CUDA graphs replay it);
    the rows and their plans are those of the usual layout. verify_rows_apart takes it where a
    step feeds drafts behind decode tokens only, within the graphs' rows."""
    from weft.runtime.scheduler.batch_builder import verify_rows_apart

    memory = _memory()
    decoding = Req("decoding", [7] * 3, SamplingParams(max_new_tokens=8))
    drafting = Req("drafting", [8] * 4, SamplingParams(max_new_tokens=8))
    prompt = Req("prompt", [5] * 6, SamplingParams(max_new_tokens=8))
    for req in (decoding, drafting, prompt):
        memory.admit(req)
        req.kv_len = len(req.input_ids)
        req.output_ids.append(9)
    drafting.draft = [1, 2]
    work = [(decoding, 1), (drafting, 3)]
    assert verify_rows_apart(work, 4) and not verify_rows_apart(work, 3)
    assert not verify_rows_apart(work, None)
    assert not verify_rows_apart([(decoding, 1)], 8)  # no drafts: a decode batch anyway
    prompt.kv_len = 0
    assert not verify_rows_apart([*work, (prompt, 6)], 64)  # a prompt: an extend step
    together, plans = build_batch(work, memory, torch.device("cpu"))
    for req in (decoding, drafting):
        memory.truncate(req, req.kv_len)  # (the slots again, for the second layout)
    apart, apart_plans = build_batch(work, memory, torch.device("cpu"), token_rows_apart=True)
    assert together.extend_lens_cpu == [1, 3] and not together.is_decode
    assert apart.is_decode and apart.batch_size == 4
    assert apart.seq_lens.tolist() == [4, 5, 6, 7]
    assert apart.prefix_lens.tolist() == [3, 4, 5, 6]
    rows = [decoding.req_pool_idx] + [drafting.req_pool_idx] * 3
    assert apart.req_pool_indices.tolist() == rows
    for name in ("input_ids", "positions", "logits_indices"):
        assert getattr(apart, name).tolist() == getattr(together, name).tolist(), name
    assert apart.output_only_cpu == [True] * 4
    assert [(p.sample_row, p.draft) for p in apart_plans] == [
        (p.sample_row, p.draft) for p in plans
    ]
