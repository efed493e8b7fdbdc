/*
 * The tiles of rows_gemm.c: float32 products of MR rows of x with NB panels of packed weights,
 * one family per instruction set, chosen at compile time: AVX-512F when the compiler targets it,
 * else AVX2 with FMA, else portable C (also forced by -DSPECSERVE_SCALAR).
 *
 * Weights are laid out in column panels of PANEL = 16 floats, [ceil(N / 16)][K][16] when packed.
 * A tile keeps MR x NB panel-wide accumulators in registers and streams each panel once: every
 * weight is loaded once for all MR rows, and each output is accumulated in float32 in k order
 * (one fused multiply-add per k on the vector paths), in blocks of KBLOCK steps whose sums are
 * added to the output in turn. A tile broadcasts each row's x[k] from x itself (row stride ldx):
 * x is a few kilobytes, and copying it into another layout first costs more than it saves.
 * (int8 weights have tiles of their own: rows_q8.h.)
 *
 * Included once, by rows_gemm.c.
 */
#ifndef SPECSERVE_ROWS_TILES_H
#define SPECSERVE_ROWS_TILES_H

#include <stdint.h>
#include <string.h>

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
 * PREFETCH_L2 (PF_L2_LINES ahead over the tile's NB panels together, PF_L2_LINES / NB each, into
 * L2: the lines in flight, not how far each stream runs ahead, set how well the products of
 * several rows overlap the stream). Distances are in 64-byte lines. One row always streams with
 * the hardware's prefetcher alone (the fastest on every CPU measured); for several rows the
 * fastest mode depends on the CPU and the row count, so callers choose by timing.
 * PREFETCH_DEFAULT until then. Results never depend on it. */
enum { PREFETCH_NONE, PREFETCH_NTA, PREFETCH_L2, PREFETCH_MODES };
#define PF_NTA_LINES 32
#define PF_L2_LINES 128
#define PREFETCH_DEFAULT PREFETCH_NTA
/* Each output sums its products in blocks of this many k steps, then adds the blocks in k
 * order: rounding error grows with the block count and size, not with k (as blocked GEMMs). */
#define KBLOCK 128

/* ---------------------------------------------------------------------------------------------
 * Tiles `tile_MR_NB`: MR rows of x times NB panels starting at `w` (panel j, step kk at
 * w + j * ps + kk * wk floats: ps = k * PANEL, wk = PANEL when packed; ps = PANEL, wk = ldw in
 * place), written to y[MR][ncols] with row stride ldy, ncols <= NB * PANEL (the rest of the last
 * panel is padding). `bias` is NULL or points at NB * PANEL readable floats (the padded bias).
 * `prefetch` is the tile's PREFETCH_* mode.
 * ------------------------------------------------------------------------------------------- */

typedef void (*tile_fn)(const float *x, int64_t ldx, const float *w, int64_t k, int64_t ps,
                        int64_t wk, const float *bias, float *y, int64_t ldy, int64_t ncols,
                        int64_t prefetch);

/* A tile's prefetch distance in k steps under mode `prefetch`, 0 for none; and the prefetch of
 * address `a` under that mode. */
#define PF_STEPS \
    (MR == 1 || prefetch == PREFETCH_NONE \
         ? 0 \
         : (prefetch == PREFETCH_L2 ? PF_L2_LINES / NB : PF_NTA_LINES))
#define PREFETCH_AT(a) \
    do { \
        if (prefetch == PREFETCH_L2) _mm_prefetch((const char *)(a), _MM_HINT_T1); \
        else _mm_prefetch((const char *)(a), _MM_HINT_NTA); \
    } while (0)

#if defined(ROWS_AVX512)
#define ISA_NAME "avx512"
#define MR_MAX 16
#define GROUP_ROWS 14 /* default rows per pass over the weights (rows_gemm_set_group_rows) */
/* Whether more rows than a pass takes are served as full passes and the rest (1) or in passes of
 * equal size (0). Every AVX-512 tile of 5 rows or more keeps 14 sums or more apart. */
#define FILL_GROUPS 0

/* The lanes of a panel's first `left` columns (all 16 for left >= PANEL). */
static inline __mmask16 panel_mask(int64_t left) {
    return left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* acc + w * x[0] in all lanes, as _mm512_fmadd_ps(_mm512_set1_ps(*x), w, acc) (the same rounding)
 * but in one instruction whose memory operand is broadcast, where the compiler would load the
 * broadcast into a register first. Tiles of BCAST_FMA_ROWS rows or more use it: a step of k then
 * takes MR fewer instructions, so more steps, and more lines of weights in flight, fit in the
 * core's reorder window; tiles of fewer rows and more panels load x more often this way than they
 * save (docs/benchmarks.md). */
#define BCAST_FMA_ROWS 5
static inline __attribute__((always_inline)) __m512 fmadd_bcast(const float *x, __m512 w,
                                                                __m512 acc) {
    __asm__("vfmadd231ps %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*x));
    return acc;
}

/* The running sums of the KBLOCK blocks stay in `part` (the tile's stack frame) and y is
 * written once, at the last block: rows of y whose stride is a multiple of 4 KiB (gate/up
 * products, vocabulary heads) would alias one another in the load/store unit if each block
 * re-read them. */
#define TILE_BODY(MR, NB) \
    const int64_t pf = PF_STEPS; \
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
                wv[j] = _mm512_loadu_ps(w + j * ps + kk * wk); \
                if (pf) PREFETCH_AT(w + j * ps + (kk + pf) * wk); \
            } \
_Pragma("GCC unroll 16") \
            for (int i = 0; i < MR; i++) { \
                if (MR >= BCAST_FMA_ROWS) { \
_Pragma("GCC unroll 8") \
                    for (int j = 0; j < NB; j++) \
                        acc[i][j] = fmadd_bcast(x + i * ldx + kk, wv[j], acc[i][j]); \
                } else { \
                    const __m512 xb = _mm512_set1_ps(x[i * ldx + kk]); \
_Pragma("GCC unroll 8") \
                    for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]); \
                } \
            } \
        } \
