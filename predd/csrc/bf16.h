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
