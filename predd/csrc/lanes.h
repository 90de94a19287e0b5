/* Horizontal sums of AVX-512 float32 vectors, many at a time. */
#ifndef PREDD_LANES_H
#define PREDD_LANES_H
#if defined(__AVX512F__)
#include <immintrin.h>

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
#endif
#endif
