/*
 * Attention over the paged KV cache for the CPU backend (engine/attention/cpu_backend.py): each
 * new token's K/V stored in its slot, then causal or tree-masked attention over the cache in
 * place, in float32. Conventions as in cpu_kernels.c.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

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
