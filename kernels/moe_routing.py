"""The routing half of the fused MoE: top-k over the router's softmax, and the grouping of the
T * k (token, expert) entries by expert in blocks of BLOCK_M rows that the expert kernels read.

    sorted_entries [P]   entry ids (t * k + j), expert by expert, in entry order within one;
                         NUM = T * k marks a padding row (each expert's rows padded to BLOCK_M)
    block_expert [P/BM]  the expert of each BLOCK_M rows of sorted_entries; E past the used blocks

P (`padded_capacity`) is the worst case for T alone, so no size depends on the routing's values:
no host sync, and a CUDA graph captured at T replays for any routing.

Why kernels: in torch the two steps are ~25 launches of tiny kernels (softmax, topk, scatter,
cumsums, a sort, searchsorted...), each a few microseconds even replayed from a CUDA graph: at
decode that is more than streaming the chosen experts' weights takes (Qwen3-30B-A3B: ~75 MB a
layer, ~25 us on an H100). Here they are two launches. Twins: `fused_moe_ref.route_topk` and
`align_by_expert_ref` (also the path for large T, where one program would loop too long).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weft.kernels._checks import FLOAT_DTYPES, check, check_tensor, next_pow2

# Above this many entries (T * k) the grouping runs as torch ops: one program would loop over
# them all, and at prefill sizes the launches no longer matter next to the GEMMs.
ALIGN_KERNEL_MAX_ENTRIES = 4096


def padded_capacity(num_entries: int, num_experts: int, block_m: int) -> int:
    """P: the most rows the grouping can need for `num_entries` = T * k entries. At most
    min(E, T * k) experts hold entries, each padded by at most block_m - 1 rows."""
    worst = num_entries + min(num_experts, num_entries) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _topk_softmax_kernel(
    logits,  # [T, E]
    weights,  # [T, k] float32 out
    ids,  # [T, k] int32 out
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits + t * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.where(mask, tl.exp(x - tl.max(x, 0)), 0.0)
    denom = tl.sum(p, 0)
    left = tl.where(mask, p, -1.0)  # probabilities not taken yet (-1: padding or taken)
    slots = tl.arange(0, BLOCK_K)
    chosen_p = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        # NOTE: the lowest index among equal probabilities, so a tie cannot take one twice
        idx = tl.min(tl.where(left == best, offs, BLOCK_E), 0)
        chosen_p = tl.where(slots == j, best, chosen_p)
        chosen_id = tl.where(slots == j, idx, chosen_id)
        left = tl.where(offs == idx, -1.0, left)
    if RENORMALIZE:
        out = chosen_p / tl.sum(chosen_p, 0)  # padded slots hold 0
    else:
        out = chosen_p / denom
    keep = slots < TOP_K
    tl.store(weights + t * TOP_K + slots, out, mask=keep)
    tl.store(ids + t * TOP_K + slots, chosen_id, mask=keep)


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int32), one program a token;
    twin: fused_moe_ref.route_topk (the same experts, in the same order: descending weight)."""
    dev = router_logits.device
    check_tensor("router_logits", router_logits, 2, FLOAT_DTYPES, dev)
    num_tokens, num_experts = router_logits.shape
    check(0 < top_k <= num_experts, "top_k {} not in 1..{}", top_k, num_experts)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=dev)
    if num_tokens == 0:
        return weights, ids
    _topk_softmax_kernel[(num_tokens,)](
        router_logits,
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_E=next_pow2(num_experts),
        BLOCK_K=next_pow2(top_k),
        num_warps=4 if num_experts > 256 else 1,
    )
    return weights, ids


@triton.jit
def _align_kernel(
    ids,  # [N] flat expert ids (N = T * k)
    sorted_entries,  # [P] out
    block_expert,  # [P / BLOCK_M] out
    num_entries,
    num_experts,
    capacity,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program. Pass 1 counts each expert's entries; the padded counts' running sum gives
    each expert's first row; pass 2 places each entry at its expert's first row + its rank
    among that expert's earlier entries (entry order, as a stable sort by expert gives)."""
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(0, num_entries, CHUNK):
        e = tl.load(ids + c + lanes, mask=c + lanes < num_entries, other=-1)
        counts += tl.sum((e[None, :] == experts[:, None]).to(tl.int32), 1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    placed = ends - padded  # the next free row of each expert
    wide = tl.arange(0, FILL)
    for p in range(0, capacity, FILL):
        tl.store(sorted_entries + p + wide, num_entries, mask=p + wide < capacity)
    # NOTE: the padding fill above and the placement below may hit one row from two threads
    tl.debug_barrier()
    for c in range(0, num_entries, CHUNK):
        valid = c + lanes < num_entries
        e = tl.load(ids + c + lanes, mask=valid, other=-1)
        hit = (e[None, :] == experts[:, None]).to(tl.int32)  # [BLOCK_E, CHUNK]
        rank = tl.cumsum(hit, 1) - 1
        dest = tl.sum(hit * (placed[:, None] + rank), 0)  # one expert hits each valid lane
        tl.store(sorted_entries + dest, c + lanes, mask=valid)
        placed += tl.sum(hit, 1)
    for b in range(0, capacity // BLOCK_M, CHUNK):
        block = b + lanes
        # the expert whose padded rows hold the block's first row (E past the used rows);
        # padding experts (>= num_experts) end at the total and so never count below it
        below = (ends[:, None] <= block[None, :] * BLOCK_M) & (experts[:, None] < num_experts)
        tl.store(
            block_expert + block, tl.sum(below.to(tl.int32), 0), mask=block < capacity // BLOCK_M
        )


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_entries [P] int32, block_expert [P / block_m] int32): one program,
    or the torch twin past ALIGN_KERNEL_MAX_ENTRIES entries."""
    check_tensor("ids", ids, 2, (torch.int32, torch.int64), ids.device, last_contiguous=False)
    n = ids.numel()
    if n > ALIGN_KERNEL_MAX_ENTRIES:
        return align_by_expert_ref(ids, num_experts, block_m)
    cap = padded_capacity(n, num_experts, block_m)
    sorted_entries = torch.empty((cap,), dtype=torch.int32, device=ids.device)
    block_expert = torch.empty((cap // block_m,), dtype=torch.int32, device=ids.device)
    if n == 0:
        return sorted_entries, block_expert
    block_e = next_pow2(num_experts)
    _align_kernel[(1,)](
        ids.contiguous().view(-1),
        sorted_entries,
        block_expert,
        n,
        num_experts,
        cap,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        CHUNK=max(16, 4096 // block_e),  # [BLOCK_E, CHUNK] tiles of ~4096 elements
        FILL=1024,
        num_warps=4,
    )
    return sorted_entries, block_expert


def align_by_expert_ref(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of `align_by_expert` (device ops of shapes fixed by T, k, E, block_m)."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    cap = padded_capacity(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # NOTE: not bincount (sized by values)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # entries by expert, in entry order within one
    expert = flat[order]
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    dest = (ends - padded)[expert] + rank
    sorted_entries = torch.full((cap,), n, dtype=torch.int32, device=ids.device)
    sorted_entries.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, cap, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return sorted_entries, block_expert
