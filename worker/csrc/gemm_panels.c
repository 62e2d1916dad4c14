/* out = x @ W^T (+ bias) with W held in float32, fp16 or bf16 and x / out in float32, for CPUs.
 *
 * Why: a decode step reads every weight once per step for a handful of rows, so its GEMMs are
 * bound by the bytes read, and half-precision weights halve them. Arithmetic stays float32:
 * weights are widened in registers (F16C vcvtph2ps for fp16; bf16 is the top half of a float32).
 * float32 weights take the same path (no widening): it is as fast as oneDNN's packed GEMM where
 * the work is compute bound and needs nothing built per shape (oneDNN builds a primitive for
 * every new row count, which made cold batches slow and the primitive cache grow).
 *
 * Packed layout (made by tidal/worker/panel_gemm.py, pack_weight): W [N, K] is cut into
 * P = ceil(N / 16) panels of 16 output columns (the last one padded with zero columns), stored
 * [P, K, 16]: element (p, k, s) is W[16 p + c, k] with
 *   float32, fp16: c = s;
 *   bf16: s = 2 c for c < 8, s = 2 (c - 8) + 1 for c >= 8 (columns 0-7 and 8-15 interleaved),
 * so that one 32-byte load of 16 bf16 values gives columns 0-7 by a 16-bit left shift of each
 * 32-bit lane and columns 8-15 by masking off the low 16 bits: two integer ops, no shuffles.
 * The microkernel computes an MR x 16 tile (MR <= 6: 12 accumulators + 2 weight vectors + 1
 * broadcast = 15 of AVX2's 16 registers) with no horizontal sums.
 *
 * Each tile sums its whole K in registers, widening the weight as it goes (the schedule is in
 * gemm() below), one FMA chain per output element in k order: results do not depend on the
 * batch (see micro). OpenMP shares torch's threads (see runtime.c).
 */
#include <stddef.h>
#include <stdint.h>

#include <omp.h>

#include "vec_math.h"
#include "thread_pool.h"

#define NR 16
#define MR 6
#define X_BLOCK_BYTES (192 << 10) /* x rows per block: in L2 (512 KiB a core here) with the panel */

enum { W_F32 = 0, W_F16 = 1, W_BF16 = 2 }; /* the `kind` argument of tidal_gemm_panels */

static inline int64_t w_elt_size(int kind) { return kind == W_F32 ? 4 : 2; }

/* Every argument check of the public function; 0 when the call is well formed. */
static int check_args(const float *x, int64_t x_row_stride, const void *w, float *out,
                      int64_t out_row_stride, int64_t m, int64_t n, int64_t k) {
    if (m < 0 || n < 0 || k < 0) return -1;
    if (m == 0 || n == 0) return 0;
    if (out == NULL || out_row_stride < n) return -1;
    if (k > 0 && (x == NULL || w == NULL || (m > 1 && x_row_stride < k))) return -1;
    return 0;
}

/* out[i, :] = bias or 0, for k == 0 (an empty sum). */
static void fill_bias(const float *bias, float *out, int64_t os, int64_t m, int64_t n) {
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) out[i * os + j] = bias ? bias[j] : 0.0f;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* Row kk of a panel slice as two float32 vectors: columns 0-7 and 8-15. */
static inline __attribute__((always_inline)) void load_w(const void *w, int64_t kk, const int kind,
                                                         __m256 *w0, __m256 *w1) {
    if (kind == W_F32) {
        const float *p = (const float *)w + kk * NR;
        *w0 = _mm256_loadu_ps(p);
        *w1 = _mm256_loadu_ps(p + 8);
    } else if (kind == W_F16) {
        const uint16_t *p = (const uint16_t *)w + kk * NR;
        *w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        *w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    } else { /* bf16, interleaved: even 16-bit slots are columns 0-7, odd ones 8-15 */
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + kk * NR));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
    }
}

/* Lines of the panel a thread runs next, asked for while the tiles of this one compute (see
 * gemm): a tile reads its panel from L1 / L2 only if it came in earlier, and a tile that waits
 * on memory for it leaves the FMA units idle (decode-size row counts spent 1.2-1.5x the time of
 * the same GEMM with its weight already in cache). */
typedef struct {
    const char *next; /* the next line to ask for */
    int64_t lines;    /* lines left to ask for (0: none) */
    int64_t every;    /* one line every `every` k */
} Prefetch;

static const Prefetch NO_PREFETCH = {NULL, 0, 1};

