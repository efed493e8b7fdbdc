/*
 * Fused float32 CPU kernels for the decoder's glue and for attention over the paged KV cache.
 *
 * Each entry point replaces several ATen ops (each paying a dispatch cost larger than its work on
 * a small tensor) with one call. Loops are written so that the compiler vectorises them with `-fopenmp-simd` alone:
 * no OpenMP runtime, no fast-math. All functions run on the calling thread; the Python side may
 * split a batch of sequences across threads (ctypes releases the GIL around each call).
 *
 * Row strides are in floats. Tensors not described as strided are contiguous.
 */
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static void rms_norm_row(const float *x, const float *weight, float *out, int64_t d, float eps) {
    const float inv_rms = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; i++) out[i] = x[i] * inv_rms * weight[i];
}

/* out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * weight, for n rows of d floats (x row stride
 * x_stride; out contiguous). */
void rms_norm(const float *x, int64_t x_stride, const float *weight, float *out, int64_t n,
              int64_t d, float eps) {
    for (int64_t t = 0; t < n; t++) rms_norm_row(x + t * x_stride, weight, out + t * d, d, eps);
}

/* residual[t] += x[t]; out[t] = rms_norm(residual[t]). x has row stride x_stride; residual and
 * out are contiguous [n, d]. out may alias x when x is contiguous. */
void add_rms_norm(const float *x, int64_t x_stride, float *residual, const float *weight,
                  float *out, int64_t n, int64_t d, float eps) {
    for (int64_t t = 0; t < n; t++) {
        const float *xr = x + t * x_stride;
        float *res = residual + t * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) res[i] = res[i] + xr[i];
        rms_norm_row(res, weight, out + t * d, d, eps);
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, d + i] for i < d; gate_up is [n, 2d]. */
void silu_and_mul(const float *gate_up, float *out, int64_t n, int64_t d) {
    for (int64_t t = 0; t < n; t++) {
        const float *gate = gate_up + t * 2 * d, *up = gate + d;
        float *o = out + t * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = gate[i] / (1.0f + exp_poly(-gate[i])) * up[i];
    }
}

/* Rotate-half RoPE in place on heads [0, num_heads) of each row of x (row stride x_stride,
 * heads of head_dim floats back to back). cos_sin is [P, 2, head_dim]: (cos, cos) then
 * (-sin, sin), so that x' = x * cos_sin[p, 0] + swap_halves(x) * cos_sin[p, 1]. */
void rope(float *x, int64_t x_stride, int64_t num_heads, int64_t head_dim,
          const float *cos_sin, const int64_t *positions, int64_t n) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos_sin + positions[t] * 2 * head_dim, *s = c + head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *x1 = x + t * x_stride + h * head_dim, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] + b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* scores[j] = exp(scores[j] - max) over [0, num_keys), 0 where it was -inf; returns the sum. */
static inline __attribute__((always_inline)) float softmax_in_place(float *scores,
                                                                    int64_t num_keys) {
    float max = -INFINITY;
#pragma omp simd reduction(max : max)
    for (int64_t j = 0; j < num_keys; j++) max = scores[j] > max ? scores[j] : max;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < num_keys; j++) {
        const float p = scores[j] == -INFINITY ? 0.0f : exp_poly(scores[j] - max);
        scores[j] = p;
        sum += p;
    }
    return sum;
}

/* Query rows attended together, sharing each key and value row they read. */
#define ROW_BLOCK 4

#if defined(__AVX512F__)
/* The sums of a, b, c and d's lanes, in that order. Each sum is added in the same order whatever
 * the other three hold, so a row's score does not depend on the rows attended with it. */
static inline __m128 reduce_add4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* 128-bit lane i: four partial sums of the i-th argument */
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
    return _mm512_castps512_ps128(
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
}
#endif

