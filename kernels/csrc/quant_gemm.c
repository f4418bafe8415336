/* Products of many rows (prompts) with weft's quantized weights on a CPU, in float32:
 * out[m, n] = sum_k x[m, k] w[n, k], w dequantized to float32 a panel at a time.
 *
 * quant_gemv.c multiplies x widened to int16 with the weight's integers: one pmaddwd and one add
 * for 16 products, the weight widened again for every few rows of x. Past a few rows that is no
 * faster than float32 FMA (8 products an instruction) without AVX-512 VNNI, and on a CPU without
 * bf16 in hardware (AVX2, AVX-512 without AVX512_BF16) torch's bf16 GEMM is emulated at a
 * quarter of its float32 rate. Here each thread dequantizes KC columns of NB rows of w (a panel,
 * float32 [NB / NP][KC][NP]) into its own buffer once per block of x's rows; RM rows of x at a
 * time pass over it, an RM x NP tile of the output summed in RM * 2 vector registers, one FMA a
 * product, carried in float32 from one panel of columns to the next: a blocked float32 GEMM
 * whose weight comes from the quantized form (no float32 or bf16 copy of the weight is held).
 *
 * The sum of out[m, n] is k = 0 .. K-1 in order, one FMA each, in its own lane: a row's bits
 * depend on its own row of x only, whatever rows, threads or blocks come with it (a prompt
 * computes alike whole, in chunks or after a cached prefix). They differ from quant_gemv.c's for
 * the same row (x is not rounded to int16 here).
 *
 * Forms as quant_gemv.c's: int8 w [N, K] with a bf16 scale per row; int4 groups of 32 along K,
 * 16 bytes a group (byte i: k = i low nibble, k = i + 16 high), bf16 (scale, offset) per group:
 * w = q * scale + offset. x and out are bfloat16 [M, K] and [M, N].
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(VL * 4)));

/* BCAST: the float at p in every lane, one load (GCC's `(vf){0} + x` adds the zero first) */
#if defined(__AVX512F__)
#define FMA(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#define BCAST(p) ((vf)_mm512_set1_ps(*(p)))
#elif defined(__AVX2__) && defined(__FMA__)
#define FMA(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define BCAST(p) ((vf)_mm256_broadcast_ss(p))
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#define BCAST(p) ((vf){*(p), *(p), *(p), *(p)})
#endif

#define RM 6            /* rows of x a tile holds: 6 x 2 accumulators, 2 of w, 1 of x: 15 of 16 */
#define NP (2 * VL)     /* rows of w a tile sums */
#define NB 64           /* rows of w in a panel: NB / NP tiles' worth, for each rows of x read */
#define KC 64           /* columns of a panel: KC x NB floats, 16 KB, within L1 */
#define GROUP 32        /* int4 group (KC is a multiple) */
#define X_BLOCK_BYTES (384 << 10) /* KC columns of x's rows a block (1536 rows): within L2 */

/* Where row j (of NB) and column k (of KC) of w sit in a panel: tile j / NP, [k][j % NP]. */
static inline int at_panel(int j, int k) { return (j / NP) * KC * NP + k * NP + j % NP; }

/* Columns k0 .. k0 + kc - 1 of rows n0 .. n0 + NB - 1 of w into the panel (0 past row N - 1). */
static void panel_int8(const int8_t *w, const uint16_t *scale, int K, int N, int n0, int k0,
                       int kc, float *panel) {
    for (int j = 0; j < NB; j++) {
        float *p = panel + at_panel(j, 0);
        int n = n0 + j;
        if (n >= N) {
            for (int k = 0; k < kc; k++) p[k * NP] = 0.0f;
            continue;
        }
        const int8_t *row = w + (int64_t)n * K + k0;
        float s = bf16_to_f32(scale[n]);
        for (int k = 0; k < kc; k++) p[k * NP] = (float)row[k] * s;
    }
}

/* k0 and kc whole groups. */
static void panel_int4(const uint8_t *w, const uint16_t *so, int K, int N, int n0, int k0,
                       int kc, float *panel) {
    int G = K / GROUP;
    for (int j = 0; j < NB; j++) {
        int n = n0 + j;
        if (n >= N) {
            float *p = panel + at_panel(j, 0);
            for (int k = 0; k < kc; k++) p[k * NP] = 0.0f;
            continue;
        }
        for (int g = 0; g < kc / GROUP; g++) {
            int64_t at = (int64_t)n * G + k0 / GROUP + g;
            float s = bf16_to_f32(so[at * 2]), o = bf16_to_f32(so[at * 2 + 1]);
            const uint8_t *b = w + at * (GROUP / 2);
            float *p = panel + at_panel(j, g * GROUP);
            for (int i = 0; i < GROUP / 2; i++) {
                p[i * NP] = (float)(b[i] & 15) * s + o;
                p[(i + GROUP / 2) * NP] = (float)(b[i] >> 4) * s + o;
            }
        }
    }
}

/* acc rows 0 .. M - 1 (M <= RM, NB floats apart; NP of them here) += x rows (from column k0, row
 * stride K) . a tile's kc columns of the panel; acc starts at 0 where `first`. */
