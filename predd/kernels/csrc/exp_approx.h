/* e^x in plain float operations, so that loops calling it vectorise (libm's expf does
 * not without -ffast-math): x = n ln2 + f with |f| <= ln2 / 2, e^f by its Taylor
 * polynomial to degree 7 (relative error ~1e-7), 2^n put into the exponent bits. x is
 * clamped to [-87, 88], where e^x stays a normal float (e^-87 ~ 1.6e-38 stands for 0). */
#ifndef PREDD_EXP_APPROX_H
#define PREDD_EXP_APPROX_H
#include <stdint.h>

static inline float exp_approx(float x)
{
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = x log2(e) rounded to an integer by adding and taking away 1.5 * 2^23 (not
     * roundf, which GCC leaves scalar on AVX-512 targets) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float f = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    union { float f; int32_t i; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* exp_approx on 16 lanes at once, written out (the compiler's own vectorising of the
 * loops that call exp_approx takes 8 lanes on AVX-512 machines) */
static inline __m512 exp_approx16(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 round = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), f);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i scale = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
/* exp_approx on 8 lanes at once, written out as exp_approx16 (AVX2 and FMA) */
static inline __m256 exp_approx8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 round = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), round), round);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), f);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif
#endif