/* Query rows r0 .. r0 + ROWS - 1 of key head kv_head in one sequence, where row r is new token
 * i = r / group under query head kv_head * group + r % group: one pass over the keys gives every
 * row's scores, one over the values every row's output, so each key and value row is read once
 * for the ROWS query rows that share it. scores has room for ROW_BLOCK * seq_len floats. With
 * AVX-512 and a head size of a multiple of 16 up to 128, the ROWS dot products with a key are
 * summed together (`reduce_add4`) and the outputs stay in registers. */
static inline __attribute__((always_inline)) void attend_rows_grouped(
    const float *q, int64_t q_stride, const float *keys, const float *values,
    const int64_t *key_offsets, int64_t q_first, int64_t q_len, int64_t seq_len,
    const uint8_t *mask, float *out, int64_t num_heads, int64_t kv_head, int64_t group,
    float scale, float *scores, int64_t r0, const int64_t ROWS, const int64_t head_dim) {
    const int64_t ctx_len = seq_len - q_len;
    const float *rows[ROW_BLOCK];
    float *row_out[ROW_BLOCK];
    int64_t new_token[ROW_BLOCK];
    int64_t num_keys = 0;
    for (int64_t b = 0; b < ROWS; b++) {
        const int64_t r = r0 + b, i = r / group, head = kv_head * group + r % group;
        rows[b] = q + (q_first + i) * q_stride + head * head_dim;
        row_out[b] = out + ((q_first + i) * num_heads + head) * head_dim;
        new_token[b] = i;
        /* Causal rows see keys [0, ctx_len + i]; tree rows the context and their mask. */
        const int64_t n = mask != NULL ? seq_len : ctx_len + i + 1;
        num_keys = n > num_keys ? n : num_keys;
    }
#if defined(__AVX512F__)
    const int vector = head_dim % 16 == 0 && head_dim <= 128;
#else
    const int vector = 0;
#endif
    if (vector) {
#if defined(__AVX512F__)
        const int64_t chunks = head_dim / 16;
        for (int64_t j = 0; j < num_keys; j++) {
            const float *key = keys + key_offsets[j];
            __m512 acc[ROW_BLOCK];
            for (int64_t b = 0; b < ROW_BLOCK; b++) acc[b] = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                const __m512 k = _mm512_loadu_ps(key + 16 * c);
                for (int64_t b = 0; b < ROWS; b++)
                    acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps(rows[b] + 16 * c), k, acc[b]);
            }
            float dots[4];
            _mm_storeu_ps(dots, reduce_add4(acc[0], acc[1], acc[2], acc[3]));
            for (int64_t b = 0; b < ROWS; b++) scores[b * seq_len + j] = dots[b] * scale;
        }
#endif
    } else {
        for (int64_t j = 0; j < num_keys; j++) {
            const float *key = keys + key_offsets[j];
            for (int64_t b = 0; b < ROWS; b++) {
                scores[b * seq_len + j] = dot(rows[b], key, head_dim) * scale;
            }
        }
    }
    float inv_sum[ROW_BLOCK];
    for (int64_t b = 0; b < ROWS; b++) {
        float *row = scores + b * seq_len;
        const int64_t i = new_token[b];
        for (int64_t j = ctx_len; j < num_keys; j++) {
            const int visible = mask != NULL ? mask[i * q_len + j - ctx_len] : j <= ctx_len + i;
            if (!visible) row[j] = -INFINITY;
        }
        inv_sum[b] = 1.0f / softmax_in_place(row, num_keys);
    }
    if (vector) {
#if defined(__AVX512F__)
        const int64_t chunks = head_dim / 16;
        __m512 acc[ROW_BLOCK][8];
        for (int64_t b = 0; b < ROWS; b++)
            for (int64_t c = 0; c < chunks; c++) acc[b][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < num_keys; j++) {
            const float *value = values + key_offsets[j];
            for (int64_t c = 0; c < chunks; c++) {
                const __m512 v = _mm512_loadu_ps(value + 16 * c);
                for (int64_t b = 0; b < ROWS; b++)
                    acc[b][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[b * seq_len + j]), v, acc[b][c]);
            }
        }
        for (int64_t b = 0; b < ROWS; b++) {
            const __m512 inv = _mm512_set1_ps(inv_sum[b]);
            for (int64_t c = 0; c < chunks; c++)
                _mm512_storeu_ps(row_out[b] + 16 * c, _mm512_mul_ps(acc[b][c], inv));
        }
