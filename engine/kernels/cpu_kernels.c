/*
 * Fused float32 CPU kernels for the decoder's glue and for attention over the paged KV cache.
 *
 * Each entry point replaces several ATen ops (each ~3-7 us of dispatch on a small tensor) with
 * one call. Loops are written so that the compiler vectorises them with `-fopenmp-simd` alone:
 * no OpenMP runtime, no fast-math. All functions run on the calling thread; the Python side may
 * split a batch of sequences across threads (ctypes releases the GIL around each call).
 *
 * Row strides are in floats. Tensors not described as strided are contiguous.
 */
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

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
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

/* out = softmax(scores[0, num_keys)) . V, with V rows at value_cache + key_offsets[j] and
 * -inf for keys that are not visible. Overwrites scores with unnormalised probabilities. */
static inline __attribute__((always_inline)) void softmax_values(
    float *scores, int64_t num_keys, const float *value_cache, const int64_t *key_offsets,
    float *out, const int64_t head_dim) {
    float max = -INFINITY;
    for (int64_t j = 0; j < num_keys; j++) max = scores[j] > max ? scores[j] : max;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < num_keys; j++) {
        const float p = scores[j] == -INFINITY ? 0.0f : exp_poly(scores[j] - max);
        scores[j] = p;
        sum += p;
    }
    float acc[256] = {0};
    for (int64_t j = 0; j < num_keys; j++) {
        const float p = scores[j];
        if (p == 0.0f) continue;
        const float *value = value_cache + key_offsets[j];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) acc[d] += p * value[d];
    }
    const float inv_sum = 1.0f / sum;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++) out[d] = acc[d] * inv_sum;
}

/* One query row against keys [0, num_keys) of a sequence: softmax(q . K^T * scale) . V.
 * key_offsets[j] is the float offset of key j's row in key_cache and value_cache; visible
 * (may be NULL: all visible) flags the keys this row may attend. scores has num_keys floats. */
static inline __attribute__((always_inline)) void attend_row(
    const float *q, const float *key_cache, const float *value_cache,
    const int64_t *key_offsets, int64_t num_keys, const uint8_t *visible, float scale,
    float *scores, float *out, const int64_t head_dim) {
    for (int64_t j = 0; j < num_keys; j++) {
        scores[j] = visible == NULL || visible[j]
                        ? dot(q, key_cache + key_offsets[j], head_dim) * scale
                        : -INFINITY;
    }
    softmax_values(scores, num_keys, value_cache, key_offsets, out, head_dim);
}

#define ROW_BLOCK 4
#define KEY_TILE 16
_Static_assert(ROW_BLOCK == 4, "the tile loop of attend_rows_tiled spells out four rows");
/* Query rows per key head from which attend_rows_tiled beats one dot product per key. */
#define TILED_MIN_ROWS 8

/* Every query row of one key head at once, for many rows (draft trees, short prompt chunks):
 * the keys are transposed into key_t [head_dim, padded] (padded = seq_len rounded up to
 * KEY_TILE) and scores come from ROW_BLOCK x KEY_TILE register tiles, with no horizontal sums.
 * Rows are (i, g) for new token i and head kv_head * group + g. scores has room for
 * q_len * group * padded floats. */
static inline __attribute__((always_inline)) void attend_rows_tiled(
    const float *q, int64_t q_stride, const float *keys, const float *values,
    const int64_t *key_offsets, int64_t q_first, int64_t q_len, int64_t seq_len,
    const uint8_t *mask, float *out, int64_t num_heads, int64_t kv_head, int64_t group,
    float scale, float *scores, float *key_t, const int64_t head_dim) {
    const int64_t ctx_len = seq_len - q_len, num_rows = q_len * group;
    const int64_t padded = (seq_len + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    for (int64_t j = 0; j < seq_len; j++) {
        const float *key = keys + key_offsets[j];
        for (int64_t d = 0; d < head_dim; d++) key_t[d * padded + j] = key[d];
    }
    for (int64_t d = 0; d < head_dim; d++) {
        for (int64_t j = seq_len; j < padded; j++) key_t[d * padded + j] = 0.0f;
    }
    for (int64_t r0 = 0; r0 < num_rows; r0 += ROW_BLOCK) {
        const float *rows[ROW_BLOCK];
        for (int64_t b = 0; b < ROW_BLOCK; b++) {
            const int64_t r = r0 + b < num_rows ? r0 + b : num_rows - 1;
            const int64_t head = kv_head * group + r % group;
            rows[b] = q + (q_first + r / group) * q_stride + head * head_dim;
        }
        for (int64_t j0 = 0; j0 < padded; j0 += KEY_TILE) {
            float acc[ROW_BLOCK][KEY_TILE] = {{0}};
            for (int64_t d = 0; d < head_dim; d++) {
                const float *kt = key_t + d * padded + j0;
                const float a0 = rows[0][d], a1 = rows[1][d], a2 = rows[2][d], a3 = rows[3][d];
#pragma omp simd
                for (int64_t t = 0; t < KEY_TILE; t++) {
                    acc[0][t] += a0 * kt[t];
                    acc[1][t] += a1 * kt[t];
                    acc[2][t] += a2 * kt[t];
                    acc[3][t] += a3 * kt[t];
                }
            }
            for (int64_t b = 0; b < ROW_BLOCK && r0 + b < num_rows; b++) {
                memcpy(scores + (r0 + b) * padded + j0, acc[b], sizeof(acc[b]));
            }
        }
    }
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t i = r / group, head = kv_head * group + r % group;
        float *row = scores + r * padded;
        /* Causal rows see keys [0, ctx_len + i]; tree rows the context and their mask. */
        const int64_t num_keys = mask != NULL ? seq_len : ctx_len + i + 1;
        for (int64_t j = 0; j < num_keys; j++) {
            const int visible = j < ctx_len || mask == NULL || mask[i * q_len + j - ctx_len];
            row[j] = visible ? row[j] * scale : -INFINITY;
        }
        softmax_values(row, num_keys, values, key_offsets,
                       out + ((q_first + i) * num_heads + head) * head_dim, head_dim);
    }
}

