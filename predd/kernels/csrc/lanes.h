/* Horizontal sums of AVX-512 float32 vectors, many at a time. */
#ifndef PREDD_LANES_H
#define PREDD_LANES_H
#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

/* lane i: the sum of v[i]'s 16 lanes (a transpose by halves: 15 adds, not 16 reduces) */
static inline __m512 sum_lanes16(const __m512 v[16])
{
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)      /* a[i]: v[2i]'s halves summed, then v[2i + 1]'s */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)      /* b[i], 128-bit block k: 4 sums of v[4i + k] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)      /* c[i], block k: 2 of v[8i + k], 2 of v[8i + 4 + k] */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    /* block k, lane j: v[k + 4j] */
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                   _mm512_shuffle_ps(c[0], c[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1,
                                           12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, d);
}

/* dst[i * 16 + j] = src[j * stride + i] for 16 x 16 uint32 (j < n; 0 for j >= n): a
 * tile operand's pairs of bf16 from rows `stride` uint32 apart, transposed in registers
 * by four rounds of shuffles, which cost less than gathers, one per output row
 * (measured: docs/kernels.md, "Tile operands transposed in registers"). dst is 64-byte
 * aligned. */
static inline void transpose16_u32(uint32_t *dst, const uint32_t *src, int64_t stride,
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