#endif
        return;
    }
    float acc[ROW_BLOCK][256];
    for (int64_t b = 0; b < ROWS; b++) memset(acc[b], 0, (size_t)head_dim * sizeof(float));
    for (int64_t j = 0; j < num_keys; j++) {
        const float *value = values + key_offsets[j];
        for (int64_t b = 0; b < ROWS; b++) {
            const float p = scores[b * seq_len + j];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) acc[b][d] += p * value[d];
        }
    }
    for (int64_t b = 0; b < ROWS; b++) {
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) row_out[b][d] = acc[b][d] * inv_sum[b];
    }
}

/* Sequence s of store_and_attend: every new token, every head. */
static inline __attribute__((always_inline)) void attend_sequence(
    const float *q, int64_t q_stride, const float *key_cache, const float *value_cache,
    const int32_t *table, int64_t block_size, int64_t q_first, int64_t q_len, int64_t seq_len,
    const uint8_t *mask, float *out, int64_t num_heads, int64_t num_kv_heads, float scale,
    int64_t *key_offsets, float *scores, const int64_t head_dim) {
    const int64_t group = num_heads / num_kv_heads, num_rows = q_len * group;
    for (int64_t j = 0; j < seq_len; j++) {
        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
        key_offsets[j] = slot * num_kv_heads * head_dim;
    }
    for (int64_t h = 0; h < num_kv_heads; h++) {
        for (int64_t r0 = 0; r0 < num_rows; r0 += ROW_BLOCK) {
            const int64_t rows = num_rows - r0 < ROW_BLOCK ? num_rows - r0 : ROW_BLOCK;
#define GROUPED(n)                                                                             \
    attend_rows_grouped(q, q_stride, key_cache + h * head_dim, value_cache + h * head_dim,     \
                        key_offsets, q_first, q_len, seq_len, mask, out, num_heads, h, group,  \
                        scale, scores, r0, n, head_dim)
            /* A constant row count keeps the rows' dot products and accumulators apart. */
            if (rows == 1) GROUPED(1);
            else if (rows == 2) GROUPED(2);
            else if (rows == 3) GROUPED(3);
            else GROUPED(4);
#undef GROUPED
        }
    }
}

/* Writes each new token's K and V to its cache slot, then attends, for sequences
 * [seq_begin, seq_end) of a flat varlen batch.
 *
 * q:  [N, num_heads, head_dim] rows with stride q_stride (the heads themselves contiguous)
 * k, v: [N, num_kv_heads, head_dim] rows with stride kv_stride
 * key_cache, value_cache: [num_slots, num_kv_heads, head_dim]; slot = block * block_size + offset
 * slot_mapping: [N] cache slot of each new token
 * block_tables: [S, max_blocks] int32
 * query_start: [S + 1] first row of each sequence's new tokens; seq_lens: [S] context + new
 * mask_offsets: [S] byte offset into masks of sequence s's [q_len, q_len] tree mask (1 = may
 *   attend), or -1 for causal attention among its new tokens
 * out: [N, num_heads, head_dim] contiguous; head_dim <= 256
 *
 * New token i of a sequence sees every cached key before its first new token, and new token j
 * when j <= i (causal) or mask[i, j] (tree). Softmax in float32 with the row maximum subtracted.
 */