/* out[0..mr, 0..cols) of np adjacent panels (at w + j * panel_elems, columns 16 j ..) =
 * x[0..mr, 0..kc) @ W^T (+ bias). mr, np and kind are compile-time constants at every call (the
 * switches in run_tile), so acc lives in registers and the loops unroll.
 *
 * Invariant: every output element is one FMA chain over k = 0, 1, ..., kc - 1 in order, then
 * + bias, whatever mr and np are. So a row's result does not depend on which tile it falls in
 * or how many rows the batch has (batch invariance: a request's tokens do not change with the
 * load). Short tiles keep FMA latency (4 cycles) from bounding them by running several panels
 * at once (independent chains over columns, never over k): 1 row x 4 panels, 2-3 rows x 2.
 * cols < 16 only in the last panel (np == 1 there); bias then has cols valid entries, and the
 * padded columns' sums are dropped. */
static inline __attribute__((always_inline)) void micro(const int mr, const int np, const int kind, const float *x,
                                                        int64_t xs, const void *w, int64_t panel_elems, int64_t kc,
                                                        float *out, int64_t os, int64_t cols, const float *bias,
                                                        const int use_pf, Prefetch pf) {
    __m256 acc[4][MR][2];
    const int64_t elt = w_elt_size(kind);
    int64_t pf_countdown = pf.every;
#pragma GCC unroll 4
    for (int j = 0; j < np; ++j)
#pragma GCC unroll 6
        for (int r = 0; r < mr; ++r) acc[j][r][0] = acc[j][r][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < kc; ++kk) {
        /* One line of the next panel every `every` k (use_pf is a constant: no branch without). */
        if (use_pf && pf.lines > 0 && --pf_countdown == 0) {
            __builtin_prefetch(pf.next, 0, 3);
            pf.next += 64;
            --pf.lines;
            pf_countdown = pf.every;
        }
#pragma GCC unroll 4
        for (int j = 0; j < np; ++j) {
            __m256 w0, w1;
            load_w((const char *)w + j * panel_elems * elt, kk, kind, &w0, &w1);
#pragma GCC unroll 6
            for (int r = 0; r < mr; ++r) {
                const __m256 b = _mm256_broadcast_ss(x + r * xs + kk);
                acc[j][r][0] = _mm256_fmadd_ps(b, w0, acc[j][r][0]);
                acc[j][r][1] = _mm256_fmadd_ps(b, w1, acc[j][r][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < np; ++j)
#pragma GCC unroll 6
        for (int r = 0; r < mr; ++r) {
            float *o = out + r * os + j * NR;
            const float *bj = bias ? bias + j * NR : NULL;
            if (cols == NR) {
                __m256 a0 = acc[j][r][0], a1 = acc[j][r][1];
                if (bj) {
                    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bj));
                    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bj + 8));
                }
                _mm256_storeu_ps(o, a0);
                _mm256_storeu_ps(o + 8, a1);
            } else {
                float tmp[NR];
                _mm256_storeu_ps(tmp, acc[j][r][0]);
                _mm256_storeu_ps(tmp + 8, acc[j][r][1]);
                for (int64_t c = 0; c < cols; ++c) o[c] = tmp[c] + (bj ? bj[c] : 0.0f);
            }
        }
}

/* Panels run together by a tile of mr rows (see micro). */
static inline int panels_per_tile(int64_t mr) { return mr == 1 ? 4 : (mr <= 3 ? 2 : 1); }

static void run_tile(int64_t mr, int np, const int kind, const float *x, int64_t xs, const void *w,
                     int64_t panel_elems, int64_t kc, float *out, int64_t os, int64_t cols, const float *bias,
                     Prefetch pf) {
#define MICRO(R, P, PF) micro(R, P, kind, x, xs, w, panel_elems, kc, out, os, cols, bias, PF, pf)
    if (np == 4) { MICRO(1, 4, 0); return; }
    if (np == 2) {
        if (mr == 2) MICRO(2, 2, 0); else MICRO(3, 2, 0);
        return;
    }
    if (pf.lines > 0 && mr >= 4) { /* gemm asks only for tiles of 4-6 rows */
        switch (mr) {
        case 4: MICRO(4, 1, 1); break;
        case 5: MICRO(5, 1, 1); break;
        default: MICRO(6, 1, 1); break;
        }
        return;
    }
    switch (mr) {
    case 1: MICRO(1, 1, 0); break;
    case 2: MICRO(2, 1, 0); break;
    case 3: MICRO(3, 1, 0); break;
    case 4: MICRO(4, 1, 0); break;
    case 5: MICRO(5, 1, 0); break;
    default: MICRO(6, 1, 0); break;
    }
#undef MICRO
}

