/*
 * The q8 tiles of rows_gemm.c: products of int8 activations with int8 weights, summed exactly in
 * int32, for memory-bound products whose result may be approximate (a draft model's vocabulary
 * heads and projections).
 *
 * Weights: per output column c, q_w in [-127, 127] with a float32 scale s_w[c], stored as the
 * unsigned bytes q_w + 128 in panels of PANEL columns by groups of four k steps,
 * [ceil(n / 16)][ceil(k / 4)][16][4] (padding: q_w = 0). Activations: each row i quantised to
 * int8 q_x in [-127, 127] with a float32 scale s_x[i] (`rows_gemm_q8`), [m][ceil(k / 4) * 4]
 * (padding 0), and corr[i] = 128 * sum_k q_x[i][k]. A tile sums the exact integers
 * d = sum_k (q_w + 128) * q_x, so that d - corr[i] = sum_k q_w * q_x (|d| <= 255 * 127 * k: exact
 * in int32 for k up to 66,000), and writes y[i][c] = ((float)(d - corr[i]) * s_x[i]) * s_w[c]
 * (+ bias[c]).
 *
 * Three bodies, chosen at compile time: AVX-512 VNNI (vpdpbusd: 64 products per instruction),
 * AVX2 (vpmaddwd on bytes widened to 16 bits, a row at a time), portable C. Their sums are
 * the same integers and, without a bias, their outputs the same floats; the compiler may fuse
 * a bias's addition into the last product on some paths. Included once, by rows_gemm.c, after
 * rows_tiles.h.
 */
#ifndef SPECSERVE_ROWS_Q8_H
#define SPECSERVE_ROWS_Q8_H

#include <stdint.h>
#include <string.h>

#define Q8_GROUP 4                     /* k steps per 32-bit group of a column */
#define Q8_GROUP_BYTES (PANEL * Q8_GROUP) /* one group of a panel: 64 bytes */

typedef void (*q8_tile_fn)(const int8_t *xq, int64_t ldq, const int32_t *corr,
                           const float *row_scale, const uint8_t *w, int64_t groups, int64_t ps,
                           const float *scales, const float *bias, float *y, int64_t ldy,
                           int64_t ncols);

#if defined(ROWS_AVX512) && defined(__AVX512VNNI__)
#define Q8_ISA "avx512-vnni"
#define Q8_TILE_BODY(MR, NB) \
    __m512i acc[MR][NB]; \
_Pragma("GCC unroll 16") \
    for (int i = 0; i < MR; i++) { \
_Pragma("GCC unroll 8") \
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_si512(); \
    } \
    for (int64_t g = 0; g < groups; g++) { \
        __m512i wv[NB]; \
_Pragma("GCC unroll 8") \
        for (int j = 0; j < NB; j++) \
            wv[j] = _mm512_loadu_si512((const void *)(w + j * ps + g * Q8_GROUP_BYTES)); \
_Pragma("GCC unroll 16") \
        for (int i = 0; i < MR; i++) { \
            int32_t quad; \
            memcpy(&quad, xq + i * ldq + g * Q8_GROUP, sizeof quad); \
            const __m512i xb = _mm512_set1_epi32(quad); \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], wv[j], xb); \
        } \
    } \
_Pragma("GCC unroll 8") \
    for (int j = 0; j < NB; j++) { \
        const int64_t left = ncols - j * PANEL; \
        if (left <= 0) break; \
        const __mmask16 mask = panel_mask(left); \
        const __m512 s = _mm512_loadu_ps(scales + j * PANEL); \
        const __m512 b = bias ? _mm512_loadu_ps(bias + j * PANEL) : _mm512_setzero_ps(); \
_Pragma("GCC unroll 16") \
        for (int i = 0; i < MR; i++) { \
            const __m512i d = _mm512_sub_epi32(acc[i][j], _mm512_set1_epi32(corr[i])); \
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(row_scale[i])); \
            v = _mm512_mul_ps(v, s); \
            if (bias) v = _mm512_add_ps(v, b); \
            _mm512_mask_storeu_ps(y + i * ldy + j * PANEL, mask, v); \
        } \
    }

#elif defined(ROWS_AVX512) || defined(ROWS_AVX2)
#define Q8_ISA "avx2"
/* One row's y over one panel: four accumulators of four columns each, lanes (column, k steps
 * 0-1) and (column, k steps 2-3) side by side (vpmaddwd on weights widened to 16 bits), added
 * pairwise at the end. */
