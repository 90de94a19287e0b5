/* AMX tiles, shared by the kernels that use them (quant_tiles.c, which owns the state,
 * and attention_tiles.c): defines AMX where the compiler targets a CPU with them. */
#ifndef PREDD_AMX_H
#define PREDD_AMX_H
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <stdint.h>
#define AMX 1

/* 1 where this process may use the tiles (the kernel granted them) and they are not
 * turned off (linear_bf16_tiles(0)), else 0 */
int amx_ready(void);
/* this thread's tiles: all eight 16 rows of 64 bytes */
void amx_configure(void);

/* dst[i * 16 + j] = src[j * stride + i] for 16 x 16 uint32 (j < n; 0 for j >= n): a
 * tile operand's pairs of bf16 from rows `stride` uint32 apart, transposed in registers
 * by four rounds of shuffles. Gathers, one per output row, cost ~3x as much on the
 * Sapphire Rapids this was measured on. dst is 64-byte aligned. */
static inline void amx_transpose16(uint32_t *dst, const uint32_t *src, int64_t stride,
                                   int64_t n)
{
    __m512i r[16], t[16];
    for (int j = 0; j < 16; j++)
        r[j] = _mm512_maskz_loadu_epi32(j < n ? 0xFFFF : 0, src + j * stride);
    for (int j = 0; j < 16; j += 2) {       /* per 128 bits: rows j, j + 1 paired */
        t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
        t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int j = 0; j < 16; j += 4) {       /* ... and four rows */
        r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
        r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
        r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
        r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    /* r[4g + c], 128-bit lane L: column 4L + c of rows 4g .. 4g + 3 */
    for (int c = 0; c < 4; c++) {
        const __m512i a0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);   /* L = 0, 2 */
        const __m512i a1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);   /* L = 1, 3 */
        const __m512i b0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        const __m512i b1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
        _mm512_store_si512(dst + c * 16, _mm512_shuffle_i32x4(a0, b0, 0x88));
        _mm512_store_si512(dst + (8 + c) * 16, _mm512_shuffle_i32x4(a0, b0, 0xDD));
        _mm512_store_si512(dst + (4 + c) * 16, _mm512_shuffle_i32x4(a1, b1, 0x88));
        _mm512_store_si512(dst + (12 + c) * 16, _mm512_shuffle_i32x4(a1, b1, 0xDD));
    }
}
#endif
#endif
