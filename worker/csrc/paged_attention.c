/* Decode attention straight from a paged KV cache, for CPUs.
 *
 * The torch backend has to gather every decode's blocks into one padded tensor before SDPA can
 * run, which copies the whole context of every sequence on every layer and step; here each
 * task (a sequence, or a share of its kv heads when sequences are fewer than threads) walks its
 * own block table and reads each cached K/V row once.
 *
 * Layout (what tidal's model runner binds): k_cache / v_cache are contiguous
 * [num_blocks, block_size, num_kv_heads, head_dim]; query heads h of kv head j are
 * j * group .. j * group + group - 1 (group = num_heads / num_kv_heads), as in HF's GQA.
 *
 * The caches hold float32, fp16 or bf16 (one kernel each; q and out are float32 in every case):
 * a half cache's K/V values are widened to float32 in registers as they are read (dot_kv,
 * axpy_kv), so the arithmetic is float32 for all three and a half cache reads half the bytes.
 * Writes round float32 K/V to nearest even, as torch's `.to(dtype)`.
 *
 * Softmax is computed online per block (running max and sum), in float32 throughout, so no
 * scratch grows with the context length. Built by tidal/worker/cpu_kernels.py with
 * -O3 -march=native -fopenmp; the OpenMP runtime is the one torch already loaded (libgomp.so.1),
 * so the kernel shares torch's threads.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define TIDAL_F16C 1
#endif

/* Cache element types; always a compile-time constant where it selects code (the public
 * functions below pass literals into always_inline bodies), so the float32 kernel compiles to
 * the same loops it had before half caches existed. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static inline int64_t kv_elem_size(const int kind) { return kind == KV_F32 ? 4 : 2; }

#ifdef TIDAL_F16C
/* 8 half values widened to float32. */
static inline __attribute__((always_inline)) __m256 widen8(const uint16_t *h, const int kind) {
    const __m128i v = _mm_loadu_si128((const __m128i *)h);
    return kind == KV_F16 ? _mm256_cvtph_ps(v) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
#endif

static inline __attribute__((always_inline)) float widen1(uint16_t h, const int kind) {
    return kind == KV_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

/* sum_d q[d] * row[d] over a cache row of len values; half rows are widened in registers as
 * they are read (no float32 scratch copy of the row: a store and a load fewer per value). */
static inline __attribute__((always_inline)) float dot_kv(const float *restrict q, const void *restrict row,
                                                          const int64_t len, const int kind) {
    float dot = 0.0f;
    int64_t d = 0;
    if (kind == KV_F32) {
        const float *k = (const float *)row;
#pragma omp simd reduction(+ : dot)
        for (d = 0; d < len; ++d) dot += q[d] * k[d];
        return dot;
    }
    const uint16_t *h = (const uint16_t *)row;
#ifdef TIDAL_F16C
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(); /* two chains: FMA latency */
    for (; d + 16 <= len; d += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), widen8(h + d, kind), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), widen8(h + d + 8, kind), acc2);
    }
    for (; d + 8 <= len; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), widen8(h + d, kind), acc);
    acc = _mm256_add_ps(acc, acc2);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    dot = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#endif
    for (; d < len; ++d) dot += q[d] * widen1(h[d], kind);
    return dot;
}

/* acc[d] += w * row[d] over a cache row of len values. */
static inline __attribute__((always_inline)) void axpy_kv(float *restrict acc, float w, const void *restrict row,
                                                          const int64_t len, const int kind) {
    int64_t d = 0;
    if (kind == KV_F32) {
        const float *v = (const float *)row;
#pragma omp simd
        for (d = 0; d < len; ++d) acc[d] += w * v[d];
        return;
    }
    const uint16_t *h = (const uint16_t *)row;
#ifdef TIDAL_F16C
    const __m256 wv = _mm256_set1_ps(w);
    for (; d + 8 <= len; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, widen8(h + d, kind), _mm256_loadu_ps(acc + d)));
#endif
    for (; d < len; ++d) acc[d] += w * widen1(h[d], kind);
}

