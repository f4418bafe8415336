/* Weight-only quantized matrix products on a CPU: out[m, n] = x[m, :] . w[n, :], for any M.
 *
 * Decode is bound by reading weights; torch's packed int4/int8 CPU kernels stream them at about
 * half the memory's read rate (RESULTS.md, issue 21). These stream each weight row once for all
 * M rows of x: a thread takes its rows of w a block at a time (BLOCK_BYTES, within the core's
 * L1), and every group of MR rows of x passes over the block while it is there. MR is what the
 * registers hold: MR x NR accumulators (NR rows of w at a time), 16 vector registers in AVX2, 32
 * in AVX-512. x is widened to int16 with one scale per row (max |x| / 32767: finer than x's own
 * bfloat16), the weight's integers are multiplied with it in int16 lanes and summed in int32
 * (AVX-512 VNNI's vpdpwssd, else pmaddwd), then scaled in float32.
 *
 * Forms (kernels/cpu_gemv.py packs them):
 *   int8: w int8 [N, K], one bfloat16 scale per row: w = q * scale.
 *   int4: groups of 32 along K, 16 bytes a group: byte i holds k = i in its low nibble and
 *         k = i + 16 in its high one; per group a bfloat16 scale s and offset o: w = q * s + o
 *         (q in 0..15).
 * x and out are bfloat16 [M, K] and [M, N]. Rows of w are split over OpenMP threads in
 * contiguous blocks, so each thread streams its own part of the weight. A row of the output
 * depends on its own row of x only: the same bits whatever rows come with it, in a group of MR
 * or not, and however the rows of w are grouped (each x row and w row pair has accumulators of
 * its own, summed in one order).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define PREFETCH(p) __builtin_prefetch(p)
#endif

#define GROUP 32
#define BLOCK_BYTES (16 << 10) /* a thread's block of w: half a Zen 4 / Intel L1 */

/* The vector layer of the int8 product: KS int16 lanes a step. W16 widens KS int8 of w, XL
 * loads KS int16 of x, DPW adds the products of adjacent lane pairs into KS / 2 int32 lanes. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
#define KS 32
#define MR 8
typedef __m512i vi;
#define W16(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define XL(p) _mm512_loadu_si512((const void *)(p))
#define IZERO() _mm512_setzero_si512()
#define ISUM(v) _mm512_reduce_add_epi32(v)
#if defined(__AVX512VNNI__)
#define DPW(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DPW(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define KS 16
/* NOTE: 3 x 2 accumulators, as many products before they are added, and 2 rows of w fit the 16
 * registers; at 4 x 2 GCC spilled an accumulator, whose store-to-load chain held every step
 * (9 int16 products a cycle on Zen 4 where pmaddwd does 32) */