void store_and_attend(const float *q, int64_t q_stride, const float *k, const float *v,
                      int64_t kv_stride, float *key_cache, float *value_cache,
                      const int64_t *slot_mapping, const int32_t *block_tables,
                      int64_t max_blocks, int64_t block_size, const int64_t *query_start,
                      const int64_t *seq_lens, const int64_t *mask_offsets,
                      const uint8_t *masks, float *out, int64_t seq_begin, int64_t seq_end,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale) {
    const int64_t kv_row = num_kv_heads * head_dim;
    for (int64_t t = query_start[seq_begin]; t < query_start[seq_end]; t++) {
        memcpy(key_cache + slot_mapping[t] * kv_row, k + t * kv_stride, kv_row * sizeof(float));
        memcpy(value_cache + slot_mapping[t] * kv_row, v + t * kv_stride, kv_row * sizeof(float));
    }
    int64_t max_len = 1;
    for (int64_t s = seq_begin; s < seq_end; s++) {
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    }
    int64_t *key_offsets = malloc((size_t)max_len * sizeof(int64_t));
    float *scores = malloc((size_t)(ROW_BLOCK * max_len) * sizeof(float));
    if (key_offsets == NULL || scores == NULL) abort();
    for (int64_t s = seq_begin; s < seq_end; s++) {
        const int64_t q_first = query_start[s], q_len = query_start[s + 1] - q_first;
        const int32_t *table = block_tables + s * max_blocks;
        const uint8_t *mask = mask_offsets[s] < 0 ? NULL : masks + mask_offsets[s];
#define ATTEND_SEQUENCE(dim)                                                                   \
    attend_sequence(q, q_stride, key_cache, value_cache, table, block_size, q_first, q_len,    \
                    seq_lens[s], mask, out, num_heads, num_kv_heads, scale, key_offsets,       \
                    scores, dim)
        /* Constant head sizes let the compiler unroll the dot products and keep a row's
         * output accumulator in registers. */
        if (head_dim == 64) ATTEND_SEQUENCE(64);
        else if (head_dim == 128) ATTEND_SEQUENCE(128);
        else ATTEND_SEQUENCE(head_dim);
#undef ATTEND_SEQUENCE
    }
    free(key_offsets);
    free(scores);
}

/* ---------------------------------------------------------------------------------------------
 * The MLP speculator's drafting glue (engine/spec_decode/mlp_speculator.py).
 * ------------------------------------------------------------------------------------------- */

/* GELU with erf, 0.5 x (1 + erf(x / sqrt 2)), written as 0.5 x (2 - q) for x >= 0 and
 * 0.5 x q below, q = erfc(|x| / sqrt 2) by Abramowitz and Stegun 7.1.26 (no cancellation for
 * negative x); within 3e-7 of the exact value. Branch-free, so loops over it vectorise. */
static inline float gelu_erf(float x) {
    const float z = fabsf(x) * 0.70710678118654752f;
    const float t = 1.0f / (1.0f + 0.3275911f * z);
    float p = 1.061405429f;
    p = p * t - 1.453152027f;
    p = p * t + 1.421413741f;
    p = p * t - 0.284496736f;
    p = p * t + 0.254829592f;
    const float q = p * t * exp_poly(-z * z);
    return 0.5f * x * (x >= 0.0f ? 2.0f - q : q);
}

/* out[0 .. d) = GELU(ln_weight * rms(h) + ln_bias), h = p + emb_scale * e (out may not alias). */
static inline void stage_row(const float *p, const float *e, float emb_scale, const float *ln_weight,
                             const float *ln_bias, float eps, float *out, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; i++) out[i] = e[i] * emb_scale + p[i];
    const float inv_rms = 1.0f / sqrtf(dot(out, out, d) / (float)d + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; i++) out[i] = gelu_erf(out[i] * inv_rms * ln_weight[i] + ln_bias[i]);
}

/* One speculator stage for groups of sibling tokens that share their parent's projection:
 * out[g * c + j] = GELU(ln_weight * rms(h) + ln_bias), h = projected[g] + emb_scale *
 * emb[token_ids[g * c + j]], rms(h) = h * rsqrt(mean(h^2) + eps). projected is [groups, d]
 * (row stride proj_stride), emb [vocab, d], token_ids [groups * c] (each < vocab),
 * out [groups * c, d]. */