/* len float32 values -> the cache at element offset `offset`, rounded to nearest even. */
static inline __attribute__((always_inline)) void kv_store_row(void *restrict cache, int64_t offset,
                                                               const float *restrict src, int64_t len, const int kind) {
    if (kind == KV_F32) {
        memcpy((float *)cache + offset, src, sizeof(float) * len);
        return;
    }
    uint16_t *h = (uint16_t *)cache + offset;
    int64_t d = 0;
    if (kind == KV_F16) {
#ifdef TIDAL_F16C /* vcvtps2ph: the same rounding and NaN handling as f32_to_f16 */
        for (; d + 8 <= len; d += 8)
            _mm_storeu_si128((__m128i *)(h + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; d < len; ++d) h[d] = f32_to_f16(src[d]);
    } else {
#pragma omp simd
        for (d = 0; d < len; ++d) h[d] = f32_to_bf16(src[d]);
    }
}

/* Rows r = 0 .. num_rows-1 are the query heads first_kv_head * group + r, i.e. kv heads
 * [first_kv_head, first_kv_head + num_rows / group); row r reads kv head first_kv_head + r / group.
 * Blocks are walked in the outer loop and, inside a block, tokens before heads, so the block's
 * K and V rows are read front to back. Positions [first_pos, seq_len) are attended (first_pos > 0
 * under a sliding window): blocks before first_pos's are never touched (they may be freed).
 * softcap > 0: each score s (already scaled) becomes softcap * tanh(s / softcap) before the
 * softmax; callers pass the literal 0 for none, so that copy compiles without the branch.
 * sinks (nullable): row r's sink logit sinks[r] (gpt-oss's attention sinks) joins the softmax's
 * denominator only: weights exp(s_j) / (sum_j exp(s_j) + exp(sink)).
 *
 * Always inlined so that each call with a constant head_dim (see the dispatch below) gets its own
 * copy with fixed trip counts: with a runtime head_dim every short inner loop re-checks aliasing
 * and peels, which cost more than the arithmetic (measured 1.3x on head_dim 64). */
static inline __attribute__((always_inline)) void attend_rows(
    const float *restrict q, float *restrict out, const void *restrict k_cache,
    const void *restrict v_cache, const int64_t *restrict blocks, int64_t first_pos, int64_t seq_len,
    int64_t first_kv_head, int64_t num_rows, int64_t group, int64_t num_kv_heads,
    const int64_t head_dim, int64_t block_size, float scale, const float softcap, const float *restrict sinks,
    float *restrict work, const int kind) {
    float *acc = work;                              /* [num_rows, head_dim] */
    float *probs = acc + num_rows * head_dim;       /* [num_rows, block_size] */
    float *run_max = probs + num_rows * block_size; /* [num_rows] */
    float *run_sum = run_max + num_rows;            /* [num_rows] */
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t span = num_rows / group * head_dim; /* this task's kv heads of one token */
    memset(acc, 0, sizeof(float) * num_rows * head_dim);
    for (int64_t r = 0; r < num_rows; ++r) {
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
    }
    for (int64_t start = first_pos / block_size * block_size; start < seq_len; start += block_size) {
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        const int64_t t0 = first_pos > start ? first_pos - start : 0; /* window cut in this block */
        const int64_t base = blocks[start / block_size] * block_size * token_stride + first_kv_head * head_dim;
        /* Scores, token-outer: the block's K rows are read front to back (a head-outer walk
         * jumps token_stride bytes per read, which the hardware prefetcher follows poorly). */
        for (int64_t t = t0; t < n; ++t) {
            const char *kt = (const char *)k_cache + kv_elem_size(kind) * (base + t * token_stride);
            /* Ask for the V row now: K and V then stream from memory side by side, which
             * measured ~1.4x faster than reading V only after the block's scores. */
            const char *v_bytes = (const char *)v_cache + kv_elem_size(kind) * (base + t * token_stride);
            for (int64_t off = 0; off < span * kv_elem_size(kind); off += 64) __builtin_prefetch(v_bytes + off, 0, 3);
            for (int64_t r = 0; r < num_rows; ++r) {
                const float *qr = q + r * head_dim;
                const char *kh = kt + kv_elem_size(kind) * (r / group) * head_dim;
                const float score = dot_kv(qr, kh, head_dim, kind) * scale;
                /* Gemma 2's logit soft-capping (HF's order: scale, then cap * tanh(s / cap)). */
                probs[r * block_size + t] = softcap > 0.0f ? softcap * tanhf(score / softcap) : score;
            }
        }
        for (int64_t r = 0; r < num_rows; ++r) {
            float *p = probs + r * block_size;
            float blk_max = -INFINITY;
            for (int64_t t = t0; t < n; ++t) blk_max = p[t] > blk_max ? p[t] : blk_max;
            const float new_max = blk_max > run_max[r] ? blk_max : run_max[r];
            /* 0 on the first block (run_max = -inf): acc and run_sum are still 0 then. */
            const float correction = run_max[r] == -INFINITY ? 0.0f : exp_clamped(run_max[r] - new_max);
            float blk_sum = 0.0f;
#pragma omp simd reduction(+ : blk_sum)
            for (int64_t t = t0; t < n; ++t) {
                p[t] = exp_clamped(p[t] - new_max);
                blk_sum += p[t];
            }
            run_sum[r] = run_sum[r] * correction + blk_sum;
            run_max[r] = new_max;
            if (correction != 1.0f) {
                float *ar = acc + r * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) ar[d] *= correction;
            }
        }
        for (int64_t t = t0; t < n; ++t) {
            const char *vt = (const char *)v_cache + kv_elem_size(kind) * (base + t * token_stride);
            for (int64_t r = 0; r < num_rows; ++r)
                axpy_kv(acc + r * head_dim, probs[r * block_size + t], vt + kv_elem_size(kind) * (r / group) * head_dim,
                        head_dim, kind);
        }
    }
    for (int64_t r = 0; r < num_rows; ++r) {
        float sum = run_sum[r], rescale = 1.0f;
        if (sinks != NULL && sinks[r] > -INFINITY) {
            const float sink = sinks[r], m = run_max[r];
            if (sink > m) { /* the sink is the row's max: rescale acc and sum onto it */
                rescale = m == -INFINITY ? 0.0f : expf(m - sink);
                sum = sum * rescale + 1.0f;
            } else {
                sum += expf(sink - m);
            }
        }
        const float inv = sum > 0.0f ? rescale / sum : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] = acc[r * head_dim + d] * inv;
    }
}

