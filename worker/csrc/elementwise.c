/* Fused float32 elementwise kernels for CPUs: each replaces a chain of 4-8 torch ops (and as
 * many passes over memory and dispatches) in the decoder layer.
 *
 *   rms_norm:           out = w * x / sqrt(mean(x^2) + eps)            (HF LlamaRMSNorm)
 *   fused_add_rms_norm: residual += x; x = rms_norm(residual)          (in place, vLLM's op)
 *   qk_norm_rope:       per-head RMSNorm (Qwen3, optional) then neox RoPE on q and k, in place
 *   silu_and_mul:       out = silu(x[:, :d]) * x[:, d:]
 *
 * Rows are independent, so every kernel splits rows across torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

static inline float inv_rms(const float *restrict x, int64_t dim, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; ++i) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* x row i at x + i * x_stride; out is contiguous [rows, dim]. */
void tidal_rms_norm_f32(const float *x, int64_t x_stride, float *out, const float *weight, float eps,
                        int64_t rows, int64_t dim) {
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict xr = x + r * x_stride;
        float *restrict o = out + r * dim;
        const float s = inv_rms(xr, dim, eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) o[i] = weight[i] * (xr[i] * s);
    }
}

/* x and residual contiguous [rows, dim]: residual = x + residual; x = rms_norm(residual). */
void tidal_fused_add_rms_norm_f32(float *x, float *residual, const float *weight, float eps, int64_t rows,
                                  int64_t dim) {
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        float *restrict xr = x + r * dim;
        float *restrict res = residual + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) res[i] = xr[i] + res[i];
        const float s = inv_rms(res, dim, eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) xr[i] = weight[i] * (res[i] * s);
    }
}

/* One head of head_dim values at h: optional RMSNorm with weight w, then rotate the halves
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as HF's rotate_half formula. */
static inline void norm_rope_head(float *restrict h, const float *restrict w, float eps,
                                  const float *restrict cos, const float *restrict sin, int64_t half) {
    if (w != 0) {
        const float s = inv_rms(h, 2 * half, eps);
#pragma omp simd
        for (int64_t i = 0; i < 2 * half; ++i) h[i] = w[i] * (h[i] * s);
    }
    float *restrict x1 = h;
    float *restrict x2 = h + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * cos[i] - b * sin[i];
        x2[i] = b * cos[i] + a * sin[i];
    }
}

/* qkv row t at qkv + t * row_stride holds [q heads | k heads | v heads], each head_dim wide.
 * q and k heads are normalized (when q_weight / k_weight are not NULL) and rotated in place by
 * position positions[t]; cos_cache / sin_cache are [max_position, head_dim / 2].
 * Returns -1 (touching nothing) if a position is outside [0, max_position). */
int tidal_qk_norm_rope_f32(float *qkv, int64_t row_stride, int64_t num_tokens, int64_t num_q_heads,
                           int64_t num_kv_heads, int64_t head_dim, const float *q_weight,
                           const float *k_weight, float eps, const int64_t *positions,
                           const float *cos_cache, const float *sin_cache, int64_t max_position) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return -1;
    const int64_t half = head_dim / 2;
    const int64_t heads = num_q_heads + num_kv_heads;
#pragma omp parallel for schedule(static) if (num_tokens * heads * head_dim > 32768)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *cos = cos_cache + positions[t] * half;
        const float *sin = sin_cache + positions[t] * half;
        float *row = qkv + t * row_stride;
        for (int64_t h = 0; h < heads; ++h)
            norm_rope_head(row + h * head_dim, h < num_q_heads ? q_weight : k_weight, eps, cos, sin, half);
    }
    return 0;
}

/* x contiguous [rows, 2 * d]; out contiguous [rows, d]. silu(a) = a / (1 + exp(-a)). */
void tidal_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d) {
#pragma omp parallel for schedule(static) if (rows * d > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict gate = x + r * 2 * d;
        const float *restrict up = gate + d;
        float *restrict o = out + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
    }
}