/* Rows are cut into blocks of at most rows_per_block(k) (the block's x stays in L2 while every
 * panel passes over it), a block into ceil(rows / 6) tiles of near-equal height (8 rows: 4 + 4,
 * not 6 + 2: a short tile costs about as much per k as a full one). Each tile sums the whole K in
 * registers straight from the half panel, which the first tile brings into L1 / L2 for the
 * others. Threads start on contiguous equal shares of the (block, group of 4 panels) pairs, so for few rows
 * each streams its half of the weight front to back; one that finishes early then takes tasks
 * from the back of the others' shares (see gemm and work_share.h).
 * (Widening each panel once into a float32 buffer shared by a block's tiles, BLIS style, with
 * K blocks, measured slower at every size tried: 1.05-1.2x the time at 24-256 rows.) */
static int64_t rows_per_block(int64_t k) {
    const int64_t rows = X_BLOCK_BYTES / (int64_t)sizeof(float) / k;
    return rows < MR ? MR : rows / MR * MR;
}

#define PANEL_GROUP 4 /* panels per task: a 1-row tile runs 4 at once */
/* Prefetching the next panel pays for float32 panels while the panel's own stream is a large
 * part of the work: up to 2 tiles (12 rows), 1.05-1.45x at 4-8 rows. At 3 tiles it measured
 * 0.86-1.27x from run to run (~1.04x on average), with more tiles 0.7-1.2x, and for half panels
 * (half the bytes per k) 0.65-0.9x. */
#define PREFETCH_MAX_TILES 2

/* The tile of mr rows from row i over np panels from panel p (kind dispatched to a constant). */
static inline void tile_at(int kind, int64_t mr, int np, const float *x, int64_t xs, const void *w, int64_t panel_elems,
                           int64_t k, float *out, int64_t os, int64_t n, const float *bias, int64_t i, int64_t p,
                           Prefetch pf) {
    const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
    const void *wp = (const char *)w + p * panel_elems * w_elt_size(kind);
    const float *bp = bias ? bias + p * NR : NULL;
    float *o = out + i * os + p * NR;
    if (kind == W_BF16)
        run_tile(mr, np, W_BF16, x + i * xs, xs, wp, panel_elems, k, o, os, cols, bp, pf);
    else if (kind == W_F16)
        run_tile(mr, np, W_F16, x + i * xs, xs, wp, panel_elems, k, o, os, cols, bp, pf);
    else
        run_tile(mr, np, W_F32, x + i * xs, xs, wp, panel_elems, k, o, os, cols, bp, pf);
}

/* Task (mb, g) of gemm: x rows of block mb (of mblocks equal ones) times the panels of group g. */
static void gemm_task(const float *x, int64_t xs, const void *w, const float *bias, float *out, int64_t os, int64_t m,
                      int64_t n, int64_t k, int kind, int64_t mb, int64_t mblocks, int64_t g) {
    const int64_t panels = (n + NR - 1) / NR, full_panels = n / NR;
    const int64_t panel_elems = k * NR, panel_bytes = panel_elems * w_elt_size(kind);
    const int64_t m0 = m * mb / mblocks, rows = m * (mb + 1) / mblocks - m0; /* equal blocks */
    const int64_t tiles = (rows + MR - 1) / MR;
    const int64_t p_end = (g + 1) * PANEL_GROUP < panels ? (g + 1) * PANEL_GROUP : panels;
    if (panels_per_tile(rows / tiles) == 1) {
        /* Tiles of 4+ rows, one panel at a time: panel outer, tiles inner, so the panel
         * stays in L1 / L2 while every tile of the block passes over it. */
        for (int64_t p = g * PANEL_GROUP; p < p_end; ++p) {
            /* Tile t asks for its share of the next panel's lines (the next one this
             * thread runs, but for the last of its share), spread over its k loop. */
            const int64_t lines =
                kind == W_F32 && p + 1 < panels && tiles <= PREFETCH_MAX_TILES ? panel_bytes / 64 : 0;
            for (int64_t t = 0, i = m0; t < tiles; ++t) {
                const int64_t mr = rows / tiles + (t < rows % tiles);
                const int64_t first = lines * t / tiles, share = lines * (t + 1) / tiles - first;
                const Prefetch pf = {(const char *)w + (p + 1) * panel_bytes + first * 64, share,
                                     share > 0 && k / share > 0 ? k / share : 1};
                tile_at(kind, mr, 1, x, xs, w, panel_elems, k, out, os, n, bias, i, p, pf);
                i += mr;
            }
        }
    } else {
        /* Short tiles (few rows, so few tiles) take several full panels at once. */
        for (int64_t t = 0, i = m0; t < tiles; ++t) {
            const int64_t mr = rows / tiles + (t < rows % tiles);
            for (int64_t p = g * PANEL_GROUP; p < p_end;) {
                const int np = p + panels_per_tile(mr) <= full_panels ? panels_per_tile(mr) : 1;
                tile_at(kind, mr, np, x, xs, w, panel_elems, k, out, os, n, bias, i, p, NO_PREFETCH);
                p += np;
            }
            i += mr;
        }
    }
}

