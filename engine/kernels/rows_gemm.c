/*
 * float32 matrix product for few rows: y[M, N] = x[M, K] @ W^T[K, N] (+ bias[N]).
 *
 * The weights are packed once (`rows_gemm_pack`) into column panels of PANEL = 16 floats,
 * [ceil(N / 16)][K][16] contiguous, the last panel zero-padded. A tile of MR rows and NB panels
 * keeps MR x NB panel-wide accumulators in registers and streams each panel once: every weight is
 * loaded once per pass for all rows of the pass, and each output is accumulated in float32 in k
 * order (one fused multiply-add per k on the vector paths), in blocks of KBLOCK steps whose sums
 * are added to the output in turn. A pass takes up to `group_rows` rows
 * (MR_MAX at most: 16 on AVX-512); more rows are served in equal groups that run over the same
 * run of panels one after another, the later groups reading its weights from cache. A tile
 * broadcasts each row's x[k] from x itself (row stride ldx): x is a few kilobytes, and copying it
 * into another layout first costs more than it saves.
 *
 * int8 weights ("q8", weight-only, for memory-bound products whose result may be approximate,
 * such as a draft model's vocabulary head): `rows_gemm_pack_q8` quantises W^T symmetrically per
 * output column j, scale_j = max_k |W^T[k, j]| / 127 (0 for a column of zeros),
 * q = round-to-nearest-even(W^T / scale_j) clamped to [-127, 127], into int8 panels of the same
 * [ceil(N / 16)][K][16] layout (a quarter of the bytes) plus scales[ceil(N / 16) * 16] (padding
 * 0). `rows_gemm_q8` computes y = x @ (q * scale)^T (+ bias) with the float path's tiles,
 * threads, row groups and k order: each int8 weight vector is converted to float32 in
 * registers, and each KBLOCK block's sums are multiplied by the column scales before they are
 * added to y.
 *
 * Path, chosen at compile time: AVX-512F when the compiler targets it, else AVX2 with FMA, else
 * portable C (also forced by -DSPECSERVE_SCALAR).
 *
 * Threads: the panels are cut into units of whole tiles that the calling thread and a persistent
 * pool of workers claim in runs from one atomic counter, each run a share of the units left
 * (guided scheduling: up to about `chunk_bytes` of weights, down to one unit as the call ends,
 * so that the threads finish together). Between calls a worker spins for `spin_us`
 * microseconds, then sleeps on a condition variable (no OpenMP runtime). The pool is process-wide:
 * concurrent `rows_gemm` calls from several threads are serialised by a mutex. Worker threads
 * are not inherited by a forked child; the child starts its own on its first call.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if !defined(SPECSERVE_SCALAR) && defined(__AVX512F__)
#define ROWS_AVX512 1
#include <immintrin.h>
#elif !defined(SPECSERVE_SCALAR) && defined(__AVX2__) && defined(__FMA__)
#define ROWS_AVX2 1
#include <immintrin.h>
#endif

#define PANEL 16
/* Software prefetch of the weights by tiles of several rows, set per tile row count
 * (`rows_gemm_set_prefetch`): PREFETCH_NONE (the hardware's prefetcher alone), PREFETCH_NTA (each
 * panel's line PF_NTA_LINES ahead, into L1 as non-temporal: each weight is read once) or
 * PREFETCH_L2 (PF_L2_LINES ahead, into L2). Distances are in 64-byte lines of float weights (q8
 * weights: the same distance in bytes). One row always streams with the hardware's prefetcher
 * alone (the fastest on every CPU measured); for several rows the fastest mode depends on the CPU
 * and the row count, so callers choose by timing. PREFETCH_DEFAULT until then. Results never
 * depend on it. */
enum { PREFETCH_NONE, PREFETCH_NTA, PREFETCH_L2, PREFETCH_MODES };
#define PF_NTA_LINES 32
#define PF_L2_LINES 64
#define PREFETCH_DEFAULT PREFETCH_NTA
/* Each output sums its products in blocks of this many k steps, then adds the blocks in k
 * order: rounding error grows with the block count and size, not with k (as blocked GEMMs). */
#define KBLOCK 128
#define MAX_THREADS 256

