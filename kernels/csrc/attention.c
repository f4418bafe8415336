/* Attention over the paged KV cache on a CPU: every row (a prompt's, a decode step's, a draft's).
 *
 * Query row t (a token at position len[t] - 1 of its request) attends to the keys at positions
 * lo[t] .. len[t] - 1 of its request, whose KV slots are table[rows[t] * stride + j]:
 *
 *   out[t, h] = sum_j softmax_j(s_j) v_j,   s_j = scale * q[t, h] . k_j   (c * tanh(s_j / c)
 *                                                                           with a cap c > 0)
 *
 * with k_j, v_j the KV head h / G (G = query heads per KV head). The G query heads of a KV head
 * share every key and value read, and so do the rows of a tile (up to TILE consecutive rows of
 * one request). The keys are taken VL at a time from lo[t] on, in one fixed order, with an
 * online softmax in float32; so a row's result depends on its own query and keys only, never on
 * which rows come with it, how many threads run, or where its buffers lie (the reason this
 * kernel exists: torch's SDPA takes other paths, summing in other orders, for a decode step, a
 * verify step and a prompt).
 *
 * q, out: float32 [T, Hq, D]. k, v: bfloat16 (kv_bf16) or float32 [slots, Hkv, D].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX2__)
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vint __attribute__((vector_size(VL * 4)));

/* a * b + c in one rounding where the ISA has it (the sums' order is the same either way) */
#if defined(__AVX512F__)
#include <immintrin.h>
#define FMA(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FMA(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif

static inline vf splat(float x) { return (vf){0} + x; } /* GCC broadcasts the scalar */

/* e^x lane by lane (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
 * then 2^n into the exponent bits); 0 below -87.3 (e^x would be denormal), so -inf gives 0. */
static inline vf vexp(vf x) {
    const vf lo = splat(-87.3f);
    const vint tiny = x < lo; /* true lanes are -1 */
    x = (vf)(((vint)x & ~tiny) | ((vint)lo & tiny));
    vf t = x * splat(1.44269504088896341f) + splat(0.5f);
    vint ti = __builtin_convertvector(t, vint);
    vf n = __builtin_convertvector(ti, vf);
    vint above = n > t;  /* truncation went up (t < 0): floor is one less */
    ti = ti + above;      /* true lanes are -1 */
    n = __builtin_convertvector(ti, vf);
    vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf z = r * r;
    vf y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * z + r + splat(1.0f);
    vint bits = (ti + 127) << 23;
    y = y * (vf)bits;
    return (vf)((vint)y & ~tiny);
}

/* One key or value (D entries at p, bfloat16 or float32) into float32, zero-padded to Dp. */
static inline void widen(const void *p, int kv_bf16, int D, int Dp, float *dst) {
    if (kv_bf16) {
        const uint16_t *h = p;
        for (int c = 0; c < D; c++) dst[c] = bf16_to_f32(h[c]);
    } else {
        memcpy(dst, p, (size_t)D * sizeof(float));
    }
    for (int c = D; c < Dp; c++) dst[c] = 0.0f;
}

#define TILE 16 /* rows of one request that share each block of widened keys and values */

struct task_buffers {
    float *q;    /* [TILE, G, Dp] the tile's query heads of this task */
    float *acc;  /* [TILE, G, Dp] */
    float *ml;   /* [TILE, 2, G] running max and sum */
    float *kt;   /* [D, VL] the block's keys, transposed */
    float *vb;   /* [VL, Dp] the block's values */
    float *p;    /* [G, VL] a row's probabilities in the block */
};

/* s[g] = the block's scores of query heads g < GB, each summed over c in order. GB is a constant
 * at each call (a switch below), so the GB accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_scores(const float *q, int Dp, int D,
                                                               const float *kt, const int GB,
                                                               vf *s) {
    vf acc[8];
    for (int g = 0; g < GB; g++) acc[g] = splat(0.0f);
    for (int c = 0; c < D; c++) {
        vf kc;
        memcpy(&kc, kt + c * VL, sizeof kc);
        for (int g = 0; g < GB; g++) acc[g] = FMA(splat(q[g * Dp + c]), kc, acc[g]);
    }
    for (int g = 0; g < GB; g++) s[g] = acc[g];
}

/* acc[g] += sum_jj p[g][jj] v[jj] over the block's nb values, query heads g < GB, one VL-wide
 * column chunk at a time (the GB accumulators of a chunk in registers). */
