/*
 * float32 matrix product for few rows: y[M, N] = x[M, K] @ W^T[K, N] (+ bias[N]).
 *
 * The weights are packed once (`rows_gemm_pack`) into column panels of PANEL = 16 floats,
 * [ceil(N / 16)][K][16] contiguous, the last panel zero-padded; the tiles (rows_tiles.h) stream
 * them, each weight loaded once per pass for all rows of the pass. A pass takes up to
 * `group_rows` rows (MR_MAX at most: 16 on AVX-512); more rows are served in groups that run
 * over the same run of panels one after another, the later groups reading its weights from
 * cache: groups of equal size or, where the path's widest tile does the most arithmetic per
 * cycle (FILL_GROUPS, rows_tiles.h), full groups and the rest.
 *
 * int8 ("q8", for memory-bound products whose result may be approximate, such as a draft
 * model's vocabulary head): `rows_gemm_pack_q8` quantises W^T symmetrically per output column j,
 * scale_j = max_k |W^T[k, j]| / 127 (0 for a column of zeros), q = round-to-nearest-even(W^T /
 * scale_j) clamped to [-127, 127], into byte panels (rows_q8.h: a quarter of float's bytes) plus
 * scales[ceil(N / 16) * 16] (padding 0). `rows_gemm_q8` quantises each row of x the same way
 * (one scale per row) and sums the integer products exactly (rows_q8.h), with the float path's
 * threads and row groups: y = (q_x * scale_x) @ (q * scale)^T (+ bias).
 *
 * Gated layers (an MLP's gate and up projections in one product: W^T's columns [0, n/2) are the
 * gate, [n/2, n) the up projection) may be packed in pairs of panels (`rows_gemm_pack_pairs`):
 * panel 2q holds gate columns [16q, 16q + 16) and panel 2q + 1 the up columns beside them, so
 * that a unit of whole pairs sees both halves of its columns. `rows_gemm_pairs` then writes y
 * in W^T's column order or, fused, silu(gate) * up [m, n/2] straight from the tiles' sums, in
 * the same k order as the plain product.
 *
 * Threads: the panels are cut into units of whole tiles that the threads of unit_pool.h claim in
 * runs of up to about `chunk_bytes` of weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#include "rows_tiles.h"
#include "rows_q8.h"
#include "unit_pool.h"

/* ---------------------------------------------------------------------------------------------
 * One call's work, cut into units of whole tiles that the pool's threads claim in runs.
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const float *x; /* [m, k], row stride ldx */
    const float *w; /* float weights: panel j, step kk at j * ps + kk * wk */
    int64_t ps, wk;
    const float *bias;
    float *y;
    int64_t m, k, n, ldx;
    int64_t group; /* rows per pass over the weights, <= MR_MAX */
    int64_t pairs; /* PAIRS_*: how y is written from panels packed in pairs */
    /* q8 products (w NULL; see rows_q8.h): x quantised [m, ldq] with its rows' corrections and
     * scales, and the weights' byte panels (ldq * PANEL bytes each) with their column scales */
    const int8_t *xq;
    int64_t ldq;
    const int32_t *corr;
    const float *row_scale;
    const uint8_t *q8;
    const float *scales;
} job_t;

/* How a product on panels packed in pairs writes y: no pairs (y as the panels), y [m, n] in W^T's
 * column order, or y [m, n/2] = silu(gate) * up. */
enum { PAIRS_NONE, PAIRS_HALVES, PAIRS_SILU };

/* Panels per unit: whole tiles, TILE_NB[group] (the last unit may be short), so that a run of
 * units goes through its first group's main tile throughout and no remainder of single panels;
 * in pairs, whole tiles of whole pairs. Every TILE_NB is at most PAIR_UNIT_MAX, and even or
 * one. */
#define PAIR_UNIT_MAX 8
static inline int64_t unit_panels(int64_t group, int64_t pairs) {
    const int64_t nb = TILE_NB[group];
    return pairs != PAIRS_NONE && nb % 2 ? 2 * nb : nb;
}