/* ---------------------------------------------------------------------------------------------
 * Tiles: MR rows of x times NB panels starting at `w` (panel j, step kk at w + j * ps + kk * wk
 * elements: ps = k * PANEL, wk = PANEL when packed; ps = PANEL, wk = ldw in place), written to
 * y[MR][ncols] with row stride ldy, ncols <= NB * PANEL (the rest of the last panel is padding).
 * `bias` is NULL or points at NB * PANEL readable floats (the padded bias). `prefetch` is the
 * tile's PREFETCH_* mode.
 *
 * Two families come from one TILE_BODY(MR, NB, WLOAD, SCALED): `tile_MR_NB` on float weights
 * (WLOAD_F32, SCALED 0; `scales` unused) and `tile_q8_MR_NB` on int8 weights (WLOAD_Q8, which
 * widens them to float32 in registers, SCALED 1: each block's sums times the NB * PANEL floats
 * at `scales`). In the body `w` is typed (const float * or const int8_t *), so the same pointer
 * arithmetic addresses either format.
 * ------------------------------------------------------------------------------------------- */

typedef void (*tile_fn)(const float *x, int64_t ldx, const void *w, const float *scales,
                        int64_t k, int64_t ps, int64_t wk, const float *bias, float *y,
                        int64_t ldy, int64_t ncols, int64_t prefetch);

/* A tile's prefetch distance in k steps for weights of `w`'s element type under mode
 * `prefetch`, 0 for none; and the prefetch of address `a` under that mode. */
#define PF_STEPS(w) \
    (MR == 1 || prefetch == PREFETCH_NONE \
         ? 0 \
         : (prefetch == PREFETCH_L2 ? PF_L2_LINES : PF_NTA_LINES) * \
               (int64_t)(sizeof(float) / sizeof(*(w))))
#define PREFETCH_AT(a) \
    do { \
        if (prefetch == PREFETCH_L2) _mm_prefetch((const char *)(a), _MM_HINT_T1); \
        else _mm_prefetch((const char *)(a), _MM_HINT_NTA); \
    } while (0)

#if defined(ROWS_AVX512)
#define ISA_NAME "avx512"
#define MR_MAX 16
#define GROUP_ROWS 14 /* default rows per pass over the weights (rows_gemm_set_group_rows) */

/* 16 weights at p as float32. */
#define WLOAD_F32(p) _mm512_loadu_ps(p)
#define WLOAD_Q8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))

/* The running sums of the KBLOCK blocks stay in `part` (the tile's stack frame) and y is
 * written once, at the last block: rows of y whose stride is a multiple of 4 KiB (gate/up
 * products, vocabulary heads) would alias one another in the load/store unit if each block
 * re-read them. */
#define TILE_BODY(MR, NB, WLOAD, SCALED) \
    const int64_t pf = PF_STEPS(w); \
    int64_t k0 = 0; \
    __m512 part[MR][NB]; \
    do { \
        const int64_t k1 = k - k0 < KBLOCK ? k : k0 + KBLOCK; \
        __m512 acc[MR][NB]; \
_Pragma("GCC unroll 16") \
        for (int i = 0; i < MR; i++) { \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps(); \
        } \
        for (int64_t kk = k0; kk < k1; kk++) { \
            __m512 wv[NB]; \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) { \
                wv[j] = WLOAD(w + j * ps + kk * wk); \
                if (pf) PREFETCH_AT(w + j * ps + (kk + pf) * wk); \
            } \
_Pragma("GCC unroll 16") \
            for (int i = 0; i < MR; i++) { \
                const __m512 xb = _mm512_set1_ps(x[i * ldx + kk]); \
_Pragma("GCC unroll 8") \
                for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]); \
            } \
        } \
_Pragma("GCC unroll 8") \
        for (int j = 0; j < NB; j++) { \
            const int64_t left = ncols - j * PANEL; \
            if (left <= 0) break; \
            const __mmask16 mask = \
                left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); \
            const __m512 b = bias && k1 == k ? _mm512_loadu_ps(bias + j * PANEL) \
                                             : _mm512_setzero_ps(); \
            const __m512 s = SCALED ? _mm512_loadu_ps(scales + j * PANEL) : _mm512_setzero_ps(); \