#define MR 3
typedef __m256i vi;
#define W16(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define XL(p) _mm256_loadu_si256((const __m256i *)(p))
#define IZERO() _mm256_setzero_si256()
#define DPW(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
static inline int ISUM(vi v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define LANES 1
#define KS 1
#define MR 8
typedef int32_t vi;
#define W16(p) ((int32_t) * (p))
#define XL(p) ((int32_t) * (p))
#define IZERO() 0
#define ISUM(v) (v)
#define DPW(acc, a, b) ((acc) + (a) * (b))
#endif
/* steps summed in int32 before float32: each adds at most 2 * 127 * 32767 to a lane */
#define CHUNK 128

/* Which vector path this build took: 16 (AVX-512), 8 (AVX2 + FMA) or 1 (scalar C). */
int weft_gemv_lanes(void) { return LANES; }

/* Rows of w in a thread's block: BLOCK_BYTES of them, whole steps, at least one step. */
static int block_rows(int64_t row_bytes, int step) {
    int64_t rows = BLOCK_BYTES / row_bytes / step * step;
    return rows < step ? step : (int)rows;
}

/* A row of x -> its int16 scale: max |x| / 32767 (1 for a row of zeros). */
static float x16_scale(const uint16_t *row, int K) {
    float peak = 0.0f;
    for (int k = 0; k < K; k++) {
        float v = bf16_to_f32(row[k]), a = v < 0.0f ? -v : v;
        peak = a > peak ? a : peak;
    }
    return peak > 0.0f ? peak / 32767.0f : 1.0f;
}

/* Calls body(mr) with mr a constant 1 .. MR, so each inlined copy keeps its accumulators in
 * registers. */
#if MR == 8
#define BY_ROWS(mr, body)                  \
    switch (mr) {                          \
        case 1: body(1); break;            \
        case 2: body(2); break;            \
        case 3: body(3); break;            \
        case 4: body(4); break;            \
        case 5: body(5); break;            \
        case 6: body(6); break;            \
        case 7: body(7); break;            \
        default: body(8); break;           \
    }
#elif MR == 3
#define BY_ROWS(mr, body)                  \
    switch (mr) {                          \
        case 1: body(1); break;            \
        case 2: body(2); break;            \
        default: body(3); break;           \
    }
#endif

/* --- int8 --------------------------------------------------------------------------------
 * Row n of the output: scale[n] * xs * (q . xq), q . xq in int32 lanes CHUNK steps at a time.
 * NR rows of w (n .. n+NR-1) against M (<= MR) rows of x: NR * M accumulators. */
static inline __attribute__((always_inline)) void int8_rows(
    const uint16_t *x, const int16_t *xq, const float *xs, int M, int NR, int K, const int8_t *w,
    const uint16_t *scale, uint16_t *out, int N, int n) {
    float sums[4][MR];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < M; m++) sums[r][m] = 0.0f;
    const int8_t *row = w + (int64_t)n * K;
    int k = 0;
    while (k + KS <= K) {
        vi d[4][MR];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) d[r][m] = IZERO();
        int end = k + CHUNK * KS < K - KS + 1 ? k + CHUNK * KS : K - KS + 1;
        for (; k < end; k += KS) {
            /* NOTE: rows shorter than a few KB (896 bytes in a 0.5B model) end before the
             * hardware prefetcher ramps up: fetching the next block of rows ahead, as fast as
             * this one is read, streams the weight at ~28 GB/s on 2 Zen 4 cores, not ~13 */
            PREFETCH(row + NR * (int64_t)K + NR * (int64_t)k);
            if (KS * NR > 64) PREFETCH(row + NR * (int64_t)K + NR * (int64_t)k + 64);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                vi wv = W16(row + (int64_t)r * K + k);
#pragma GCC unroll 8
                for (int m = 0; m < M; m++) d[r][m] = DPW(d[r][m], wv, XL(xq + (int64_t)m * K + k));
            }
        }
        for (int r = 0; r < NR; r++)
            for (int m = 0; m < M; m++) sums[r][m] += (float)ISUM(d[r][m]);
    }
    for (int r = 0; r < NR; r++) {
        float s = bf16_to_f32(scale[n + r]);
        for (int m = 0; m < M; m++) {
            float tail = 0.0f;  /* the last K % KS columns, in float32 */
            for (int t = k; t < K; t++)
                tail += (float)row[(int64_t)r * K + t] * bf16_to_f32(x[(int64_t)m * K + t]);
            out[(int64_t)m * N + n + r] = f32_to_bf16((sums[r][m] * xs[m] + tail) * s);
        }
    }
}

/* Rows lo .. hi of w against M (<= MR) rows of x, NR at a time: 4 where M * 4 accumulators fit
 * the registers (with AVX2 a product each beside them), else 2; the rest one at a time. */
static inline __attribute__((always_inline)) void int8_span(
    const uint16_t *x, const int16_t *xq, const float *xs, int M, int K, const int8_t *w,
    const uint16_t *scale, uint16_t *out, int N, int lo, int hi) {
    const int NR = LANES == 16 ? (M <= 4 ? 4 : 2) : (M == 1 ? 4 : 2);
    int n = lo;
    for (; n + NR <= hi; n += NR) int8_rows(x, xq, xs, M, NR, K, w, scale, out, N, n);
    for (; n < hi; n++) int8_rows(x, xq, xs, M, 1, K, w, scale, out, N, n);
}