void speculator_stage(const float *projected, int64_t proj_stride, const int64_t *token_ids,
                      int64_t groups, int64_t c, const float *emb, float emb_scale,
                      const float *ln_weight, const float *ln_bias, float eps, float *out,
                      int64_t d) {
    for (int64_t r = 0; r < groups * c; r++) {
        stage_row(projected + (r / c) * proj_stride, emb + token_ids[r] * d, emb_scale, ln_weight,
                  ln_bias, eps, out + r * d, d);
    }
}

#define TOPK_BLOCK 64

/* The k (<= v) largest log-probabilities of one row of logits x [v], logit minus the row's
 * log-sum-exp, in descending order (ties: the lower column first) into best [k], and their
 * columns into ids [k], as columns[column] where columns [v] is not NULL. */
static void topk_row(const float *x, int64_t v, int64_t k, const int64_t *columns, float *best,
                     int64_t *ids) {
    int64_t filled = 0;
    for (int64_t j0 = 0; j0 < v; j0 += TOPK_BLOCK) {
        const int64_t j1 = j0 + TOPK_BLOCK < v ? j0 + TOPK_BLOCK : v;
        if (filled == k) { /* most blocks hold nothing above the k-th best: one max says so */
            float block_max = x[j0];
#pragma omp simd reduction(max : block_max)
            for (int64_t j = j0; j < j1; j++) block_max = x[j] > block_max ? x[j] : block_max;
            if (!(block_max > best[k - 1])) continue;
        }
        for (int64_t j = j0; j < j1; j++) {
            const float value = x[j];
            if (filled == k && !(value > best[k - 1])) continue;
            int64_t at = filled < k ? filled++ : k - 1;
            while (at > 0 && value > best[at - 1]) {
                best[at] = best[at - 1];
                ids[at] = ids[at - 1];
                at--;
            }
            best[at] = value;
            ids[at] = j;
        }
    }
    const float max = best[0];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < v; j++) sum += exp_poly(x[j] - max);
    const float lse = max + logf(sum);
    for (int64_t i = 0; i < k; i++) best[i] -= lse;
    if (columns != NULL) {
        for (int64_t i = 0; i < k; i++) ids[i] = columns[ids[i]];
    }
}

/* For each of n rows of logits [n, v]: topk_row into top_logprobs [n, k] and top_ids [n, k]. */
void log_softmax_topk(const float *logits, int64_t n, int64_t v, int64_t k, const int64_t *columns,
                      float *top_logprobs, int64_t *top_ids) {
    for (int64_t r = 0; r < n; r++) {
        topk_row(logits + r * v, v, k, columns, top_logprobs + r * k, top_ids + r * k);
    }
}

/* ---------------------------------------------------------------------------------------------
 * A whole draft tree of "nodes" selection in one call (engine/spec_decode/proposer.py).
 * ------------------------------------------------------------------------------------------- */

/* rows_gemm_q8's signature (engine/kernels/rows_gemm.c), called through its address. */
typedef void (*q8_matmul_t)(const float *x, int64_t ldx, const int8_t *packed, const float *scales,
                            const float *bias, float *y, int64_t m, int64_t k, int64_t n);

/* Per head, the addresses `speculator_draft` reads, in this order. */
enum { H_PROJ, H_PROJ_SCALES, H_EMB, H_LN_WEIGHT, H_LN_BIAS, H_HEAD, H_HEAD_SCALES, H_FIELDS };

typedef struct {
    float score;  /* summed log-probability of the node's path */
    int64_t token;
    int32_t parent; /* index of the parent node in its request, -1 below the root */
    int32_t depth;  /* 1 for the root's children */
    int32_t row;    /* the parent's state row in the previous head's rows */
} node_t;

/* node_picks' order: the higher score first, NaN last; ties: the shallower, then the earlier
 * made (nodes of one depth are made in the mixed-radix order of the whole tree). */
