/*
 * Products of float32 rows with grouped 8- or 4-bit weights for few rows, through int8
 * activations: y[M, N] = s_x * (q_x @ W'^T) (+ bias[N]), W' as rows_qg.h describes it (what
 * engine/quant/reference.py's `reference_linear(..., int8_activations=True)` computes).
 *
 * Each call quantises the rows of x on the calling thread, into a buffer of its own: optionally
 * gathering x's columns in the weight's stored order first (x[:, perm], GPTQ's act-order), per
 * row s_x = max |x| / 127 and q_x = round-half-to-even(x / s_x) clamped to [-127, 127] (a row of
 * zeros: s_x = 0, q_x = 0; as rows_gemm_q8), and the sums of q_x over each group. Then the
 * panels are cut into units of whole tiles that the threads of unit_pool.h (the pool of
 * rows_gemm.c, the same library) claim in runs of about QG_CHUNK_BYTES of weights; more rows
 * than a tile takes (QG_MR_MAX) run in passes of equal size over the same run of panels, the
 * later passes reading its weights from cache.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows_tiles.h"
#include "rows_qg.h"
#include "unit_pool.h"

#define QG_CHUNK_BYTES (256 * 1024)

typedef struct {
    const int8_t *xq; /* [m, k] */
    const int32_t *xsum; /* [m, groups] */
    const float *row_scale; /* [m] */
    const uint8_t *w;
    const float *scales;
    const int8_t *zeros;
    const float *bias;
    float *y; /* [m, n] */
    int64_t m, k, n, gs, groups, bits;
    int64_t pass; /* rows per pass over the weights, <= QG_MR_MAX */
} qg_job_t;

/* Bytes of one panel's weights. */
static inline int64_t panel_bytes(const qg_job_t *job) { return job->k * PANEL * job->bits / 8; }

/* Rows [r, r + mr) times panels [p0, p1), a main tile at a time and single panels for the
 * rest. */
static void run_tiles(const qg_job_t *job, int64_t r, int mr, int64_t p0, int64_t p1) {
    const int nb = QG_TILE_NB[mr];
    const int64_t ps = panel_bytes(job), ss = job->groups * PANEL;
    const qg_tile_fn main = (job->bits == 8 ? QG_MAIN_8 : QG_MAIN_4)[mr];
    const qg_tile_fn one = (job->bits == 8 ? QG_ONE_8 : QG_ONE_4)[mr];
    for (int64_t p = p0; p < p1;) {
        const int full = p + nb <= p1;
        const int64_t width = (full ? nb : 1) * PANEL, left = job->n - p * PANEL;
        (full ? main : one)(job->xq + r * job->k, job->k, job->xsum + r * job->groups,
                            job->groups, job->row_scale + r, job->w + p * ps, ps,
                            job->scales + p * ss, job->zeros ? job->zeros + p * ss : 0, ss,
                            job->gs, job->groups, job->bias ? job->bias + p * PANEL : 0,
                            job->y + r * job->n + p * PANEL, job->n, left < width ? left : width);
        p += full ? nb : 1;
    }
}

/* Units [u0, u1)'s panels for all rows, a pass of rows at a time. */
static void run_units(const void *ctx, int64_t u0, int64_t u1) {
    const qg_job_t *job = ctx;
    const int64_t npanels = (job->n + PANEL - 1) / PANEL, unit = QG_TILE_NB[job->pass];
    const int64_t p0 = u0 * unit, p1 = u1 * unit < npanels ? u1 * unit : npanels;
    for (int64_t r = 0; r < job->m; r += job->pass) {
        const int mr = (int)(job->m - r < job->pass ? job->m - r : job->pass);
        run_tiles(job, r, mr, p0, p1);
    }
}

/* The compiled path: "avx512-vnni", "avx2" or "scalar". */
const char *rows_gemm_qg_isa(void) { return QG_ISA; }

/* The most rows one tile takes. */
int rows_gemm_qg_max_rows(void) { return QG_MR_MAX; }

/* The int8 value of a / scale (scale > 0): rounded to nearest (ties to even), clamped to
 * [-127, 127]. */
static inline int8_t quantise(float a, float scale) {
    const float q = nearbyintf(a / scale);
    return (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
}

/* y [m, n] (contiguous) = x [m, k] (row stride ldx) times the grouped weight packed as
 * rows_qg.h describes (`bits` 8 or 4, `gs` input columns per group), x's columns taken in the
 * order `perm` [k] when not NULL; + bias, when not NULL, padded to ceil(n / 16) * 16 floats.
 * Returns 0, -2 (y untouched) if bits, gs or k do not fit the layout (gs a multiple of 4 for 8
 * bits, of 8 for 4 bits, dividing k; gs at most 65536). Aborts if memory runs out. */
int rows_gemm_qg(const float *x, int64_t ldx, const int64_t *perm, const uint8_t *packed,
                 const float *scales, const int8_t *zeros, int64_t bits, int64_t gs,
                 const float *bias, float *y, int64_t m, int64_t k, int64_t n) {
    if ((bits != 8 && bits != 4) || gs <= 0 || gs % (bits == 8 ? 4 : 8) || k % gs || gs > 65536)
        return -2;
    if (m <= 0 || n <= 0) return 0;
    static __thread char *buffer;
    static __thread size_t capacity;
    const int64_t groups = k / gs;
    const size_t need = (size_t)m * ((size_t)groups * sizeof(int32_t) + sizeof(float) + (size_t)k);
    if (need > capacity) {
        free(buffer);
        buffer = malloc(need);
        if (buffer == NULL) abort();
        capacity = need;
    }
    int32_t *xsum = (int32_t *)buffer;
    float *row_scale = (float *)(xsum + m * groups);
    int8_t *xq = (int8_t *)(row_scale + m);
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * ldx;
        float amax = 0.0f;
        for (int64_t kk = 0; kk < k; kk++) amax = fabsf(row[kk]) > amax ? fabsf(row[kk]) : amax;
        const float scale = amax / 127.0f;
        int8_t *q = xq + i * k;
        for (int64_t g = 0; g < groups; g++) {
            int32_t sum = 0;
            for (int64_t kk = g * gs; kk < (g + 1) * gs; kk++) {
                q[kk] = scale != 0.0f ? quantise(row[perm ? perm[kk] : kk], scale) : 0;
                sum += q[kk];
            }
            xsum[i * groups + g] = sum;
        }
        row_scale[i] = scale;
    }
    const int64_t passes = (m + QG_MR_MAX - 1) / QG_MR_MAX;
    qg_job_t job = {.xq = xq, .xsum = xsum, .row_scale = row_scale, .w = packed,
                    .scales = scales, .zeros = zeros, .bias = bias, .y = y, .m = m, .k = k,
                    .n = n, .gs = gs, .groups = groups, .bits = bits,
                    .pass = (m + passes - 1) / passes};
    const int64_t npanels = (n + PANEL - 1) / PANEL, unit = QG_TILE_NB[job.pass];
    const int64_t unit_bytes = unit * panel_bytes(&job);
    unit_pool_run(run_units, &job, (npanels + unit - 1) / unit,
                  QG_CHUNK_BYTES / (unit_bytes > 0 ? unit_bytes : 1));
    return 0;
}
