"""Triton kernels, each with a torch reference twin (`<name>_ref`) and a checking wrapper.

    decode_attention   paged attention, one query token per request (split-K + merge)
    extend_attention   paged prefill/extend attention over a cached prefix + causal new tokens
    kv_store           write new tokens' K/V into the pool at their slots
    rmsnorm            fused residual add + RMSNorm (Gemma's 1 + weight too)
    rotary             rotate-half RoPE from cos/sin tables
    activation         SiLU-and-mul (GELU-tanh-and-mul too)
    fused_moe          mixture-of-experts MLP: grouped GEMMs over the tokens of each expert
    moe_routing        its top-k softmax and the grouping of tokens by expert (padded blocks)

and one in C for CPUs: cpu_gemv (csrc/quant_gemv.c), the int8 / int4 weight-only products of
decode, compiled for the processor on first use.

Import the modules themselves (`from weft.kernels.rmsnorm import rmsnorm`): this package imports
nothing, so `import weft.kernels` works where Triton is not installed.
CPU tensors run under Triton's interpreter (set TRITON_INTERPRET=1 before importing triton).
"""
