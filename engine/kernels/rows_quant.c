/*
 * Products of float32 rows with grouped 8- or 4-bit weights for few rows, through int8
 * activations quantised in groups: W' as rows_qg.h describes it, what
 * engine/quant/reference.py's `reference_linear(..., int8_activations=True)` computes.
 *
 * Each call quantises the rows of x on the calling thread, into a buffer of its own: optionally
 * gathering x's columns in the weight's stored order first (x[:, perm], GPTQ's act-order), per
 * row and activation group of `ags` columns s_x = max |x| / 127 and q_x = round-half-to-even(x /
 * s_x) clamped to [-127, 127] (a group of zeros: s_x = 0, q_x = 0), and the sums of q_x over each
 * block of gcd(ags, gs) columns, with the scale of the block's activation group. Then the
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
    const int32_t *xsum; /* [m, blocks] */
    const float *xscale; /* [m, blocks] */
    const uint8_t *w;
    const float *scales;
    const int8_t *zeros;
    const float *bias;
    float *y; /* [m, n] */
    int64_t m, k, n, bs, blocks, wr, bits;
    int64_t pass; /* rows per pass over the weights, <= QG_MR_MAX */
} qg_job_t;

/* Bytes of one panel's weights. */
static inline int64_t panel_bytes(const qg_job_t *job) { return job->k * PANEL * job->bits / 8; }

/* Rows [r, r + mr) times panels [p0, p1), a main tile at a time and single panels for the
 * rest. */
static void run_tiles(const qg_job_t *job, int64_t r, int mr, int64_t p0, int64_t p1) {
    const int nb = QG_TILE_NB[mr];
    const int64_t ps = panel_bytes(job), ss = job->blocks / job->wr * PANEL;
    const qg_tile_fn main = (job->bits == 8 ? QG_MAIN_8 : QG_MAIN_4)[mr];
    const qg_tile_fn one = (job->bits == 8 ? QG_ONE_8 : QG_ONE_4)[mr];
    for (int64_t p = p0; p < p1;) {
        const int full = p + nb <= p1;
        const int64_t width = (full ? nb : 1) * PANEL, left = job->n - p * PANEL;
        (full ? main : one)(job->xq + r * job->k, job->k, job->xsum + r * job->blocks,
                            job->xscale + r * job->blocks, job->blocks, job->w + p * ps, ps,
                            job->scales + p * ss, job->zeros ? job->zeros + p * ss : 0, ss,
                            job->bs, job->blocks, job->wr, job->bias ? job->bias + p * PANEL : 0,
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

/* q [n] = v [n] quantised with the scale it returns: max |v| / 127 (0: q all 0), as `quantise`.
 * The maximum is taken over the bits of |v| as integers (the same order for floats that are not
 * NaN), a loop the compiler vectorises. */
static float quantise_group(const float *v, int64_t n, int8_t *q) {
    uint32_t top = 0;
    for (int64_t kk = 0; kk < n; kk++) {
        uint32_t bits;
        memcpy(&bits, v + kk, sizeof bits);
        bits &= 0x7FFFFFFFu;
        top = bits > top ? bits : top;
    }
    float amax;
    memcpy(&amax, &top, sizeof amax);
    const float scale = amax / 127.0f;
    if (scale == 0.0f) {
        memset(q, 0, (size_t)n);
        return scale;
    }
    for (int64_t kk = 0; kk < n; kk++) q[kk] = quantise(v[kk], scale);
    return scale;
}

/* The greatest common divisor of a and b (both > 0). */
static int64_t gcd(int64_t a, int64_t b) {
    while (b) {
        const int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* y [m, n] (contiguous) = x [m, k] (row stride ldx) times the grouped weight packed as
 * rows_qg.h describes (`bits` 8 or 4, `gs` input columns per group), x's columns taken in the
 * order `perm` [k] when not NULL and quantised in activation groups of `ags` columns; + bias,
 * when not NULL, padded to ceil(n / 16) * 16 floats. Returns 0, -2 (y untouched) if bits, gs,
 * ags or k do not fit the layout (gs and ags dividing k; gs and gcd(ags, gs) a multiple of 4 for
 * 8 bits, of 8 for 4 bits; gs at most 65536). Aborts if memory runs out. */
int rows_gemm_qg(const float *x, int64_t ldx, const int64_t *perm, const uint8_t *packed,
                 const float *scales, const int8_t *zeros, int64_t bits, int64_t gs, int64_t ags,
                 const float *bias, float *y, int64_t m, int64_t k, int64_t n) {
    const int64_t step = bits == 8 ? 4 : 8;
    if ((bits != 8 && bits != 4) || gs <= 0 || gs % step || k % gs || gs > 65536 || ags <= 0 ||
        k % ags || gcd(ags, gs) % step)
        return -2;
    if (m <= 0 || n <= 0) return 0;
    static __thread char *buffer;
    static __thread size_t capacity;
    const int64_t bs = gcd(ags, gs), blocks = k / bs;
    const size_t need =
        (size_t)m * ((size_t)blocks * (sizeof(int32_t) + sizeof(float)) + (size_t)k) +
        (perm ? (size_t)k * sizeof(float) : 0);
    if (need > capacity) {
        free(buffer);
        buffer = malloc(need);
        if (buffer == NULL) abort();
        capacity = need;
    }
    int32_t *xsum = (int32_t *)buffer;
    float *xscale = (float *)(xsum + m * blocks);
    int8_t *xq = (int8_t *)(xscale + m * blocks);
    float *gathered = (float *)(xq + m * k); /* one row's x[:, perm], when perm */
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * ldx;
        if (perm) {
            for (int64_t kk = 0; kk < k; kk++) gathered[kk] = row[perm[kk]];
            row = gathered;
        }
        int8_t *q = xq + i * k;
        for (int64_t a = 0; a < k / ags; a++) {
            const float scale = quantise_group(row + a * ags, ags, q + a * ags);
            for (int64_t b = a * ags / bs; b < (a + 1) * ags / bs; b++) {
                int32_t sum = 0;
                for (int64_t kk = b * bs; kk < (b + 1) * bs; kk++) sum += q[kk];
                xsum[i * blocks + b] = sum;
                xscale[i * blocks + b] = scale;
            }
        }
    }
    const int64_t passes = (m + QG_MR_MAX - 1) / QG_MR_MAX;
    qg_job_t job = {.xq = xq, .xsum = xsum, .xscale = xscale, .w = packed,
                    .scales = scales, .zeros = zeros, .bias = bias, .y = y, .m = m, .k = k,
                    .n = n, .bs = bs, .blocks = blocks, .wr = gs / bs, .bits = bits,
                    .pass = (m + passes - 1) / passes};
    const int64_t npanels = (n + PANEL - 1) / PANEL, unit = QG_TILE_NB[job.pass];
    const int64_t unit_bytes = unit * panel_bytes(&job);
    unit_pool_run(run_units, &job, (npanels + unit - 1) / unit,
                  QG_CHUNK_BYTES / (unit_bytes > 0 ? unit_bytes : 1));
    return 0;
}