static inline int node_before(const node_t *nodes, int64_t a, int64_t b) {
    const float sa = nodes[a].score, sb = nodes[b].score;
    const int nan_a = sa != sa, nan_b = sb != sb;
    if (nan_a != nan_b) return nan_b;
    if (!nan_a && sa != sb) return sa > sb;
    if (nodes[a].depth != nodes[b].depth) return nodes[a].depth < nodes[b].depth;
    return a < b;
}

static int64_t node_rank(const node_t *nodes, int64_t count, int64_t n) {
    int64_t rank = 0;
    for (int64_t m = 0; m < count; m++) rank += m != n && node_before(nodes, m, n);
    return rank;
}

/* Drafts the first `num_drafts` nodes of highest summed log-probability (node_picks' order) of
 * the top-k tree of an MLP speculator with int8 projections and heads, for `batch` requests:
 * the maths of `MLPSpeculator.draft_candidates` (stage i: s' = GELU(ln_i(proj_i(s) + emb_scale
 * * emb_i[token])); head i: the top_k[i] log-probabilities of head_i(s')), scoring only the
 * children of nodes ranked below num_drafts - 1 among the nodes known so far (none other can
 * have a child among the picks), every product by `matmul_address` (rows_gemm_q8).
 *
 * states [batch, d_in] (row stride ld_states): the base model's final-norm states, RMS-normed
 * and divided by sqrt(2) first when scale_input; root_tokens [batch]; top_k [n_heads], each
 * at most 256; heads [n_heads, H_FIELDS] addresses: proj_i packed [.., d_in or d] -> d and its
 * scales, emb_i [.., d] float32, ln_i weight and bias [d], head_i packed d -> vocab and its
 * scales; columns [vocab] maps a head's column to a token id, or NULL. Out, per request b, its
 * out_counts[b] <= num_drafts picks in order: tokens, parents (the parent's pick, -1 for the
 * root) and scores [batch, num_drafts] (unused entries untouched). Returns 0, or -1 when
 * memory runs out. */
