/*
 * Fused float32 CPU kernels for the decoder's glue between matrix products: RMSNorm (with the
 * residual add), SiLU-and-multiply, RoPE, and a tied embedding's gather; and the sampler's passes
 * over whole vocabulary rows (engine/kernels/selection.py). Attention over the
 * paged KV cache is in attention.c, the MLP speculator's drafting in drafting.c; the three build
 * into one library (engine/kernels/cpu.py).
 *
 * Each entry point replaces several ATen ops (each paying a dispatch cost larger than its work on
 * a small tensor) with one call. Loops are written so that the compiler vectorises them with
 * `-fopenmp-simd` alone: no OpenMP runtime, no fast-math. All functions run on the calling
 * thread, except attention.c's store_and_attend, which may run on the rows kernels' pool.
 *
 * Row strides are in floats. Tensors not described as strided are contiguous.
 */
#include "cpu_math.h"

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
        for (int64_t i = 0; i < d; i++) o[i] = silu_mul(gate[i], up[i]);
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

/* Columns ids[0 .. n) of W^T [k, ncols] (row stride ldw): out[i, kk] = wt[kk * ldw + ids[i]],
 * out [n, k] contiguous; a tied embedding's rows read from its head's transposed storage. Each
 * element sits on a cache line of its own, so the lines of the next GATHER_AHEAD steps are
 * prefetched for every column at once. Returns 0, or -1 (out untouched) if an id is not in
 * [0, ncols). */
#define GATHER_AHEAD 16
int gather_columns(const float *wt, int64_t ldw, int64_t k, int64_t ncols, const int64_t *ids,
                   int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= ncols) return -1;
    }
    for (int64_t kk = 0; kk < k && kk < GATHER_AHEAD; kk++) {
        for (int64_t i = 0; i < n; i++) __builtin_prefetch(wt + kk * ldw + ids[i]);
    }
    for (int64_t kk = 0; kk < k; kk++) {
        const float *row = wt + kk * ldw;
        for (int64_t i = 0; i < n; i++) {
            if (kk + GATHER_AHEAD < k) __builtin_prefetch(row + GATHER_AHEAD * ldw + ids[i]);
            out[i * k + kk] = row[ids[i]];
        }
    }
    return 0;
}

/* For each of n rows of scores [n, v] (row stride ld): its k (1 <= k <= v) largest values in
 * descending order (ties: the lower column first) into values [n, k] and their columns into
 * ids [n, k] (top_select); scratch [3v] and kept_ids [v] are scratch. */
void top_candidates(const float *scores, int64_t ld, int64_t n, int64_t v, int64_t k,
                    float *values, int64_t *ids, float *scratch, int64_t *kept_ids) {
    for (int64_t r = 0; r < n; r++) {
        top_select(scores + r * ld, v, k, values + r * k, ids + r * k, scratch, kept_ids);
    }
}

/* For each of n rows of x [n, v] (row stride ld): the sum of its v values in double, added in
 * blocks (an order of its own) into sums [n]. */
void row_sums_double(const float *x, int64_t ld, int64_t n, int64_t v, double *sums) {
    for (int64_t r = 0; r < n; r++) {
        const float *row = x + r * ld;
        double total = 0.0;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < v; j++) total += (double)row[j];
        sums[r] = total;
    }
}

/* out [n, v] = x[rows[r]] / divisors[r] for each of n rows (x's row stride ld; rows NULL: row
 * r), divided as IEEE float32 division does. */
void divide_rows(const float *x, int64_t ld, const int64_t *rows, int64_t n, int64_t v,
                 const float *divisors, float *out) {
    for (int64_t r = 0; r < n; r++) {
        const float *row = x + (rows ? rows[r] : r) * ld;
        const float d = divisors[r];
        float *o = out + r * v;
#pragma omp simd
        for (int64_t j = 0; j < v; j++) o[j] = row[j] / d;
    }
}

/* For each of n rows (shifted [n, v] and e [n, v] contiguous; totals, log_totals [n]): the
 * sum in double, in an order of its own, of p * (shifted - log_total) over the entries where
 * p = e / total > 0, each product rounded to float32 first (torch's float32 products). */
void plogp_sums_double(const float *shifted, const float *e, int64_t n, int64_t v,
                       const float *totals, const float *log_totals, double *sums) {
    for (int64_t r = 0; r < n; r++) {
        const float *s = shifted + r * v, *x = e + r * v;
        const float total = totals[r], log_total = log_totals[r];
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < v; j++) {
            const float p = x[j] / total;
            const float term = p * (s[j] - log_total);
            sum += p > 0.0f ? (double)term : 0.0;
        }
        sums[r] = sum;
    }
}