_Pragma("GCC unroll 8") \
        for (int j = 0; j < NB; j++) { \
            const int64_t left = ncols - j * PANEL; \
            if (left <= 0) break; \
            const __mmask16 mask = panel_mask(left); \
            const __m512 b = bias && k1 == k ? _mm512_loadu_ps(bias + j * PANEL) \
                                             : _mm512_setzero_ps(); \
_Pragma("GCC unroll 16") \
            for (int i = 0; i < MR; i++) { \
                float *dst = y + i * ldy + j * PANEL; \
                __m512 v = acc[i][j]; \
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
/* The 6-row tile keeps 12 sums apart, enough to hide the multiply-add's latency; those of 4 rows
 * or fewer keep 8 or fewer and do less arithmetic per cycle (docs/benchmarks.md). So 8 rows run as
 * 6 + 2, not 4 + 4. */
#define FILL_GROUPS 1

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

#define TILE_BODY(MR, NB) \
    const int64_t pf = PF_STEPS; \
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
                wl[j] = _mm256_loadu_ps(w + j * ps + kk * wk); \
                wh[j] = _mm256_loadu_ps(w + j * ps + kk * wk + 8); \
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
_Pragma("GCC unroll 16") \
            for (int i = 0; i < MR; i++) { \
                float *dst = y + i * ldy + j * PANEL; \
                __m256 vl = lo[i][j], vh = hi[i][j]; \
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
#define FILL_GROUPS 0

#define TILE_BODY(MR, NB) \
    for (int j = 0; j < NB; j++) { \
        const int64_t left = ncols - j * PANEL; \
        if (left <= 0) break; \
        const int64_t cols = left < PANEL ? left : PANEL; \
        const float *wp = w + j * ps; \
        int64_t k0 = 0; \
        do { \
            const int64_t k1 = k - k0 < KBLOCK ? k : k0 + KBLOCK; \
            float acc[MR][PANEL]; \
            memset(acc, 0, sizeof(acc)); \
            for (int64_t kk = k0; kk < k1; kk++) { \
                for (int i = 0; i < MR; i++) { \
                    const float xv = x[i * ldx + kk]; \
                    for (int c = 0; c < PANEL; c++) acc[i][c] += xv * wp[kk * wk + c]; \
                } \
            } \
            for (int i = 0; i < MR; i++) { \
                for (int64_t c = 0; c < cols; c++) { \
                    float v = acc[i][c]; \
                    if (k0) v = y[i * ldy + j * PANEL + c] + v; \
                    if (k1 == k && bias) v += bias[j * PANEL + c]; \
                    y[i * ldy + j * PANEL + c] = v; \
                } \
            } \
            k0 = k1; \
        } while (k0 < k); \
    }
#endif

#define TILE_F32(MR_, NB_)                                                                       \
    static void tile_##MR_##_##NB_(const float *x, int64_t ldx, const float *w, int64_t k,       \
                                   int64_t ps, int64_t wk, const float *bias, float *y,          \
                                   int64_t ldy, int64_t ncols, int64_t prefetch) {               \
        enum { MR = MR_, NB = NB_ };                                                             \
        (void)prefetch;                                                                          \
        TILE_BODY(MR, NB)                                                                        \
    }

/* Panels per tile for each row count: at most as many accumulators as the registers hold; 4 rows
 * take six panels, which stream faster than four, and 7 and 8 rows two, which stream faster
 * than three (docs/benchmarks.md). TILES lists the tiles (MR, NB) to generate; TILE_NB and the
 * tables TILE_MAIN (MR rows, TILE_NB[MR] panels) and TILE_ONE (MR rows, one panel: a run's
 * remainder) are indexed by MR. */
#if defined(ROWS_AVX512)
#define TILES(T)                                                                                   \
    T(1, 4) T(2, 8) T(3, 6) T(4, 6) T(5, 4) T(6, 4) T(7, 2) T(8, 2) T(9, 2) T(10, 2) T(11, 2)      \
    T(12, 2) T(13, 2) T(14, 2) T(15, 1) T(16, 1) T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(5, 1) T(6, 1)   \
    T(7, 1) T(8, 1) T(9, 1) T(10, 1) T(11, 1) T(12, 1) T(13, 1) T(14, 1)
static const int TILE_NB[MR_MAX + 1] = {0, 4, 8, 6, 6, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1};
#define MAIN_TABLE(P)                                                                              \
    {0, P##_1_4, P##_2_8, P##_3_6, P##_4_6, P##_5_4, P##_6_4, P##_7_2, P##_8_2, P##_9_2,           \
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
static const tile_fn TILE_MAIN[MR_MAX + 1] = MAIN_TABLE(tile);
static const tile_fn TILE_ONE[MR_MAX + 1] = ONE_TABLE(tile);

#endif
