"""Launch-time checks shared by the kernel wrappers.

The wrappers raise `ValueError` (not `assert`, which `python -O` strips): a kernel launched on a
wrong shape or stride reads or writes memory it does not own instead of failing.
NOTE: only metadata is checked; values (slot indices, lengths) live on the device and checking
them would cost a host-device sync per launch.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check(cond: bool, message: str, *args: object) -> None:
    """Raise ValueError(message.format(*args)) unless cond.

    NOTE: the message is formatted only on failure: these checks run on every launch (decode runs
    once per layer and step), and eager f-strings of shapes and dtypes cost ~10 us each.
    """
    if not cond:
        raise ValueError(message.format(*args))


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    *,
    last_contiguous: bool = True,
) -> None:
    """Rank, dtype and device of `t`; with `last_contiguous`, unit stride in the last dim."""
    check(t.dim() == ndim, "{}: expected {} dims, got shape {}", name, ndim, tuple(t.shape))
    check(t.dtype in dtypes, "{}: dtype {} not in {}", name, t.dtype, dtypes)
    check(t.device == device, "{}: on {}, expected {}", name, t.device, device)
    if last_contiguous and t.shape[-1] > 1:
        check(t.stride(-1) == 1, "{}: last dim must have stride 1, got {}", name, t.stride())


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    check(t.shape == shape, "{}: expected shape {}, got {}", name, shape, tuple(t.shape))


def check_out(
    out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor, name: str = "out"
) -> torch.Tensor:
    """An output buffer of `shape` with like's dtype and device: `out` once checked, else new."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor(name, out, len(shape), (like.dtype,), like.device)
    check_shape(name, out, shape)
    return out


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def dot_mode(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """(UPCAST, PRECISION) for `_attn.dot`: exact fp32 products for fp32 tensors (tf32 would cost
    ~1e-3 relative error); on CPU tensors (the interpreter) upcast 16-bit operands (see `dot`)."""
    return device.type == "cpu", "ieee" if dtype == torch.float32 else "tf32"