_Pragma("GCC unroll 16") \
            for (int i = 0; i < MR; i++) { \
                float *dst = y + i * ldy + j * PANEL; \
                __m512 v = acc[i][j]; \
                if (SCALED) v = _mm512_mul_ps(v, s); \
                if (k0) v = _mm512_add_ps(part[i][j], v); \
                if (k1 == k) _mm512_mask_storeu_ps(dst, mask, _mm512_add_ps(v, b)); \
                else part[i][j] = v; \
            } \
        } \
        k0 = k1; \
    } while (k0 < k);

#elif defined(ROWS_AVX2)
#define ISA_NAME "avx2"
#define MR_MAX 6
#define GROUP_ROWS 6

static inline __attribute__((always_inline)) __m256 load8(const float *src, int64_t left) {
    if (left >= 8) return _mm256_loadu_ps(src);
    float tmp[8] = {0};
    if (left > 0) memcpy(tmp, src, (size_t)left * sizeof(float));
    return _mm256_loadu_ps(tmp);
}

static inline __attribute__((always_inline)) void store8(float *dst, __m256 v, int64_t left) {
    if (left >= 8) {
        _mm256_storeu_ps(dst, v);
    } else if (left > 0) {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        memcpy(dst, tmp, (size_t)left * sizeof(float));
    }
}

/* 8 weights at p as float32. */
#define WLOAD_F32(p) _mm256_loadu_ps(p)
#define WLOAD_Q8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

#define TILE_BODY(MR, NB, WLOAD, SCALED) \
    const int64_t pf = PF_STEPS(w); \
    int64_t k0 = 0; \
    do { \
        const int64_t k1 = k - k0 < KBLOCK ? k : k0 + KBLOCK; \
        __m256 lo[MR][NB], hi[MR][NB]; \
_Pragma("GCC unroll 16") \
        for (int i = 0; i < MR; i++) { \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) lo[i][j] = hi[i][j] = _mm256_setzero_ps(); \
        } \
        for (int64_t kk = k0; kk < k1; kk++) { \
            __m256 wl[NB], wh[NB]; \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) { \
                wl[j] = WLOAD(w + j * ps + kk * wk); \
                wh[j] = WLOAD(w + j * ps + kk * wk + 8); \
                if (pf) PREFETCH_AT(w + j * ps + (kk + pf) * wk); \
            } \
_Pragma("GCC unroll 16") \
            for (int i = 0; i < MR; i++) { \
                const __m256 xb = _mm256_broadcast_ss(x + i * ldx + kk); \
_Pragma("GCC unroll 8") \
                for (int j = 0; j < NB; j++) { \
                    lo[i][j] = _mm256_fmadd_ps(xb, wl[j], lo[i][j]); \
                    hi[i][j] = _mm256_fmadd_ps(xb, wh[j], hi[i][j]); \
                } \
            } \
        } \
_Pragma("GCC unroll 8") \
        for (int j = 0; j < NB; j++) { \
            const int64_t left = ncols - j * PANEL; \
            if (left <= 0) break; \
            const int last = k1 == k && bias; \
            const __m256 bl = last ? _mm256_loadu_ps(bias + j * PANEL) : _mm256_setzero_ps(); \
            const __m256 bh = last ? _mm256_loadu_ps(bias + j * PANEL + 8) : _mm256_setzero_ps(); \
            const __m256 sl = SCALED ? _mm256_loadu_ps(scales + j * PANEL) : _mm256_setzero_ps(); \
            const __m256 sh = \
                SCALED ? _mm256_loadu_ps(scales + j * PANEL + 8) : _mm256_setzero_ps(); \
_Pragma("GCC unroll 16") \
            for (int i = 0; i < MR; i++) { \
                float *dst = y + i * ldy + j * PANEL; \
                __m256 vl = lo[i][j], vh = hi[i][j]; \
                if (SCALED) { \
                    vl = _mm256_mul_ps(vl, sl); \
                    vh = _mm256_mul_ps(vh, sh); \
                } \
                if (k0) { \
                    vl = _mm256_add_ps(load8(dst, left), vl); \
                    vh = _mm256_add_ps(load8(dst + 8, left - 8), vh); \
                } \
                store8(dst, _mm256_add_ps(vl, bl), left); \
                store8(dst + 8, _mm256_add_ps(vh, bh), left - 8); \
            } \
        } \
        k0 = k1; \
    } while (k0 < k);