static inline __attribute__((always_inline)) void block_values(const float *p, const float *vb,
                                                               int Dp, int nb, const int GB,
                                                               float *acc) {
    for (int c = 0; c < Dp; c += VL) {
        vf a[8];
        for (int g = 0; g < GB; g++) memcpy(&a[g], acc + g * Dp + c, sizeof a[g]);
        for (int jj = 0; jj < nb; jj++) {
            vf r;
            memcpy(&r, vb + jj * Dp + c, sizeof r);
            for (int g = 0; g < GB; g++) a[g] = FMA(splat(p[g * VL + jj]), r, a[g]);
        }
        for (int g = 0; g < GB; g++) memcpy(acc + g * Dp + c, &a[g], sizeof a[g]);
    }
}

#define BY_GB(call)            \
    switch (gb) {              \
        case 1: call(1); break; \
        case 2: call(2); break; \
        case 3: call(3); break; \
        case 4: call(4); break; \
        case 5: call(5); break; \
        case 6: call(6); break; \
        case 7: call(7); break; \
        default: call(8); break; \
    }

/* One row's step over a block of nb keys (kt, vb): scores, the online softmax, the values.
 * Its arithmetic depends on the row's own query, keys and nb only (lanes past nb are masked,
 * whatever keys of other rows they hold). */
static inline void row_block(const float *q, float *acc, float *m, float *l, int G, int D,
                             int Dp, int nb, float scale, float cap, struct task_buffers *b) {
    for (int g0 = 0; g0 < G; g0 += 8) {
        const int gb = G - g0 < 8 ? G - g0 : 8;
        vf s[8];
#define SCORES(n) block_scores(q + g0 * Dp, Dp, D, b->kt, n, s)
        BY_GB(SCORES)
#undef SCORES
        for (int i = 0; i < gb; i++) {
            const int g = g0 + i;
            vf sg = s[i] * splat(scale);
            float block_max = -INFINITY;
            for (int jj = 0; jj < VL; jj++) {
                if (jj >= nb) {
                    sg[jj] = -INFINITY;
                    continue;
                }
                if (cap > 0.0f) sg[jj] = cap * tanhf(sg[jj] / cap);
                block_max = sg[jj] > block_max ? sg[jj] : block_max;
            }
            const float m_new = block_max > m[g] ? block_max : m[g];
            const float shrink = m[g] == -INFINITY ? 0.0f : expf(m[g] - m_new);
            vf p = vexp(sg - splat(m_new));
            float sum = 0.0f;
            for (int jj = 0; jj < VL; jj++) sum += p[jj];
            l[g] = l[g] * shrink + sum;
            m[g] = m_new;
            memcpy(b->p + g * VL, &p, sizeof p);
            if (shrink != 1.0f)
                for (int c = 0; c < Dp; c++) acc[g * Dp + c] *= shrink;
        }
#define VALUES(n) block_values(b->p + g0 * VL, b->vb, Dp, nb, n, acc + g0 * Dp)
        BY_GB(VALUES)
#undef VALUES
    }
}

/* Rows t0 .. t0 + n - 1 (one request, one lo), KV head h: each row's online softmax over its
 * keys lo .. len[t] - 1, VL keys a block from lo; a block's keys and values are widened once
 * for all the rows that reach it. */