/* For each decode i: q row rows[i] of q ([*, num_heads, head_dim], row stride q_row_stride
 * floats) attends over positions [0, seq_lens[i]) of the sequence whose block ids are
 * block_tables[i * table_width ...], or with window > 0 over its last `window` positions only
 * (a sliding window: entries before them are never read, so they may name freed blocks); with
 * softcap > 0 every scaled score s is soft-capped to softcap * tanh(s / softcap) first (Gemma 2's
 * attn_logit_softcapping); with sinks (nullable, [num_heads]) head h's sink logit sinks[h] joins
 * its softmax's denominator (gpt-oss). The result goes to the same row of out.
 * Returns 0; -1 when scratch memory could not be allocated; -2 when a row is outside
 * [0, num_q_rows), or a sequence needs more blocks than its table row holds or names a block it
 * reads outside [0, num_blocks) (nothing is read or written then). The public kernels below are
 * this body with the cache element type fixed. */
/* The first position a decode of context seq_len attends (window <= 0: no window). */
#define FIRST_POS(seq_len) (window > 0 && (seq_len) > window ? (seq_len) - window : 0)

static inline __attribute__((always_inline)) int paged_decode_attention(
    const float *q, int64_t q_row_stride, float *out, int64_t out_row_stride, const int64_t *rows,
    int64_t num_q_rows, const void *k_cache, const void *v_cache, int64_t num_blocks, const int64_t *block_tables,
    int64_t table_width, const int64_t *seq_lens, int64_t num_decodes, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int64_t window, float softcap, const float *sinks,
    const int kind) {
    const int64_t table_stride = table_width;
    if (num_decodes <= 0) return 0;
    for (int64_t i = 0; i < num_decodes; ++i) {
        if (rows[i] < 0 || rows[i] >= num_q_rows) return -2;
        const int64_t used = (seq_lens[i] + block_size - 1) / block_size;
        if (seq_lens[i] < 0 || used > table_width) return -2;
        for (int64_t b = FIRST_POS(seq_lens[i]) / block_size; b < used; ++b) {
            const int64_t id = block_tables[i * table_stride + b];
            if (id < 0 || id >= num_blocks) return -2;
        }
    }
    const int64_t group = num_heads / num_kv_heads;
    /* A task is one sequence's kv heads, or a share of them when there are too few sequences
     * to keep every thread busy. */
    const int64_t threads = omp_get_max_threads();
    int64_t splits = num_decodes >= 2 * threads ? 1 : (2 * threads + num_decodes - 1) / num_decodes;
    if (splits > num_kv_heads) splits = num_kv_heads;
    const int64_t heads_per_task = (num_kv_heads + splits - 1) / splits;
    const int64_t work_floats = heads_per_task * group * (head_dim + block_size + 2);
    int failed = 0;
#pragma omp parallel
    {
        float *work = (float *)malloc(sizeof(float) * work_floats);
        if (work == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t i = 0; i < num_decodes; ++i) {
            for (int64_t part = 0; part < splits; ++part) {
                const int64_t j0 = part * heads_per_task;
                const int64_t j1 = j0 + heads_per_task < num_kv_heads ? j0 + heads_per_task : num_kv_heads;
                if (work == NULL || j0 >= j1) continue;
                const float *qi = q + rows[i] * q_row_stride + j0 * group * head_dim;
                float *oi = out + rows[i] * out_row_stride + j0 * group * head_dim;
                const int64_t *blocks = block_tables + i * table_stride;
#define ATTEND_CAP(D, CAP) attend_rows(qi, oi, k_cache, v_cache, blocks, FIRST_POS(seq_lens[i]), seq_lens[i], \
                                       j0, (j1 - j0) * group, group, num_kv_heads, D, block_size, scale, CAP, \
                                       sinks == NULL ? NULL : sinks + j0 * group, work, kind)
#define ATTEND(D) (softcap > 0.0f ? ATTEND_CAP(D, softcap) : ATTEND_CAP(D, 0.0f))
                switch (head_dim) { /* the head sizes of common models get specialized loops */
                case 64: ATTEND(64); break;
                case 80: ATTEND(80); break;
                case 96: ATTEND(96); break;
                case 128: ATTEND(128); break;
                case 256: ATTEND(256); break;
                default: ATTEND(head_dim);
                }
#undef ATTEND
#undef ATTEND_CAP
            }
        }
        free(work);
    }
    return failed ? -1 : 0;
}
#undef FIRST_POS

