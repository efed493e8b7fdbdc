/*
 * The tiles of rows_quant.c: int8 activations times grouped 8- or 4-bit weights, the products of
 * each block summed exactly in int32 and the blocks' sums scaled and added in float32.
 *
 * Weights (`QuantizedWeight`'s q, zeros and scales, repacked by engine/kernels/quant_rows.py):
 * per output column c and input group g of `gs` columns, W'[c, i] = s[c, g] * (q[c, i] - z[c, g]).
 * q is stored unsigned, u = q + QG_OFFSET(bits) (128 for 8 bits, 8 for 4 bits), in panels of
 * PANEL = 16 columns:
 *   8 bits: [ceil(n / 16)][k / 4][16][4], byte (t, c, e) = u[c][4t + e] (rows_q8.h's layout);
 *   4 bits: [ceil(n / 16)][k / 8][16][4], byte (b, c, e) = u[c][8b + e] | u[c][8b + 4 + e] << 4;
 * scales float32 [ceil(n / 16)][k / gs][16] and zeros (NULL: all 0) int8 [ceil(n / 16)][k / gs]
 * [16], padding columns 0. gs is a multiple of 4 (8 bits) or 8 (4 bits).
 *
 * Activations: each row quantised to q_x int8 [m][k] in activation groups, each with its scale
 * (rows_quant.c). The product runs over blocks of bs columns, each inside one weight group g
 * (block b: g = b / wr) and one activation group, with xsum[i][b] = sum of q_x over block b and
 * xscale[i][b] its activation group's scale. A tile sums d = sum_{k in b} u * q_x exactly (|d| <=
 * 255 * 127 * bs), so that d - (QG_OFFSET + z) * xsum = sum_{k in b} (q - z) * q_x, and writes
 * y[i][c] = sum_b s[c, g] * xscale[i][b] * (that) (+ bias[c]), the blocks added in order.
 *
 * Three bodies, chosen at compile time: AVX-512 VNNI (vpdpbusd, the activations broadcast from
 * memory), AVX2 (vpmaddwd on bytes widened to 16 bits, a row at a time) and portable C. Their
 * integer sums are the same; floats may differ in the last bits (fused multiply-adds). Included
 * once, by rows_quant.c, after rows_tiles.h.
 */
#ifndef SPECSERVE_ROWS_QG_H
#define SPECSERVE_ROWS_QG_H

#include <stdint.h>
#include <string.h>

#define QG_OFFSET(bits) ((bits) == 8 ? 128 : 8)

/* One tile: MR rows of q_x (row stride ldq; xsum and xscale row stride ldg) times NB panels
 * from `w` (panel j at w + j * ps bytes, its scales at scales + j * ss, zeros at zeros + j * ss),
 * in `blocks` blocks of `bs` columns, `wr` blocks a weight group, written to y[MR][ncols] (row
 * stride ldy). */
typedef void (*qg_tile_fn)(const int8_t *xq, int64_t ldq, const int32_t *xsum,
                           const float *xscale, int64_t ldg, const uint8_t *w, int64_t ps,
                           const float *scales, const int8_t *zeros, int64_t ss, int64_t bs,
                           int64_t blocks, int64_t wr, const float *bias, float *y, int64_t ldy,
                           int64_t ncols);

#if defined(ROWS_AVX512) && defined(__AVX512VNNI__)
#define QG_ISA "avx512-vnni"
#define QG_MR_MAX 16

/* acc + the unsigned bytes of w times the signed bytes of *x (four, broadcast to every lane), in
 * one instruction whose memory operand is broadcast. */
static inline __attribute__((always_inline)) __m512i dpbusd_bcast(const int8_t *x, __m512i w,
                                                                  __m512i acc) {
    __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*x));
    return acc;
}

/* Tiles of up to QG_PREFETCH_MR rows, which stream their weights faster than they use them, ask
 * for each panel's bytes QG_PREFETCH ahead of the loads. */
