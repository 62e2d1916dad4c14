/* out = x @ W^T (+ bias) for 1-4 rows of x over the panel GEMM's packed weights (gemm_panels.c's
 * layout and `kind`s), for CPUs: the decode step's GEMMs at batch 1-4.
 *
 * Why a path of its own: at a handful of rows every weight byte is used by 1-4 FMAs, so the
 * work is reading the weight, and what bounds it is how many lines are in flight from DRAM.
 * gemm_panels.c's tiles leave that to the hardware prefetcher, and its out-of-order window holds
 * fewer bytes of a half weight (twice the k per byte, plus the widening): bf16 / fp16 streamed at
 * 24-26 GB/s a core where float32 reached 29 (this machine: 2 Zen 4 cores, ~53 GB/s together).
 * Here each weight stream is prefetched PF_DIST bytes ahead of its loads, and a stream that runs
 * off its panel goes on into the same stream of the tile the thread runs next (see gemv_tile).
 *
 * Results are exactly gemm_panels.c's: every output element is one FMA chain over k = 0 .. K-1
 * in order from 0, then + bias (its `micro` invariant). So a row's result does not depend on
 * how many rows the batch has, on which path ran it, or on the thread count. Latency of the
 * chains (4 cycles, 2 FMAs a cycle) is hidden by running several columns at once, never by
 * splitting k: 1 row x 4 panels, 2 rows x 2 panels, 3-4 rows x 1 panel (see tile_panels).
 *
 * Threads: the tiles (groups of panels) are shared as work_share.h says: equal contiguous
 * ranges of N per thread, each read front to back (so the prefetch into "the next tile" is
 * right), tasks stolen from the back only when a thread finishes early (a busy core).
 */
#include <stddef.h>
#include <stdint.h>

#include <omp.h>

#include "vec_math.h"
#include "thread_pool.h"

#define NR 16
#define GEMV_MAX_ROWS 4
/* Bytes ahead in each weight stream. Measured on the bench model's shapes (2 threads, min time
 * per call, weights from DRAM, a shared machine: +-10% noise): 1 KiB took 2-row bf16 / fp16 from
 * 31-36 to 35-45 GB/s and 1 row from ~43 to ~46; 512 B gained less, 2-4 KiB no more. */
#ifndef PF_DIST
#define PF_DIST 1024
#endif

enum { W_F32 = 0, W_F16 = 1, W_BF16 = 2 }; /* gemm_panels.c's kinds */

static inline int64_t elt_size(int kind) { return kind == W_F32 ? 4 : 2; }

/* Panels a tile of mr rows runs together: 8 accumulators for 1, 2 and 4 rows. 3 rows take one
 * panel (6 chains): 3 x 2 panels needs 12 accumulators + 4 weight vectors + a broadcast, more than
 * AVX2's 16 registers, and its spills made it 1.1-1.15x slower than 1 panel. */
static inline int tile_panels(int64_t mr) { return mr == 1 ? 4 : (mr == 2 ? 2 : 1); }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* Row kk of a panel as two float32 vectors, columns 0-7 and 8-15 (gemm_panels.c's load_w). */
static inline __attribute__((always_inline)) void load_row(const void *w, int64_t kk, const int kind, __m256 *w0,
                                                           __m256 *w1) {
    if (kind == W_F32) {
        const float *p = (const float *)w + kk * NR;
        *w0 = _mm256_loadu_ps(p);
        *w1 = _mm256_loadu_ps(p + 8);
    } else if (kind == W_F16) {
        const uint16_t *p = (const uint16_t *)w + kk * NR;
        *w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        *w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    } else { /* bf16, columns 0-7 / 8-15 interleaved: one shift and one mask widen them */
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + kk * NR));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
    }
}

/* out[0..mr, 0..16 np) (the last panel: cols_last columns) = x[0..mr, 0..k) @ W^T (+ bias) for
 * the np adjacent panels at w. mr, np and kind are constants at every call (gemv_task's switch),
 * so the accumulators live in registers and the loops unroll.
 * Prefetch: stream j (panel j) asks for the line PF_DIST bytes past its loads, one line per 64
 * bytes it reads; past its panel's end that is the same offset into the panel np panels on
 * (the tile this thread runs next), not into panel j + 1, which stream j + 1 is reading. */
