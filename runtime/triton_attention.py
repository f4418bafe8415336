"""The Triton attention backend: a drop-in replacement for TorchAttention (same semantics).

Per step, `prepare` derives what the kernels take from the batch without a device sync: the
grid sizes come from the host copies of the lengths (`seq_lens_cpu`, `extend_lens_cpu`).
Per layer, `forward` stores the new K/V (kv_store), then runs decode attention (every request
has one new token) or extend attention (anything else, mixed lengths included).
"""

from __future__ import annotations

import math

import torch

from weft.kernels.decode_attention import decode_attention, default_num_kv_splits
from weft.kernels.extend_attention import extend_attention
from weft.kernels.kv_store import kv_store
from weft.runtime.attention import AttentionBackend
from weft.runtime.core import ForwardBatch


class TritonAttention(AttentionBackend):
    """Paged attention through the kernels in weft.kernels (page size 1, as the KVPool)."""

    fused_layers = True

    def prepare(self, batch: ForwardBatch) -> None:
        self._is_decode = batch.is_decode
        if self._is_decode:
            k_buf = self.kv_pool.k_buffers[0]
            self._num_kv_splits = default_num_kv_splits(
                batch.batch_size, k_buf.shape[1], max(batch.seq_lens_cpu), k_buf.device
            )
            return
        # request b's queries are rows qo_indptr[b] .. qo_indptr[b+1]-1 of the step's tokens
        ext = batch.extend_lens
        self._qo_indptr = torch.zeros(
            len(batch.extend_lens_cpu) + 1, dtype=ext.dtype, device=ext.device
        )
        torch.cumsum(ext, dim=0, out=self._qo_indptr[1:])
        self._max_extend_len = max(batch.extend_lens_cpu)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch) -> None:
        kv_store(
            k, v, self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer], batch.out_cache_loc
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        k_buf = self.kv_pool.k_buffers[layer]
        v_buf = self.kv_pool.v_buffers[layer]
        table = self.req_to_token.req_to_token
        num_tokens, num_heads, head_dim = q.shape
        sm_scale = 1.0 / math.sqrt(head_dim)  # SDPA's default, as TorchAttention
        if self._is_decode:
            out = decode_attention(
                q,
                k_buf,
                v_buf,
                table,
                batch.req_pool_indices,
                batch.seq_lens,
                sm_scale,
                num_kv_splits=self._num_kv_splits,
            )  # [B, Hq, D], B == T
        else:
            out = extend_attention(
                q,
                k_buf,
                v_buf,
                table,
                batch.req_pool_indices,
                self._qo_indptr,
                batch.prefix_lens,
                self._max_extend_len,
                sm_scale,
            )  # [T, Hq, D]
        return out.view(num_tokens, num_heads * head_dim)
