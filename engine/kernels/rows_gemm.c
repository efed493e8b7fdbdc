/*
 * float32 matrix product for few rows: y[M, N] = x[M, K] @ W^T[K, N] (+ bias[N]).
 *
 * The weights are packed once (`rows_gemm_pack`) into column panels of PANEL = 16 floats,
 * [ceil(N / 16)][K][16] contiguous, the last panel zero-padded; the tiles (rows_tiles.h) stream
 * them, each weight loaded once per pass for all rows of the pass. A pass takes up to
 * `group_rows` rows (MR_MAX at most: 16 on AVX-512); more rows are served in equal groups that
 * run over the same run of panels one after another, the later groups reading its weights from
 * cache.
 *
 * int8 weights ("q8", weight-only, for memory-bound products whose result may be approximate,
 * such as a draft model's vocabulary head): `rows_gemm_pack_q8` quantises W^T symmetrically per
 * output column j, scale_j = max_k |W^T[k, j]| / 127 (0 for a column of zeros),
 * q = round-to-nearest-even(W^T / scale_j) clamped to [-127, 127], into int8 panels of the same
 * [ceil(N / 16)][K][16] layout (a quarter of the bytes) plus scales[ceil(N / 16) * 16] (padding
 * 0). `rows_gemm_q8` computes y = x @ (q * scale)^T (+ bias) with the float path's tiles,
 * threads, row groups and k order.
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
#include "unit_pool.h"

/* ---------------------------------------------------------------------------------------------
 * One call's work, cut into units of whole tiles that the pool's threads claim in runs.
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const float *x; /* [m, k], row stride ldx */
    const void *w;  /* weights: float (FMT_F32) or int8_t (FMT_Q8) */
    const float *scales; /* FMT_Q8: per-column scales, padded to whole panels; else NULL */
    int64_t fmt;    /* FMT_F32 or FMT_Q8 */
    int64_t ps, wk; /* panel j, step kk at weight element j * ps + kk * wk */
    const float *bias;
    float *y;
    int64_t m, k, n, ldx;
    int64_t group;  /* rows per pass over the weights, <= MR_MAX */
    int64_t pairs;  /* PAIRS_*: how y is written from panels packed in pairs */
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
    const float *x = job->x + r * job->ldx; /* this group's rows */
    const int64_t panel_bytes = job->ps * FMT_BYTES[job->fmt];
    for (int64_t p = p0; p < p1;) {
        const int full = p + nb <= p1; /* a main tile fits */
        const int64_t width = (full ? nb : 1) * PANEL, left = cols - (p - p0) * PANEL;
        (full ? TILE_MAIN : TILE_ONE)[job->fmt][mr](
            x, job->ldx, (const char *)job->w + p * panel_bytes,
            job->scales ? job->scales + p * PANEL : 0, job->k, job->ps, job->wk,
            job->bias ? job->bias + p * PANEL : 0, y + (p - p0) * PANEL, ldy,
            left < width ? left : width, prefetch);
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

/* Elements of the packed layout of a [k, n] weight (floats; int8 values for q8). */
int64_t rows_gemm_packed_size(int64_t k, int64_t n) { return (n + PANEL - 1) / PANEL * PANEL * k; }

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

/* W^T [k, n] (row stride ldw) -> int8 panels packed [ceil(n / 16)][k][16] (the last panel
 * zero-padded) and scales[ceil(n / 16) * 16] (padding 0): per column j, scale_j =
 * max_k |W^T[k, j]| / 127 and q = W^T / scale_j rounded to nearest (ties to even), clamped to
 * [-127, 127]; a column of zeros gets scale 0 and q = 0. */
void rows_gemm_pack_q8(const float *wt, int64_t ldw, int64_t k, int64_t n, int8_t *packed,
                       float *scales) {
    const int64_t npanels = (n + PANEL - 1) / PANEL;
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
        int8_t *dst = packed + p * k * PANEL;
        for (int64_t kk = 0; kk < k; kk++) {
            for (int64_t c = 0; c < PANEL; c++) {
                float q = 0.0f;
                if (c < cols && s[c] != 0.0f) {
                    q = nearbyintf(wt[kk * ldw + c0 + c] / s[c]);
                    q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
                }
                dst[kk * PANEL + c] = (int8_t)q;
            }
        }
    }
}

