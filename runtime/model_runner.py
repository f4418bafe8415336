"""Model executor: resolves the model source, builds the model, sizes the KV pool, runs steps."""

from __future__ import annotations

import dataclasses
import logging

import torch

from weft.kernels import cpu_native
from weft.runtime.attention import AttentionBackend, TorchAttention
from weft.runtime.config import EngineConfig
from weft.runtime.core import ForwardBatch
from weft.runtime.cuda_graph import CudaGraphRunner
from weft.runtime.hardware import cpu_bf16_flags
from weft.runtime.kv_pool import KVPool, KVScales, ReqToTokenPool
from weft.runtime.loaders.fp8_plan import apply_fp8, fp8_text, resolve_fp8
from weft.runtime.loaders.source import ModelSource
from weft.runtime.loaders.weights import init_dummy, iter_safetensors, safetensors_files
from weft.runtime.model_config import ModelConfig
from weft.runtime.models import cpu_gemm
from weft.runtime.models.cpu_gemm import F32_MIN_ROWS, widen_bf16_gemm
from weft.runtime.models.fp8 import FP8_DTYPE, FP8Weight
from weft.runtime.models.layers import QUANT_MAX_ROWS, QuantRows, QuantWeight, quant_rows
from weft.runtime.models.registry import model_class
from weft.runtime.parallel import SINGLE, TPGroup

logger = logging.getLogger("weft")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: EngineConfig, model: ModelConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    stored = _DTYPES.get(model.torch_dtype or "", torch.bfloat16)
    if device.type == "cpu" and stored == torch.float16:
        return torch.bfloat16  # fp16 matmuls are slow on CPUs; bf16 has the same storage cost
    # NOTE: bf16 on a CPU without bf16 in hardware too: decode reads the weights (half the
    # bytes of float32: twice the speed); prefill's products may run in float32 there
    # (cpu_float32_products, models/cpu_gemm.py). The start log says which.
    return stored


# the warm-up's prefill: more rows than QUANT_MAX_ROWS, so that it takes the prefill path of
# GGUF weights kept quantized (their dense copy) as a real prompt does
WARM_UP_TOKENS = 2 * QUANT_MAX_ROWS


def resolve_kv_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's storage dtype (kv_cache_dtype); FP8 refused where the kernels cannot read it."""
    if config.kv_cache_dtype == "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype}: the Triton kernels read e4m3 on CUDA "
            f"compute capability 8.9 or later (Ada, Hopper); this GPU is {major}.{minor}"
        )
    return FP8_DTYPE


def _activation_text(dtype: torch.dtype, device: torch.device) -> str:
    name = str(dtype).removeprefix("torch.")
    if device.type != "cpu":
        return f"activations {name}"
    flags = cpu_bf16_flags()
    if flags:
        return f"activations {name} (CPU bf16 in hardware: {', '.join(flags)})"
    if dtype == torch.bfloat16 and widen_bf16_gemm():
        return (
            f"activations {name}, products of {F32_MIN_ROWS}+ rows in float32 "
            "(CPU without bf16 in hardware)"
        )
    return f"activations {name} (CPU without bf16 in hardware)"


def quantized_prefill(config: EngineConfig, quantized: list[QuantWeight]) -> bool:
    """Whether prompts multiply GGUF weights as they are kept (no bf16 copy): where asked
    (quantized_prefill), or on a CPU without bf16 in hardware where weft's kernels run and the
    float32 products are off. There torch emulates a bf16 GEMM at ~a quarter of its float32
    rate; weft's float32 product of the quantized weight, dequantized a panel at a time
    (kernels/csrc/quant_gemm.c), prefilled 140-164 tok/s on a 2-core AVX2 AMD EPYC where the
    copy's float32 products did 109 and the int16 kernels 94-97 (benchmarks/RESULTS.md), and the
    copy's memory (2 bytes a weight) is not held."""
    if config.quantized_prefill:
        return True
    native = bool(quantized) and quantized[0].native is not None
    return native and not cpu_bf16_flags() and not widen_bf16_gemm()


