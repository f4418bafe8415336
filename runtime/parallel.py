"""Tensor parallelism: the group of ranks that run one model together, and how a dimension of
the model splits over them.

Every layer takes a `TPGroup`; the default, `SINGLE` (one rank), makes each collective return
its input untouched and each split the whole dimension, so a one-rank model is the model as it
was. Over `size` ranks, rank r holds:

    | layer                          | rank r holds                                  | then       |
    |--------------------------------|-----------------------------------------------|------------|
    | ColumnLinear (qkv, gate_up)    | its rows of each merged shard                 | -          |
    | RowLinear (o_proj, down_proj)  | its columns (the slice of x it receives)      | all-reduce |
    | attention, KV pool             | num_heads / size q heads; num_kv_heads / size | -          |
    |                                | KV heads, or the one its q heads read         |            |
    | VocabEmbedding (embed_tokens)  | vocab rows [r V', (r + 1) V'),                | all-reduce |
    |                                | V' = ceil(vocab / size), padded with zeros    |            |
    | LMHead (or the tied embedding) | the same vocab rows                           | all-gather |
    | MoE experts                    | each expert's gate_up rows and down columns   | all-reduce |
    | norms, rotary, MoE router      | all of it (replicated)                        | -          |

Collectives run over torch.distributed (gloo on CPUs, NCCL on GPUs); every rank must run the
same steps with the same inputs, as they meet in each all-reduce.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankSlice:
    """Indices [start, start + size) of a dimension of `total` that one rank holds."""

    total: int
    start: int
    size: int

    @classmethod
    def whole(cls, total: int) -> RankSlice:
        return cls(total, 0, total)

    def scaled(self, factor: int) -> RankSlice:
        """The same slice in units `factor` times smaller (heads -> rows of head_dim each)."""
        return RankSlice(self.total * factor, self.start * factor, self.size * factor)

    def take(self, tensor: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """This rank's part of a full (checkpoint) tensor along `dim`; a whole slice returns the
        tensor as it is, for the loader's own shape check."""
        if self.size == self.total:
            return tensor
        if tensor.dim() <= dim or tensor.shape[dim] != self.total:
            raise ValueError(
                f"{what}: expected {self.total} along dim {dim}, got shape {tuple(tensor.shape)}"
            )
        return tensor.narrow(dim, self.start, self.size)


_CPU = torch.device("cpu")


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: one rank, no collectives
    device: torch.device = _CPU  # where this rank runs (NCCL: its GPU)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a tensor-parallel group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each one's partial `x`, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank r's values at [r n, (r + 1) n)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (what every rank can afford)."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.group)
        return int(box.item())

    def split(self, total: int, *, what: str) -> RankSlice:
        """An even share of `total` (heads, rows): ValueError naming `what` if it does not
        divide."""
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) does not split over {self.size} tensor-parallel ranks: it "
                f"must be a multiple of the tensor-parallel size"
            )
        share = total // self.size
        return RankSlice(total, self.rank * share, share)

    def split_kv_heads(self, num_kv_heads: int) -> RankSlice:
        """The KV heads this rank holds: an even share, or, with fewer KV heads than ranks, the
        one its q heads read (each KV head then lives on size / num_kv_heads consecutive ranks,
        as do the q heads of its group)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, what="num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) is fewer than the {self.size} "
                "tensor-parallel ranks and does not divide them: no rank would hold whole "
                "KV-head groups"
            )
        return RankSlice(num_kv_heads, self.rank // (self.size // num_kv_heads), 1)


SINGLE = TPGroup()


def init_tp_group(
    rank: int,
    size: int,
    device: torch.device,
    *,
    init_method: str | None = None,
    store: dist.Store | None = None,
    timeout: datetime.timedelta | None = None,
) -> TPGroup:
    """Join the group of `size` ranks as `rank`, running on `device` (CUDA: one GPU per rank,
    e.g. cuda:rank on one host). Rendezvous through `init_method` ("tcp://host:port",
    "file:///path", as torchrun does it) or a torch.distributed `store`; the backend is NCCL on
    CUDA, gloo on CPUs. Size 1 is SINGLE, without torch.distributed.

    NOTE: the group is torch.distributed's default (world) group, which is per process: one
    tensor-parallel model per process, as in a rank process; `destroy_tp_group` ends it.
    """
    if size == 1:
        return SINGLE
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a tensor-parallel group of {size}")
    if not dist.is_available():
        raise RuntimeError("tensor parallelism needs torch.distributed, missing from this torch")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return TPGroup(rank, size, dist.group.WORLD, device)


def destroy_tp_group(tp: TPGroup) -> None:
    if tp.size > 1:
        dist.destroy_process_group()