/* The (row, column) pairs of scores [n, v] (row stride ld) whose value is at least its row's
 * thresholds[r], in row-major order, into rows [cap] and cols [cap]; returns their number, or
 * -1 as soon as there are more than cap. */
int64_t columns_at_least(const float *scores, int64_t ld, int64_t n, int64_t v,
                         const float *thresholds, int64_t *rows, int64_t *cols, int64_t cap) {
    int64_t count = 0;
    for (int64_t r = 0; r < n; r++) {
        const float *x = scores + r * ld;
        const float t = thresholds[r];
        for (int64_t j0 = 0; j0 < v; j0 += TOP_SELECT_BLOCK) {
            const int64_t j1 = j0 + TOP_SELECT_BLOCK < v ? j0 + TOP_SELECT_BLOCK : v;
            float m = x[j0];
#pragma omp simd reduction(max : m)
            for (int64_t j = j0; j < j1; j++) m = x[j] > m ? x[j] : m;
            if (!(m >= t)) continue;
            if (count + (j1 - j0) > cap) { /* room for the whole block, else count exactly */
                for (int64_t j = j0; j < j1; j++) {
                    if (!(x[j] >= t)) continue;
                    if (count == cap) return -1;
                    rows[count] = r, cols[count++] = j;
                }
                continue;
            }
            for (int64_t j = j0; j < j1; j++) { /* no branch: written always, kept or not */
                rows[count] = r;
                cols[count] = j;
                count += x[j] >= t;
            }
        }
    }
    return count;
}

#define SCREEN_SLACK 1.001 /* on the bounds, for their own float rounding */
#define SCREEN_U 5.9604644775390625e-08 /* float32's unit roundoff, 2^-24 */

/* The argmax-preserving rows of a float32 head from an int8 screen of it (engine/layers/
 * head_screen.py states the bound). The screen's int8 rows are w^_j = wscale[j] q_j, stored in
 * wq as rows_qg.h lays out 8-bit panels (group size k, bytes q + 128); basis [k / group + 2, v]
 * holds per column j its int8 row's L1 norm over each activation group of `group` columns,
 * then ||w_j - w^_j||_2, then ||w^_j||_2, and basis_max [k / group + 2] each of its rows'
 * largest entry. For each of m rows of x [m, k] (contiguous), approx [m, v] holds the int8
 * product's scores, within bound_j = sum_t c_t basis[t][j] of the exact x . w_j, where c = (h_g
 * = max |x_g| / 254 for each group g; ||x||_2 + r; 2 r), r = 4 (k + 2) u (||x||_2 +
 * sqrt(group sum_g h_g^2)) (times SCREEN_SLACK). A row's columns are narrowed in two stages,
 * `keep` (nkeep columns) set aside:
 *   1. near: the columns j with approx_j + bound_j >= approx_b - bound_b, at the largest
 *      approx_b (bound_j is computed only where approx_j passes a coarser test with basis_max);
 *   2. of those, the ones with x . w^_j + e_j >= the largest x . w^_i - e_i over the near
 *      columns, where x . w^_j is summed in float32 from the int8 row and e_j = c_{g+1}
 *      ||w_j - w^_j||_2 + c_{g+2} ||w^_j||_2 bounds its distance from x . w_j (no activation
 *      rounding) (compared in double).
 * Each stage keeps every column that may hold the row's maximum outside `keep`. Writes out
 * [m, v]: in every row, x . w_j summed in float32 in k order from W^T [k, v] (row stride ldw)
 * at `keep` and at each column that stage 2 kept for any row, -inf elsewhere; each such column
 * of W^T is read once for all rows. Returns 0, or -1 (out not written) when a row of x is not
 * finite, a row has more than cap_near near columns, or the rows keep more than cap columns
 * together. approx's `keep` columns are overwritten; near [cap_near], refined [2 cap_near],
 * cols [cap] and acc [m, cap] are scratch. */