/* M >= 1 rows, on `threads` OpenMP threads. Returns 0, or -1 when out of memory. */
int weft_gemv_int8(const uint16_t *x, int M, int K, const int8_t *w, const uint16_t *scale,
                   uint16_t *out, int N, int threads) {
    float *xs = malloc((size_t)M * sizeof(float));
    int16_t *xq = malloc((size_t)M * K * sizeof(int16_t));
    if (!xs || !xq) {
        free(xs);
        free(xq);
        return -1;
    }
    for (int m = 0; m < M; m++) {
        const uint16_t *row = x + (int64_t)m * K;
        xs[m] = x16_scale(row, K);
        for (int k = 0; k < K; k++)
            xq[(int64_t)m * K + k] = (int16_t)__builtin_lrintf(bf16_to_f32(row[k]) / xs[m]);
    }
    int nb = block_rows(K, 4);
#pragma omp parallel num_threads(threads)
    {
        int lo, hi;
        thread_share(N, 4, &lo, &hi);
        for (int n0 = lo; n0 < hi; n0 += nb) {
            int n1 = n0 + nb < hi ? n0 + nb : hi;
            for (int m0 = 0; m0 < M; m0 += MR) {
                const uint16_t *xm = x + (int64_t)m0 * K;
                const int16_t *qm = xq + (int64_t)m0 * K;
                uint16_t *om = out + (int64_t)m0 * N;
#define INT8_SPAN(mr) int8_span(xm, qm, xs + m0, mr, K, w, scale, om, N, n0, n1)
                BY_ROWS(M - m0, INT8_SPAN)
#undef INT8_SPAN
            }
        }
    }
    free(xs);
    free(xq);
    return 0;
}

/* --- int4 --------------------------------------------------------------------------------
 * Per group g of row n: sum_k x_k (q_k s + o) = s * (x . q) + o * sum_g(x). With x = xs * xq
 * (xq int16): xs * (s * (xq . q) + o * sum_g(x) / xs); each thread sums the bracket, the
 * offsets' term apart, a vector of groups an FMA: xsv holds sum_g(x) / xs per row, XSV_STRIDE
 * floats a row (0 past the groups the steps cover: an odd last group is int4_tail's). */

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Two groups a step: 32 bytes widen to 32 int16 lanes [g: bytes 0-15 | g+1: bytes 0-15], whose
 * low nibbles are k 0-15 and high nibbles k 16-31 of each group; xq is stored in that order
 * (per pair: 32 x of the low nibbles, then 32 of the high ones). */
#define I4_STEP 2
#define XSV_STRIDE(G) (((G) + 15) / 16 * 16)  /* whole vectors of 16 groups */
#if defined(__AVX512VNNI__)
#define DPW(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DPW(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

static inline __attribute__((always_inline)) void int4_rows2(
    const int16_t *xq, const float *xsv, int M, int K, const uint8_t *w, const uint16_t *so,
    float sums[2][MR], int n) {
    int G = K / GROUP, P = G / 2;
    const __m512i idx_s = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low4 = _mm512_set1_epi16(15);
    __m512 acc[2][MR];
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++)
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    for (int p = 0; p < P; p++) {
        PREFETCH(w + (int64_t)n * G * (GROUP / 2) + K + 64 * (int64_t)p);  /* the next 2 rows */
        if ((p & 3) == 0) PREFETCH(so + (int64_t)(n + 2) * G * 2 + 8 * (int64_t)p);
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++) {
            int64_t at = (int64_t)(n + r) * G + 2 * p;
            __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + at * 16)));
            __m512i lo = _mm512_and_si512(b, low4), hi = _mm512_srli_epi16(b, 4);
            __m128i raw = _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(so + at * 2)));
            __m512 so4 = _mm512_castps128_ps512(_mm_castsi128_ps(_mm_slli_epi32(raw, 16)));
            __m512 sv = _mm512_permutexvar_ps(idx_s, so4);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const int16_t *xp = xq + (int64_t)m * K + (int64_t)p * 64;
                __m512i d = DPW(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp));
                d = DPW(d, hi, _mm512_loadu_si512(xp + 32));
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, acc[r][m]);
            }
        }
    }
    /* the offsets: (scale, offset) bf16 pairs are 32-bit lanes whose high half is the offset */
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int g = 0; g < G; g += 16) {
        __mmask16 live = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++) {
            __m512i pairs = _mm512_maskz_loadu_epi32(live, so + ((int64_t)(n + r) * G + g) * 2);
            __m512 off = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
                acc[r][m] = _mm512_fmadd_ps(off, _mm512_loadu_ps(xsv + (int64_t)m * XSV_STRIDE(G) + g),
                                            acc[r][m]);
        }
    }
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < M; m++) sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