/* Each tile row count's PREFETCH_* mode (atomic; set by rows_gemm_set_prefetch). */
static int64_t tile_prefetch[MR_MAX + 1] = {[2 ... MR_MAX] = PREFETCH_DEFAULT};

/* Rows [r, r + mr) times panels [p0, p1), a main tile at a time and single panels for the rest:
 * panel p's columns go to y + (p - p0) * PANEL (row stride ldy), the first `cols` columns of the
 * run being real (the rest of the last panel is padding). */
static void run_tiles(const job_t *job, int64_t r, int mr, int64_t p0, int64_t p1, float *y,
                      int64_t ldy, int64_t cols) {
    const int nb = TILE_NB[mr];
    /* a setting of speed alone: y is the same in every mode */
    const int64_t prefetch = __atomic_load_n(&tile_prefetch[mr], __ATOMIC_RELAXED);
    for (int64_t p = p0; p < p1;) {
        const int full = p + nb <= p1; /* a main tile fits */
        const int64_t width = (full ? nb : 1) * PANEL, left = cols - (p - p0) * PANEL;
        const int64_t ncols = left < width ? left : width;
        const float *bias = job->bias ? job->bias + p * PANEL : 0;
        if (job->q8) {
            const int64_t ps = job->ldq * PANEL; /* bytes per panel */
            (full ? Q8_TILE_MAIN : Q8_TILE_ONE)[mr](
                job->xq + r * job->ldq, job->ldq, job->corr + r, job->row_scale + r,
                job->q8 + p * ps, job->ldq / Q8_GROUP, ps, job->scales + p * PANEL, bias,
                y + (p - p0) * PANEL, ldy, ncols);
        } else {
            (full ? TILE_MAIN : TILE_ONE)[mr](job->x + r * job->ldx, job->ldx, job->w + p * job->ps,
                                              job->k, job->ps, job->wk, bias, y + (p - p0) * PANEL,
                                              ldy, ncols, prefetch);
        }
        p += full ? nb : 1;
    }
}

/* Panels [p0, p1) (whole pairs, at most PAIR_UNIT_MAX) of a product in pairs, a row group at a
 * time: the tiles' sums into a buffer of the unit's own, then each pair's columns into y. */
static void run_pairs(const job_t *job, int64_t p0, int64_t p1) {
    float sums[MR_MAX * PAIR_UNIT_MAX * PANEL]; /* [group rows][p1 - p0 panels] */
    const int64_t ld = (p1 - p0) * PANEL, half = job->n / 2;
    for (int64_t r = 0; r < job->m; r += job->group) {
        const int mr = (int)(job->m - r < job->group ? job->m - r : job->group);
        run_tiles(job, r, mr, p0, p1, sums, ld, ld);
        for (int i = 0; i < mr; i++) {
            for (int64_t q = p0 / 2; q < p1 / 2; q++) {
                const float *gate = sums + i * ld + (2 * q - p0) * PANEL, *up = gate + PANEL;
                if (job->pairs == PAIRS_SILU) {
                    float *h = job->y + (r + i) * half + q * PANEL;
#pragma omp simd
                    for (int c = 0; c < PANEL; c++) h[c] = silu_mul(gate[c], up[c]);
                } else {
                    float *row = job->y + (r + i) * job->n + q * PANEL;
                    memcpy(row, gate, PANEL * sizeof(float));
                    memcpy(row + half, up, PANEL * sizeof(float));
                }
            }
        }
    }
}

/* Units [u0, u1)'s panels for all rows, a row group at a time (later groups re-read the units'
 * weights from cache); in pairs, a unit at a time. */
static void run_units(const void *ctx, int64_t u0, int64_t u1) {
    const job_t *job = ctx;
    const int64_t npanels = (job->n + PANEL - 1) / PANEL;
    const int64_t unit = unit_panels(job->group, job->pairs);
    if (job->pairs != PAIRS_NONE) {
        for (int64_t u = u0; u < u1; u++) {
            run_pairs(job, u * unit, (u + 1) * unit < npanels ? (u + 1) * unit : npanels);
        }
        return;
    }
    const int64_t p0 = u0 * unit;
    const int64_t p1 = u1 * unit < npanels ? u1 * unit : npanels;
    for (int64_t r = 0; r < job->m; r += job->group) {
        const int mr = (int)(job->m - r < job->group ? job->m - r : job->group);
        run_tiles(job, r, mr, p0, p1, job->y + r * job->n + p0 * PANEL, job->n,
                  job->n - p0 * PANEL);
    }
}

