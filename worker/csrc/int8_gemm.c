/* out = x @ W^T (+ bias) with W in int8 blocks (llama.cpp's Q8_0 idea) and x / out float32, for CPUs.
 *
 * Why: a decode step reads every weight once per step, so its time is the bytes read; int8
 * blocks are 36 bytes per 32 weights (9/32 of float32, 56% of bf16).
 *
 * Format (made by tidal/worker/layers/quantization.py): K is cut into kb = ceil(K / 32) blocks
 * of 32 (the last padded with zero weights). Row j of W is kb blocks of 32 int8 values q
 * (wq [N, kb * 32], row major) and one float32 scale per block (wd [N, kb]): w = wd * q, with
 * wd = max |w| / 127 over the block and q = rint(w / wd) in [-127, 127] (0 where the block is 0).
 *
 * Each x row is quantized the same way on the fly (the rule is quantize_row below, which the
 * Python reference repeats exactly), so a block's dot product is an exact int32 sum of 32
 * int8 x int8 products; then out = sum over blocks of (xd * wd) * isum, in float32, + bias.
 * AVX2: |x| (u8) times sign-adjusted w (s8) by vpmaddubsw (pairs: at most 2 * 127 * 127, no
 * saturation), widened by vpmaddwd with ones. Every output element is one fixed sequence of
 * operations over its blocks, whatever m and however the columns are grouped: results do not
 * depend on the batch. Threads split N into tasks of 16 columns (work_share.h); a task runs
 * every row over its columns, whose 16 K bytes stay in L1 / L2 for the rows after the first.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>

#include "work_share.h"

#define QK 32        /* values per block */
#define COLS_TASK 16 /* output columns per task */

/* x[0..k) -> kb blocks: q (kb * 32 int8, zero padded), d (kb scales). */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *d) {
    const int64_t kb = (k + QK - 1) / QK;
    for (int64_t b = 0; b < kb; ++b) {
        const int64_t lo = b * QK, hi = lo + QK < k ? lo + QK : k;
        float amax = 0.0f;
        for (int64_t i = lo; i < hi; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const float scale = amax / 127.0f;
        d[b] = scale;
        for (int64_t i = 0; i < QK; ++i) {
            const float v = lo + i < hi && scale > 0.0f ? rintf(x[lo + i] / scale) : 0.0f;
            q[lo + i] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Horizontal sum of 8 lanes, in one fixed order. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int32 partial sums of one block's 32 products. */
static inline __m256i block_dot(__m256i ax, __m256i xv, const int8_t *w) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    const __m256i p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* out[c] = sum_b (xd[b] wd[c][b]) * <xq_b, wq[c]_b> for NC columns at once (x loaded once). */
#define DEFINE_DOT(NC)                                                                              \
    static inline void dot##NC(const int8_t *xq, const float *xd, int64_t kb, const int8_t *wq,    \
                               const float *wd, int64_t wrow, int64_t drow, float *res) {          \
        __m256 acc[NC];                                                                             \
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < kb; ++b) {                                                          \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));                  \
            const __m256i ax = _mm256_sign_epi8(xv, xv);                                            \
            for (int c = 0; c < NC; ++c) {                                                          \
                if (NC > 1 && b + 8 < kb) _mm_prefetch((const char *)(wq + c * wrow + (b + 8) * QK), _MM_HINT_T0); \
                const __m256 s = _mm256_set1_ps(xd[b] * wd[c * drow + b]);                          \
                const __m256 p = _mm256_cvtepi32_ps(block_dot(ax, xv, wq + c * wrow + b * QK));     \
                acc[c] = _mm256_fmadd_ps(s, p, acc[c]);                                             \
            }                                                                                       \
        }                                                                                           \
        for (int c = 0; c < NC; ++c) res[c] = hsum(acc[c]);                                         \
    }
DEFINE_DOT(1)
DEFINE_DOT(4)

