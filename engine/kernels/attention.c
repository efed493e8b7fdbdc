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

/* Runs units [u0, u1) of a call's work: unit_fn of unit_pool.h (engine/kernels/unit_pool.h,
 * linked into the rows_gemm library), passed by address. */
typedef void (*unit_fn)(const void *ctx, int64_t u0, int64_t u1);
typedef void (*pool_run_fn)(unit_fn fn, const void *ctx, int64_t num_units, int64_t max_take);

/* One store_and_attend call's attention work: for each sequence s, num_kv_heads x blocks(s)
 * units, blocks(s) = ceil(q_len(s) * group / ROW_BLOCK), numbered from unit_start[s], a key
 * head's row blocks together (they read the same keys). */
typedef struct {
    const float *q, *key_cache, *value_cache;
    int64_t q_stride, block_size, max_blocks, max_len;
    const int32_t *block_tables;
    const int64_t *query_start, *seq_lens, *mask_offsets, *unit_start;
    const uint8_t *masks;
    float *out;
    int64_t num_heads, num_kv_heads, head_dim;
    float scale;
} attend_job_t;

/* Units [u0, u1) of an attend_job_t, on this thread's scratch (grown as needed and kept: a pool
 * thread serves every step). */
static void attend_units(const void *ctx, int64_t u0, int64_t u1) {
    const attend_job_t *job = ctx;
    static __thread int64_t *key_offsets;
    static __thread float *scores;
    static __thread int64_t capacity;
    if (job->max_len > capacity) {
        free(key_offsets);
        free(scores);
        key_offsets = malloc((size_t)job->max_len * sizeof(int64_t));
        scores = malloc((size_t)(ROW_BLOCK * job->max_len) * sizeof(float));
        if (key_offsets == NULL || scores == NULL) abort();
        capacity = job->max_len;
    }
    const int64_t group = job->num_heads / job->num_kv_heads, head_dim = job->head_dim;
    int64_t s = 0, offsets_of = -1; /* the unit's sequence; whose key_offsets are filled */
    for (int64_t u = u0; u < u1; u++) {
        while (job->unit_start[s + 1] <= u) s++;
        const int64_t q_first = job->query_start[s], q_len = job->query_start[s + 1] - q_first;
        const int64_t seq_len = job->seq_lens[s], num_rows = q_len * group;
        if (offsets_of != s) {
            const int32_t *table = job->block_tables + s * job->max_blocks;
            const int64_t bs = job->block_size;
            for (int64_t j = 0; j < seq_len; j++) {
                const int64_t slot = (int64_t)table[j / bs] * bs + j % bs;
                key_offsets[j] = slot * job->num_kv_heads * head_dim;
            }
            offsets_of = s;
        }
        const int64_t blocks = (num_rows + ROW_BLOCK - 1) / ROW_BLOCK;
        const int64_t h = (u - job->unit_start[s]) / blocks;
        const int64_t r0 = (u - job->unit_start[s]) % blocks * ROW_BLOCK;
        const int64_t rows = num_rows - r0 < ROW_BLOCK ? num_rows - r0 : ROW_BLOCK;
        const uint8_t *mask = job->mask_offsets[s] < 0 ? NULL : job->masks + job->mask_offsets[s];
#define GROUPED(n, dim)                                                                        \
    attend_rows_grouped(job->q, job->q_stride, job->key_cache + h * head_dim,                  \
                        job->value_cache + h * head_dim, key_offsets, q_first, q_len, seq_len, \
                        mask, job->out, job->num_heads, h, group, job->scale, scores, r0, n,   \
                        dim)
/* Constant row counts keep the rows' dot products and accumulators apart; constant head sizes
 * let the compiler unroll the dot products and keep a row's output in registers. */
#define GROUPED_DIM(dim)                     \
    do {                                     \
        if (rows == 1) GROUPED(1, dim);      \
        else if (rows == 2) GROUPED(2, dim); \
        else if (rows == 3) GROUPED(3, dim); \
        else GROUPED(4, dim);                \
    } while (0)
        if (head_dim == 64) GROUPED_DIM(64);
        else if (head_dim == 128) GROUPED_DIM(128);
        else GROUPED_DIM(head_dim);
#undef GROUPED_DIM
#undef GROUPED
    }
}

/* Writes each new token's K and V to its cache slot, then attends, for the num_seqs sequences
 * of a flat varlen batch: on the calling thread alone or, where pool_run_address is the address
 * of unit_pool_run (rows_gemm's pool), on the pool's threads, in units of one key head and
 * ROW_BLOCK query rows of one sequence (results do not depend on the threads).
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
                      const uint8_t *masks, float *out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, float scale,
                      int64_t pool_run_address) {
    const int64_t kv_row = num_kv_heads * head_dim, group = num_heads / num_kv_heads;
    for (int64_t t = 0; t < query_start[num_seqs]; t++) {
        memcpy(key_cache + slot_mapping[t] * kv_row, k + t * kv_stride, kv_row * sizeof(float));
        memcpy(value_cache + slot_mapping[t] * kv_row, v + t * kv_stride, kv_row * sizeof(float));
    }
    int64_t stack_starts[65]; /* up to 64 sequences without a malloc */
    int64_t *unit_start =
        num_seqs < 65 ? stack_starts : malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (unit_start == NULL) abort();
    int64_t max_len = 1;
    unit_start[0] = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t q_len = query_start[i + 1] - query_start[i];
        max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
        const int64_t blocks = (q_len * group + ROW_BLOCK - 1) / ROW_BLOCK;
        unit_start[i + 1] = unit_start[i] + num_kv_heads * blocks;
    }
    const attend_job_t job = {q, key_cache, value_cache, q_stride, block_size, max_blocks,
                              max_len, block_tables, query_start, seq_lens, mask_offsets,
                              unit_start, masks, out, num_heads, num_kv_heads, head_dim, scale};
    const int64_t num_units = unit_start[num_seqs];
    if (pool_run_address != 0) {
        ((pool_run_fn)(intptr_t)pool_run_address)(attend_units, &job, num_units, num_units);
    } else {
        attend_units(&job, 0, num_units);
    }
    if (unit_start != stack_starts) free(unit_start);
}
