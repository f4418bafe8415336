"""The attention backend interface and its torch twin (CPU and GPU, the reference).

A backend gets the paged layout once per step (`prepare`) and is then called once per layer.
Inputs per step (see `ForwardBatch`): `req_pool_indices` picks rows of `req_to_token`, whose first
`seq_lens[b]` entries are the KV slots of request b; the last `extend_lens[b]` of them are the
tokens of this step (already allocated, written here), the first `prefix_lens[b]` were computed
earlier (or come from the prefix cache). Query tokens of one request are contiguous in the batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from weft.runtime.core import ForwardBatch
from weft.runtime.kv_pool import KVPool, ReqToTokenPool


class AttentionBackend(ABC):
    # whether the model runs its norms, rotary and activation through the Triton kernels too
    # (weft.kernels; CUDA only) instead of torch ops
    fused_layers = False

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata, before the first layer runs."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens -> attention output [T, Hq * D].

        Stores k and v at `batch.out_cache_loc` in layer `layer` of the pool first.
        """

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch) -> None:
        self.kv_pool.k_buffers[layer][batch.out_cache_loc] = k
        self.kv_pool.v_buffers[layer][batch.out_cache_loc] = v


class TorchAttention(AttentionBackend):
    """Gathers each request's KV from the pool and runs SDPA (batched for pure decode steps)."""

    def prepare(self, batch: ForwardBatch) -> None:
        table = self.req_to_token.req_to_token
        if batch.is_decode:
            max_len = max(batch.seq_lens_cpu)
            keep = torch.arange(max_len, device=table.device)[None, :] < batch.seq_lens[:, None]
            # NOTE: past a request's length its row holds stale slots that may now belong to other
            # requests (and hold inf/NaN that a mask does not neutralise): read slot 0 there.
            self._slots = torch.where(keep, table[batch.req_pool_indices, :max_len], 0)  # [B, L]
            self._decode_mask = keep[:, None, None, :]  # [B, 1, 1, L]
            return
        self._per_req = []
        rows = batch.req_pool_indices.tolist()
        for row, seq, ext in zip(rows, batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True):
            slots = table[row, :seq]
            prefix = seq - ext
            mask = None
            if prefix > 0 and ext > 1:
                # query t sits at absolute position prefix + t and sees keys 0 .. prefix + t
                q_pos = torch.arange(prefix, seq, device=table.device)[:, None]
                mask = torch.arange(seq, device=table.device)[None, :] <= q_pos  # [ext, seq]
            self._per_req.append((slots, ext, prefix, mask))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        k_buf = self.kv_pool.k_buffers[layer]
        v_buf = self.kv_pool.v_buffers[layer]
        num_tokens, num_heads, head_dim = q.shape
        if batch.is_decode:
            keys = k_buf[self._slots].transpose(1, 2)  # [B, Hkv, L, D]
            values = v_buf[self._slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=self._decode_mask, enable_gqa=True
            )  # [B, Hq, 1, D]
            return out.reshape(num_tokens, num_heads * head_dim)
        outputs = []
        start = 0
        for slots, ext, prefix, mask in self._per_req:
            qi = q[start : start + ext].transpose(0, 1)  # [Hq, ext, D]
            ki = k_buf[slots].transpose(0, 1)  # [Hkv, seq, D]
            vi = v_buf[slots].transpose(0, 1)
            causal = prefix == 0 and ext > 1
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=causal, enable_gqa=True
            )
            outputs.append(oi.transpose(0, 1).reshape(ext, num_heads * head_dim))
            start += ext
        return torch.cat(outputs, dim=0)