/* Settings of the product (atomic): rows per pass over the weights, weight bytes per claim. */
static int group_rows = GROUP_ROWS;
static int64_t chunk_bytes = 512 * 1024;

#define RELAXED(p) __atomic_load_n(&(p), __ATOMIC_RELAXED)

/* ---------------------------------------------------------------------------------------------
 * Entry points.
 * ------------------------------------------------------------------------------------------- */

/* The compiled path: "avx512", "avx2" or "scalar". */
const char *rows_gemm_isa(void) { return ISA_NAME; }

/* The most rows one tile takes: MR_MAX. */
int rows_gemm_max_rows(void) { return MR_MAX; }

/* W^T [k, n] (row stride ldw) -> packed [ceil(n / 16)][k][16], the last panel zero-padded; in
 * pairs (n a multiple of 32), panel 2q from columns 16q and panel 2q + 1 from n/2 + 16q. */
static void pack(const float *wt, int64_t ldw, int64_t k, int64_t n, float *packed, int pairs) {
    const int64_t npanels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < npanels; p++) {
        const int64_t c0 = pairs ? (p % 2) * (n / 2) + (p / 2) * PANEL : p * PANEL;
        const int64_t cols = n - c0 < PANEL ? n - c0 : PANEL;
        float *dst = packed + p * k * PANEL;
        for (int64_t kk = 0; kk < k; kk++) {
            memcpy(dst + kk * PANEL, wt + kk * ldw + c0, (size_t)cols * sizeof(float));
            if (cols < PANEL) memset(dst + kk * PANEL + cols, 0, (PANEL - cols) * sizeof(float));
        }
    }
}

void rows_gemm_pack(const float *wt, int64_t ldw, int64_t k, int64_t n, float *packed) {
    pack(wt, ldw, k, n, packed, 0);
}

/* W^T [k, n] of a gated layer -> panels packed in pairs (see above). Returns 0, or -2 (nothing
 * written) if n is not a multiple of 32. */
int rows_gemm_pack_pairs(const float *wt, int64_t ldw, int64_t k, int64_t n, float *packed) {
    if (n % (2 * PANEL) != 0) return -2;
    pack(wt, ldw, k, n, packed, 1);
    return 0;
}

/* The int8 value of a / scale (scale > 0): rounded to nearest (ties to even), clamped to
 * [-127, 127]. */
