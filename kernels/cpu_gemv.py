"""Weight-only int8 / int4 products of a few rows on a CPU (decode), in weft's own C
(csrc/quant_gemv.c), compiled for this processor on first use and called through ctypes.

torch's packed int4/int8 CPU kernels stream a decode step's weights at ~10-11 GB/s on 2 cores
that read ~28 GB/s (RESULTS.md, issue 21); these stream them at the memory's rate. Each is the
float32 product of x and the dequantized weight, summed in another order (int4: x widened to
int16 first); `reference_int8` / `reference_int4` are their torch twins.

The build: the C compiler (`$CC`, else cc / gcc) with -O3 -march=native -fopenmp, into
`<cache>/kernels/<hash>.so`; the hash covers the source, the flags, the compiler and the CPU's
flags. The library links libgomp by its soname, so it runs on the OpenMP runtime torch loaded
(one thread pool, not two fighting over the cores). Where there is no compiler, no AVX2, or a
torch without OpenMP, `native()` is None and `why_not()` says why: the model runner says so at
start and uses torch's kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from weft.runtime.hardware import cpu_flags

logger = logging.getLogger("weft")

SOURCE = Path(__file__).with_name("csrc") / "quant_gemv.c"
MAX_ROWS = 8  # rows of x per pass over the weight (the C's MAX_M)
GROUP = 32
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_ISA = {16: "AVX-512", 8: "AVX2"}


@dataclass(frozen=True)
class NativeGemv:
    """The loaded library: `lanes` is the vector path it was built with (16 AVX-512, 8 AVX2)."""

    lib: ctypes.CDLL
    lanes: int

    @property
    def isa(self) -> str:
        return _ISA.get(self.lanes, "scalar C")

    def int8(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x bf16 [M, K] @ (q int8 [N, K] * scale bf16 [N, 1])^T -> bf16 [M, N]."""
        return self._run(self.lib.weft_gemv_int8, x, q, scale)

    def int4(self, x: torch.Tensor, packed: torch.Tensor, so: torch.Tensor) -> torch.Tensor:
        """x bf16 [M, K] @ the int4 weight of `pack_int4` (packed u8 [N, K/2], so bf16
        [N, K/32, 2])^T -> bf16 [M, N]."""
        return self._run(self.lib.weft_gemv_int4, x, packed, so)

    def _run(self, fn, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        m, n = x.shape[0], w.shape[0]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        threads = torch.get_num_threads()
        for lo in range(0, m, MAX_ROWS):  # NOTE: prefill without a dense copy re-reads w
            rows = min(MAX_ROWS, m - lo)
            status = fn(
                x[lo].data_ptr(),
                rows,
                x.shape[1],
                w.data_ptr(),
                scales.data_ptr(),
                out[lo].data_ptr(),
                n,
                threads,
            )
            if status:
                raise MemoryError(f"weft CPU kernel: no memory for {rows} x {x.shape[1]} rows")
        return out


def pack_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q u8 [N, K] (0..15), scale and zero [N, K/32] with w = (q - 8) * scale + zero -> the C's
    form: u8 [N, K/2] (per group byte i: k = i low, k = i + 16 high) and bf16 [N, K/32, 2] of
    (scale, offset = zero - 8 * scale), the offset rounded once from float32."""
    n, k = q.shape
    groups = q.view(n, k // GROUP, 2, GROUP // 2).to(torch.uint8)
    packed = (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2)
    scale32 = scale.float()
    so = torch.stack((scale32, zero.float() - 8 * scale32), dim=-1).to(torch.bfloat16)
    return packed.contiguous(), so.contiguous()


def reference_int4(x: torch.Tensor, packed: torch.Tensor, so: torch.Tensor) -> torch.Tensor:
    """The torch twin of NativeGemv.int4, in float32."""
    n = packed.shape[0]
    nib = packed.view(n, -1, GROUP // 2)
    q = torch.cat((nib & 15, nib >> 4), dim=-1).float()
    w = q * so[..., 0:1].float() + so[..., 1:2].float()
    return x.float() @ w.view(n, -1).t()


def reference_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch twin of NativeGemv.int8, in float32."""
    return x.float() @ (q.float() * scale.float()[:, None]).t()


_use = True  # NOTE: per process, set by the model runner before its weights load (cpu_kernels)


def use(on: bool) -> None:
    """Whether QuantWeights built from now on in this process take these kernels."""
    global _use
    _use = on


def native() -> NativeGemv | None:
    """This process's library, built on first use; None where it is off or cannot run."""
    return _load()[0] if _use else None


def why_not() -> str | None:
    """Why `native()` is None; None where it is not."""
    return _load()[1] if _use else "cpu_kernels torch"


@functools.cache
def _load() -> tuple[NativeGemv | None, str | None]:
    # NOTE: ATEN_CPU_CAPABILITY caps torch's kernels below this CPU (how tests reproduce an
    # AVX2-only or a plain CPU): the C build takes the same cap
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if cap == "default":
        return None, "ATEN_CPU_CAPABILITY=default (no vector kernels)"
    if not {"avx2", "fma"} <= cpu_flags():
        return None, "the CPU has no AVX2 + FMA"
    if not torch.backends.openmp.is_available():
        return None, "torch is built without OpenMP"
    extra = ("-mno-avx512f",) if cap == "avx2" else ()
    try:
        lib = build(extra)
    except (OSError, RuntimeError) as exc:
        return None, str(exc)
    return lib, None


def build(extra_flags: tuple[str, ...] = ()) -> NativeGemv:
    """Compile (or find compiled) and load the library; RuntimeError naming what failed."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or $CC) to build weft's CPU kernels")
    flags = (*_FLAGS, *extra_flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            (SOURCE.read_text(), " ".join(flags), version, " ".join(sorted(cpu_flags())))
        ).encode()
    ).hexdigest()[:16]
    from weft.runtime.loaders.default_model import default_cache_root

    path = default_cache_root() / "kernels" / f"quant_gemv-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run(
                [cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True
            )
            if done.returncode:
                raise RuntimeError(f"{cc} could not build {SOURCE.name}: {done.stderr.strip()}")
            os.replace(tmp, path)  # NOTE: atomic: processes building at once each rename whole
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        logger.info("built weft's CPU kernels: %s", path)
    lib = ctypes.CDLL(str(path))
    for name in ("weft_gemv_int8", "weft_gemv_int4"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
        ]
    return NativeGemv(lib, lib.weft_gemv_lanes())
