/* What weft's C kernels for CPUs share: bfloat16 to float32. */
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

#endif