static inline __attribute__((always_inline)) void q8_avx2_row(
    const int8_t *xq, int32_t corr, float row_scale, const uint8_t *wp, int64_t groups,
    const float *scales, const float *bias, float *y, int64_t cols) {
    __m256i a[4];
    for (int t = 0; t < 4; t++) a[t] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; g++) {
        int32_t quad;
        memcpy(&quad, xq + g * Q8_GROUP, sizeof quad);
        const __m256i xb = _mm256_broadcastq_epi64(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(quad)));
        for (int t = 0; t < 4; t++) {
            const __m256i wv = _mm256_cvtepu8_epi16(
                _mm_loadu_si128((const __m128i *)(wp + g * Q8_GROUP_BYTES + 16 * t)));
            a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(wv, xb));
        }
    }
    float v[PANEL];
    for (int h = 0; h < 2; h++) { /* columns 8h .. 8h + 7 */
        const __m256i sums =
            _mm256_permute4x64_epi64(_mm256_hadd_epi32(a[2 * h], a[2 * h + 1]), 0xD8);
        __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(sums, _mm256_set1_epi32(corr)));
        f = _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(row_scale)),
                          _mm256_loadu_ps(scales + 8 * h));
        if (bias) f = _mm256_add_ps(f, _mm256_loadu_ps(bias + 8 * h));
        _mm256_storeu_ps(v + 8 * h, f);
    }
    memcpy(y, v, (size_t)cols * sizeof(float));
}
#define Q8_TILE_BODY(MR, NB) \
    for (int j = 0; j < NB; j++) { \
        const int64_t left = ncols - j * PANEL; \
        if (left <= 0) break; \
        for (int i = 0; i < MR; i++) \
            q8_avx2_row(xq + i * ldq, corr[i], row_scale[i], w + j * ps, groups, \
                        scales + j * PANEL, bias ? bias + j * PANEL : 0, y + i * ldy + j * PANEL, \
                        left < PANEL ? left : PANEL); \
    }

#else
#define Q8_ISA "scalar"
/* y[0 .. cols) of one row from its panel's integer sums d [PANEL]. */
static inline void q8_store(const int32_t *d, int32_t corr, float row_scale, const float *scales,
                            const float *bias, float *y, int64_t cols) {
    for (int64_t c = 0; c < cols; c++) {
        const float v = (float)(d[c] - corr) * row_scale * scales[c];
        y[c] = bias ? v + bias[c] : v;
    }
}
#define Q8_TILE_BODY(MR, NB) \
    for (int j = 0; j < NB; j++) { \
        const int64_t left = ncols - j * PANEL; \
        if (left <= 0) break; \
        const uint8_t *wp = w + j * ps; \
        for (int i = 0; i < MR; i++) { \
            int32_t d[PANEL] = {0}; \
            for (int64_t g = 0; g < groups; g++) { \
                for (int c = 0; c < PANEL; c++) { \
                    for (int t = 0; t < Q8_GROUP; t++) \
                        d[c] += (int32_t)wp[g * Q8_GROUP_BYTES + c * Q8_GROUP + t] * \
                                xq[i * ldq + g * Q8_GROUP + t]; \
                } \
            } \
            q8_store(d, corr[i], row_scale[i], scales + j * PANEL, bias ? bias + j * PANEL : 0, \
                     y + i * ldy + j * PANEL, left < PANEL ? left : PANEL); \
        } \
    }
#endif

#define Q8_TILE(MR_, NB_)                                                                        \
    static void tile_q8_##MR_##_##NB_(const int8_t *xq, int64_t ldq, const int32_t *corr,        \
                                      const float *row_scale, const uint8_t *w, int64_t groups,  \
                                      int64_t ps, const float *scales, const float *bias,        \
                                      float *y, int64_t ldy, int64_t ncols) {                    \
        enum { MR = MR_, NB = NB_ };                                                             \
        Q8_TILE_BODY(MR, NB)                                                                     \
    }

/* The same tile shapes and tables as the float tiles (rows_tiles.h). */
TILES(Q8_TILE)
static const q8_tile_fn Q8_TILE_MAIN[MR_MAX + 1] = MAIN_TABLE(tile_q8);
static const q8_tile_fn Q8_TILE_ONE[MR_MAX + 1] = ONE_TABLE(tile_q8);

#endif