static inline int8_t quantise(float a, float scale) {
    const float q = nearbyintf(a / scale);
    return (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
}

/* W^T [k, n] (row stride ldw) -> byte panels packed [ceil(n / 16)][ceil(k / 4)][16][4]
 * (rows_q8.h: q + 128; padding q = 0) and scales[ceil(n / 16) * 16] (padding 0): per column j,
 * scale_j = max_k |W^T[k, j]| / 127 and q = quantise(W^T[k, j], scale_j); a column of zeros
 * gets scale 0 and q = 0. */
void rows_gemm_pack_q8(const float *wt, int64_t ldw, int64_t k, int64_t n, uint8_t *packed,
                       float *scales) {
    const int64_t npanels = (n + PANEL - 1) / PANEL, groups = (k + Q8_GROUP - 1) / Q8_GROUP;
    for (int64_t p = 0; p < npanels; p++) {
        const int64_t c0 = p * PANEL;
        const int64_t cols = n - c0 < PANEL ? n - c0 : PANEL;
        float amax[PANEL] = {0};
        for (int64_t kk = 0; kk < k; kk++) {
            for (int64_t c = 0; c < cols; c++) {
                const float a = fabsf(wt[kk * ldw + c0 + c]);
                amax[c] = a > amax[c] ? a : amax[c];
            }
        }
        float *s = scales + c0;
        for (int64_t c = 0; c < PANEL; c++) s[c] = c < cols ? amax[c] / 127.0f : 0.0f;
        uint8_t *dst = packed + p * groups * Q8_GROUP_BYTES;
        for (int64_t kk = 0; kk < groups * Q8_GROUP; kk++) {
            for (int64_t c = 0; c < PANEL; c++) {
                const int real = kk < k && c < cols && s[c] != 0.0f;
                const int8_t q = real ? quantise(wt[kk * ldw + c0 + c], s[c]) : 0;
                dst[kk / Q8_GROUP * Q8_GROUP_BYTES + c * Q8_GROUP + kk % Q8_GROUP] =
                    (uint8_t)(q + 128);
            }
        }
    }
}

/* Threads per call, the caller included. */
void rows_gemm_set_threads(int threads) { unit_pool_set_threads(threads); }

int rows_gemm_get_threads(void) { return unit_pool_get_threads(); }

int rows_gemm_get_group_rows(void) { return RELAXED(group_rows); }

/* Rows per pass over the weights (1 .. MR_MAX): more rows are served in groups (see above). */
void rows_gemm_set_group_rows(int rows) {
    rows = rows < 1 ? 1 : rows > MR_MAX ? MR_MAX : rows;
    __atomic_store_n(&group_rows, rows, __ATOMIC_RELAXED);
}

/* How tiles of `rows` rows (2 .. MR_MAX) prefetch weights: a PREFETCH_* mode. Returns 0, or -1
 * (nothing set) if rows or mode is out of range. */
int rows_gemm_set_prefetch(int64_t rows, int64_t mode) {
    if (rows < 2 || rows > MR_MAX || mode < 0 || mode >= PREFETCH_MODES) return -1;
    __atomic_store_n(&tile_prefetch[rows], mode, __ATOMIC_RELAXED);
    return 0;
}

/* The PREFETCH_* mode of tiles of `rows` rows (PREFETCH_NONE for one row); -1 if out of range. */
int64_t rows_gemm_get_prefetch(int64_t rows) {
    if (rows < 1 || rows > MR_MAX) return -1;
    return __atomic_load_n(&tile_prefetch[rows], __ATOMIC_RELAXED);
}

/* How long an idle worker spins before it sleeps, in microseconds (0: sleep at once). */
void rows_gemm_set_spin_us(int64_t us) { unit_pool_set_spin_us(us); }

/* Weight bytes per claimed run of units at most, about (a run is at least one unit). */
void rows_gemm_set_chunk_bytes(int64_t bytes) {
    __atomic_store_n(&chunk_bytes, bytes < 1 ? 1 : bytes, __ATOMIC_RELAXED);
}

/* Runs `job` (all but its row grouping filled in) on the pool: y [m, n] = x [m, k] @ W^T. */
static void run(job_t job) {
    if (job.m <= 0 || job.n <= 0) return;
    const int64_t npanels = (job.n + PANEL - 1) / PANEL;
    /* Row groups of at most group_rows each: of equal size, or full groups and the rest. */
    const int64_t gmax = RELAXED(group_rows), groups = (job.m + gmax - 1) / gmax;
    job.group = FILL_GROUPS ? (job.m < gmax ? job.m : gmax) : (job.m + groups - 1) / groups;
    const int64_t unit = unit_panels(job.group, job.pairs);
    const int64_t panel_bytes = job.q8 ? job.ldq * PANEL : job.k * PANEL * (int64_t)sizeof(float);
    const int64_t unit_bytes = unit * panel_bytes;
    unit_pool_run(run_units, &job, (npanels + unit - 1) / unit,
                  RELAXED(chunk_bytes) / (unit_bytes > 0 ? unit_bytes : 1));
}

/* y [m, n] (contiguous) = x [m, k] (row stride ldx) @ W^T, W packed by rows_gemm_pack;
 * + bias, when not NULL, padded to ceil(n / 16) * 16 floats. */
void rows_gemm(const float *x, int64_t ldx, const float *packed, const float *bias, float *y,
               int64_t m, int64_t k, int64_t n) {
    run((job_t){.x = x, .ldx = ldx, .w = packed, .ps = k * PANEL, .wk = PANEL, .bias = bias,
                .y = y, .m = m, .k = k, .n = n});
}

/* The product of a gated layer packed by rows_gemm_pack_pairs (bias, when not NULL, padded and
 * ordered as the panels): y [m, n] (contiguous) as rows_gemm on the unpacked W^T when silu is
 * 0, else y [m, n/2] = silu(gate) * up. Returns 0, or -2 (y untouched) if n is not a multiple
 * of 32. */
int rows_gemm_pairs(const float *x, int64_t ldx, const float *packed, const float *bias,
                    float *y, int64_t m, int64_t k, int64_t n, int64_t silu) {
    if (n % (2 * PANEL) != 0) return -2;
    run((job_t){.x = x, .ldx = ldx, .w = packed, .ps = k * PANEL, .wk = PANEL, .bias = bias,
                .y = y, .m = m, .k = k, .n = n, .pairs = silu ? PAIRS_SILU : PAIRS_HALVES});
    return 0;
}

/* The same on W^T [k, n] read in place (row stride ldw): n must be a multiple of 16, and bias,
 * when not NULL, holds n floats. Returns 0, or -2 (y untouched) if n is not a multiple of 16. */
int rows_gemm_inplace(const float *x, int64_t ldx, const float *wt, int64_t ldw, const float *bias,
                      float *y, int64_t m, int64_t k, int64_t n) {
    if (n % PANEL != 0) return -2;
    run((job_t){.x = x, .ldx = ldx, .w = wt, .ps = PANEL, .wk = ldw, .bias = bias, .y = y,
                .m = m, .k = k, .n = n});
    return 0;
}

/* The compiled q8 path: "avx512-vnni", "avx2" or "scalar". */
const char *rows_gemm_q8_isa(void) { return Q8_ISA; }

/* y [m, n] (contiguous) = (q_x * scale_x) @ (q * scale)^T (+ bias as rows_gemm): q and scales
 * packed by rows_gemm_pack_q8; each row of x [m, k] (row stride ldx) quantised as a column of
 * W^T is (scale_x = max |row| / 127, q_x = quantise(x, scale_x), 0 for a row of zeros), on the
 * calling thread, into a buffer of its own (grown as needed and kept). Aborts if memory runs
 * out. */
void rows_gemm_q8(const float *x, int64_t ldx, const uint8_t *packed, const float *scales,
                  const float *bias, float *y, int64_t m, int64_t k, int64_t n) {
    if (m <= 0 || n <= 0) return;
    static __thread char *buffer;
    static __thread size_t capacity;
    const int64_t ldq = (k + Q8_GROUP - 1) / Q8_GROUP * Q8_GROUP;
    const size_t need = (size_t)m * (sizeof(int32_t) + sizeof(float) + (size_t)ldq);
    if (need > capacity) {
        free(buffer);
        buffer = malloc(need);
        if (buffer == NULL) abort();
        capacity = need;
    }
    int32_t *corr = (int32_t *)buffer;
    float *row_scale = (float *)(corr + m);
    int8_t *xq = (int8_t *)(row_scale + m);
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * ldx;
        float amax = 0.0f;
        for (int64_t kk = 0; kk < k; kk++) amax = fabsf(row[kk]) > amax ? fabsf(row[kk]) : amax;
        const float scale = amax / 127.0f;
        int32_t sum = 0;
        int8_t *q = xq + i * ldq;
        for (int64_t kk = 0; kk < ldq; kk++) {
            q[kk] = kk < k && scale != 0.0f ? quantise(row[kk], scale) : 0;
            sum += q[kk];
        }
        row_scale[i] = scale;
        corr[i] = 128 * sum;
    }
    run((job_t){.bias = bias, .y = y, .m = m, .k = k, .n = n, .xq = xq, .ldq = ldq,
                .corr = corr, .row_scale = row_scale, .q8 = packed, .scales = scales});
}