#else /* portable C: the same products; float sums in another order */

static void dot1(const int8_t *xq, const float *xd, int64_t kb, const int8_t *wq, const float *wd, int64_t wrow,
                 int64_t drow, float *res) {
    (void)wrow, (void)drow;
    float acc = 0.0f;
    for (int64_t b = 0; b < kb; ++b) {
        int32_t s = 0;
        for (int i = 0; i < QK; ++i) s += (int32_t)xq[b * QK + i] * (int32_t)wq[b * QK + i];
        acc += xd[b] * wd[b] * (float)s;
    }
    res[0] = acc;
}

static void dot4(const int8_t *xq, const float *xd, int64_t kb, const int8_t *wq, const float *wd, int64_t wrow,
                 int64_t drow, float *res) {
    for (int c = 0; c < 4; ++c) dot1(xq, xd, kb, wq + c * wrow, wd + c * drow, wrow, drow, res + c);
}
#endif

/* Columns [j0, j1) of every row. */
static void int8_task(const int8_t *xq, const float *xd, int64_t m, int64_t kb, const int8_t *wq, const float *wd,
                      const float *bias, float *out, int64_t os, int64_t j0, int64_t j1) {
    const int64_t wrow = kb * QK;
    for (int64_t i = 0; i < m; ++i) {
        const int8_t *xqi = xq + i * wrow;
        const float *xdi = xd + i * kb;
        float *o = out + i * os;
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4) dot4(xqi, xdi, kb, wq + j * wrow, wd + j * kb, wrow, kb, o + j);
        for (; j < j1; ++j) dot1(xqi, xdi, kb, wq + j * wrow, wd + j * kb, wrow, kb, o + j);
        if (bias)
            for (j = j0; j < j1; ++j) o[j] += bias[j];
    }
}

/* out[i, j] = sum_k x[i, k] W[j, k] (+ bias[j]), W as described at the top; strides in floats.
 * Returns 0, -1 for bad arguments, -2 when the quantized x rows' buffer cannot be allocated. */
int tidal_int8_gemm(const float *x, int64_t x_row_stride, const int8_t *wq, const float *wd, const float *bias,
                    float *out, int64_t out_row_stride, int64_t m, int64_t n, int64_t k) {
    if (m < 0 || n < 0 || k < 0) return -1;
    if (m == 0 || n == 0) return 0;
    if (out == NULL || out_row_stride < n) return -1;
    if (k > 0 && (x == NULL || wq == NULL || wd == NULL || (m > 1 && x_row_stride < k))) return -1;
    const int64_t kb = (k + QK - 1) / QK;
    if (kb == 0) {
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) out[i * out_row_stride + j] = bias ? bias[j] : 0.0f;
        return 0;
    }
    int8_t *xq = malloc((size_t)(m * kb * QK) + (size_t)(m * kb) * sizeof(float));
    if (xq == NULL) return -2;
    float *xd = (float *)(xq + m * kb * QK); /* m * kb * 32 bytes: 4-aligned */
    const int64_t tasks = (n + COLS_TASK - 1) / COLS_TASK;
    /* Bound by reading the weight: a second thread pays from ~64 KiB of it on. */
    const int64_t threads = n * kb * QK >= 65536 ? omp_get_max_threads() : 1;
    OwnedSpan spans[threads];
    work_share_init(spans, threads, tasks);
#pragma omp parallel if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; ++i) quantize_row(x + i * x_row_stride, k, xq + i * kb * QK, xd + i * kb);
        for (int64_t t; (t = work_share_next(spans, threads, omp_get_thread_num())) >= 0;) {
            const int64_t j0 = t * COLS_TASK, j1 = j0 + COLS_TASK < n ? j0 + COLS_TASK : n;
            int8_task(xq, xd, m, kb, wq, wd, bias, out, out_row_stride, j0, j1);
        }
    }
    free(xq);
    return 0;
}