int speculator_draft(const float *states, int64_t ld_states, const int64_t *root_tokens,
                     int64_t batch, int64_t d_in, int64_t d, int64_t scale_input,
                     const int64_t *heads, const int64_t *top_k, int64_t n_heads, int64_t vocab,
                     const int64_t *columns, float emb_scale, float eps, int64_t num_drafts,
                     int64_t matmul_address, int64_t *out_tokens, int64_t *out_parents,
                     float *out_scores, int64_t *out_counts) {
    const q8_matmul_t matmul = (q8_matmul_t)(intptr_t)matmul_address;
    int64_t max_nodes = 0, max_rows = 1, width = 1; /* per request */
    for (int64_t i = 0; i < n_heads; i++) {
        if (width > max_rows) max_rows = width; /* head i scores at most width nodes' children */
        width *= top_k[i];
        max_nodes += width;
    }
    max_rows *= batch;
    const int64_t d_max = d_in > d ? d_in : d;
    /* One per-thread buffer, grown as needed (freeing it each call would fault its pages in
     * again): nodes, node counts, rows' nodes, ranks, then floats. */
    static __thread char *arena;
    static __thread size_t arena_size;
    const size_t node_bytes = (size_t)(batch * max_nodes) * sizeof(node_t);
    const size_t index_bytes = (size_t)(batch + max_rows + max_nodes + 256) * sizeof(int64_t);
    const size_t float_bytes = (size_t)(max_rows * (3 * d_max + vocab) + 256) * sizeof(float);
    const size_t need = node_bytes + index_bytes + float_bytes;
    if (need > arena_size) {
        char *grown = realloc(arena, need);
        if (!grown) return -1;
        arena = grown;
        arena_size = need;
    }
    node_t *nodes = (node_t *)arena;
    int64_t *count = (int64_t *)(arena + node_bytes);
    int64_t *row_node = count + batch; /* b * max_nodes + node */
    int64_t *ranks = row_node + max_rows;
    int64_t *ids = ranks + max_nodes;
    float *prev = (float *)(ids + 256), *cur = prev + max_rows * d_max;
    float *projected = cur + max_rows * d_max, *logits = projected + max_rows * d_max;
    float *best = logits + max_rows * vocab;
    memset(count, 0, (size_t)batch * sizeof(int64_t));
    const float *x = states; /* the previous head's states: [rows, d_in or d] */
    int64_t ldx = ld_states, prev_rows = batch, rows = batch;
    if (scale_input) {
        for (int64_t b = 0; b < batch; b++) {
            const float *s = states + b * ld_states;
            const float inv = 1.0f / (sqrtf(dot(s, s, d_in) / (float)d_in + 1e-6f) * sqrtf(2.0f));
            for (int64_t i = 0; i < d_in; i++) prev[b * d_in + i] = s[i] * inv;
        }
        x = prev;
        ldx = d_in;
    }
    for (int64_t i = 0; i < n_heads; i++) {
        const int64_t *h = heads + i * H_FIELDS, k = top_k[i];
        const float *emb = (const float *)(intptr_t)h[H_EMB];
        const float *ln_w = (const float *)(intptr_t)h[H_LN_WEIGHT];
        const float *ln_b = (const float *)(intptr_t)h[H_LN_BIAS];
        if (i > 0) { /* the nodes worth expanding: depth i, ranked below num_drafts - 1 */
            rows = 0;
            for (int64_t b = 0; b < batch; b++) {
                const node_t *mine = nodes + b * max_nodes;
                for (int64_t n = 0; n < count[b]; n++) {
                    if (mine[n].depth == i && node_rank(mine, count[b], n) < num_drafts - 1) {
                        row_node[rows++] = b * max_nodes + n;
                    }
                }
            }
            if (rows == 0) break;
        }
        matmul(x, ldx, (const int8_t *)(intptr_t)h[H_PROJ],
               (const float *)(intptr_t)h[H_PROJ_SCALES], NULL, projected, prev_rows,
               i == 0 ? d_in : d, d);
        for (int64_t r = 0; r < rows; r++) {
            const node_t *n = i == 0 ? NULL : nodes + row_node[r];
            stage_row(projected + (i == 0 ? r : n->row) * d,
                      emb + (i == 0 ? root_tokens[r] : n->token) * d, emb_scale, ln_w, ln_b, eps,
                      cur + r * d, d);
        }
        matmul(cur, d, (const int8_t *)(intptr_t)h[H_HEAD],
               (const float *)(intptr_t)h[H_HEAD_SCALES], NULL, logits, rows, d, vocab);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t b = i == 0 ? r : row_node[r] / max_nodes;
            const int64_t parent = i == 0 ? -1 : row_node[r] % max_nodes;
            const float base = parent < 0 ? 0.0f : nodes[b * max_nodes + parent].score;
            topk_row(logits + r * vocab, vocab, k, columns, best, ids);
            for (int64_t c = 0; c < k; c++) {
                node_t *child = nodes + b * max_nodes + count[b]++;
                child->score = base + best[c];
                child->token = ids[c];
                child->parent = (int32_t)parent;
                child->depth = (int32_t)(i + 1);
                child->row = (int32_t)r;
            }
        }
        float *swap = prev; /* this head's states are the next projection's input */
        prev = cur;
        cur = swap;
        x = prev;
        ldx = d;
        prev_rows = rows;
    }
    for (int64_t b = 0; b < batch; b++) {
        const node_t *mine = nodes + b * max_nodes;
        const int64_t picks = count[b] < num_drafts ? count[b] : num_drafts;
        for (int64_t n = 0; n < count[b]; n++) ranks[n] = node_rank(mine, count[b], n);
        for (int64_t n = 0; n < count[b]; n++) {
            const int64_t at = ranks[n];
            if (at >= picks) continue;
            out_tokens[b * num_drafts + at] = mine[n].token;
            out_parents[b * num_drafts + at] = mine[n].parent < 0 ? -1 : ranks[mine[n].parent];
            out_scores[b * num_drafts + at] = mine[n].score;
        }
        out_counts[b] = picks;
    }
    return 0;
}