static void attend_tile(const float *q, int hq, int hkv, int D, int Dp, const char *k,
                        const char *v, int kv_bf16, const int64_t *slots, int lo,
                        const int32_t *len, int n, float scale, float cap, int h, float *out,
                        struct task_buffers *b) {
    const int G = hq / hkv;
    const size_t esize = kv_bf16 ? 2 : 4;
    const size_t slot_bytes = (size_t)hkv * D * esize, head_bytes = (size_t)D * esize;
    int end = lo;
    for (int r = 0; r < n; r++) {
        end = len[r] > end ? len[r] : end;
        for (int g = 0; g < G; g++) {
            const float *src = q + ((int64_t)r * hq + h * G + g) * D;
            float *dst = b->q + (r * G + g) * Dp, *acc = b->acc + (r * G + g) * Dp;
            for (int c = 0; c < Dp; c++) dst[c] = c < D ? src[c] : 0.0f;
            for (int c = 0; c < Dp; c++) acc[c] = 0.0f;
            b->ml[(r * 2) * G + g] = -INFINITY;
            b->ml[(r * 2 + 1) * G + g] = 0.0f;
        }
    }
    for (int j0 = lo; j0 < end; j0 += VL) {
        const int nb_all = end - j0 < VL ? end - j0 : VL;
        for (int jj = 0; jj < VL; jj++) {
            float *row = b->vb + jj * Dp; /* scratch until the values come */
            if (jj < nb_all)
                widen(k + slots[j0 + jj] * slot_bytes + h * head_bytes, kv_bf16, D, Dp, row);
            else
                memset(row, 0, (size_t)Dp * sizeof(float));
            for (int c = 0; c < D; c++) b->kt[c * VL + jj] = row[c];
        }
        for (int jj = 0; jj < nb_all; jj++)
            widen(v + slots[j0 + jj] * slot_bytes + h * head_bytes, kv_bf16, D, Dp,
                  b->vb + jj * Dp);
        for (int r = 0; r < n; r++) {
            if (len[r] <= j0) continue;
            const int nb = len[r] - j0 < VL ? len[r] - j0 : VL;
            row_block(b->q + r * G * Dp, b->acc + r * G * Dp, b->ml + (r * 2) * G,
                      b->ml + (r * 2 + 1) * G, G, D, Dp, nb, scale, cap, b);
        }
    }
    for (int r = 0; r < n; r++)
        for (int g = 0; g < G; g++) {
            float *dst = out + ((int64_t)r * hq + h * G + g) * D;
            const float sum = b->ml[(r * 2 + 1) * G + g];
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (int c = 0; c < D; c++) dst[c] = b->acc[(r * G + g) * Dp + c] * inv;
        }
}

/* T rows on `threads` OpenMP threads. Runs of up to TILE rows of one request and one lo
 * (a prompt's, a verify step's) form tiles; a (tile, KV head) is a task, handed out as threads
 * come free, the last (longest: the latest positions) first. Returns 0, or -1 when out of
 * memory. */
int weft_attention_rows(const float *q, int T, int hq, int hkv, int D, const void *k,
                        const void *v, int kv_bf16, const int64_t *table, int64_t stride,
                        const int64_t *rows, const int32_t *lo, const int32_t *len, float scale,
                        float cap, float *out, int threads) {
    const int G = hq / hkv, Dp = (D + VL - 1) / VL * VL;
    int *starts = malloc(sizeof(int) * (size_t)(T + 1));
    if (!starts) return -1;
    int tiles = 0;
    for (int t = 0; t < T; t++)
        if (t == 0 || rows[t] != rows[t - 1] || lo[t] != lo[t - 1] || t - starts[tiles - 1] == TILE)
            starts[tiles++] = t;
    starts[tiles] = T;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        struct task_buffers b;
        const size_t floats =
            (size_t)(2 * TILE * G * Dp + 2 * TILE * G + D * VL + VL * Dp + G * VL);
        float *mem = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (!mem) failed = 1;
        b.q = mem;
        b.acc = b.q + TILE * G * Dp;
        b.ml = b.acc + TILE * G * Dp;
        b.kt = b.ml + 2 * TILE * G;
        b.vb = b.kt + D * VL;
        b.p = b.vb + VL * Dp;
#pragma omp for schedule(dynamic, 1)
        for (int task = tiles * hkv - 1; task >= 0; task--) {
            if (!mem) continue;
            const int i = task / hkv, h = task % hkv, t = starts[i];
            attend_tile(q + (int64_t)t * hq * D, hq, hkv, D, Dp, k, v, kv_bf16,
                        table + rows[t] * stride, lo[t], len + t, starts[i + 1] - t, scale, cap,
                        h, out + (int64_t)t * hq * D, &b);
        }
        free(mem);
    }
    free(starts);
    return failed ? -1 : 0;
}