#define QG_PREFETCH 1024
#define QG_PREFETCH_MR 4
/* The k steps of block b into acc[MR][NB]. */
#define QG_GROUP_8(MR, NB) \
    for (int64_t t = b * bs / 4; t < (b + 1) * bs / 4; t++) { \
        __m512i wv[NB]; \
_Pragma("GCC unroll 8") \
        for (int j = 0; j < NB; j++) { \
            if (MR <= QG_PREFETCH_MR) \
                _mm_prefetch((const char *)(w + j * ps + t * 64 + QG_PREFETCH), _MM_HINT_T0); \
            wv[j] = _mm512_loadu_si512((const void *)(w + j * ps + t * 64)); \
        } \
_Pragma("GCC unroll 16") \
        for (int i = 0; i < MR; i++) { \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) \
                acc[i][j] = dpbusd_bcast(xq + i * ldq + 4 * t, wv[j], acc[i][j]); \
        } \
    }
#define QG_GROUP_4(MR, NB) \
    for (int64_t h = b * bs / 8; h < (b + 1) * bs / 8; h++) { \
        __m512i lo[NB], hi[NB]; \
_Pragma("GCC unroll 8") \
        for (int j = 0; j < NB; j++) { \
            if (MR <= QG_PREFETCH_MR) \
                _mm_prefetch((const char *)(w + j * ps + h * 64 + QG_PREFETCH), _MM_HINT_T0); \
            const __m512i v = _mm512_loadu_si512((const void *)(w + j * ps + h * 64)); \
            lo[j] = _mm512_and_si512(v, nibble); \
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble); \
        } \
_Pragma("GCC unroll 16") \
        for (int i = 0; i < MR; i++) { \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) { \
                acc[i][j] = dpbusd_bcast(xq + i * ldq + 8 * h, lo[j], acc[i][j]); \
                acc[i][j] = dpbusd_bcast(xq + i * ldq + 8 * h + 4, hi[j], acc[i][j]); \
            } \
        } \
    }
/* One path of the tile, ONE (one weight group, wr == blocks) and ZEROS (zeros != NULL) known at
 * compile time. Each block's sums start at -QG_OFFSET * xsum, so that they end as d - QG_OFFSET *
 * xsum; the zero term z * xsum is subtracted in float (exact: integers below 2^24). The block's
 * sums times its activation scale are added up: with one weight group its scales multiply the
 * total once at the end, with several they multiply each block's sums. */
#define QG_TILE_PATH(MR, NB, BITS, ONE, ZEROS) \
    __m512 facc[MR][NB], s[NB], zf[NB]; \
_Pragma("GCC unroll 16") \
    for (int i = 0; i < MR; i++) { \
_Pragma("GCC unroll 8") \
        for (int j = 0; j < NB; j++) facc[i][j] = _mm512_setzero_ps(); \
    } \
    for (int64_t b = 0, g = 0, in_group = wr; b < blocks; b++) { \
        if (in_group == wr) { /* block b starts weight group g = b / wr */ \
            if (b) g++; \
            in_group = 0; \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) { \
                s[j] = _mm512_loadu_ps(scales + j * ss + g * PANEL); \
                if (ZEROS) \
                    zf[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32( \
                        _mm_loadu_si128((const __m128i *)(zeros + j * ss + g * PANEL)))); \
            } \
        } \
        in_group++; \
        __m512i acc[MR][NB]; \
_Pragma("GCC unroll 16") \
        for (int i = 0; i < MR; i++) { \
            const __m512i start = _mm512_set1_epi32(-QG_OFFSET(BITS) * xsum[i * ldg + b]); \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) acc[i][j] = start; \
        } \
        if (BITS == 8) { \
            QG_GROUP_8(MR, NB) \
        } else { \
            QG_GROUP_4(MR, NB) \
        } \
_Pragma("GCC unroll 16") \
        for (int i = 0; i < MR; i++) { \
            const __m512 sx = _mm512_set1_ps(xscale[i * ldg + b]); \
            const __m512 xf = _mm512_set1_ps(ZEROS ? (float)xsum[i * ldg + b] : 0.0f); \
            (void)xf; \
_Pragma("GCC unroll 8") \
            for (int j = 0; j < NB; j++) { \
                __m512 d = _mm512_cvtepi32_ps(acc[i][j]); \
                if (ZEROS) d = _mm512_fnmadd_ps(zf[j], xf, d); \
                if (!ONE) d = _mm512_mul_ps(d, s[j]); \
                facc[i][j] = _mm512_fmadd_ps(d, sx, facc[i][j]); \
            } \
        } \
    } \
