/*
 * Inline float32 helpers shared by the CPU kernels (cpu_kernels.c, attention.c, drafting.c,
 * rows_gemm.c's gated products):
 * written so that loops over them vectorise with `-fopenmp-simd` alone (no fast-math).
 */
#ifndef SPECSERVE_CPU_MATH_H
#define SPECSERVE_CPU_MATH_H

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 88.7: Cephes' single-precision polynomial, within 2 ulp of expf, written
 * without calls or branches so that loops over it vectorise. Results below exp(-87.3) are
 * returned as exp(-87.3) instead of a subnormal or 0; callers only add them to larger sums. */
static inline float exp_poly(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    /* n = round(x / ln 2) with the 1.5 * 2^23 trick (exact for |n| < 2^22). */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
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
    } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* SiLU-and-multiply of one gated activation: silu(gate) * up. */
static inline float silu_mul(float gate, float up) { return gate / (1.0f + exp_poly(-gate)) * up; }

/* Without fast-math, compilers sum a vectorised reduction's lanes one after another (16
 * dependent scalar adds for AVX-512); the intrinsics below add them as a tree instead. */
static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        }
        s = _mm512_reduce_add_ps(acc);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        }
        const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
        s = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
    }
#endif
    float tail = 0.0f;
#pragma omp simd reduction(+ : tail)
    for (int64_t j = i; j < n; j++) tail += a[j] * b[j];
    return s + tail;
}

#endif