#elif defined(__AVX2__) && defined(__FMA__)
/* One group a step: 16 bytes widen to 16 int16 lanes; xq in x's order. */
#define I4_STEP 1
#define XSV_STRIDE(G) (((G) + 7) / 8 * 8)  /* whole vectors of 8 groups */

static inline __attribute__((always_inline)) void int4_rows2(
    const int16_t *xq, const float *xsv, int M, int K, const uint8_t *w, const uint16_t *so,
    float sums[2][MR], int n) {
    int G = K / GROUP;
    const __m256i low4 = _mm256_set1_epi16(15);
    __m256 acc[2][MR];
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++)
#pragma GCC unroll 3
        for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        PREFETCH(w + (int64_t)n * G * (GROUP / 2) + K + 32 * (int64_t)g);
        if ((g & 7) == 0) PREFETCH(so + (int64_t)(n + 2) * G * 2 + 4 * (int64_t)g);
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++) {
            int64_t at = (int64_t)(n + r) * G + g;
            __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + at * 16)));
            __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_srli_epi16(b, 4);
            __m256 sv = _mm256_castsi256_ps(_mm256_set1_epi32((int)((uint32_t)so[at * 2] << 16)));
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) {
                const int16_t *xp = xq + (int64_t)m * K + (int64_t)g * GROUP;
                __m256i d = _mm256_add_epi32(
                    _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xp)),
                    _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 16))));
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sv, acc[r][m]);
            }
        }
    }
    /* the offsets, 8 groups an FMA: (scale, offset) bf16 pairs are 32-bit lanes whose high half
     * is the offset */
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int g = 0; g < G; g += 8) {
        __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(G - g),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++) {
            __m256i pairs =
                _mm256_maskload_epi32((const int *)(so + ((int64_t)(n + r) * G + g) * 2), live);
            __m256 off = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
#pragma GCC unroll 4
            for (int m = 0; m < M; m++)
                acc[r][m] = _mm256_fmadd_ps(off, _mm256_loadu_ps(xsv + (int64_t)m * XSV_STRIDE(G) + g),
                                            acc[r][m]);
        }
    }
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < M; m++) sums[r][m] = hsum256(acc[r][m]);
}

#else
#define I4_STEP 1
#define XSV_STRIDE(G) (G)

static inline void int4_rows2(const int16_t *xq, const float *xsv, int M, int K,
                              const uint8_t *w, const uint16_t *so, float sums[2][MR], int n) {
    int G = K / GROUP;
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < M; m++) {
            float sum = 0.0f;
            for (int g = 0; g < G; g++) {
                int64_t at = (int64_t)(n + r) * G + g;
                const int16_t *xp = xq + (int64_t)m * K + (int64_t)g * GROUP;
                int32_t d = 0;
                for (int i = 0; i < GROUP / 2; i++)
                    d += (w[at * 16 + i] & 15) * xp[i] + (w[at * 16 + i] >> 4) * xp[i + 16];
                sum += (float)d * bf16_to_f32(so[at * 2]) +
                       bf16_to_f32(so[at * 2 + 1]) * xsv[(int64_t)m * G + g];
            }
            sums[r][m] = sum;
        }
}
#endif

/* The groups int4_rows2's steps leave over (an odd last group of the AVX-512 path), in C. */
static float int4_tail(const uint16_t *x, int K, const uint8_t *w, const uint16_t *so, int n,
                       int g0) {
    int G = K / GROUP;
    float sum = 0.0f;
    for (int g = g0; g < G; g++) {
        int64_t at = (int64_t)n * G + g;
        float s = bf16_to_f32(so[at * 2]), o = bf16_to_f32(so[at * 2 + 1]);
        for (int i = 0; i < GROUP / 2; i++) {
            uint8_t b = w[at * 16 + i];
            sum += bf16_to_f32(x[g * GROUP + i]) * ((b & 15) * s + o) +
                   bf16_to_f32(x[g * GROUP + i + 16]) * ((b >> 4) * s + o);
        }
    }
    return sum;
}