_Pragma("GCC unroll 8") \
    for (int j = 0; j < NB; j++) { \
        const int64_t left = ncols - j * PANEL; \
        if (left <= 0) break; \
        const __mmask16 mask = panel_mask(left); \
_Pragma("GCC unroll 16") \
        for (int i = 0; i < MR; i++) { \
            __m512 v = ONE ? _mm512_mul_ps(facc[i][j], s[j]) : facc[i][j]; \
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j * PANEL)); \
            _mm512_mask_storeu_ps(y + i * ldy + j * PANEL, mask, v); \
        } \
    }
#define QG_TILE_BODY(MR, NB, BITS) \
    const __m512i nibble = _mm512_set1_epi8(0x0F); \
    (void)nibble; \
    if (zeros) { \
        QG_TILE_PATH(MR, NB, BITS, 0, 1) \
    } else if (wr == blocks) { \
        QG_TILE_PATH(MR, NB, BITS, 1, 0) \
    } else { \
        QG_TILE_PATH(MR, NB, BITS, 0, 0) \
    }

/* Panels per tile for each row count (registers: 2 * MR * NB accumulators). */
#define QG_TILES(T, BITS)                                                                         \
    T(1, 4, BITS) T(2, 4, BITS) T(3, 2, BITS) T(4, 2, BITS) T(5, 2, BITS) T(6, 2, BITS)             \
    T(7, 1, BITS) T(8, 1, BITS) T(9, 1, BITS) T(10, 1, BITS) T(11, 1, BITS) T(12, 1, BITS)          \
    T(13, 1, BITS) T(14, 1, BITS) T(15, 1, BITS) T(16, 1, BITS) T(1, 1, BITS) T(2, 1, BITS)         \
    T(3, 1, BITS) T(4, 1, BITS) T(5, 1, BITS) T(6, 1, BITS)
