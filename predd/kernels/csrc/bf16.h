/* Values of a float32 or a bfloat16 tensor, as float32: `bf16` is a constant where the
 * caller is inlined, so each variant compiles without the test. A bfloat16 is a
 * float32's top 16 bits; storing one rounds to nearest even, as torch rounds. */
#ifndef PREDD_BF16_H
#define PREDD_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_widen(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_narrow(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    /* round to nearest even; a NaN stays NaN (quietened). A select, not a branch, so
     * that loops storing bf16 vectorise. */
    const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
    const uint32_t quiet = u | 0x00400000u;
    return (uint16_t)(((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded) >> 16);
}

/* f as the nearest bfloat16 would hold it */
static inline float bf16_round(float f)
{
    return bf16_widen(bf16_narrow(f));
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* bf16_widen on 16 lanes */
static inline __m512 bf16_widen16(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The 32 bf16 at p widened by halves of their 32-bit pairs, one operation each and no
 * shuffle: *even = values 0, 2, .., 30, *odd = values 1, 3, .., 31 (as float32). A sum
 * kept in this order is put back in value order by bf16_pairs_order. */
static inline void bf16_widen_pairs(const uint16_t *p, __m512 *even, __m512 *odd)
{
    const __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)));
}

/* 32 float32 at f from value order to bf16_widen_pairs' (`to_pairs`) or back */
static inline void bf16_pairs_order(float *f, const int to_pairs)
{
    const __m512 a = _mm512_loadu_ps(f), b = _mm512_loadu_ps(f + 16);
    if (to_pairs) {
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10,
                                              8, 6, 4, 2, 0);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        _mm512_storeu_ps(f, _mm512_permutex2var_ps(a, even, b));
        _mm512_storeu_ps(f + 16, _mm512_permutex2var_ps(a, odd, b));
    } else {
        const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                            1, 16, 0);
        const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
        _mm512_storeu_ps(f, _mm512_permutex2var_ps(a, lo, b));
        _mm512_storeu_ps(f + 16, _mm512_permutex2var_ps(a, hi, b));
    }
}
#endif

#if defined(__AVX512BF16__)
/* bf16_narrow on 16 lanes: VCVTNEPS2BF16 rounds to nearest even and quietens NaNs as
 * bf16_narrow does, but reads float32 denormals as 0; a vector holding one (never in
 * practice) takes bf16_narrow lane by lane */
static inline __m256i bf16_narrow16(__m512 v)
{
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) != 0, 0)) {
        float f[16];
        uint16_t h[16];
        _mm512_storeu_ps(f, v);
        for (int i = 0; i < 16; i++)
            h[i] = bf16_narrow(f[i]);
        return _mm256_loadu_si256((const __m256i *)h);
    }
    return (__m256i)_mm512_cvtneps_pbh(v);
}
#endif

static inline float load1(const void *p, int64_t i, const int bf16)
{
    return bf16 ? bf16_widen(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float f, const int bf16)
{
    if (bf16)
        ((uint16_t *)p)[i] = bf16_narrow(f);
    else
        ((float *)p)[i] = f;
}
#endif