#else
#define ISA_NAME "scalar"
#define MR_MAX 4
#define GROUP_ROWS 4

/* One weight at p as float32. */
#define WLOAD_F32(p) (*(p))
#define WLOAD_Q8(p) ((float)*(p))

#define TILE_BODY(MR, NB, WLOAD, SCALED) \
    for (int j = 0; j < NB; j++) { \
        const int64_t left = ncols - j * PANEL; \
        if (left <= 0) break; \
        const int64_t cols = left < PANEL ? left : PANEL; \
        const __typeof__(w) wp = w + j * ps; \
        int64_t k0 = 0; \
        do { \
            const int64_t k1 = k - k0 < KBLOCK ? k : k0 + KBLOCK; \
            float acc[MR][PANEL]; \
            memset(acc, 0, sizeof(acc)); \
            for (int64_t kk = k0; kk < k1; kk++) { \
                for (int i = 0; i < MR; i++) { \
                    const float xv = x[i * ldx + kk]; \
                    for (int c = 0; c < PANEL; c++) acc[i][c] += xv * WLOAD(wp + kk * wk + c); \
                } \
            } \
            for (int i = 0; i < MR; i++) { \
                for (int64_t c = 0; c < cols; c++) { \
                    float v = acc[i][c]; \
                    if (SCALED) v *= scales[j * PANEL + c]; \
                    if (k0) v = y[i * ldy + j * PANEL + c] + v; \
                    if (k1 == k && bias) v += bias[j * PANEL + c]; \
                    y[i * ldy + j * PANEL + c] = v; \
                } \
            } \
            k0 = k1; \
        } while (k0 < k); \
    }
#endif

#define TILE(NAME, WTYPE, WLOAD, SCALED, MR_, NB_)                                               \
    static void NAME##_##MR_##_##NB_(const float *x, int64_t ldx, const void *wv,                \
                                     const float *scales, int64_t k, int64_t ps, int64_t wk,     \
                                     const float *bias, float *y, int64_t ldy, int64_t ncols,    \
                                     int64_t prefetch) {                                         \
        enum { MR = MR_, NB = NB_ };                                                             \
        const WTYPE *w = (const WTYPE *)wv;                                                      \
        (void)scales;                                                                            \
        (void)prefetch;                                                                          \
        TILE_BODY(MR, NB, WLOAD, SCALED)                                                         \
    }
#define TILE_F32(MR, NB) TILE(tile, float, WLOAD_F32, 0, MR, NB)
#define TILE_Q8(MR, NB) TILE(tile_q8, int8_t, WLOAD_Q8, 1, MR, NB)

/* Panels per tile for each row count: as many accumulators as the registers hold. TILES lists
 * the tiles (MR, NB) to generate; TILE_NB and the tables TILE_MAIN (MR rows, TILE_NB[MR]
 * panels) and TILE_ONE (MR rows, one panel: a run's remainder) are indexed by the weight
 * format (FMT_F32, FMT_Q8), then MR. */
#if defined(ROWS_AVX512)
#define TILES(T)                                                                                   \
    T(1, 4) T(2, 8) T(3, 6) T(4, 4) T(5, 4) T(6, 4) T(7, 3) T(8, 3) T(9, 2) T(10, 2) T(11, 2)      \
    T(12, 2) T(13, 2) T(14, 2) T(15, 1) T(16, 1) T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(5, 1) T(6, 1)   \
    T(7, 1) T(8, 1) T(9, 1) T(10, 1) T(11, 1) T(12, 1) T(13, 1) T(14, 1)
