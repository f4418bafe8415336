"""The attention backend interface and its torch twin (CPU and GPU, the reference).

A backend gets the paged layout once per step (`prepare`) and is then called once per layer.
Inputs per step (see `ForwardBatch`): `req_pool_indices` picks rows of `req_to_token`, whose first
`seq_lens[b]` entries are the KV slots of request b; the last `extend_lens[b]` of them are the
tokens of this step (already allocated, written here), the first `prefix_lens[b]` were computed
earlier (or come from the prefix cache). Query tokens of one request are contiguous in the batch.

Per layer, the model passes its `AttentionOptions` with every call: a sliding window, logit
soft-capping and the score scale, each at its plain default unless set (a model may give each
layer its own, as Gemma 3 does).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from weft.kernels.cpu_native import NativeCPU, RowSlots
from weft.runtime.core import ForwardBatch
from weft.runtime.kv_pool import KVPool, ReqToTokenPool, dequantize_kv


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer attends, beyond causal attention over its request's KV."""

    # W: a query at position p sees keys at positions p - W < j <= p (HF: q - k < window)
    sliding_window: int | None = None
    # c: scores (q.k * scale) become c * tanh(score / c) before the softmax (Gemma 2/3)
    logit_cap: float | None = None
    # s: scores are q.k * s (None: 1 / sqrt(head_dim), SDPA's default; Gemma 3 sets its own)
    scale: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logit_cap is not None and self.logit_cap <= 0:
            raise ValueError(f"logit_cap must be > 0, got {self.logit_cap}")
        if self.scale is not None and self.scale <= 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")


