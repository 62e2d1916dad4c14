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

/* Rows r = 0 .. num_rows-1 are the query heads first_kv_head * group + r, i.e. kv heads
 * [first_kv_head, first_kv_head + num_rows / group); row r reads kv head first_kv_head + r / group.
 * Blocks are walked in the outer loop and, inside a block, tokens before heads, so the block's
 * K and V rows are read front to back.
 *
 * Always inlined so that each call with a constant head_dim (see the dispatch below) gets its own
 * copy with fixed trip counts: with a runtime head_dim every short inner loop re-checks aliasing
 * and peels, which cost more than the arithmetic (measured 1.3x on head_dim 64). */
static inline __attribute__((always_inline)) void attend_rows(
    const float *restrict q, float *restrict out, const float *restrict k_cache,
    const float *restrict v_cache, const int64_t *restrict blocks, int64_t seq_len,
    int64_t first_kv_head, int64_t num_rows, int64_t group, int64_t num_kv_heads,
    const int64_t head_dim, int64_t block_size, float scale, float *restrict work) {
    float *acc = work;                              /* [num_rows, head_dim] */
    float *probs = acc + num_rows * head_dim;       /* [num_rows, block_size] */
    float *run_max = probs + num_rows * block_size; /* [num_rows] */
    float *run_sum = run_max + num_rows;            /* [num_rows] */
    const int64_t token_stride = num_kv_heads * head_dim;
    memset(acc, 0, sizeof(float) * num_rows * head_dim);
    for (int64_t r = 0; r < num_rows; ++r) {
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
    }
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        const int64_t base = blocks[start / block_size] * block_size * token_stride + first_kv_head * head_dim;
        const float *k_blk = k_cache + base;
        const float *v_blk = v_cache + base;
        /* Scores, token-outer: the block's K rows are read front to back (a head-outer walk
         * jumps token_stride bytes per read, which the hardware prefetcher follows poorly). */
        for (int64_t t = 0; t < n; ++t) {
            const float *kt = k_blk + t * token_stride;
            /* Ask for the V row now: K and V then stream from memory side by side, which
             * measured ~1.4x faster than reading V only after the block's scores. */
            for (int64_t off = 0; off < num_rows / group * head_dim; off += 16)
                __builtin_prefetch(v_blk + t * token_stride + off, 0, 3);
            for (int64_t r = 0; r < num_rows; ++r) {
                const float *qr = q + r * head_dim;
                const float *kh = kt + (r / group) * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * kh[d];
                probs[r * block_size + t] = dot * scale;
            }
        }
        for (int64_t r = 0; r < num_rows; ++r) {
            float *p = probs + r * block_size;
            float blk_max = -INFINITY;
            for (int64_t t = 0; t < n; ++t) blk_max = p[t] > blk_max ? p[t] : blk_max;
            const float new_max = blk_max > run_max[r] ? blk_max : run_max[r];
            /* 0 on the first block (run_max = -inf): acc and run_sum are still 0 then. */
            const float correction = run_max[r] == -INFINITY ? 0.0f : exp_clamped(run_max[r] - new_max);
            float blk_sum = 0.0f;
#pragma omp simd reduction(+ : blk_sum)
            for (int64_t t = 0; t < n; ++t) {
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
        for (int64_t t = 0; t < n; ++t) {
            const float *vt = v_blk + t * token_stride;
            for (int64_t r = 0; r < num_rows; ++r) {
                const float w = probs[r * block_size + t];
                const float *vh = vt + (r / group) * head_dim;
                float *ar = acc + r * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) ar[d] += w * vh[d];
            }
        }
    }
    for (int64_t r = 0; r < num_rows; ++r) {
        const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] = acc[r * head_dim + d] * inv;
    }
}

/* For each decode i: q row rows[i] of q ([*, num_heads, head_dim], row stride q_row_stride
 * floats) attends over positions [0, seq_lens[i]) of the sequence whose block ids are
 * block_tables[i * table_width ...]; the result goes to the same row of out.
 * Returns 0; -1 when scratch memory could not be allocated; -2 when a row is outside
 * [0, num_q_rows), or a sequence needs more blocks than its table row holds or names a block
 * outside [0, num_blocks) (nothing is read or written then). */
int tidal_paged_decode_attention_f32(const float *q, int64_t q_row_stride, float *out,
                                     int64_t out_row_stride, const int64_t *rows, int64_t num_q_rows,
                                     const float *k_cache, const float *v_cache, int64_t num_blocks,
                                     const int64_t *block_tables, int64_t table_width,
                                     const int64_t *seq_lens, int64_t num_decodes, int64_t num_heads,
                                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                     float scale) {
    const int64_t table_stride = table_width;
    if (num_decodes <= 0) return 0;
    for (int64_t i = 0; i < num_decodes; ++i) {
        if (rows[i] < 0 || rows[i] >= num_q_rows) return -2;
        const int64_t used = (seq_lens[i] + block_size - 1) / block_size;
        if (seq_lens[i] < 0 || used > table_width) return -2;
        for (int64_t b = 0; b < used; ++b) {
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
#define ATTEND(D) attend_rows(qi, oi, k_cache, v_cache, blocks, seq_lens[i], j0, (j1 - j0) * group, \
                              group, num_kv_heads, D, block_size, scale, work)
                switch (head_dim) { /* the head sizes of common models get specialized loops */
                case 64: ATTEND(64); break;
                case 80: ATTEND(80); break;
                case 96: ATTEND(96); break;
                case 128: ATTEND(128); break;
                case 256: ATTEND(256); break;
                default: ATTEND(head_dim);
                }
#undef ATTEND
            }
        }
        free(work);
    }
    return failed ? -1 : 0;
}

/* Token t's K and V rows (row_len floats each, at k + t * k_stride and v + t * v_stride) go to
 * row slots[t] of k_cache / v_cache ([num_slots, row_len]); a negative slot (a padding token)
 * is skipped. Returns 0, or -1 when a slot is >= num_slots (then nothing is written). */
int tidal_write_kv_cache_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                             const int64_t *slots, int64_t num_tokens, float *k_cache, float *v_cache,
                             int64_t num_slots, int64_t row_len) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slots[t] >= num_slots) return -1;
#pragma omp parallel for schedule(static) if (num_tokens * row_len > 65536)
    for (int64_t t = 0; t < num_tokens; ++t) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row_len, k + t * k_stride, sizeof(float) * row_len);
        memcpy(v_cache + slots[t] * row_len, v + t * v_stride, sizeof(float) * row_len);
    }
    return 0;
}
