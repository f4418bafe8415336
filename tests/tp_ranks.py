"""What one tensor-parallel rank runs in tests/test_tensor_parallel.py: a model through the real
ModelRunner (its KV pool and torch attention) over a fixed schedule of chunked prefill and greedy
decode steps, plus single layers on known weights. Kept apart from the test module so that the
spawned rank processes import no transformers or pytest."""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import weft
from weft.runtime.config import EngineConfig
from weft.runtime.core import ForwardBatch
from weft.runtime.loaders.source import ModelSource
from weft.runtime.model_runner import ModelRunner
from weft.runtime.models.layers import RowLinear
from weft.runtime.models.vocab_parallel import LMHead, VocabEmbedding
from weft.runtime.parallel import TPGroup, destroy_tp_group, init_tp_group

TP_SIZE = 2
FP8_MODEL = "llama-gqa-untied"  # also run with quantization fp8 (bfloat16 activations)
# (request, tokens fed) per step: A's prompt in two chunks, the second beside B's first decode;
# a request samples its next token where its feed reaches the end of its tokens
PROMPTS = ([5, 81, 17, 140, 3, 99, 62, 28, 7, 131, 44, 12, 90], [33, 2, 150, 64, 9, 118])
SCHEDULE = [[(0, 8), (1, 6)], [(0, 5), (1, 1)]] + [[(0, 1), (1, 1)]] * 5


def build_runner(
    folder: Path, tp: TPGroup, *, dtype: str = "float32", quantization: str = "auto"
) -> ModelRunner:
    config = EngineConfig(
        model_path=str(folder),
        dtype=dtype,
        quantization=quantization,
        device="cpu",
        attention_backend="torch",
        max_total_tokens=64,
        max_running_requests=2,
        show_progress=False,
    )
    return ModelRunner(config, ModelSource(folder, None, "safetensors", str(folder)), tp=tp)


@dataclass
class _Request:
    tokens: list[int]
    row: int
    kv_len: int = 0
    output: list[int] = field(default_factory=list)


def greedy_steps(runner: ModelRunner) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Runs SCHEDULE; returns every step's logits [requests, vocab] and each request's greedy
    tokens."""
    reqs = [_Request(list(p), runner.req_to_token.allocate()) for p in PROMPTS]
    all_logits = []
    for step in SCHEDULE:
        ids: list[int] = []
        positions: list[int] = []
        slots = []
        last_rows = []
        for i, n in step:
            req = reqs[i]
            start = req.kv_len
            ids += req.tokens[start : start + n]
            positions += range(start, start + n)
            new = runner.kv_pool.allocate(n)
            runner.req_to_token.write(req.row, start, new)
            slots.append(new)
            last_rows.append(len(ids) - 1)
        seq_lens = [reqs[i].kv_len + n for i, n in step]
        prefix_lens = [reqs[i].kv_len for i, _ in step]
        extend_lens = [n for _, n in step]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            out_cache_loc=torch.cat(slots),
            req_pool_indices=torch.tensor([reqs[i].row for i, _ in step]),
            seq_lens=torch.tensor(seq_lens),
            prefix_lens=torch.tensor(prefix_lens),
            extend_lens=torch.tensor(extend_lens),
            logits_indices=torch.tensor(last_rows),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
        )
        logits = runner.logits(runner.forward(batch))
        all_logits.append(logits)
        for (i, n), row in zip(step, logits, strict=True):
            req = reqs[i]
            req.kv_len += n
            if req.kv_len == len(req.tokens):
                token = int(row.argmax())
                req.tokens.append(token)
                req.output.append(token)
    return all_logits, [r.output for r in reqs]


def layer_weights() -> dict[str, torch.Tensor]:
    """Known full weights and inputs for `layer_outputs` (a vocabulary of 7: not a multiple of
    the ranks, so the last rank's table is padded)."""
    gen = torch.Generator().manual_seed(3)
    return {
        "table": torch.randn(7, 4, generator=gen),
        "head": torch.randn(7, 4, generator=gen),
        "hidden": torch.randn(3, 4, generator=gen),
        "ids": torch.tensor([0, 6, 3, 4, 2, 5, 1, 6]),
        "row_weight": torch.randn(5, 6, generator=gen),
        "row_bias": torch.randn(5, generator=gen),
        "row_x": torch.randn(3, 6, generator=gen),
    }


@torch.no_grad()
def layer_outputs(tp: TPGroup) -> dict[str, torch.Tensor]:
    """The vocab-parallel embedding and head and a row-parallel linear with a bias on this rank,
    from the full weights of `layer_weights`; and the group's min_int."""
    w = layer_weights()
    embed = VocabEmbedding(7, 4, torch.float32, tp=tp)
    embed.load_param("weight", w["table"], "embed")
    head = LMHead(4, 7, torch.float32, tp=tp)
    head.load_param("weight", w["head"], "head")
    row = RowLinear(6, 5, torch.float32, bias=True, tp=tp)
    row.load_param("weight", w["row_weight"], "row.weight")
    row.load_param("bias", w["row_bias"], "row.bias")
    x = w["row_x"][:, row.inputs.start : row.inputs.start + row.inputs.size]
    return {
        "embed": embed(w["ids"]),
        "tied_logits": embed.logits(w["hidden"]),
        "head_logits": head.logits(w["hidden"]),
        "row": row(x),
        "min_int": torch.tensor(tp.min_int(10 + tp.rank)),  # what every rank can afford
    }


def rank_main(rank: int, store_path: str, folders: dict[str, str], out_dir: str) -> None:
    """One rank: runs every model of `folders` and the layers, saves what it saw to
    out_dir/rank{rank}.pt (torch.multiprocessing.spawn's entry point)."""
    torch.set_num_threads(1)  # NOTE: two ranks share the test machine's cores
    store = dist.FileStore(store_path, TP_SIZE)
    timeout = datetime.timedelta(seconds=120)
    tp = init_tp_group(rank, TP_SIZE, torch.device("cpu"), store=store, timeout=timeout)
    try:
        results: dict[str, object] = {"layers": layer_outputs(tp)}
        for name, folder in folders.items():
            runner = build_runner(Path(folder), tp)
            logits, tokens = greedy_steps(runner)
            results[name] = {
                "logits": logits,
                "tokens": tokens,
                "kv_heads": runner.kv_pool.k_buffers[0].shape[1],
            }
        fp8 = build_runner(Path(folders[FP8_MODEL]), tp, dtype="bfloat16", quantization="fp8")
        results["fp8"] = greedy_steps(fp8)[0]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_tp_group(tp)


def spawn_ranks(store_path: str, folders: dict[str, str], out_dir: str) -> None:
    """Runs `rank_main` on TP_SIZE processes and waits for them (a rank's exception is raised
    here)."""
    # NOTE: spawned processes start from this one's sys.path, from which `import weft` took the
    # checkout's root (weft._unshadow): without it there they would import another installed
    # weft, or none
    root = str(Path(weft.__file__).resolve().parents[1])
    saved = list(sys.path)
    sys.path.insert(0, root)
    try:
        mp.spawn(rank_main, args=(store_path, folders, out_dir), nprocs=TP_SIZE, join=True)
    finally:
        sys.path[:] = saved