static const int QG_TILE_NB[QG_MR_MAX + 1] = {0, 4, 4, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
#define QG_MAIN_TABLE(P, B)                                                                       \
    {0, P##_1_4_##B, P##_2_4_##B, P##_3_2_##B, P##_4_2_##B, P##_5_2_##B, P##_6_2_##B, P##_7_1_##B,  \
     P##_8_1_##B, P##_9_1_##B, P##_10_1_##B, P##_11_1_##B, P##_12_1_##B, P##_13_1_##B,             \
     P##_14_1_##B, P##_15_1_##B, P##_16_1_##B}
#define QG_ONE_TABLE(P, B)                                                                        \
    {0, P##_1_1_##B, P##_2_1_##B, P##_3_1_##B, P##_4_1_##B, P##_5_1_##B, P##_6_1_##B,             \
     P##_7_1_##B, P##_8_1_##B, P##_9_1_##B, P##_10_1_##B, P##_11_1_##B, P##_12_1_##B,             \
     P##_13_1_##B, P##_14_1_##B, P##_15_1_##B, P##_16_1_##B}

#else
#define QG_MR_MAX 4
#define QG_TILES(T, BITS) T(1, 1, BITS) T(2, 1, BITS) T(3, 1, BITS) T(4, 1, BITS)
static const int QG_TILE_NB[QG_MR_MAX + 1] = {0, 1, 1, 1, 1};
#define QG_MAIN_TABLE(P, B) {0, P##_1_1_##B, P##_2_1_##B, P##_3_1_##B, P##_4_1_##B}
#define QG_ONE_TABLE(P, B) QG_MAIN_TABLE(P, B)

/* The sums d [PANEL] of one row's block b (of bs columns) of one panel. */
#if defined(ROWS_AVX512) || defined(ROWS_AVX2)
#define QG_ISA "avx2"
/* Four accumulators of four columns each, lanes (column, k steps 0-1) and (column, k steps
 * 2-3) side by side (vpmaddwd), added pairwise at the end (as rows_q8.h). */
static inline void qg_group(const int8_t *xq, const uint8_t *w, int64_t b, int64_t bs, int bits,
                            int32_t *d) {
    __m256i a[4];
    for (int s = 0; s < 4; s++) a[s] = _mm256_setzero_si256();
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (int64_t t = b * bs / 4; t < (b + 1) * bs / 4; t++) {
        int32_t quad;
        memcpy(&quad, xq + 4 * t, sizeof quad);
        const __m256i xb = _mm256_broadcastq_epi64(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(quad)));
        for (int s = 0; s < 4; s++) {
            __m256i wv;
            if (bits == 8) {
                wv = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + t * 64 + 16 * s)));
            } else { /* quad t is the low (t even) or high nibbles of block t / 2 */
                const __m128i v = _mm_loadu_si128((const __m128i *)(w + t / 2 * 64 + 16 * s));
                const __m128i u = t % 2 ? _mm_and_si128(_mm_srli_epi16(v, 4), nibble)
                                        : _mm_and_si128(v, nibble);
                wv = _mm256_cvtepu8_epi16(u);
            }
            a[s] = _mm256_add_epi32(a[s], _mm256_madd_epi16(wv, xb));
        }
    }
    for (int h = 0; h < 2; h++) { /* columns 8h .. 8h + 7 */
        const __m256i sums =
            _mm256_permute4x64_epi64(_mm256_hadd_epi32(a[2 * h], a[2 * h + 1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(d + 8 * h), sums);
    }
}
#else
#define QG_ISA "scalar"
static inline void qg_group(const int8_t *xq, const uint8_t *w, int64_t b, int64_t bs, int bits,
                            int32_t *d) {
    memset(d, 0, PANEL * sizeof(int32_t));
    for (int64_t kk = b * bs; kk < (b + 1) * bs; kk++) {
        const int32_t xv = xq[kk];
        for (int c = 0; c < PANEL; c++) {
            int32_t u;
            if (bits == 8) {
                u = w[kk / 4 * 64 + c * 4 + kk % 4];
            } else {
                const uint8_t byte = w[kk / 8 * 64 + c * 4 + kk % 4];
                u = kk % 8 < 4 ? byte & 0x0F : byte >> 4;
            }
            d[c] += u * xv;
        }
    }
}
#endif

/* A row at a time, a panel at a time: each block's exact sums, then scaled into float sums. */
#define QG_TILE_BODY(MR, NB, BITS) \
    for (int j = 0; j < NB; j++) { \
        const int64_t left = ncols - j * PANEL; \
        if (left <= 0) break; \
        for (int i = 0; i < MR; i++) { \
            float facc[PANEL] = {0}; \
            for (int64_t b = 0; b < blocks; b++) { \
                int32_t d[PANEL]; \
                qg_group(xq + i * ldq, w + j * ps, b, bs, BITS, d); \
                const int32_t xs = xsum[i * ldg + b]; \
                const float sx = xscale[i * ldg + b]; \
                const float *s = scales + j * ss + b / wr * PANEL; \
                const int8_t *z = zeros ? zeros + j * ss + b / wr * PANEL : 0; \
                for (int c = 0; c < PANEL; c++) { \
                    const int32_t zo = QG_OFFSET(BITS) + (z ? z[c] : 0); \
                    facc[c] += (float)(d[c] - zo * xs) * (s[c] * sx); \
                } \
            } \
            const int64_t cols = left < PANEL ? left : PANEL; \
            for (int64_t c = 0; c < cols; c++) { \
                const float v = facc[c]; \
                y[i * ldy + j * PANEL + c] = bias ? v + bias[j * PANEL + c] : v; \
            } \
        } \
    }
#endif

#define QG_TILE(MR_, NB_, BITS_)                                                                  \
    static void tile_qg_##MR_##_##NB_##_##BITS_(                                                  \
        const int8_t *xq, int64_t ldq, const int32_t *xsum, const float *xscale, int64_t ldg,      \
        const uint8_t *w, int64_t ps, const float *scales, const int8_t *zeros, int64_t ss,        \
        int64_t bs, int64_t blocks, int64_t wr, const float *bias, float *y, int64_t ldy,          \
        int64_t ncols) {                                                                           \
        enum { MR = MR_, NB = NB_, BITS = BITS_ };                                                 \
        QG_TILE_BODY(MR, NB, BITS)                                                                 \
    }

QG_TILES(QG_TILE, 8)
QG_TILES(QG_TILE, 4)
static const qg_tile_fn QG_MAIN_8[QG_MR_MAX + 1] = QG_MAIN_TABLE(tile_qg, 8);
static const qg_tile_fn QG_ONE_8[QG_MR_MAX + 1] = QG_ONE_TABLE(tile_qg, 8);
static const qg_tile_fn QG_MAIN_4[QG_MR_MAX + 1] = QG_MAIN_TABLE(tile_qg, 4);
static const qg_tile_fn QG_ONE_4[QG_MR_MAX + 1] = QG_ONE_TABLE(tile_qg, 4);

#endif
