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

#define TOP_SELECT_BLOCK 64

/* Whether entry a of a top_select heap ranks below entry b: a lower value, or an equal value
 * at a higher index. */
static inline int top_worse(const float *best, const int64_t *ids, int64_t a, int64_t b) {
    return best[a] < best[b] || (best[a] == best[b] && ids[a] > ids[b]);
}

/* Restores the heap (root: the worst entry) below entry `at` of the first n. */
static inline void top_sift_down(float *best, int64_t *ids, int64_t n, int64_t at) {
    for (;;) {
        int64_t worst = at;
        const int64_t left = 2 * at + 1, right = left + 1;
        if (left < n && top_worse(best, ids, left, worst)) worst = left;
        if (right < n && top_worse(best, ids, right, worst)) worst = right;
        if (worst == at) return;
        const float value = best[at];
        const int64_t id = ids[at];
        best[at] = best[worst], ids[at] = ids[worst];
        best[worst] = value, ids[worst] = id;
        at = worst;
    }
}

/* top_select's heap of the best k among the n entries (values, their indices) in index order,
 * sorted: best [k] and ids [k] in descending order (ties: the lower index first). */
static inline void top_heap(const float *values, const int64_t *index, int64_t n, int64_t k,
                            float *best, int64_t *ids) {
    for (int64_t j = 0; j < k; j++) best[j] = values[j], ids[j] = index ? index[j] : j;
    for (int64_t at = k / 2 - 1; at >= 0; at--) top_sift_down(best, ids, k, at);
    for (int64_t j0 = k; j0 < n; j0 += TOP_SELECT_BLOCK) {
        const int64_t j1 = j0 + TOP_SELECT_BLOCK < n ? j0 + TOP_SELECT_BLOCK : n;
        float block_max = values[j0];
#pragma omp simd reduction(max : block_max)
        for (int64_t j = j0; j < j1; j++) block_max = values[j] > block_max ? values[j] : block_max;
        if (!(block_max > best[0])) continue; /* an equal value at a higher index ranks below */
        for (int64_t j = j0; j < j1; j++) {
            if (values[j] > best[0]) {
                best[0] = values[j], ids[0] = index ? index[j] : j;
                top_sift_down(best, ids, k, 0);
            }
        }
    }
    for (int64_t m = k - 1; m > 0; m--) { /* the worst left goes last */
        const float value = best[0];
        const int64_t id = ids[0];
        best[0] = best[m], ids[0] = ids[m];
        best[m] = value, ids[m] = id;
        top_sift_down(best, ids, m, 0);
    }
}

/* The k-th largest (1 <= k <= n) of a [n] (no NaN), which it reorders: quickselect. */
static inline float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t target = k - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        float p0 = a[lo], p1 = a[mid], p2 = a[hi], t; /* the median of three as the pivot */
        if (p0 < p1) t = p0, p0 = p1, p1 = t;
        if (p1 < p2) t = p1, p1 = p2, p2 = t;
        if (p0 < p1) t = p0, p0 = p1, p1 = t;
        const float pivot = p1;
        int64_t i = lo, j = hi;
        while (i <= j) { /* descending: [lo, i) >= pivot, (j, hi] <= pivot */
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                t = a[i], a[i] = a[j], a[j] = t;
                i++, j--;
            }
        }
        if (target <= j) {
            hi = j;
        } else if (target >= i) {
            lo = i;
        } else {
            break; /* between j and i: equal to the pivot */
        }
    }
    return a[target];
}

/* The k (1 <= k <= v) largest values of x [v] in descending order (ties: the lower index
 * first) into best [k], their indices into ids [k]; a row holding NaN gets some k of its
 * entries. `scratch` [3v] and `kept_ids` [v] are scratch.
 *
 * The k-th largest of the maxima of blocks of x bounds the k-th largest value from below (k
 * blocks hold a value at least as large), so only the values at or above it are kept, in index
 * order; blocks are sized to give about 3k maxima. Of those, the values above their k-th largest
 * and then the ones equal to it, in index order, are the k best, sorted last. */
static inline void top_select(const float *x, int64_t v, int64_t k, float *best, int64_t *ids,
                              float *scratch, int64_t *kept_ids) {
    int64_t size = v / (3 * k);
    size = size < 1 ? 1 : size > 64 ? 64 : size;
    const int64_t num_blocks = v / size; /* a partial last block is left out: still a bound */
    float *maxima = scratch, *selected = scratch + v, *kept = scratch + 2 * v;
    const int bounded = num_blocks >= k; /* else every value is kept */
    float bound = -INFINITY;
    if (bounded) {
        for (int64_t b = 0; b < num_blocks; b++) {
            const float *block = x + b * size;
            float m = block[0];
#pragma omp simd reduction(max : m)
            for (int64_t j = 1; j < size; j++) m = block[j] > m ? block[j] : m;
            maxima[b] = m;
            selected[b] = m == m ? m : -INFINITY; /* NaN: no bound from this block */
        }
        bound = kth_largest(selected, num_blocks, k);
    }
    int64_t n = 0;
    for (int64_t b = 0; b * size < v; b++) {
        if (bounded && b < num_blocks && maxima[b] < bound) continue;
        const int64_t j1 = (b + 1) * size < v && b + 1 < num_blocks ? (b + 1) * size : v;
        for (int64_t j = b * size; j < j1; j++) { /* no branch: written always, kept or not */
            kept[n] = x[j];
            kept_ids[n] = j;
            n += x[j] >= bound;
        }
        if (b + 1 >= num_blocks) break;
    }
    if (n < k) { /* NaN in the row */
        top_heap(x, NULL, v, k, best, ids);
        return;
    }
    /* the kept values above the k-th largest, then those equal to it in index order */
    for (int64_t j = 0; j < n; j++) selected[j] = kept[j];
    const float kth = kth_largest(selected, n, k);
    int64_t m = 0;
    for (int64_t j = 0; j < n && m < k; j++) {
        if (kept[j] > kth) best[m] = kept[j], ids[m++] = kept_ids[j];
    }
    for (int64_t j = 0; j < n && m < k; j++) {
        if (kept[j] == kth) best[m] = kept[j], ids[m++] = kept_ids[j];
    }
    top_heap(best, ids, k, k, best, ids);
}

#endif