/* Threads per call, the caller included. */
void rows_gemm_set_threads(int threads) { unit_pool_set_threads(threads); }

int rows_gemm_get_threads(void) { return unit_pool_get_threads(); }

int rows_gemm_get_group_rows(void) { return RELAXED(group_rows); }

/* Rows per pass over the weights (1 .. MR_MAX): more rows are served in equal groups. */
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

/* y [m, n] = x [m, k] @ W^T on weights laid out as panels (see the tiles), of format `fmt`
 * (FMT_Q8: int8 with per-column `scales`). */
static void run(const float *x, int64_t ldx, const void *w, const float *scales, int64_t fmt,
                int64_t ps, int64_t wk, const float *bias, float *y, int64_t m, int64_t k,
                int64_t n, int64_t pairs) {
    if (m <= 0 || n <= 0) return;
    const int64_t npanels = (n + PANEL - 1) / PANEL;
    /* Row groups of equal size, at most group_rows each. */
    const int64_t gmax = RELAXED(group_rows);
    const int64_t group = (m + (m + gmax - 1) / gmax - 1) / ((m + gmax - 1) / gmax);
    const int64_t unit = unit_panels(group, pairs);
    const int64_t unit_bytes = unit * k * PANEL * FMT_BYTES[fmt];
    const job_t job = {x, w, scales, fmt, ps, wk, bias, y, m, k, n, ldx, group, pairs};
    unit_pool_run(run_units, &job, (npanels + unit - 1) / unit,
                  RELAXED(chunk_bytes) / (unit_bytes > 0 ? unit_bytes : 1));
}

/* y [m, n] (contiguous) = x [m, k] (row stride ldx) @ W^T, W packed by rows_gemm_pack;
 * + bias, when not NULL, padded to ceil(n / 16) * 16 floats. */
void rows_gemm(const float *x, int64_t ldx, const float *packed, const float *bias, float *y,
               int64_t m, int64_t k, int64_t n) {
    run(x, ldx, packed, 0, FMT_F32, k * PANEL, PANEL, bias, y, m, k, n, PAIRS_NONE);
}

/* The product of a gated layer packed by rows_gemm_pack_pairs (bias, when not NULL, padded and
 * ordered as the panels): y [m, n] (contiguous) as rows_gemm on the unpacked W^T when silu is
 * 0, else y [m, n/2] = silu(gate) * up. Returns 0, or -2 (y untouched) if n is not a multiple
 * of 32. */
int rows_gemm_pairs(const float *x, int64_t ldx, const float *packed, const float *bias,
                    float *y, int64_t m, int64_t k, int64_t n, int64_t silu) {
    if (n % (2 * PANEL) != 0) return -2;
    run(x, ldx, packed, 0, FMT_F32, k * PANEL, PANEL, bias, y, m, k, n,
        silu ? PAIRS_SILU : PAIRS_HALVES);
    return 0;
}

/* The same on W^T [k, n] read in place (row stride ldw): n must be a multiple of 16, and bias,
 * when not NULL, holds n floats. Returns 0, or -2 (y untouched) if n is not a multiple of 16. */
int rows_gemm_inplace(const float *x, int64_t ldx, const float *wt, int64_t ldw, const float *bias,
                      float *y, int64_t m, int64_t k, int64_t n) {
    if (n % PANEL != 0) return -2;
    run(x, ldx, wt, 0, FMT_F32, PANEL, ldw, bias, y, m, k, n, PAIRS_NONE);
    return 0;
}

/* y [m, n] (contiguous) = x [m, k] (row stride ldx) @ (q * scale)^T, q and scales packed by
 * rows_gemm_pack_q8; + bias as rows_gemm. */
void rows_gemm_q8(const float *x, int64_t ldx, const int8_t *packed, const float *scales,
                  const float *bias, float *y, int64_t m, int64_t k, int64_t n) {
    run(x, ldx, packed, scales, FMT_Q8, k * PANEL, PANEL, bias, y, m, k, n, PAIRS_NONE);
}