/* Sequence s of store_and_attend: every new token, every head. scores and key_t have room for
 * the tiled path (attend_rows_tiled) when it applies. */
static inline __attribute__((always_inline)) void attend_sequence(
    const float *q, int64_t q_stride, const float *key_cache, const float *value_cache,
    const int32_t *table, int64_t block_size, int64_t q_first, int64_t q_len, int64_t seq_len,
    const uint8_t *mask, float *out, int64_t num_heads, int64_t num_kv_heads, float scale,
    int64_t *key_offsets, uint8_t *visible, float *scores, float *key_t,
    const int64_t head_dim) {
    const int64_t group = num_heads / num_kv_heads, ctx_len = seq_len - q_len;
    for (int64_t j = 0; j < seq_len; j++) {
        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
        key_offsets[j] = slot * num_kv_heads * head_dim;
    }
    if (q_len * group >= TILED_MIN_ROWS) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            attend_rows_tiled(q, q_stride, key_cache + h * head_dim, value_cache + h * head_dim,
                              key_offsets, q_first, q_len, seq_len, mask, out, num_heads, h,
                              group, scale, scores, key_t, head_dim);
        }
        return;
    }
    memset(visible, 1, (size_t)seq_len);
    for (int64_t i = 0; i < q_len; i++) {
        /* Causal rows see keys [0, ctx_len + i]; tree rows see the context and their mask. */
        int64_t num_keys = ctx_len + i + 1;
        const uint8_t *row_visible = NULL;
        if (mask != NULL) {
            num_keys = seq_len;
            memcpy(visible + ctx_len, mask + i * q_len, (size_t)q_len);
            row_visible = visible;
        }
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t head_offset = h / group * head_dim;
            attend_row(q + (q_first + i) * q_stride + h * head_dim, key_cache + head_offset,
                       value_cache + head_offset, key_offsets, num_keys, row_visible, scale,
                       scores, out + ((q_first + i) * num_heads + h) * head_dim, head_dim);
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
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_len = 1, max_scores = 1, max_key_t = 1;
    for (int64_t s = seq_begin; s < seq_end; s++) {
        const int64_t len = seq_lens[s], rows = (query_start[s + 1] - query_start[s]) * group;
        const int64_t padded = (len + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
        max_len = len > max_len ? len : max_len;
        max_scores = len > max_scores ? len : max_scores;
        if (rows >= TILED_MIN_ROWS) {
            max_scores = rows * padded > max_scores ? rows * padded : max_scores;
            max_key_t = head_dim * padded > max_key_t ? head_dim * padded : max_key_t;
        }
    }
    int64_t *key_offsets = malloc((size_t)max_len * sizeof(int64_t));
    uint8_t *visible = malloc((size_t)max_len);
    float *scores = malloc((size_t)max_scores * sizeof(float));
    float *key_t = malloc((size_t)max_key_t * sizeof(float));
    if (key_offsets == NULL || visible == NULL || scores == NULL || key_t == NULL) abort();
    for (int64_t s = seq_begin; s < seq_end; s++) {
        const int64_t q_first = query_start[s], q_len = query_start[s + 1] - q_first;
        const int32_t *table = block_tables + s * max_blocks;
        const uint8_t *mask = mask_offsets[s] < 0 ? NULL : masks + mask_offsets[s];
#define ATTEND_SEQUENCE(dim)                                                                   \
    attend_sequence(q, q_stride, key_cache, value_cache, table, block_size, q_first, q_len,    \
                    seq_lens[s], mask, out, num_heads, num_kv_heads, scale, key_offsets,       \
                    visible, scores, key_t, dim)
        /* Constant head sizes let the compiler unroll the dot products and keep a row's
         * output accumulator in registers. */
        if (head_dim == 64) ATTEND_SEQUENCE(64);
        else if (head_dim == 128) ATTEND_SEQUENCE(128);
        else ATTEND_SEQUENCE(head_dim);
#undef ATTEND_SEQUENCE
    }
    free(key_offsets);
    free(visible);
    free(scores);
    free(key_t);
}
