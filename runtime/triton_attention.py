"""The Triton attention backend: a drop-in replacement for TorchAttention (same semantics).

Per step, `prepare` derives what the kernels take from the batch without a device sync: the
grid sizes come from the host copies of the lengths (`seq_lens_cpu`, `extend_lens_cpu`).
Per layer, `forward` stores the new K/V (kv_store), then runs decode attention over the
requests with one new token and extend attention over the rest. A mixed step (decodes and a
prefill chunk) lists its decodes first (the scheduler's order), so the two kernels take the two
halves of the step's rows: the extend kernel pads a one-token request to a 128-row query tile and
reads its KV once per query head, several times slower than the split-K decode kernel over the
long contexts of a busy server.
"""

from __future__ import annotations

import math

import torch

from weft.kernels.decode_attention import decode_attention, default_num_kv_splits
from weft.kernels.extend_attention import extend_attention
from weft.kernels.kv_store import kv_store
from weft.runtime.attention import FULL_ATTENTION, AttentionBackend, AttentionOptions
from weft.runtime.core import ForwardBatch


class TritonAttention(AttentionBackend):
    """Paged attention through the kernels in weft.kernels (page size 1, as the KVPool)."""

    fused_layers = True
    split_mixed = True  # False: a mixed step runs the extend kernel only (for the ablation)

    def prepare(self, batch: ForwardBatch) -> None:
        ext_cpu = batch.extend_lens_cpu
        num_decode = 0  # the leading requests with one new token
        if self.split_mixed or batch.is_decode:
            while num_decode < len(ext_cpu) and ext_cpu[num_decode] == 1:
                num_decode += 1
        self._num_decode = num_decode
        if num_decode:
            k_buf = self.kv_pool.k_buffers[0]
            self._num_kv_splits = default_num_kv_splits(
                num_decode, k_buf.shape[1], max(batch.seq_lens_cpu[:num_decode]), k_buf.device
            )
        if num_decode == len(ext_cpu):
            return
        # request b of the rest has queries qo_indptr[b] .. qo_indptr[b+1]-1 of the rest's rows
        ext = batch.extend_lens[num_decode:]
        self._qo_indptr = torch.zeros(len(ext) + 1, dtype=ext.dtype, device=ext.device)
        torch.cumsum(ext, dim=0, out=self._qo_indptr[1:])
        self._max_extend_len = max(ext_cpu[num_decode:])
        # NOTE: copies, not views at row num_decode: Triton specializes on 16-byte pointer
        # alignment, and views at odd offsets compiled the extend kernel again mid-serving
        self._rest_rows = batch.req_pool_indices[num_decode:]
        self._rest_prefix_lens = batch.prefix_lens[num_decode:]
        if num_decode:
            self._rest_rows = self._rest_rows.clone()
            self._rest_prefix_lens = self._rest_prefix_lens.clone()

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch) -> None:
        pool = self.kv_pool
        kv_store(
            k,
            v,
            pool.k_buffers[layer],
            pool.v_buffers[layer],
            batch.out_cache_loc,
            k_scale=pool.scales.k[layer],
            v_scale=pool.scales.v[layer],
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        *,
        options: AttentionOptions = FULL_ATTENTION,
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, batch)
        k_buf = self.kv_pool.k_buffers[layer]
        v_buf = self.kv_pool.v_buffers[layer]
        k_scale, v_scale = self.kv_pool.scales.k[layer], self.kv_pool.scales.v[layer]
        table = self.req_to_token.req_to_token
        num_tokens, num_heads, head_dim = q.shape
        # NOTE: a runtime argument of the kernels, not a constexpr: a model's own scale
        # compiles nothing new
        sm_scale = 1.0 / math.sqrt(head_dim) if options.scale is None else options.scale
        d = self._num_decode  # requests with one new token: rows [0, d)
        if d == batch.batch_size:
            out = decode_attention(
                q,
                k_buf,
                v_buf,
                table,
                batch.req_pool_indices,
                batch.seq_lens,
                sm_scale,
                num_kv_splits=self._num_kv_splits,
                sliding_window=options.sliding_window,
                logit_cap=options.logit_cap,
                k_scale=k_scale,
                v_scale=v_scale,
            )  # [B, Hq, D], B == T
            return out.view(num_tokens, num_heads * head_dim)
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if d:
            decode_attention(
                q[:d],
                k_buf,
                v_buf,
                table,
                batch.req_pool_indices[:d],
                batch.seq_lens[:d],
                sm_scale,
                num_kv_splits=self._num_kv_splits,
                sliding_window=options.sliding_window,
                logit_cap=options.logit_cap,
                k_scale=k_scale,
                v_scale=v_scale,
                out=out[:d],
            )
        extend_attention(
            q[d:],
            k_buf,
            v_buf,
            table,
            self._rest_rows,
            self._qo_indptr,
            self._rest_prefix_lens,
            self._max_extend_len,
            sm_scale,
            sliding_window=options.sliding_window,
            logit_cap=options.logit_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            out=out[d:],
        )  # [T - d, Hq, D]
        return out.view(num_tokens, num_heads * head_dim)