static inline __attribute__((always_inline)) void gemv_tile(const int mr, const int np, const int kind,
                                                            const float *x, int64_t xs, const void *w, int64_t k,
                                                            float *out, int64_t os, int64_t cols_last,
                                                            const float *bias) {
    const int64_t elt = elt_size(kind), row_bytes = NR * elt, panel_bytes = k * row_bytes;
    const int unroll = (int)(64 / row_bytes); /* panel rows per 64-byte line: 1 or 2 */
    const char *wb = (const char *)w;
    __m256 acc[4][GEMV_MAX_ROWS][2];
#pragma GCC unroll 4
    for (int j = 0; j < np; ++j)
#pragma GCC unroll 4
        for (int r = 0; r < mr; ++r) acc[j][r][0] = acc[j][r][1] = _mm256_setzero_ps();
    /* float32 at 1-2 rows (64 bytes a k per stream, few FMAs per byte) streams as fast without:
     * the hardware prefetcher keeps up there, and asking again cost 1.1-1.2x. */
    const int prefetch = kind != W_F32 || mr >= 3;
    int64_t kk = 0;
    for (; kk + unroll <= k; kk += unroll) {
        int64_t ahead = kk * row_bytes + PF_DIST;
        if (ahead >= panel_bytes) ahead += (np - 1) * panel_bytes;
        if (prefetch)
#pragma GCC unroll 4
            for (int j = 0; j < np; ++j) __builtin_prefetch(wb + j * panel_bytes + ahead, 0, 3);
#pragma GCC unroll 2
        for (int u = 0; u < unroll; ++u)
#pragma GCC unroll 4
            for (int j = 0; j < np; ++j) {
                __m256 w0, w1;
                load_row(wb + j * panel_bytes, kk + u, kind, &w0, &w1);
#pragma GCC unroll 4
                for (int r = 0; r < mr; ++r) {
                    const __m256 b = _mm256_broadcast_ss(x + r * xs + kk + u);
                    acc[j][r][0] = _mm256_fmadd_ps(b, w0, acc[j][r][0]);
                    acc[j][r][1] = _mm256_fmadd_ps(b, w1, acc[j][r][1]);
                }
            }
    }
    for (; kk < k; ++kk) /* an odd k of half weights: the last row alone */
#pragma GCC unroll 4
        for (int j = 0; j < np; ++j) {
            __m256 w0, w1;
            load_row(wb + j * panel_bytes, kk, kind, &w0, &w1);
#pragma GCC unroll 4
            for (int r = 0; r < mr; ++r) {
                const __m256 b = _mm256_broadcast_ss(x + r * xs + kk);
                acc[j][r][0] = _mm256_fmadd_ps(b, w0, acc[j][r][0]);
                acc[j][r][1] = _mm256_fmadd_ps(b, w1, acc[j][r][1]);
            }
        }
#pragma GCC unroll 4
    for (int j = 0; j < np; ++j)
#pragma GCC unroll 4
        for (int r = 0; r < mr; ++r) {
            float *o = out + r * os + j * NR;
            const float *bj = bias ? bias + j * NR : NULL;
            const int64_t cols = j == np - 1 ? cols_last : NR;
            if (cols == NR) {
                __m256 a0 = acc[j][r][0], a1 = acc[j][r][1];
                if (bj) {
                    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bj));
                    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bj + 8));
                }
                _mm256_storeu_ps(o, a0);
                _mm256_storeu_ps(o + 8, a1);
            } else { /* the last panel of N: its padding columns' sums are dropped */
                float tmp[NR];
                _mm256_storeu_ps(tmp, acc[j][r][0]);
                _mm256_storeu_ps(tmp + 8, acc[j][r][1]);
                for (int64_t c = 0; c < cols; ++c) o[c] = tmp[c] + (bj ? bj[c] : 0.0f);
            }
        }
}

/* The tile of `mr` rows over panels [p, p + np) of task `task`, with kind, mr and np turned into
 * constants (np < tile_panels(mr) only for the last task of N). */