def _weights_text(
    quantized: list[QuantWeight],
    dtype: torch.dtype,
    quantized_prefill: bool,
    fp8: list[FP8Weight] | None = None,
) -> str:
    """The start log's account of how the linear weights are held."""
    name = str(dtype).removeprefix("torch.")
    if fp8:
        return f"{fp8_text(fp8)} linear weights; the rest {name}"
    if not quantized:
        return f"all {name}"
    forms = [w.form for w in quantized]
    counts = ", ".join(f"{forms.count(f)} {f}" for f in ("int4", "int8") if f in forms)
    native = quantized[0].native
    kernels = (
        f"weft's {native.isa} kernels"
        if native is not None
        else f"torch's packed kernels ({cpu_native.why_not()})"
    )
    if not quantized_prefill:
        prefill = f"steps of > {QUANT_MAX_ROWS} rows through a {name} copy of them"
    elif native is not None:
        prefill = "prompts through weft's float32 product of them, no copy"
    else:
        prefill = "prompts through them too, no copy"
    return (
        f"{counts} linear weights kept quantized from the GGUF, multiplied by {kernels}, "
        f"{prefill}; the rest {name}"
    )


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r} requested but CUDA is not available")
    return device


def resolve_attention_backend(choice: str, device: torch.device) -> str:
    """The attention backend ("triton" or "torch") for the configured choice: auto is Triton on
    CUDA where Triton is installed, torch elsewhere; Triton on another device is refused."""
    if choice == "auto":
        return "triton" if device.type == "cuda" and _has_triton() else "torch"
    if choice == "triton" and device.type != "cuda":
        raise ValueError("attention_backend 'triton' needs a CUDA device")
    return choice


def graph_max_bs(
    config: EngineConfig, device: torch.device, attention: AttentionBackend
) -> int | None:
    """The largest decode batch captured in CUDA graphs, None for no graphs: on CUDA with the
    Triton backend only (the torch backend's decode gathers a [B, context] slot table per step,
    too large to capture at the full context), unless disabled; cuda_graph_max_bs (default 256),
    never past max_running_requests."""
    if config.disable_cuda_graph or device.type != "cuda":
        return None
    from weft.runtime.triton_attention import TritonAttention

    if not isinstance(attention, TritonAttention):
        return None
    return min(config.cuda_graph_max_bs or 256, config.max_running_requests)


