/* What weft's C kernels for CPUs share: bfloat16 to float32 and back. */
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

#endif
