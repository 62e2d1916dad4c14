/* Small math helpers shared by tidal's CPU kernels. */
#ifndef TIDAL_VEC_MATH_H
#define TIDAL_VEC_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) vectorizable inside `omp simd` loops (glibc's expf is a scalar call). Cody-Waite range
 * reduction and Cephes' degree-6 polynomial, relative error ~1e-7; x is clamped to [-87, 88]. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* Half-precision <-> float32 in plain integer arithmetic: the portable path (and the reference
 * the SIMD paths must match bit for bit). Rounding is to nearest, ties to even, as torch's
 * `.to(torch.float16 / torch.bfloat16)`; a NaN stays a NaN of the same sign (quiet, its payload
 * truncated, as F16C's vcvtps2ph does), an overflow becomes infinity. */
static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u); /* the well-defined type pun; compiles to a register move */
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    const uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16; /* carries into the exponent */
    const uint32_t nan = (x >> 16) | 0x40u;                          /* quiet bit set */
    return (uint16_t)((x & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13)); /* inf / NaN */
    if (e != 0) return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
    return bits_f32(sign | f32_bits((float)m * 0x1p-24f)); /* zero or subnormal: m * 2^-24, exact */
}

static inline uint16_t f32_to_f16(float f) {
    const uint32_t x = f32_bits(f), a = x & 0x7FFFFFFFu;
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    if (a > 0x7F800000u) return sign | 0x7E00u | (uint16_t)((a >> 13) & 0x3FFu); /* NaN */
    if (a >= 0x477FF000u) return sign | 0x7C00u; /* >= 65520 (the tie above 65504) -> inf */
    if (a >= 0x38800000u) {                      /* normal half: rebias 127 -> 15, round 13 bits */
        const uint32_t r = a - 0x38000000u;
        return sign | (uint16_t)((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
    }
    if (a <= 0x33000000u) return sign; /* <= 2^-25 rounds to zero (2^-25 itself ties to even 0) */
    /* subnormal half: the value in units of 2^-24 is m >> (126 - e), rounded to nearest even */
    const uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u, s = 126u - e;
    uint32_t q = m >> s;
    const uint32_t rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
    q += rem > half || (rem == half && (q & 1u));
    return sign | (uint16_t)q;
}

#endif