static inline __attribute__((always_inline)) void tile(const float *xf, int M, int K, int kc,
                                                       const float *panel, float *acc, int first) {
    vf c[RM][2];
#pragma GCC unroll 6
    for (int m = 0; m < M; m++) {
        if (first) {
            c[m][0] = c[m][1] = (vf){0};
        } else {
            memcpy(&c[m][0], acc + m * NB, sizeof(vf));
            memcpy(&c[m][1], acc + m * NB + VL, sizeof(vf));
        }
    }
    for (int k = 0; k < kc; k++) {
        vf b0 = *(const vf *)(panel + k * NP), b1 = *(const vf *)(panel + k * NP + VL);
#pragma GCC unroll 6
        for (int m = 0; m < M; m++) {
            vf a = BCAST(xf + (int64_t)m * K + k);
            c[m][0] = FMA(a, b0, c[m][0]);
            c[m][1] = FMA(a, b1, c[m][1]);
        }
    }
    /* NOTE: unrolled, as the loops above: c indexed by a variable anywhere made GCC keep it on
     * the stack, storing every accumulator each step (half the FMA rate) */
#pragma GCC unroll 6
    for (int m = 0; m < M; m++) {
        memcpy(acc + m * NB, &c[m][0], sizeof(vf));
        memcpy(acc + m * NB + VL, &c[m][1], sizeof(vf));
    }
}

/* M (<= RM) rows of x against each tile of the panel: the rows' kc columns stay in L1. */
static inline __attribute__((always_inline)) void tile_row(const float *xf, int M, int K, int kc,
                                                           const float *panel, float *acc,
                                                           int first) {
    for (int t = 0; t < NB / NP; t++) tile(xf, M, K, kc, panel + t * KC * NP, acc + t * NP, first);
}

/* Rows m0 .. m1 - 1 of x against the panel (columns k0 .. k0 + kc - 1), RM at a time; acc holds
 * row m0's sums first. */
static void tiles(const float *xf, int m0, int m1, int K, int k0, int kc, const float *panel,
                  float *acc, int first) {
    int m = m0;
    for (; m + RM <= m1; m += RM)
        tile_row(xf + (int64_t)m * K + k0, RM, K, kc, panel, acc + (int64_t)(m - m0) * NB, first);
    const float *xm = xf + (int64_t)m * K + k0;
    float *am = acc + (int64_t)(m - m0) * NB;
    switch (m1 - m) {
        case 5: tile_row(xm, 5, K, kc, panel, am, first); break;
        case 4: tile_row(xm, 4, K, kc, panel, am, first); break;
        case 3: tile_row(xm, 3, K, kc, panel, am, first); break;
        case 2: tile_row(xm, 2, K, kc, panel, am, first); break;
        case 1: tile_row(xm, 1, K, kc, panel, am, first); break;
        default: break;
    }
}

/* form 8: w int8 [N, K], scales bf16 [N]; form 4: w u8 [N, K / 2], scales bf16 [N, K / 32, 2].
 * Returns 0, or -1 when out of memory. */
static int gemm(int form, const uint16_t *x, int M, int K, const void *w, const uint16_t *scales,
                uint16_t *out, int N, int threads) {
    float *xf = malloc((size_t)M * K * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < (int64_t)M * K; i++) xf[i] = bf16_to_f32(x[i]);
    const int mb = X_BLOCK_BYTES / (KC * 4) / RM * RM;
    int panels = (N + NB - 1) / NB, failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *panel = aligned_alloc(64, KC * NB * sizeof(float));
        float *acc = aligned_alloc(64, (size_t)mb * NB * sizeof(float));
        if (!panel || !acc) {
            failed = 1;
        } else {
            int lo, hi;
            thread_share(panels, 1, &lo, &hi);
            for (int m0 = 0; m0 < M; m0 += mb) {
                int m1 = m0 + mb < M ? m0 + mb : M;
                for (int p = lo; p < hi; p++) {
                    int n0 = p * NB, cols = N - n0 < NB ? N - n0 : NB;
                    for (int k0 = 0; k0 < K; k0 += KC) {
                        int kc = K - k0 < KC ? K - k0 : KC;
                        if (form == 8)
                            panel_int8(w, scales, K, N, n0, k0, kc, panel);
                        else
                            panel_int4(w, scales, K, N, n0, k0, kc, panel);
                        tiles(xf, m0, m1, K, k0, kc, panel, acc, k0 == 0);
                    }
                    for (int m = m0; m < m1; m++)
                        for (int j = 0; j < cols; j++)
                            out[(int64_t)m * N + n0 + j] = f32_to_bf16(acc[(int64_t)(m - m0) * NB + j]);
                }
            }
        }
        free(panel);
        free(acc);
    }
    free(xf);
    return failed ? -1 : 0;
}

int weft_gemm_int8(const uint16_t *x, int M, int K, const int8_t *w, const uint16_t *scale,
                   uint16_t *out, int N, int threads) {
    return gemm(8, x, M, K, w, scale, out, N, threads);
}

/* K % 32 == 0. */
int weft_gemm_int4(const uint16_t *x, int M, int K, const uint8_t *w, const uint16_t *so,
                   uint16_t *out, int N, int threads) {
    return gemm(4, x, M, K, w, so, out, N, threads);
}
