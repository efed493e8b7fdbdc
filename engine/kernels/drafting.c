/*
 * The MLP speculator's drafting on a CPU (engine/spec_decode/): a stage's glue, a head's top k,
 * and a whole draft tree of "nodes" selection in one call. Conventions as in cpu_kernels.c.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

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

/* The k (<= v) largest log-probabilities of one row of logits x [v], logit minus the row's
 * log-sum-exp, in descending order (ties: the lower column first) into best [k], and their
 * columns into ids [k], as columns[column] where columns [v] is not NULL. */
static void topk_row(const float *x, int64_t v, int64_t k, const int64_t *columns, float *best,
                     int64_t *ids) {
    top_heap(x, NULL, v, k, best, ids);
    /* The sum of exponentials by blocks, the blocks' sums added in double: a float sum over
     * thousands of terms would drift by 1e-5 relative, as much as the lanes of a vectorised
     * reduction decide the order. */
    const float max = best[0];
    double sum = 0.0;
    for (int64_t j0 = 0; j0 < v; j0 += TOP_SELECT_BLOCK) {
        const int64_t j1 = j0 + TOP_SELECT_BLOCK < v ? j0 + TOP_SELECT_BLOCK : v;
        float block = 0.0f;
#pragma omp simd reduction(+ : block)
        for (int64_t j = j0; j < j1; j++) block += exp_poly(x[j] - max);
        sum += block;
    }
    const float lse = max + (float)log(sum);
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
typedef void (*q8_matmul_t)(const float *x, int64_t ldx, const uint8_t *packed, const float *scales,
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
        matmul(x, ldx, (const uint8_t *)(intptr_t)h[H_PROJ],
               (const float *)(intptr_t)h[H_PROJ_SCALES], NULL, projected, prev_rows,
               i == 0 ? d_in : d, d);
        for (int64_t r = 0; r < rows; r++) {
            const node_t *n = i == 0 ? NULL : nodes + row_node[r];
            stage_row(projected + (i == 0 ? r : n->row) * d,
                      emb + (i == 0 ? root_tokens[r] : n->token) * d, emb_scale, ln_w, ln_b, eps,
                      cur + r * d, d);
        }
        matmul(cur, d, (const uint8_t *)(intptr_t)h[H_HEAD],
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