/* Tasks are (x row block, panel group) pairs, row block major, shared as work_share.h says: a
 * thread runs its own tasks in order (so "the next panel" it prefetches is the one it runs
 * next), then helps with the others'. */
static void gemm_call_task(const void *ctx, int64_t task) {
    const LinearCall *c = ctx;
    gemm_task(c->x, c->xs, c->w, c->bias, c->out, c->os, c->m, c->n, c->k, c->kind, task / c->groups, c->mblocks,
              task % c->groups);
}

static void gemm(const float *x, int64_t xs, const void *w, const float *bias, float *out, int64_t os, int64_t m,
                 int64_t n, int64_t k, int kind) {
    const int64_t groups = ((n + NR - 1) / NR + PANEL_GROUP - 1) / PANEL_GROUP;
    const int64_t mblocks = (m + rows_per_block(k) - 1) / rows_per_block(k);
    /* Bound by reading the weight for few rows: worth a second thread from ~64 KiB of it on. */
    const int64_t threads = (n + NR - 1) / NR * k >= 2048 ? omp_get_max_threads() : 1;
    const LinearCall call = {x, xs, w, bias, out, os, m, n, k, kind, groups, mblocks};
    tidal_run_tasks(gemm_call_task, &call, mblocks * groups, threads); /* < 2^32: m n / 384 tasks at most */
}

#else /* portable C: the same layout and results up to float summation order */

static inline float w_at(const void *w, int64_t index, int kind) {
    if (kind == W_F32) return ((const float *)w)[index];
    const uint16_t h = ((const uint16_t *)w)[index];
    return kind == W_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

static void gemm(const float *x, int64_t xs, const void *w, const float *bias, float *out, int64_t os, int64_t m,
                 int64_t n, int64_t k, int kind) {
#pragma omp parallel for schedule(static) if (m * n * k > 65536)
    for (int64_t j = 0; j < n; ++j) {
        const int64_t c = j % NR;
        const int64_t slot = kind == W_BF16 ? (c < 8 ? 2 * c : 2 * (c - 8) + 1) : c;
        const int64_t first = (j / NR) * k * NR + slot;
        for (int64_t i = 0; i < m; ++i) {
            float sum = 0.0f;
            for (int64_t kk = 0; kk < k; ++kk) sum += x[i * xs + kk] * w_at(w, first + kk * NR, kind);
            out[i * os + j] = sum + (bias ? bias[j] : 0.0f);
        }
    }
}
#endif

/* out[i, j] = sum_k x[i, k] * W[j, k] (+ bias[j]) for i < m, j < n; W packed as described at
 * the top, its values `kind` (W_F32, W_F16 or W_BF16). Strides are in floats. Returns 0, or -1
 * for bad arguments (negative sizes, an unknown kind, a null pointer that would be read, a row
 * stride below the row). */
int tidal_gemm_panels(const float *x, int64_t x_row_stride, const void *w_packed, const float *bias, float *out,
                      int64_t out_row_stride, int64_t m, int64_t n, int64_t k, int kind) {
    if (kind != W_F32 && kind != W_F16 && kind != W_BF16) return -1;
    const int rc = check_args(x, x_row_stride, w_packed, out, out_row_stride, m, n, k);
    if (rc != 0 || m == 0 || n == 0) return rc;
    if (k == 0) {
        fill_bias(bias, out, out_row_stride, m, n);
        return 0;
    }
    gemm(x, x_row_stride, w_packed, bias, out, out_row_stride, m, n, k, kind);
    return 0;
}

/* 1 when the vectorized path above was compiled (AVX2, FMA, F16C), 0 for the portable C one:
 * float32 weights use these panels only then (oneDNN is faster than plain C). */
int tidal_gemm_panels_simd(void) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}