/* x -> xq (int16, in int4_rows2's order), xs[m] and xsv. */
static void widen_x16(const uint16_t *x, int M, int K, int16_t *xq, float *xs, float *xsv) {
    int G = K / GROUP;
    for (int m = 0; m < M; m++) {
        const uint16_t *row = x + (int64_t)m * K;
        float scale = xs[m] = x16_scale(row, K);
        int16_t *q = xq + (int64_t)m * K;
        for (int g = 0; g < G; g++) {
            float sum = 0.0f;
            for (int i = 0; i < GROUP; i++) sum += bf16_to_f32(row[g * GROUP + i]);
#if I4_STEP == 2
            int p = g / 2, half = g % 2;
            if (p < G / 2) {
                for (int i = 0; i < GROUP / 2; i++) {
                    q[p * 64 + half * 16 + i] =
                        (int16_t)__builtin_lrintf(bf16_to_f32(row[g * GROUP + i]) / scale);
                    q[p * 64 + 32 + half * 16 + i] =
                        (int16_t)__builtin_lrintf(bf16_to_f32(row[g * GROUP + 16 + i]) / scale);
                }
                xsv[(int64_t)m * XSV_STRIDE(G) + g] = sum / scale;
            }
#else
            for (int i = 0; i < GROUP; i++)
                q[g * GROUP + i] = (int16_t)__builtin_lrintf(bf16_to_f32(row[g * GROUP + i]) / scale);
            xsv[(int64_t)m * XSV_STRIDE(G) + g] = sum / scale;
#endif
        }
    }
}

/* Rows lo .. hi of w (pairs) against M (<= MR) rows of x. */
static inline __attribute__((always_inline)) void int4_span(
    const uint16_t *x, const int16_t *xq, const float *xs, const float *xsv, int M, int K,
    const uint8_t *w, const uint16_t *so, uint16_t *out, int N, int lo, int hi) {
    int G = K / GROUP, done = G / I4_STEP * I4_STEP;
    for (int n = lo; n < hi; n += 2) {
        float sums[2][MR];
        int4_rows2(xq, xsv, M, K, w, so, sums, n);
        for (int r = 0; r < 2; r++)
            for (int m = 0; m < M; m++) {
                float tail = done < G ? int4_tail(x + (int64_t)m * K, K, w, so, n + r, done) : 0.0f;
                out[(int64_t)m * N + n + r] = f32_to_bf16(sums[r][m] * xs[m] + tail);
            }
    }
}

/* K % 32 == 0, N % 2 == 0, M >= 1; so: bfloat16 [N, K / 32, 2] (scale, offset). */
int weft_gemv_int4(const uint16_t *x, int M, int K, const uint8_t *w, const uint16_t *so,
                   uint16_t *out, int N, int threads) {
    int G = K / GROUP;
    float *xs = malloc((size_t)M * sizeof(float));
    int16_t *xq = malloc((size_t)M * K * sizeof(int16_t));
    float *xsv = calloc((size_t)M * XSV_STRIDE(G), sizeof(float));  /* 0: groups no step has */
    if (!xs || !xq || !xsv) {
        free(xs);
        free(xq);
        free(xsv);
        return -1;
    }
    widen_x16(x, M, K, xq, xs, xsv);
    int nb = block_rows(K / 2 + G * 4, 2);
#pragma omp parallel num_threads(threads)
    {
        int lo, hi;
        thread_share(N, 2, &lo, &hi);
        for (int n0 = lo; n0 < hi; n0 += nb) {
            int n1 = n0 + nb < hi ? n0 + nb : hi;
            for (int m0 = 0; m0 < M; m0 += MR) {
                const uint16_t *xm = x + (int64_t)m0 * K;
                const int16_t *qm = xq + (int64_t)m0 * K;
                const float *vm = xsv + (int64_t)m0 * XSV_STRIDE(G);
                uint16_t *om = out + (int64_t)m0 * N;
#define INT4_SPAN(mr) int4_span(xm, qm, xs + m0, vm, mr, K, w, so, om, N, n0, n1)
                BY_ROWS(M - m0, INT4_SPAN)
#undef INT4_SPAN
            }
        }
    }
    free(xs);
    free(xq);
    free(xsv);
    return 0;
}
