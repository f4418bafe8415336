"""Paged KV memory: token slots per layer, a free list, and the request -> slots table.

Page size is one token: a slot holds the K and V of one token in every layer.
NOTE: slot 0 is reserved, never handed out and stays zero: attention backends point padded
positions at it, so they read harmless memory instead of another request's KV.
The last slot (`scratch_slot`) is reserved too: padded rows of a CUDA-graph batch write their K/V
there, so nothing a request reads is overwritten.

An FP8 pool (`kv_cache_dtype fp8_e4m3`) stores each layer's K / scale and V / scale, saturated to
e4m3's range; readers widen a value and multiply it by the scale (`KVScales`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from weft.runtime.models.fp8 import FP8_DTYPE, FP8_MAX

# a layer's KV scale tensors as checkpoints name them (vLLM / SGLang / ModelOpt / compressed
# tensors): model.layers.N.self_attn[.k_proj|.v_proj].{k_scale|v_scale|kv_scale}
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(k_scale|v_scale|kv_scale)$")


class KVScales:
    """Per-layer scales of an FP8 KV cache (stored = value / scale): 1.0 (SGLang's and vLLM's
    default) unless the checkpoint carries them. `take` passes a checkpoint's tensors on, minus
    the scales it keeps."""

    def __init__(self, num_layers: int) -> None:
        self.k = [1.0] * num_layers
        self.v = [1.0] * num_layers
        self.from_checkpoint = 0  # scale tensors read

    def take(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            match = _KV_SCALE.search(name)
            if match is None:
                yield name, tensor
                continue
            layer, leaf = int(match.group(1)), match.group(2)
            if tensor.numel() != 1 or layer >= len(self.k):
                raise ValueError(
                    f"{name}: a KV cache scale must be one number of a layer < {len(self.k)}, "
                    f"got shape {tuple(tensor.shape)}"
                )
            value = float(tensor.float().reshape(()))
            if not value > 0 or value == float("inf"):
                raise ValueError(
                    f"{name}: a KV cache scale must be positive and finite, got {value}"
                )
            if leaf in ("k_scale", "kv_scale"):
                self.k[layer] = value
            if leaf in ("v_scale", "kv_scale"):
                self.v[layer] = value
            self.from_checkpoint += 1

    def describe(self) -> str:
        if self.from_checkpoint:
            return f"scales from the checkpoint ({self.from_checkpoint} tensors)"
        return "scales 1.0 (the checkpoint has none)"


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in the pool's dtype; into an FP8 pool saturated to its range (a cast of a larger
    value is not saturating on every device)."""
    if dtype != FP8_DTYPE:
        return x
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored values (from `quantize_kv`) back in the compute dtype."""
    if x.dtype == dtype:
        return x
    x = x.to(dtype)
    return x if scale == 1.0 else x * scale


class KVPool:
    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scales: KVScales | None = None,
    ) -> None:
        self.size = size  # usable slots (excluding the reserved slots 0 and size + 1)
        self.dtype = dtype  # the storage dtype: the compute dtype or FP8_DTYPE
        # NOTE: a pool in the compute dtype keeps no checkpoint scales: the Triton kernels apply
        # a pool's scales whatever its dtype
        self.scales = scales if scales is not None and self.quantized else KVScales(num_layers)
        self.device = device
        self.scratch_slot = size + 1
        shape = (size + 2, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._num_free = size

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def quantized(self) -> bool:
        return self.dtype == FP8_DTYPE

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Slots `loc` of a layer get the new tokens' K and V (the torch path; the Triton
        backend's kv_store kernel does the same)."""
        self.k_buffers[layer][loc] = quantize_kv(k, self.scales.k[layer], self.dtype)
        self.v_buffers[layer][loc] = quantize_kv(v, self.scales.v[layer], self.dtype)

    @property
    def bytes_per_token(self) -> int:
        k = self.k_buffers[0]
        return 2 * len(self.k_buffers) * k.shape[1] * k.shape[2] * k.element_size()

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int) -> torch.Tensor:
        """Return n free slots (int64, CPU). Call `can_allocate` first."""
        if n > self._num_free:
            raise RuntimeError(f"KV pool exhausted: asked {n}, free {self._num_free}")
        start = self._num_free - n
        slots = self._free[start : self._num_free].clone()
        self._num_free = start
        return slots

    def free(self, slots: torch.Tensor) -> None:
        n = int(slots.numel())
        if n == 0:
            return
        end = self._num_free + n
        if end > self.size:
            raise RuntimeError("KV pool double free: more slots freed than exist")
        self._free[self._num_free : end] = slots.to(torch.int64).cpu()
        self._num_free = end

    def free_slots(self) -> torch.Tensor:
        """A copy of the free list (for audits)."""
        return self._free[: self._num_free].clone()


class ReqToTokenPool:
    """`req_to_token[row, pos]` = the KV slot of token `pos` of the request in `row`."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        self.req_to_token = torch.zeros(
            (max_requests, max_context), dtype=torch.int64, device=device
        )
        # A host mirror, so the scheduler reads slots without a device sync.
        self._host = (
            self.req_to_token
            if device.type == "cpu"
            else torch.zeros((max_requests, max_context), dtype=torch.int64)
        )
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.max_requests = max_requests
        # tensor parallelism, rank 0: `write`s not yet replayed on the other ranks, flat as
        # [row, start, n, n slots, ...] (tp_driver); None: nobody follows this pool
        self.journal: list[int] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request rows")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Slots of positions [start, start + len(slots)) of a row, on the host and the device."""
        end = start + slots.numel()
        self._host[row, start:end] = slots
        if self.journal is not None:
            self.journal += [row, start, end - start, *slots.tolist()]
        if self._host is not self.req_to_token:
            self.req_to_token[row, start:end] = slots.to(
                self.req_to_token.device, non_blocking=True
            )

    def write_tokens(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """Host mirror only: slot i of token i at `positions[i]` of row `rows[i]`."""
        self._host[torch.tensor(rows), torch.tensor(positions)] = slots

    def scatter(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], positions[i]] = slots[i] on the device, in one kernel."""
        if self._host is not self.req_to_token:
            self.req_to_token[rows, positions] = slots

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end) as an int64 CPU tensor."""
        return self._host[row, start:end].clone()
