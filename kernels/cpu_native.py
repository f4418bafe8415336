"""weft's C kernels for CPUs (csrc/): compiled for this processor on first use into one
library, called through ctypes.

    quant_gemv.c   int8 / int4 weight-only products, x widened to int16 (output tokens;
                   kernels/cpu_gemv.py)
    quant_gemm.c   the same weights against many rows in float32, dequantized a panel at a time
                   (prompts, on a CPU without bf16 in hardware)
    attention.c    attention over the paged KV cache, a row's bits whatever comes with it

The build: the C compiler (`$CC`, else cc / gcc) with -O3 -march=native -fopenmp, into
`<cache>/kernels/<hash>.so`; the hash covers the sources, the flags, the compiler and the CPU's
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

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "quant_gemv.c", CSRC / "quant_gemm.c", CSRC / "attention.c")
HEADERS = (CSRC / "cpu_common.h",)
# Rows of x a call of the product takes: each call widens its rows (int16, 2 bytes a value, or
# float32 for prompts, 4: ~78 MB at K 18944) and reads the weight once; more rows, more calls
CALL_ROWS = 1024
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_ISA = {16: "AVX-512", 8: "AVX2"}


@dataclass(frozen=True)
class RowSlots:
    """Where attention rows find their keys: row t is a token at position lens[t] - 1 of the
    request in `table` row rows[t] (int64 [T]) and sees positions lo[t] .. lens[t] - 1 (int32
    [T] each; lo > 0 under a sliding window). table: the pool's req_to_token, int64."""

    table: torch.Tensor
    rows: torch.Tensor
    lo: torch.Tensor
    lens: torch.Tensor


@dataclass(frozen=True)
class NativeCPU:
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
        """x bf16 [M, K] @ the int4 weight of `cpu_gemv.pack_int4` (packed u8 [N, K/2], so
        bf16 [N, K/32, 2])^T -> bf16 [M, N]."""
        return self._run(self.lib.weft_gemv_int4, x, packed, so)

    def prompt_int8(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """As `int8`, summed in float32 over the dequantized weight (quant_gemm.c): another
        row's bits than `int8`'s, the same in any product."""
        return self._run(self.lib.weft_gemm_int8, x, q, scale)

    def prompt_int4(self, x: torch.Tensor, packed: torch.Tensor, so: torch.Tensor) -> torch.Tensor:
        """As `int4`, summed in float32 over the dequantized weight (quant_gemm.c)."""
        return self._run(self.lib.weft_gemm_int4, x, packed, so)

    def attention(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        slots: RowSlots,
        *,
        scale: float,
        logit_cap: float | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D] over the pool's k/v [S, Hkv, D] (bf16 or float32) -> float32 [T, Hq, D]:
        row t attends to the keys at positions slots.lo[t] .. slots.lens[t] - 1 of its request
        (slots.table[slots.rows[t]]). A row's bits depend on its own query and keys only."""
        num_tokens, hq, dim = q.shape
        hkv = k_buf.shape[1]
        assert k_buf.shape == v_buf.shape and k_buf.shape[2] == dim and hq % hkv == 0
        assert k_buf.dtype == v_buf.dtype and k_buf.dtype in (torch.bfloat16, torch.float32)
        assert k_buf.is_contiguous() and v_buf.is_contiguous() and slots.table.is_contiguous()
        assert slots.rows.shape == slots.lo.shape == slots.lens.shape == (num_tokens,)
        q = q.float().contiguous()
        out = torch.empty_like(q)
        status = self.lib.weft_attention_rows(
            q.data_ptr(),
            num_tokens,
            hq,
            hkv,
            dim,
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            int(k_buf.dtype == torch.bfloat16),
            slots.table.data_ptr(),
            slots.table.stride(0),
            slots.rows.data_ptr(),
            slots.lo.data_ptr(),
            slots.lens.data_ptr(),
            scale,
            0.0 if logit_cap is None else logit_cap,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise MemoryError("weft CPU attention: no memory for its per-thread buffers")
        return out

    def _run(self, fn, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        m, n = x.shape[0], w.shape[0]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        threads = torch.get_num_threads()
        for lo in range(0, m, CALL_ROWS):
            rows = min(CALL_ROWS, m - lo)
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


_use = True  # NOTE: per process, set by the model runner before its weights load (cpu_kernels)


def use(on: bool) -> None:
    """Whether QuantWeights built from now on in this process take these kernels."""
    global _use
    _use = on


def native() -> NativeCPU | None:
    """This process's library, built on first use; None where it is off or cannot run."""
    return _load()[0] if _use else None


def why_not() -> str | None:
    """Why `native()` is None; None where it is not."""
    return _load()[1] if _use else "cpu_kernels torch"


@functools.cache
def _load() -> tuple[NativeCPU | None, str | None]:
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


def build(extra_flags: tuple[str, ...] = ()) -> NativeCPU:
    """Compile (or find compiled) and load the library; RuntimeError naming what failed."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or $CC) to build weft's CPU kernels")
    flags = (*_FLAGS, *extra_flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            (
                *(f.read_text() for f in (*SOURCES, *HEADERS)),
                " ".join(flags),
                version,
                " ".join(sorted(cpu_flags())),
            )
        ).encode()
    ).hexdigest()[:16]
    from weft.runtime.loaders.default_model import default_cache_root

    path = default_cache_root() / "kernels" / f"weft-cpu-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run(
                [cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True
            )
            if done.returncode:
                raise RuntimeError(
                    f"{cc} could not build weft's CPU kernels: {done.stderr.strip()}"
                )
            os.replace(tmp, path)  # NOTE: atomic: processes building at once each rename whole
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        logger.info("built weft's CPU kernels: %s", path)
    lib = ctypes.CDLL(str(path))
    for name in ("weft_gemv_int8", "weft_gemv_int4", "weft_gemm_int8", "weft_gemm_int4"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        # (x, rows, K, w, scales, out, N, threads)
        fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int] * 2, *[ctypes.c_void_p] * 3]
        fn.argtypes += [ctypes.c_int] * 2
    attention = lib.weft_attention_rows
    attention.restype = ctypes.c_int
    attention.argtypes = [
        ctypes.c_void_p,
        *[ctypes.c_int] * 4,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        *[ctypes.c_void_p] * 3,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    return NativeCPU(lib, lib.weft_gemv_lanes())