def gpu_pool_tokens(
    free_bytes: int,
    total_bytes: int,
    mem_fraction_static: float,
    bytes_per_token: int,
    context_length: int,
) -> int:
    """KV pool tokens on a GPU: what is free now, less the (1 - mem_fraction_static) share of the
    whole GPU kept back for activations and graphs; refused below one full-context request."""
    budget = free_bytes - total_bytes * (1.0 - mem_fraction_static)
    if budget <= bytes_per_token * context_length:
        raise ValueError(
            "not enough GPU memory for the KV cache: raise mem_fraction_static or lower "
            "context_length"
        )
    return int(budget // bytes_per_token)


class ModelRunner:
    """One rank's model, KV pool and attention backend. Under tensor parallelism (`tp`) every
    rank builds its own runner over its slice of the model and runs each step's `forward` and
    `logits` with the same batch, in the same order: the layers' collectives pair them up."""

    def __init__(self, config: EngineConfig, source: ModelSource, *, tp: TPGroup = SINGLE) -> None:
        self.config = config
        self.tp = tp
        self.model_config = ModelConfig.from_folder(source.folder)
        # NOTE: a rank's device is its group's (init_tp_group: one GPU per CUDA rank)
        self.device = resolve_device(config) if tp.size == 1 else tp.device
        self.dtype = resolve_dtype(config, self.model_config, self.device)
        if self.device.type == "cpu":
            cpu_gemm.enable(config.cpu_float32_products)
            cpu_native.use(config.cpu_kernels == "auto")
        cls = model_class(self.model_config.architecture)
        max_ctx = config.context_length or self.model_config.max_position_embeddings
        self.context_length = max_ctx
        cfg = self.model_config
        if max_ctx > cfg.max_position_embeddings:
            cfg = dataclasses.replace(cfg, max_position_embeddings=max_ctx)
        fp8_plan = resolve_fp8(config, cfg, source.load_format, self.dtype, self.device)
        # the KV heads this rank holds (all of them on one rank)
        self.num_kv_heads = tp.split_kv_heads(cfg.num_kv_heads).size
        with torch.device(self.device):
            self.model = cls(cfg, self.dtype, tp=tp)
        self.kv_dtype = resolve_kv_dtype(config, self.dtype, self.device)
        kv_scales = KVScales(cfg.num_layers)
        self._load_weights(source, kv_scales)
        apply_fp8(self.model, fp8_plan)
        if fp8_plan.why:
            logger.info("FP8: %s", fp8_plan.why)
        if fp8_plan.action != "none" and self.device.type == "cuda":
            # NOTE: the dense weights just replaced stay in torch's cache, which the KV pool's
            # size (from the driver's free memory) would not count
            torch.cuda.empty_cache()
        self.model.eval()
        quantized = [m for m in self.model.modules() if isinstance(m, QuantWeight)]
        fp8 = [m for m in self.model.modules() if isinstance(m, FP8Weight)]
        prefill_quantized = quantized_prefill(config, quantized)
        if prefill_quantized:
            for weight in quantized:
                weight.drop_dense()
        # weft's CPU kernels give a row the same bits in any step: the output tokens of decode,
        # verify and forced-token steps take them whatever their count (layers.QuantRows)
        self.row_invariant = any(w.native is not None for w in quantized)
        self.kv_pool = KVPool(
            self._pool_size(),
            cfg.num_layers,
            self.num_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
            kv_scales,
        )
        self.req_to_token = ReqToTokenPool(config.max_running_requests + 8, max_ctx, self.device)
        self.attention = self._attention_backend()
        self.graphs = self._capture_graphs()
        self._warm_up()
        logger.info(
            "model %s: %s, %s on %s%s; weights: %s; KV pool %d tokens (%.2f GB%s)",
            source.display_path,
            cfg.architecture,
            _activation_text(self.dtype, self.device),
            self.device,
            f" (tensor-parallel rank {tp.rank} of {tp.size})" if tp.size > 1 else "",
            _weights_text(quantized, self.dtype, prefill_quantized, fp8),
            self.kv_pool.size,
            self.kv_pool.size * self.kv_pool.bytes_per_token / 1e9,
            f", fp8_e4m3, {self.kv_pool.scales.describe()}" if self.kv_pool.quantized else "",
        )

    def _warm_up(self) -> None:
        """One prefill step and one decode step on a scratch request, so that the first request
        does not pay what a first forward pays: on a GPU the Triton kernels that CUDA-graph
        capture did not build (the extend kernel is compiled on its first launch: seconds); on a
        CPU little (the default model: 0.13 s, the next prefill 0.09 s). Its KV slots and row go
        back to the pools."""
        tokens = min(WARM_UP_TOKENS, self.context_length, self.kv_pool.size)
        row = self.req_to_token.allocate()
        slots = self.kv_pool.allocate(tokens)
        self.req_to_token.write(row, 0, slots)
        try:
            if tokens > 1:
                self._scratch_step(row, slots, 0, tokens - 1)  # the prefill
            self._scratch_step(row, slots, tokens - 1, 1)  # a decode step
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.kv_pool.free(slots)
            self.req_to_token.free(row)

    def _scratch_step(self, row: int, slots: torch.Tensor, start: int, n: int) -> None:
        """A forward and logits of n tokens at positions start.. of `row` (slots: the row's)."""

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        batch = ForwardBatch(
            input_ids=column([0] * n),
            positions=column(list(range(start, start + n))),
            out_cache_loc=slots[start : start + n].to(self.device),
            req_pool_indices=column([row]),
            seq_lens=column([start + n]),
            prefix_lens=column([start]),
            extend_lens=column([n]),
            logits_indices=column([n - 1]),
            seq_lens_cpu=[start + n],
            prefix_lens_cpu=[start],
            extend_lens_cpu=[n],
        )
        self.logits(self.forward(batch))

    def _attention_backend(self) -> AttentionBackend:
        if resolve_attention_backend(self.config.attention_backend, self.device) == "triton":
            from weft.runtime.triton_attention import TritonAttention

            return TritonAttention(self.kv_pool, self.req_to_token)
        # weft's C attention on a CPU (bf16 / float32 KV): a row's bits whatever the step
        c_kv = self.device.type == "cpu" and self.kv_pool.dtype in (torch.bfloat16, torch.float32)
        native = cpu_native.native() if c_kv else None
        return TorchAttention(self.kv_pool, self.req_to_token, native=native)

    def _capture_graphs(self) -> CudaGraphRunner | None:
        max_bs = graph_max_bs(self.config, self.device, self.attention)
        if max_bs is None:
            return None
        graphs = CudaGraphRunner(
            self.model,
            self.attention,
            max_bs,
            self.context_length,
            self.kv_pool.scratch_slot,
            self.device,
        )
        graphs.capture()
        with torch.inference_mode():
            # NOTE: the logits of one row run the GEMV kernel with the lm_head's tiles: compiled
            # here, not on the first request that samples alone (a Triton compile takes seconds)
            hidden = torch.zeros(
                1, self.model_config.hidden_size, dtype=self.dtype, device=self.device
            )
            self.logits(hidden)
        return graphs

    def _load_weights(self, source: ModelSource, kv_scales: KVScales) -> None:
        """The checkpoint's tensors into the model; its KV cache scales into `kv_scales` (used
        by an FP8 pool, else ignored)."""
        if source.load_format == "dummy":
            init_dummy(self.model, self.config.random_seed)
            return
        files = safetensors_files(source.folder)
        weights = kv_scales.take(iter_safetensors(files, self.device, self.config.show_progress))
        with torch.no_grad():
            loaded = self.model.load_weights(weights)  # type: ignore[operator]
        expected = {n for n, _ in self.model.named_parameters()}
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"checkpoint in {source.folder} lacks {len(missing)} tensor(s): {shown}"
            )

    def _pool_size(self) -> int:
        cfg, config = self.model_config, self.config
        if config.max_total_tokens is not None:
            return config.max_total_tokens
        per_token = 2 * cfg.num_layers * self.num_kv_heads * cfg.head_dim * self.kv_dtype.itemsize
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            tokens = gpu_pool_tokens(
                free, total, config.mem_fraction_static, per_token, self.context_length
            )
            # NOTE: every rank's pool holds the same slots (one scheduler hands them out)
            return self.tp.min_int(tokens)
        budget_tokens = int(config.cpu_kv_cache_gb * 1e9 // per_token)
        return max(min(budget_tokens, 4 * self.context_length), 1024)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [K, hidden] of the rows in batch.logits_indices."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.replay(batch)
        with quant_rows(self._decode_rows(batch)):
            return self.model(batch, self.attention)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[K, hidden] -> [K, vocab] float32; rows: of hidden, [n] -> [n, vocab]."""
        if rows is not None:
            hidden = hidden[rows]
        # every row's logits through the quantized lm_head where it is weft's (see QuantRows)
        with quant_rows(QuantRows(hidden.shape[0]) if self.row_invariant else None):
            return self.model.compute_logits(hidden)  # type: ignore[operator]

    def _decode_rows(self, batch: ForwardBatch) -> QuantRows | None:
        """The step's tokens of requests that add output tokens only (decode, drafts to
        verify, forced tokens), for weft's CPU kernels (QuantRows); prompt tokens keep the
        dense copy. None where the weights are not those kernels' or the batch does not say."""
        flags = batch.output_only_cpu
        if not self.row_invariant or not flags:
            return None
        if all(flags):
            return QuantRows(len(batch.input_ids))
        rows: list[int] = []
        start = 0
        for n, output in zip(batch.extend_lens_cpu, flags, strict=True):
            if output:
                rows.extend(range(start, start + n))
            start += n
        return QuantRows(start, torch.tensor(rows, dtype=torch.long))