static void gemv_task(int kind, int64_t mr, const float *x, int64_t xs, const void *w, const float *bias, float *out,
                      int64_t os, int64_t n, int64_t k, int64_t task) {
    const int64_t panels = (n + NR - 1) / NR, p = task * tile_panels(mr);
    const int np = (int)(panels - p < tile_panels(mr) ? panels - p : tile_panels(mr));
    const int64_t cols_last = n - (p + np - 1) * NR < NR ? n - (p + np - 1) * NR : NR;
    const void *wp = (const char *)w + p * k * NR * elt_size(kind);
    const float *bp = bias ? bias + p * NR : NULL;
    float *o = out + p * NR;
#define TILE(R, P, KIND) gemv_tile(R, P, KIND, x, xs, wp, k, o, os, cols_last, bp)
#define BY_SHAPE(KIND)                                                                                              \
    switch (mr * 8 + np) {                                                                                          \
    case 8 + 4: TILE(1, 4, KIND); break;                                                                            \
    case 8 + 3: TILE(1, 3, KIND); break;                                                                            \
    case 8 + 2: TILE(1, 2, KIND); break;                                                                            \
    case 8 + 1: TILE(1, 1, KIND); break;                                                                            \
    case 16 + 2: TILE(2, 2, KIND); break;                                                                           \
    case 16 + 1: TILE(2, 1, KIND); break;                                                                           \
    case 24 + 1: TILE(3, 1, KIND); break;                                                                           \
    default: TILE(4, 1, KIND); break;                                                                               \
    }
    if (kind == W_BF16) {
        BY_SHAPE(W_BF16)
    } else if (kind == W_F16) {
        BY_SHAPE(W_F16)
    } else {
        BY_SHAPE(W_F32)
    }
#undef BY_SHAPE
#undef TILE
}

static void gemv_call_task(const void *ctx, int64_t task) {
    const LinearCall *c = ctx;
    gemv_task(c->kind, c->m, c->x, c->xs, c->w, c->bias, c->out, c->os, c->n, c->k, task);
}

static void gemv(const float *x, int64_t xs, const void *w, const float *bias, float *out, int64_t os, int64_t m,
                 int64_t n, int64_t k, int kind) {
    const int64_t panels = (n + NR - 1) / NR, tasks = (panels + tile_panels(m) - 1) / tile_panels(m);
    /* A second thread pays from ~64 KiB of weight on (as gemm_panels.c). */
    const int64_t threads = panels * k >= 2048 ? omp_get_max_threads() : 1;
    const LinearCall call = {x, xs, w, bias, out, os, m, n, k, kind, 0, 0};
    tidal_run_tasks(gemv_call_task, &call, tasks, threads);
}

#else /* portable C: the same layout and results up to float summation order */

static void gemv(const float *x, int64_t xs, const void *w, const float *bias, float *out, int64_t os, int64_t m,
                 int64_t n, int64_t k, int kind) {
#pragma omp parallel for schedule(static) if (n * k > 65536)
    for (int64_t j = 0; j < n; ++j) {
        const int64_t c = j % NR;
        const int64_t slot = kind == W_BF16 ? (c < 8 ? 2 * c : 2 * (c - 8) + 1) : c;
        const int64_t first = (j / NR) * k * NR + slot;
        for (int64_t i = 0; i < m; ++i) {
            float sum = 0.0f;
            for (int64_t kk = 0; kk < k; ++kk) {
                const int64_t at = first + kk * NR;
                const float wv = kind == W_F32    ? ((const float *)w)[at]
                                 : kind == W_BF16 ? bf16_to_f32(((const uint16_t *)w)[at])
                                                  : f16_to_f32(((const uint16_t *)w)[at]);
                sum += x[i * xs + kk] * wv;
            }
            out[i * os + j] = sum + (bias ? bias[j] : 0.0f);
        }
    }
}
#endif

/* tidal_gemm_panels for 1 <= m <= GEMV_MAX_ROWS (same arguments, same results bit for bit):
 * returns 0, or -1 for bad arguments (m outside 0..4, negative sizes, an unknown kind, a null
 * pointer that would be read, a row stride below the row). */
int tidal_gemv_panels(const float *x, int64_t x_row_stride, const void *w_packed, const float *bias, float *out,
                      int64_t out_row_stride, int64_t m, int64_t n, int64_t k, int kind) {
    if (kind != W_F32 && kind != W_F16 && kind != W_BF16) return -1;
    if (m < 0 || m > GEMV_MAX_ROWS || n < 0 || k < 0) return -1;
    if (m == 0 || n == 0) return 0;
    if (out == NULL || out_row_stride < n) return -1;
    if (k > 0 && (x == NULL || w_packed == NULL || (m > 1 && x_row_stride < k))) return -1;
    if (k == 0) { /* an empty sum */
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) out[i * out_row_stride + j] = bias ? bias[j] : 0.0f;
        return 0;
    }
    gemv(x, x_row_stride, w_packed, bias, out, out_row_stride, m, n, k, kind);
    return 0;
}
