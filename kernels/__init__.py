"""Triton kernels, each with a torch reference twin (`<name>_ref`) and a checking wrapper.

    decode_attention   paged attention, one query token per request (split-K + merge)
    extend_attention   paged prefill/extend attention over a cached prefix + causal new tokens
    kv_store           write new tokens' K/V into the pool at their slots
    rmsnorm            fused residual add + RMSNorm (Gemma's 1 + weight too)
    rotary             rotate-half RoPE from cos/sin tables
    activation         SiLU-and-mul (GELU-tanh-and-mul too)
    fused_moe          mixture-of-experts MLP: grouped GEMMs over the tokens of each expert
    moe_routing        its top-k softmax and the grouping of tokens by expert (padded blocks)

and weft's C for CPUs (csrc/, built for the processor on first use by cpu_native): the int8 / int4
weight-only products of decode (quant_gemv.c; forms and torch twins in cpu_gemv) and attention
over the paged KV cache (attention.c), each row's bits independent of the rows beside it.

Import the modules themselves (`from weft.kernels.rmsnorm import rmsnorm`): this package imports
nothing, so `import weft.kernels` works where Triton is not installed.
CPU tensors run under Triton's interpreter (set TRITON_INTERPRET=1 before importing triton).
"""