#define DECODE_ARGS                                                                                        \
    const float *q, int64_t q_row_stride, float *out, int64_t out_row_stride, const int64_t *rows,           \
        int64_t num_q_rows, const void *k_cache, const void *v_cache, int64_t num_blocks,                    \
        const int64_t *block_tables, int64_t table_width, const int64_t *seq_lens, int64_t num_decodes,      \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale
#define DECODE_CALL(WINDOW, SOFTCAP, KIND) DECODE_CALL_SINKS(WINDOW, SOFTCAP, NULL, KIND)
#define DECODE_CALL_SINKS(WINDOW, SOFTCAP, SINKS, KIND)                                                    \
    paged_decode_attention(q, q_row_stride, out, out_row_stride, rows, num_q_rows, k_cache, v_cache,         \
                           num_blocks, block_tables, table_width, seq_lens, num_decodes, num_heads,         \
                           num_kv_heads, head_dim, block_size, scale, WINDOW, SOFTCAP, SINKS, KIND)
/* Full attention (the signature tests and benchmarks call directly). */
int tidal_paged_decode_attention_f32(DECODE_ARGS) { return DECODE_CALL(0, 0.0f, KV_F32); }
int tidal_paged_decode_attention_f16(DECODE_ARGS) { return DECODE_CALL(0, 0.0f, KV_F16); }
int tidal_paged_decode_attention_bf16(DECODE_ARGS) { return DECODE_CALL(0, 0.0f, KV_BF16); }
/* The same with a trailing sliding window (<= 0: none). */
int tidal_paged_decode_attention_sw_f32(DECODE_ARGS, int64_t window) { return DECODE_CALL(window, 0.0f, KV_F32); }
int tidal_paged_decode_attention_sw_f16(DECODE_ARGS, int64_t window) { return DECODE_CALL(window, 0.0f, KV_F16); }
int tidal_paged_decode_attention_sw_bf16(DECODE_ARGS, int64_t window) { return DECODE_CALL(window, 0.0f, KV_BF16); }
/* The same with a window and a logit soft cap (<= 0: none) after it; the backend calls these. */
int tidal_paged_decode_attention_swcap_f32(DECODE_ARGS, int64_t window, float softcap) {
    return DECODE_CALL(window, softcap, KV_F32);
}
int tidal_paged_decode_attention_swcap_f16(DECODE_ARGS, int64_t window, float softcap) {
    return DECODE_CALL(window, softcap, KV_F16);
}
int tidal_paged_decode_attention_swcap_bf16(DECODE_ARGS, int64_t window, float softcap) {
    return DECODE_CALL(window, softcap, KV_BF16);
}
/* The same with attention sinks after the soft cap (float32 [num_heads], nullable). */
int tidal_paged_decode_attention_sink_f32(DECODE_ARGS, int64_t window, float softcap, const float *sinks) {
    return DECODE_CALL_SINKS(window, softcap, sinks, KV_F32);
}
int tidal_paged_decode_attention_sink_f16(DECODE_ARGS, int64_t window, float softcap, const float *sinks) {
    return DECODE_CALL_SINKS(window, softcap, sinks, KV_F16);
}
int tidal_paged_decode_attention_sink_bf16(DECODE_ARGS, int64_t window, float softcap, const float *sinks) {
    return DECODE_CALL_SINKS(window, softcap, sinks, KV_BF16);
}
#undef DECODE_ARGS
#undef DECODE_CALL
#undef DECODE_CALL_SINKS

