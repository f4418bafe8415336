/* What weft's C kernels for CPUs share: bfloat16 to float32 and back, a thread's share. */
#ifndef WEFT_CPU_COMMON_H
#define WEFT_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Rounded to nearest even; a NaN stays a NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* The calling OpenMP thread's outputs [lo, hi) of n, in whole steps (the last thread takes the
   rest). */
static inline void thread_share(int n, int step, int *lo, int *hi) {
#ifdef _OPENMP
    extern int omp_get_thread_num(void), omp_get_num_threads(void);
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    int t = 0, nt = 1;
#endif
    int64_t units = n / step;
    *lo = step * (int)(units * t / nt);
    *hi = t == nt - 1 ? n : step * (int)(units * (t + 1) / nt);
}

#endif