FULL_ATTENTION = AttentionOptions()


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
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        *,
        options: AttentionOptions = FULL_ATTENTION,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens -> attention output [T, Hq * D].

        Stores k and v at `batch.out_cache_loc` in layer `layer` of the pool first. The whole KV
        stays in the pool: a window only hides keys from the queries.
        """

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch) -> None:
        self.kv_pool.store(layer, batch.out_cache_loc, k, v)


class TorchAttention(AttentionBackend):
    """Gathers each request's KV from the pool and runs SDPA (batched for pure decode steps).

    A decode step gathers only a window's last W positions (`_decode_view`); an extend step's
    window becomes a boolean mask (built once per step and window). Soft-capping, which SDPA
    lacks, runs the same attention in plain torch ops (`_attend`).

    With weft's CPU kernels (`native`, a bfloat16 or float32 pool), every row attends in weft's
    C instead (`NativeCPU.attention`): a token gets the same bits whether it is decoded alone or
    in a batch, verified among drafts, or computed in a prompt after a cached prefix, in a chunk
    or whole; SDPA's paths for those shapes sum in other orders. (It is also faster here: a
    512-token prompt's causal attention 6.5 vs 17.9 ms a layer, a decode row at 512 tokens of
    context 0.05 vs 0.44 ms; RESULTS.md.)
    """

    def __init__(
        self, kv_pool: KVPool, req_to_token: ReqToTokenPool, *, native: NativeCPU | None = None
    ) -> None:
        super().__init__(kv_pool, req_to_token)
        assert native is None or kv_pool.dtype in (torch.bfloat16, torch.float32)
        self.native = native

    def prepare(self, batch: ForwardBatch) -> None:
        table = self.req_to_token.req_to_token
        # decode: window (None: whole context) -> (slots [B, L], keep [B, 1, 1, L] or None)
        self._decode_views: dict[int | None, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._window_masks: dict[int, list[torch.Tensor]] = {}  # extend: window -> [ext, seq]s
        self._row_slots: dict[int | None, RowSlots] = {}  # native: window -> the rows' keys
        if self.native is not None:
            self._row_slots[None] = _row_slots(batch, table)
            return
        if batch.is_decode:
            return
        self._per_req = []
        rows = batch.req_pool_indices.tolist()
        for row, seq, ext in zip(rows, batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True):
            slots = table[row, :seq]
            prefix = seq - ext
            mask: torch.Tensor | None = None
            if prefix > 0 and ext > 1:
                mask = _visible(prefix, seq, None, table.device)  # [ext, seq]
            self._per_req.append((slots, ext, prefix, mask))

    def _native_slots(self, window: int | None) -> RowSlots:
        """The native rows' keys under a window (lo = len - W: query p sees p - j < W)."""
        slots = self._row_slots.get(window)
        if slots is None:
            assert window is not None  # the whole context's entry is built in prepare
            whole = self._row_slots[None]
            lo = (whole.lens - window).clamp(min=0).to(torch.int32)
            slots = self._row_slots[window] = RowSlots(whole.table, whole.rows, lo, whole.lens)
        return slots

    def _attend_native(
        self, q: torch.Tensor, layer: int, options: AttentionOptions
    ) -> torch.Tensor:
        """q [N, Hq, D] of the native rows -> [N, Hq * D] in q's dtype."""
        assert self.native is not None
        scale = q.shape[-1] ** -0.5 if options.scale is None else options.scale
        out = self.native.attention(
            q,
            self.kv_pool.k_buffers[layer],
            self.kv_pool.v_buffers[layer],
            self._native_slots(options.sliding_window),
            scale=scale,
            logit_cap=options.logit_cap,
        )
        return out.to(q.dtype).view(q.shape[0], -1)

    def _decode_view(
        self, window: int | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The KV slots a decode step reads for one window, built once per step and window:
        slots [B, L] and keep [B, 1, 1, L] (False: padding, which reads slot 0), or keep None
        where no row is padded (batch 1, or requests of one length): SDPA then takes no mask,
        which gives the same values faster.

        Request b's query sits at position seq_len - 1 and sees positions [lo, seq_len) with
        lo = max(0, seq_len - W) (q - k < W, as `_visible` and the Triton kernels define it), so
        a window gathers only those: L = min(W, longest context), not the whole context.
        """
        max_len = max(batch.seq_lens_cpu)
        if window is not None and window >= max_len:
            window = None  # the window hides no position of this step
        view = self._decode_views.get(window)
        if view is None:
            table = self.req_to_token.req_to_token
            lens = batch.seq_lens[:, None]
            width = max_len if window is None else window
            pos = torch.arange(width, device=table.device)[None, :]  # [1, L]
            if window is not None:
                # NOTE: lo + width - 1 <= seq_len - 1 when seq_len >= W, else width - 1 < max_len:
                # every position is inside the row, so no clamp is needed before the gather
                pos = (lens - window).clamp(min=0) + pos  # [B, L]
            keep = pos < lens
            rows = batch.req_pool_indices[:, None]
            # NOTE: past a request's length its row holds stale slots that may now belong to other
            # requests (and hold inf/NaN that a mask does not neutralise): read slot 0 there.
            slots = torch.where(keep, table[rows, pos], 0)
            # NOTE: not from a graph's batch, whose host lengths are all the longest possible
            # (the mask baked into its replays must cover every length)
            padded = not batch.exact_lens or min(batch.seq_lens_cpu) < width
            view = (slots, keep[:, None, None, :] if padded else None)
            self._decode_views[window] = view
        return view

    def _masks(self, window: int) -> list[torch.Tensor]:
        """An extend step's masks for one window, [ext, seq] a request, built once per step."""
        masks = self._window_masks.get(window)
        if masks is None:
            masks = [
                _visible(prefix, prefix + ext, window, slots.device)
                for slots, ext, prefix, _ in self._per_req
            ]
            self._window_masks[window] = masks
        return masks

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
        if self.native is not None:
            return self._attend_native(q, layer, options)
        pool = self.kv_pool
        k_buf, v_buf = pool.k_buffers[layer], pool.v_buffers[layer]
        k_scale, v_scale = pool.scales.k[layer], pool.scales.v[layer]
        num_tokens, num_heads, head_dim = q.shape
        window, cap, scale = options.sliding_window, options.logit_cap, options.scale
        if batch.is_decode:
            slots, keep = self._decode_view(window, batch)
            # NOTE: index_select, not k_buf[slots]: it copies whole rows, ~3x faster on a CPU
            rows = (num_tokens, -1, *k_buf.shape[1:])  # [B, L, Hkv, D]; transposed below
            keys = k_buf.index_select(0, slots.view(-1)).view(rows).transpose(1, 2)
            values = v_buf.index_select(0, slots.view(-1)).view(rows).transpose(1, 2)
            keys = dequantize_kv(keys, k_scale, q.dtype)
            values = dequantize_kv(values, v_scale, q.dtype)
            out = _attend(q.unsqueeze(2), keys, values, keep, cap, scale)  # [B, Hq, 1, D]
            return out.reshape(num_tokens, num_heads * head_dim)
        windowed = None if window is None else self._masks(window)
        outputs = []
        start = 0
        for i, (slots, ext, prefix, mask) in enumerate(self._per_req):
            qi = q[start : start + ext].transpose(0, 1)  # [Hq, ext, D]
            ki = dequantize_kv(k_buf[slots], k_scale, q.dtype).transpose(0, 1)  # [Hkv, seq, D]
            vi = dequantize_kv(v_buf[slots], v_scale, q.dtype).transpose(0, 1)
            if windowed is not None:
                mask = windowed[i]
            if mask is None and prefix == 0 and ext > 1:  # causal over the new tokens alone
                if cap is None:
                    oi = F.scaled_dot_product_attention(
                        qi, ki, vi, is_causal=True, enable_gqa=True, scale=scale
                    )
                else:
                    oi = _attend(qi, ki, vi, _visible(0, ext, None, q.device), cap, scale)
            else:
                oi = _attend(qi, ki, vi, mask, cap, scale)
            outputs.append(oi.transpose(0, 1).reshape(ext, num_heads * head_dim))
            start += ext
        return torch.cat(outputs, dim=0)


def _row_slots(batch: ForwardBatch, table: torch.Tensor) -> RowSlots:
    """Each query row's request row and key count (its position + 1), for the C attention."""
    if batch.is_decode:
        seq_lens = batch.seq_lens.to(torch.int32)
        return RowSlots(table, batch.req_pool_indices, torch.zeros_like(seq_lens), seq_lens)
    rows: list[int] = []
    lens: list[int] = []
    pairs = zip(
        batch.req_pool_indices.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True
    )
    for row, seq, ext in pairs:
        rows.extend([row] * ext)
        lens.extend(range(seq - ext + 1, seq + 1))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return RowSlots(table, torch.tensor(rows), torch.zeros_like(lens_t), lens_t)


def _visible(prefix: int, seq: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[ext, seq] bool: query t (at position prefix + t) sees key j iff j <= prefix + t and, with a
    window W, prefix + t - j < W."""
    q_pos = torch.arange(prefix, seq, device=device)[:, None]
    k_pos = torch.arange(seq, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
    return visible


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    logit_cap: float | None,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA over [..., H, L, D] (k/v with Hkv heads) with a boolean mask; soft-capped scores
    (which SDPA cannot do) in plain torch ops. scale None: 1 / sqrt(D), SDPA's default."""
    if logit_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    group = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / logit_cap) * logit_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).to(v.dtype) @ v