static const int TILE_NB[MR_MAX + 1] = {0, 4, 8, 6, 4, 4, 4, 3, 3, 2, 2, 2, 2, 2, 2, 1, 1};
#define MAIN_TABLE(P)                                                                              \
    {0, P##_1_4, P##_2_8, P##_3_6, P##_4_4, P##_5_4, P##_6_4, P##_7_3, P##_8_3, P##_9_2,           \
     P##_10_2, P##_11_2, P##_12_2, P##_13_2, P##_14_2, P##_15_1, P##_16_1}
#define ONE_TABLE(P)                                                                               \
    {0, P##_1_1, P##_2_1, P##_3_1, P##_4_1, P##_5_1, P##_6_1, P##_7_1, P##_8_1, P##_9_1,           \
     P##_10_1, P##_11_1, P##_12_1, P##_13_1, P##_14_1, P##_15_1, P##_16_1}
#elif defined(ROWS_AVX2)
#define TILES(T) T(1, 4) T(2, 2) T(3, 1) T(4, 1) T(5, 1) T(6, 1) T(1, 1) T(2, 1)
static const int TILE_NB[MR_MAX + 1] = {0, 4, 2, 1, 1, 1, 1};
#define MAIN_TABLE(P) {0, P##_1_4, P##_2_2, P##_3_1, P##_4_1, P##_5_1, P##_6_1}
#define ONE_TABLE(P) {0, P##_1_1, P##_2_1, P##_3_1, P##_4_1, P##_5_1, P##_6_1}
#else
#define TILES(T) T(1, 1) T(2, 1) T(3, 1) T(4, 1)
static const int TILE_NB[MR_MAX + 1] = {0, 1, 1, 1, 1};
#define MAIN_TABLE(P) {0, P##_1_1, P##_2_1, P##_3_1, P##_4_1}
#define ONE_TABLE(P) MAIN_TABLE(P)
#endif

TILES(TILE_F32)
TILES(TILE_Q8)

enum { FMT_F32, FMT_Q8 }; /* weight formats: float32, int8 with per-column scales */
static const int64_t FMT_BYTES[2] = {sizeof(float), sizeof(int8_t)}; /* bytes per weight */
static const tile_fn TILE_MAIN[2][MR_MAX + 1] = {MAIN_TABLE(tile), MAIN_TABLE(tile_q8)};
static const tile_fn TILE_ONE[2][MR_MAX + 1] = {ONE_TABLE(tile), ONE_TABLE(tile_q8)};

/* ---------------------------------------------------------------------------------------------
 * One call's work, cut into units of whole tiles that the threads claim in runs.
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
    int64_t group;    /* rows per pass over the weights, <= MR_MAX */
    int64_t nunits;   /* units of TILE_NB[group] panels (the last may be short) */
    int64_t max_take; /* units per claim at most: about chunk_bytes of weights */
    int64_t threads;
} job_t;

/* Units hold whole tiles: TILE_NB[group] panels (the last unit may be short), so that a run of
 * units goes through its first group's main tile throughout and no remainder of single panels. */
static inline int64_t tile_units(int64_t npanels, int64_t group) {
    return (npanels + TILE_NB[group] - 1) / TILE_NB[group];
}

/* Each tile row count's PREFETCH_* mode (atomic; set by rows_gemm_set_prefetch). */
static int64_t tile_prefetch[MR_MAX + 1] = {[2 ... MR_MAX] = PREFETCH_DEFAULT};

/* Units [u0, u1)'s panels for all rows, a row group at a time (later groups re-read the units'
 * weights from cache). */
static void run_units(const job_t *job, int64_t u0, int64_t u1) {
    const int64_t npanels = (job->n + PANEL - 1) / PANEL;
    const int64_t unit = TILE_NB[job->group];
    const int64_t p0 = u0 * unit;
    const int64_t p1 = u1 * unit < npanels ? u1 * unit : npanels;
    const int64_t k = job->k;
    const tile_fn *tile_main = TILE_MAIN[job->fmt], *tile_one = TILE_ONE[job->fmt];
    const int64_t panel_bytes = job->ps * FMT_BYTES[job->fmt];
    for (int64_t r = 0; r < job->m; r += job->group) {
        const int mr = (int)(job->m - r < job->group ? job->m - r : job->group);
        const int nb = TILE_NB[mr];
        /* a setting of speed alone: y is the same in every mode */
        const int64_t prefetch = __atomic_load_n(&tile_prefetch[mr], __ATOMIC_RELAXED);
        const float *x = job->x + r * job->ldx; /* this group's rows */
        float *y = job->y + r * job->n;
        int64_t p = p0;
        for (; p + nb <= p1; p += nb) {
            const int64_t cols = job->n - p * PANEL;
            tile_main[mr](x, job->ldx, (const char *)job->w + p * panel_bytes,
                          job->scales ? job->scales + p * PANEL : 0, k, job->ps, job->wk,
                          job->bias ? job->bias + p * PANEL : 0, y + p * PANEL, job->n,
                          cols < nb * PANEL ? cols : nb * PANEL, prefetch);
        }
        for (; p < p1; p++) {
            const int64_t cols = job->n - p * PANEL;
            tile_one[mr](x, job->ldx, (const char *)job->w + p * panel_bytes,
                         job->scales ? job->scales + p * PANEL : 0, k, job->ps, job->wk,
                         job->bias ? job->bias + p * PANEL : 0, y + p * PANEL, job->n,
                         cols < PANEL ? cols : PANEL, prefetch);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * The pool. `next` holds (generation << 32 | next unit): a thread claims units only while the
 * generation is the one whose job it read, so a late worker never runs a finished job's units;
 * between calls the unit field is 0xFFFFFFFF (none left). `done` counts finished units of the
 * current job.
 * ------------------------------------------------------------------------------------------- */

static struct {
    pthread_mutex_t call_mu; /* one rows_gemm call at a time */
    pthread_mutex_t mu;      /* with cv: sleeping workers */
    pthread_cond_t cv;
    uint32_t gen;            /* atomic: the published job's generation */
    uint64_t next;           /* atomic */
    int64_t done;            /* atomic */
    int sleepers;            /* atomic */
    int started;             /* workers running (call_mu) */
    int threads;             /* atomic: threads per call, the caller included */
    int64_t spin_ns;         /* atomic */
    int64_t chunk_bytes;     /* atomic */
    int group_rows;          /* atomic */
    job_t job;               /* written by the caller before it publishes `gen` */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          0, 0xFFFFFFFFu, 0, 0, 0, 1, 50000, 512 * 1024, GROUP_ROWS, {0}};

#define LOAD(p) __atomic_load_n(&(p), __ATOMIC_ACQUIRE)
#define RELAXED(p) __atomic_load_n(&(p), __ATOMIC_RELAXED)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Units per claim when `left` are unclaimed: a share of them that shrinks as they run out
 * (guided scheduling), so that the threads finish together, from max_take down to one. */
static inline int64_t claim_size(const job_t *job, int64_t left) {
    const int64_t take = left / (2 * job->threads);
    return take < 1 ? 1 : take > job->max_take ? job->max_take : take;
}

/* All of a job's units on the calling thread, in runs of max_take. */
static void run_alone(const job_t *job) {
    for (int64_t u = 0; u < job->nunits; u += job->max_take)
        run_units(job, u, u + job->max_take < job->nunits ? u + job->max_take : job->nunits);
}

/* Claim and run units of generation `gen` until none is left. */
static void work(const job_t *job, uint32_t gen) {
    uint64_t v = LOAD(pool.next);
    for (;;) {
        const int64_t u0 = (int64_t)(v & 0xFFFFFFFFu);
        if ((uint32_t)(v >> 32) != gen || u0 >= job->nunits) return;
        const int64_t take = claim_size(job, job->nunits - u0);
        if (__atomic_compare_exchange_n(&pool.next, &v, v + (uint64_t)take, 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            const int64_t u1 = u0 + take < job->nunits ? u0 + take : job->nunits;
            run_units(job, u0, u1);
            __atomic_fetch_add(&pool.done, u1 - u0, __ATOMIC_RELEASE);
            v = LOAD(pool.next);
        }
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1 .. threads - 1 */
    uint32_t seen = LOAD(pool.gen);
    for (;;) {
        uint32_t g = LOAD(pool.gen);
        if (g == seen) {
            const int64_t deadline = now_ns() + RELAXED(pool.spin_ns);
            int spins = 0;
            while ((g = LOAD(pool.gen)) == seen) {
                cpu_relax();
                if (++spins % 64 == 0 && now_ns() > deadline) break;
            }
            if (g == seen) {
                pthread_mutex_lock(&pool.mu);
                __atomic_fetch_add(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                while ((g = __atomic_load_n(&pool.gen, __ATOMIC_SEQ_CST)) == seen) {
                    pthread_cond_wait(&pool.cv, &pool.mu);
                }
                __atomic_fetch_sub(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                pthread_mutex_unlock(&pool.mu);
            }
        }
        seen = g;
        if (index >= RELAXED(pool.threads)) continue; /* not a participant at this setting */
        job_t job;
        job.x = __atomic_load_n(&pool.job.x, __ATOMIC_RELAXED);
        job.w = __atomic_load_n(&pool.job.w, __ATOMIC_RELAXED);
        job.scales = __atomic_load_n(&pool.job.scales, __ATOMIC_RELAXED);
        job.fmt = RELAXED(pool.job.fmt);
        job.ps = RELAXED(pool.job.ps);
        job.wk = RELAXED(pool.job.wk);
        job.bias = __atomic_load_n(&pool.job.bias, __ATOMIC_RELAXED);
        job.y = __atomic_load_n(&pool.job.y, __ATOMIC_RELAXED);
        job.m = RELAXED(pool.job.m);
        job.k = RELAXED(pool.job.k);
        job.n = RELAXED(pool.job.n);
        job.ldx = RELAXED(pool.job.ldx);
        job.group = RELAXED(pool.job.group);
        job.nunits = RELAXED(pool.job.nunits);
        job.max_take = RELAXED(pool.job.max_take);
        job.threads = RELAXED(pool.job.threads);
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* pairs with the caller's release fence */
        work(&job, g); /* uses the copy only if generation g's units are still unclaimed */
    }
    return 0;
}

static void after_fork_in_child(void) {
    pthread_mutex_init(&pool.call_mu, 0);
    pthread_mutex_init(&pool.mu, 0);
    pthread_cond_init(&pool.cv, 0);
    pool.sleepers = 0;
    pool.started = 0;
}

/* Start workers up to threads - 1 (call_mu held); returns how many run. */
static int ensure_workers(int threads) {
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(0, 0, after_fork_in_child);
        atfork = 1;
    }
    while (pool.started < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.started++;
    }
    return pool.started;
}

/* ---------------------------------------------------------------------------------------------
 * Entry points.
 * ------------------------------------------------------------------------------------------- */

/* The compiled path: "avx512", "avx2" or "scalar". */
const char *rows_gemm_isa(void) { return ISA_NAME; }

/* The most rows one tile takes: MR_MAX. */
int rows_gemm_max_rows(void) { return MR_MAX; }

/* Elements of the packed layout of a [k, n] weight (floats; int8 values for q8). */
int64_t rows_gemm_packed_size(int64_t k, int64_t n) { return (n + PANEL - 1) / PANEL * PANEL * k; }

/* W^T [k, n] (row stride ldw) -> packed [ceil(n / 16)][k][16], the last panel zero-padded. */
void rows_gemm_pack(const float *wt, int64_t ldw, int64_t k, int64_t n, float *packed) {
    const int64_t npanels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < npanels; p++) {
        const int64_t c0 = p * PANEL;
        const int64_t cols = n - c0 < PANEL ? n - c0 : PANEL;
        float *dst = packed + p * k * PANEL;
        for (int64_t kk = 0; kk < k; kk++) {
            memcpy(dst + kk * PANEL, wt + kk * ldw + c0, (size_t)cols * sizeof(float));
            if (cols < PANEL) memset(dst + kk * PANEL + cols, 0, (PANEL - cols) * sizeof(float));
        }
    }
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

/* Threads per call, the caller included (1 .. MAX_THREADS). */
void rows_gemm_set_threads(int threads) {
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    __atomic_store_n(&pool.threads, threads, __ATOMIC_RELAXED);
}

int rows_gemm_get_threads(void) { return RELAXED(pool.threads); }

int rows_gemm_get_group_rows(void) { return RELAXED(pool.group_rows); }

/* Rows per pass over the weights (1 .. MR_MAX): more rows are served in equal groups. */
void rows_gemm_set_group_rows(int rows) {
    rows = rows < 1 ? 1 : rows > MR_MAX ? MR_MAX : rows;
    __atomic_store_n(&pool.group_rows, rows, __ATOMIC_RELAXED);
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
void rows_gemm_set_spin_us(int64_t us) {
    __atomic_store_n(&pool.spin_ns, us < 0 ? 0 : us * 1000, __ATOMIC_RELAXED);
}

/* Weight bytes per claimed run of units at most, about (a run is at least one unit). */
void rows_gemm_set_chunk_bytes(int64_t bytes) {
    __atomic_store_n(&pool.chunk_bytes, bytes < 1 ? 1 : bytes, __ATOMIC_RELAXED);
}

/* y [m, n] = x [m, k] @ W^T on weights laid out as panels (see the tiles), of format `fmt`
 * (FMT_Q8: int8 with per-column `scales`). */
static void run(const float *x, int64_t ldx, const void *w, const float *scales, int64_t fmt,
                int64_t ps, int64_t wk, const float *bias, float *y, int64_t m, int64_t k,
                int64_t n) {
    if (m <= 0 || n <= 0) return;
    const int64_t npanels = (n + PANEL - 1) / PANEL;
    const int threads = RELAXED(pool.threads);
    /* Row groups of equal size, at most group_rows each. */
    const int64_t gmax = RELAXED(pool.group_rows);
    const int64_t group = (m + (m + gmax - 1) / gmax - 1) / ((m + gmax - 1) / gmax);
    const int64_t unit_bytes = TILE_NB[group] * k * PANEL * FMT_BYTES[fmt];
    const int64_t max_take = RELAXED(pool.chunk_bytes) / (unit_bytes > 0 ? unit_bytes : 1);
    job_t job = {x, w, scales, fmt, ps, wk, bias, y, m, k, n, ldx, group,
                 tile_units(npanels, group), max_take > 1 ? max_take : 1, threads};
    if (threads <= 1 || job.nunits <= 1) {
        run_alone(&job);
        return;
    }
    pthread_mutex_lock(&pool.call_mu);
    if (ensure_workers(threads) == 0) {
        pthread_mutex_unlock(&pool.call_mu);
        run_alone(&job);
        return;
    }
    /* `next` holds the finished generation with no unit left (set at the end of each call);
     * a worker that reads any field below written sees that, so it never runs a torn job. */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&pool.job.x, job.x, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.w, job.w, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.scales, job.scales, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.fmt, job.fmt, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.ps, job.ps, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.wk, job.wk, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.bias, job.bias, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.y, job.y, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.m, job.m, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.k, job.k, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.n, job.n, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.ldx, job.ldx, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.group, job.group, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.nunits, job.nunits, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.max_take, job.max_take, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job.threads, job.threads, __ATOMIC_RELAXED);
    const uint32_t gen = RELAXED(pool.gen) + 1;
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.next, (uint64_t)gen << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.gen, gen, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    work(&job, gen);
    while (LOAD(pool.done) < job.nunits) cpu_relax();
    __atomic_store_n(&pool.next, (uint64_t)gen << 32 | 0xFFFFFFFFu, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool.call_mu);
}

/* y [m, n] (contiguous) = x [m, k] (row stride ldx) @ W^T, W packed by rows_gemm_pack;
 * + bias, when not NULL, padded to ceil(n / 16) * 16 floats. */
void rows_gemm(const float *x, int64_t ldx, const float *packed, const float *bias, float *y,
               int64_t m, int64_t k, int64_t n) {
    run(x, ldx, packed, 0, FMT_F32, k * PANEL, PANEL, bias, y, m, k, n);
}

/* The same on W^T [k, n] read in place (row stride ldw): n must be a multiple of 16, and bias,
 * when not NULL, holds n floats. Returns 0, or -2 (y untouched) if n is not a multiple of 16. */
int rows_gemm_inplace(const float *x, int64_t ldx, const float *wt, int64_t ldw, const float *bias,
                      float *y, int64_t m, int64_t k, int64_t n) {
    if (n % PANEL != 0) return -2;
    run(x, ldx, wt, 0, FMT_F32, PANEL, ldw, bias, y, m, k, n);
    return 0;
}

/* y [m, n] (contiguous) = x [m, k] (row stride ldx) @ (q * scale)^T, q and scales packed by
 * rows_gemm_pack_q8; + bias as rows_gemm. */
void rows_gemm_q8(const float *x, int64_t ldx, const int8_t *packed, const float *scales,
                  const float *bias, float *y, int64_t m, int64_t k, int64_t n) {
    run(x, ldx, packed, scales, FMT_Q8, k * PANEL, PANEL, bias, y, m, k, n);
}