int64_t head_screen(const float *x, int64_t m, int64_t k, int64_t group, float *approx,
                    int64_t v, const float *basis, const float *basis_max, const uint8_t *wq,
                    const float *wscale, const float *wt, int64_t ldw, const int64_t *keep,
                    int64_t nkeep, int64_t cap_near, int64_t *near, double *refined, int64_t cap,
                    int64_t *cols, float *acc, float *out) {
    const int64_t groups = k / group, terms = groups + 2, panel_bytes = k * 16;
    float coef[terms];
    int64_t count = 0;
    for (int64_t c = 0; c < nkeep && count < cap; c++) cols[count++] = keep[c];
    if (count < nkeep) return -1;
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        float *a = approx + r * v;
        double norm2 = 0.0, h2 = 0.0;
        for (int64_t g = 0; g < groups; g++) {
            float top = 0.0f;
            for (int64_t i = g * group; i < (g + 1) * group; i++) {
                if (!isfinite(xr[i])) return -1;
                const float ax = fabsf(xr[i]);
                top = ax > top ? ax : top;
                norm2 += (double)xr[i] * xr[i];
            }
            const double h = (double)top / 254.0;
            h2 += h * h;
            coef[g] = (float)(h * SCREEN_SLACK);
        }
        const double norm = sqrt(norm2), act = sqrt(h2 * (double)group);
        const double rounding = 4.0 * (double)(k + 2) * SCREEN_U * (norm + act);
        coef[groups] = (float)((norm + rounding) * SCREEN_SLACK);
        coef[groups + 1] = (float)(2.0 * rounding * SCREEN_SLACK);
        for (int64_t c = 0; c < nkeep; c++) a[keep[c]] = -INFINITY;
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < v; j++) top = a[j] > top ? a[j] : top;
        int64_t best = 0;
        while (a[best] != top) best++;
        double widest = 0.0, least = (double)top;
        for (int64_t t = 0; t < terms; t++) {
            widest += (double)coef[t] * basis_max[t];
            least -= (double)coef[t] * basis[t * v + best];
        }
        /* a float threshold at most least - widest: a column below it cannot reach least */
        float coarse = (float)(least - widest * SCREEN_SLACK);
        if ((double)coarse > least - widest * SCREEN_SLACK) coarse = nextafterf(coarse, -INFINITY);
        int64_t num_near = 0;
        for (int64_t j0 = 0; j0 < v; j0 += TOP_SELECT_BLOCK) {
            const int64_t j1 = j0 + TOP_SELECT_BLOCK < v ? j0 + TOP_SELECT_BLOCK : v;
            float high = -INFINITY;
#pragma omp simd reduction(max : high)
            for (int64_t j = j0; j < j1; j++) high = a[j] > high ? a[j] : high;
            if (high < coarse) continue;
            for (int64_t j = j0; j < j1; j++) {
                if (a[j] < coarse) continue;
                double bound = 0.0;
                for (int64_t t = 0; t < terms; t++) bound += (double)coef[t] * basis[t * v + j];
                if ((double)a[j] + bound < least) continue;
                if (num_near == cap_near) return -1;
                near[num_near++] = j;
            }
        }
        double least2 = -INFINITY;
        for (int64_t n = 0; n < num_near; n++) {
            const int64_t j = near[n];
            const uint8_t *q = wq + (j / 16) * panel_bytes + (j % 16) * 4;
            float dot = 0.0f;
            for (int64_t t = 0; t < k / 4; t++)
                for (int64_t e = 0; e < 4; e++)
                    dot += xr[4 * t + e] * (float)((int32_t)q[t * 64 + e] - 128);
            const double value = (double)dot * wscale[j];
            const double margin = (double)coef[groups] * basis[groups * v + j] +
                                  (double)coef[groups + 1] * basis[(groups + 1) * v + j];
            refined[2 * n] = value;
            refined[2 * n + 1] = margin;
            least2 = value - margin > least2 ? value - margin : least2;
        }
        for (int64_t n = 0; n < num_near; n++) {
            if (refined[2 * n] + refined[2 * n + 1] < least2) continue;
            const int64_t j = near[n];
            int64_t c = 0;
            while (c < count && cols[c] != j) c++;
            if (c < count) continue;
            if (count == cap) return -1;
            cols[count++] = j;
        }
    }
    for (int64_t i = 0; i < m * count; i++) acc[i] = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float *row = wt + i * ldw;
        if (i + GATHER_AHEAD < k) {
            const float *ahead = row + GATHER_AHEAD * ldw;
            for (int64_t c = 0; c < count; c++) __builtin_prefetch(ahead + cols[c]);
        }
        for (int64_t c = 0; c < count; c++) {
            const float w = row[cols[c]];
            for (int64_t r = 0; r < m; r++) acc[r * count + c] += x[r * k + i] * w;
        }
    }
    for (int64_t r = 0; r < m; r++) {
        float *o = out + r * v;
#pragma omp simd
        for (int64_t j = 0; j < v; j++) o[j] = -INFINITY;
        for (int64_t c = 0; c < count; c++) o[cols[c]] = acc[r * count + c];
    }
    return 0;
}