/* Token t's K and V rows (row_len floats each, at k + t * k_stride and v + t * v_stride) go to
 * row slots[t] of k_cache / v_cache ([num_slots, row_len] of the cache's element type); a
 * negative slot (a padding token) is skipped. Returns 0, or -1 when a slot is >= num_slots
 * (then nothing is written). */
static inline __attribute__((always_inline)) int write_kv_cache(const float *k, int64_t k_stride, const float *v,
                                                                int64_t v_stride, const int64_t *slots,
                                                                int64_t num_tokens, void *k_cache, void *v_cache,
                                                                int64_t num_slots, int64_t row_len, const int kind) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slots[t] >= num_slots) return -1;
#pragma omp parallel for schedule(static) if (num_tokens * row_len > 65536)
    for (int64_t t = 0; t < num_tokens; ++t) {
        if (slots[t] < 0) continue;
        kv_store_row(k_cache, slots[t] * row_len, k + t * k_stride, row_len, kind);
        kv_store_row(v_cache, slots[t] * row_len, v + t * v_stride, row_len, kind);
    }
    return 0;
}

#define WRITE_ARGS                                                                                         \
    const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots,                \
        int64_t num_tokens, void *k_cache, void *v_cache, int64_t num_slots, int64_t row_len
#define WRITE_CALL(KIND) \
    write_kv_cache(k, k_stride, v, v_stride, slots, num_tokens, k_cache, v_cache, num_slots, row_len, KIND)
int tidal_write_kv_cache_f32(WRITE_ARGS) { return WRITE_CALL(KV_F32); }
int tidal_write_kv_cache_f16(WRITE_ARGS) { return WRITE_CALL(KV_F16); }
int tidal_write_kv_cache_bf16(WRITE_ARGS) { return WRITE_CALL(KV_BF16); }
#undef WRITE_ARGS
#undef WRITE_CALL
