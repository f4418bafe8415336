"""Engine configuration: one frozen dataclass, one source of defaults.

The CLI flags are generated from these fields (see `weft.cli`); "auto" values are resolved by
`resolve_config`, a pure function that returns a new config once the model is known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from weft.grammars.spec import JSON_WHITESPACE_MAX, MAX_SPEC_CHARS
from weft.runtime.sampling_params import RequestLimits

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "gguf", "fp8")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SCHEDULE_POLICIES = ("lpm", "fcfs")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
CPU_KERNELS = ("auto", "torch")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def option(default: Any, help: str, **extra: Any) -> Any:
    """A config field: its default, and its CLI flag's help text (and argparse extras)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = option(
        None, "HF model folder or .gguf file; omitted = the embedded default model"
    )
    tokenizer_path: str | None = option(None, "tokenizer folder (defaults to the model's)")
    load_format: str = option("auto", "weights format", choices=LOAD_FORMATS)
    dtype: str = option("auto", "compute dtype", choices=DTYPES)
    device: str = option("auto", "cpu, cuda or auto")
    quantization: str = option(
        "auto",
        "GGUF weights: gguf keeps the linear weights quantized (int4 / int8 CPU kernels, "
        "bfloat16 activations), none dequantizes them to the dtype; auto: gguf on a CPU with "
        "bfloat16 in hardware, else none. HF folders and dummy weights: fp8 quantizes the "
        "linear weights to e4m3 per output channel at load (bfloat16 activations, quantized per "
        "token; GPUs of compute capability 8.9+ multiply in FP8; on a CPU ~30x slower than "
        "bfloat16, for tests); an FP8 checkpoint loads as published, except that none (and auto "
        "on a CPU) dequantizes it",
        choices=QUANTIZATIONS,
    )
    cpu_float32_products: bool = option(
        False,
        "on a CPU without bfloat16 in hardware (AVX2), run bfloat16 products of 4 rows or more "
        "(prefill, batched decode) in float32 over the bfloat16 weights: ~4x the prefill rate "
        "there; outputs may differ from the bfloat16 products' at near-ties",
    )
    cpu_kernels: str = option(
        "auto",
        "GGUF weights kept quantized on a CPU: auto multiplies decode steps with weft's own "
        "int8 / int4 kernels (C, compiled for the CPU on first use: AVX2 or AVX-512, a C "
        "compiler, torch with OpenMP) where they build, else with torch's packed kernels; "
        "torch uses torch's (~half the weight bandwidth)",
        choices=CPU_KERNELS,
    )
    quantized_prefill: bool = option(
        False,
        "with quantization gguf, multiply prompts with the weights as kept, no bfloat16 copy "
        "(weft's kernels: in float32, the weight dequantized a panel at a time; ~half the "
        "memory). Default: a bfloat16 copy of each quantized weight serves steps of more than 4 "
        "rows where the CPU has bf16 in hardware, as bf16 GEMM is faster there; on a CPU without "
        "it, with weft's kernels and cpu_float32_products off, prompts take weft's product",
    )
    context_length: int | None = option(
        None, "max tokens of prompt + output (default: the model's)"
    )
    max_total_tokens: int | None = option(None, "KV pool size in tokens (default: from memory)")
    mem_fraction_static: float = option(0.85, "GPU memory fraction for weights + KV pool")
    cpu_kv_cache_gb: float = option(2.0, "KV pool memory on the CPU when max_total_tokens is unset")
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the compute dtype) or fp8_e4m3 (one byte a value: twice the "
        "tokens in the same memory; each layer's K and V divided by a scale, the checkpoint's "
        "k_scale / v_scale where it has them, else 1.0; CUDA needs compute capability 8.9+)",
        choices=KV_CACHE_DTYPES,
    )
    max_running_requests: int = option(256, "max requests decoding at once")
    max_prompt_tokens: int | None = option(
        None, "refuse longer prompts (default: the context length)"
    )
    max_new_tokens_cap: int | None = option(
        None, "refuse requests asking for more new tokens (default: the context length)"
    )
    max_grammar_chars: int = option(
        MAX_SPEC_CHARS, "refuse longer regex / json_schema / ebnf / structural_tag texts"
    )
    chunked_prefill_size: int | None = option(
        None,
        "max prompt tokens prefilled per step (chunked prefill; default 8192 on a GPU of "
        ">= 35 GiB, else 2048)",
    )
    schedule_policy: str = option("lpm", "waiting-queue order", choices=SCHEDULE_POLICIES)
    disable_radix_cache: bool = option(False, "turn the prefix cache off")
    attention_backend: str = option(
        "auto",
        "attention implementation (auto: triton on CUDA, torch on the CPU)",
        choices=ATTENTION_BACKENDS,
    )
    disable_cuda_graph: bool = option(False, "run decode steps eagerly instead of from CUDA graphs")
    cuda_graph_max_bs: int | None = option(
        None,
        "largest decode batch captured in a CUDA graph (default min(256, max_running_requests))",
    )
    disable_overlap_schedule: bool = option(
        False,
        "read back each step's tokens before launching the next forward (by default, on "
        "CUDA, the next forward is launched first and the host work overlaps it)",
    )
    enable_overlap_schedule: bool = option(
        False,
        "run the overlap schedule on any device (by default on CUDA only: on a CPU the "
        "forward is synchronous, so it only delays the outputs; for tests of its logic)",
    )
    disable_fused_sampling: bool = option(
        False, "sample with the torch twin on CUDA too, not the fused Triton kernel"
    )
    grammar_backend: str = option(
        "xgrammar,llguidance,outlines",
        "grammar backends in fallback order, comma-separated (xgrammar, llguidance, "
        "outlines; none = no grammar, a benchmark baseline)",
    )
    grammar_compile_timeout: float = option(30.0, "seconds a backend may compile one grammar")
    grammar_race_budget: float = option(
        0.2,  # grammars.manager.RACE_BUDGET_S, where the reason is
        "seconds a grammar backend compiles a spec alone before the next in the order joins "
        "the race (the first to compile it serves; at most 0.02 s while other specs wait for "
        "a race; inf: no race, the order decides)",
    )
    constrained_json_disable_any_whitespace: bool = option(
        False,
        "JSON under a schema on one line with ', ' and ': ' (default: whitespace as the model "
        f"writes it, compact or indented, at most {JSON_WHITESPACE_MAX} characters in a run)",
    )
    disable_jump_forward: bool = option(
        False, "do not draft grammar-forced text for the model to verify"
    )
    enable_jump_forward: bool = option(
        False,
        "draft grammar-forced text even where CUDA graphs replay the decode steps (off there "
        "by default: a step that feeds drafts replays a graph too, but is not overlapped with "
        "the next; not measured since, and eagerly it ran 0.36x the tokens/s at batch 1); "
        "its drafts are fed at any batch, eagerly past the largest graph",
    )
    speculative_algorithm: str | None = option(
        None,
        "speculative decoding: ngram drafts the tokens that followed the text's last few tokens "
        "earlier in the prompt or output, draft has a small model of the same tokenizer "
        "(speculative_draft_model_path) draft them greedily (both after a grammar's forced "
        "tokens), and the model verifies them in one forward; greedy outputs are unchanged, "
        "sampled ones keep their distribution (a request opts out with sampling param "
        "speculative false)",
        choices=SPECULATIVE_ALGORITHMS,
    )
    speculative_draft_model_path: str | None = option(
        None,
        "with speculative_algorithm draft: the draft model (HF folder or .gguf file, loaded as "
        "the model is, dummy weights included), of the model's vocabulary and end tokens",
    )
    # NOTE: 7: on the CPU a verify step of 1 + 7 rows ran code editing at 2.84x, of 1 + 8 at
    # 2.66x (RESULTS.md; weft's kernels then passed over the weights once per 8 rows)
    speculative_num_draft_tokens: int = option(
        7, "most draft tokens a request verifies in one forward (speculative decoding)"
    )
    speculative_max_step_rows: int | None = option(
        None,
        "most rows a speculating decode step feeds (each request's token and its draft): the "
        "drafts past them are cut, those of requests whose drafts were kept least first; unset: "
        "8 on a CPU (one pass of weft's CPU kernels over the weights), 512 on CUDA",
    )
    speculative_row_cost: float | None = option(
        None,
        "what a drafted row costs, as a share of a one-row decode step: a draft token is fed "
        "where its chance of being kept beats its row's share of the step's tokens; unset: "
        "timed from the steps (before that 0.15 on a CPU, 0 on CUDA); 0: every token the "
        "drafter has, within speculative_max_step_rows",
    )
    profile_steps: bool = option(
        False,
        "record per-step timings (forward, grammar mask fill and accepts, sampling; CUDA events "
        "on a GPU) for benchmarks: Engine.scheduler.profile.take() (benchmarks/bench_constrained.py)",
    )
    tp_size: int = option(
        1,
        "tensor-parallel ranks: the model split over this many processes (one GPU each on "
        "CUDA; gloo on the CPU), driven by one scheduler",
    )
    nnodes: int = option(
        1, "hosts the tensor-parallel ranks span (tp_size / nnodes ranks on each, in order)"
    )
    node_rank: int = option(
        0,
        "this host's index among nnodes: 0 serves HTTP and schedules; the others only run "
        "their ranks",
    )
    dist_init_addr: str | None = option(
        None,
        "host:port where node 0 meets the other ranks (torch.distributed's TCP store, as "
        "torchrun's --master-addr and --master-port); needed with nnodes > 1 (default on one "
        "host: a free local port)",
    )
    random_seed: int = option(0, "seed for requests that set none")
    cache_dir: str | None = option(None, "where converted GGUF models live (default ~/.cache/weft)")
    num_threads: int | None = option(None, "CPU threads for torch")
    log_level: str = option("info", "logging level")
    show_progress: bool = option(True, "progress bars while loading")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # the choices its CLI flag offers, if any
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")
        for name in ("max_running_requests", "max_grammar_chars", "speculative_num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "context_length",
            "chunked_prefill_size",
            "max_total_tokens",
            "cuda_graph_max_bs",
            "max_prompt_tokens",
            "max_new_tokens_cap",
            "speculative_max_step_rows",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.speculative_row_cost is not None and self.speculative_row_cost < 0:
            raise ValueError(f"speculative_row_cost must be >= 0, got {self.speculative_row_cost}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}"
            )
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ValueError("enable_overlap_schedule and disable_overlap_schedule contradict")
        if self.enable_jump_forward and self.disable_jump_forward:
            raise ValueError("enable_jump_forward and disable_jump_forward contradict")
        order = self.grammar_backends
        known = ("xgrammar", "llguidance", "outlines", "none")
        if not order or any(name not in known for name in order):
            raise ValueError(
                f"grammar_backend must list backends from {', '.join(known)}; "
                f"got {self.grammar_backend!r}"
            )
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}"
            )
        if not self.grammar_race_budget >= 0:
            raise ValueError(f"grammar_race_budget must be >= 0, got {self.grammar_race_budget}")
        self._check_parallel()
        self._check_speculative()
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be cpu, cuda[:N] or auto, got {self.device!r}")

    def _check_parallel(self) -> None:
        for name in ("tp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes}): every "
                "host runs as many ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("nnodes > 1 needs dist_init_addr (node 0's host:port)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")

    def _check_speculative(self) -> None:
        drafting = self.speculative_algorithm == "draft"
        if drafting and self.speculative_draft_model_path is None:
            raise ValueError(
                "speculative_algorithm 'draft' needs speculative_draft_model_path (the draft model)"
            )
        if not drafting and self.speculative_draft_model_path is not None:
            raise ValueError(
                "speculative_draft_model_path is given but speculative_algorithm is "
                f"{self.speculative_algorithm!r}: set speculative_algorithm to 'draft'"
            )
        if drafting and self.tp_size > 1:
            raise ValueError(
                "speculative_draft_model_path: a draft model with tp_size > 1 is not supported yet"
            )

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(
            max_new_tokens=self.max_new_tokens_cap, max_grammar_chars=self.max_grammar_chars
        )

    @property
    def grammar_backends(self) -> list[str]:
        return [name.strip() for name in self.grammar_backend.split(",") if name.strip()]

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
