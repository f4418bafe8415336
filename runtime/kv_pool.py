"""Paged KV memory: token slots per layer, a free list, and the request -> slots table.

Page size is one token: a slot holds the K and V of one token in every layer.
NOTE: slot 0 is reserved, never handed out and stays zero: attention backends point padded
positions at it, so they read harmless memory instead of another request's KV.
The last slot (`scratch_slot`) is reserved too: padded rows of a CUDA-graph batch write their K/V
there, so nothing a request reads is overwritten.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.size = size  # usable slots (excluding the reserved slots 0 and size + 1)
        self.dtype = dtype
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
