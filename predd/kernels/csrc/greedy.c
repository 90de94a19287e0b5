/* The greedy pick of a step's generates: each float32 logits row's argmax (the first
 * where several tie, as torch.argmax) and its logprob, -log(sum_i e^(x_i - max)), in
 * two passes over the row and no copy. torch needs a concatenation of the rows, a
 * log-softmax written out in full and an argmax (measured: docs/kernels.md, "Greedy
 * pick without a log-softmax"); this reads each row twice. The sum is in double: the
 * logprob is within ~2e-7 of the exact value (e^x's own error), where torch's float32
 * log_softmax is within ~2e-6.
 *
 * Built and loaded with paged_attention.c (predd/kernels/cpu_kernels.py); rows are split over
 * torch's OpenMP threads. A row whose max or sum is not finite (a NaN, or every logit
 * -inf) gets token -1: the caller picks it its own way.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#include "exp_approx.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* The row's max (*most), the first index holding it (*at), and the sum of e^(x_i - max)
 * in double (NaN where the row has a NaN), 16 lanes at a time: the loops below (a
 * double sum of float terms) vectorise poorly. Each term is added in double as there,
 * in another order (measured: docs/kernels.md, "Greedy pick without a log-softmax"). */
static double sum_exp16(const float *x, int64_t n, float *most, int64_t *at)
{
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;                  /* VMAXPS and exp_approx16's clamp drop NaN */
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
    }
    float m = _mm512_reduce_max_ps(best);
    for (; i < n; i++)
        m = x[i] > m ? x[i] : m;       /* a NaN here reaches the sum below */
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const __mmask16 hit = _mm512_cmpeq_ps_mask(_mm512_loadu_ps(x + t), _mm512_set1_ps(m));
        if (hit) {
            t += __builtin_ctz(hit);
            break;
        }
    }
    while (t < n && x[t] != m)
        t++;
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    const __m512 mv = _mm512_set1_ps(m);
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
            _mm512_castps_pd(e), 1))));
    }
    double sum = nan ? NAN : _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
    for (; i < n; i++)
        sum += (double)exp_approx(x[i] - m);
    *most = m;
    *at = t;
    return sum;
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

static inline float max8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* sum_exp16 on 8 lanes (AVX2 and FMA): the same results but for the order of the sum */
static double sum_exp8(const float *x, int64_t n, float *most, int64_t *at)
{
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_max_ps(best, v);
    }
    float m = max8(best);
    for (; i < n; i++)
        m = x[i] > m ? x[i] : m;       /* a NaN here reaches the sum below */
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + t),
                                                         _mm256_set1_ps(m), _CMP_EQ_OQ));
        if (hit) {
            t += __builtin_ctz((unsigned)hit);
            break;
        }
    }
    while (t < n && x[t] != m)
        t++;
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    const __m256 mv = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    const __m256d s = _mm256_add_pd(lo, hi);
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    double sum = _mm256_movemask_ps(nan) ? NAN : _mm_cvtsd_f64(h) + _mm_cvtsd_f64(
        _mm_unpackhi_pd(h, h));
    for (; i < n; i++)
        sum += (double)exp_approx(x[i] - m);
    *most = m;
    *at = t;
    return sum;
}
#endif

static void pick_row(const float *x, int64_t n, int64_t *token, float *logprob)
{
    float m;
    int64_t t;
    double sum;
#if defined(__AVX512F__)
    sum = sum_exp16(x, n, &m, &t);
#elif defined(__AVX2__) && defined(__FMA__)
    sum = sum_exp8(x, n, &m, &t);
#else
    m = -INFINITY;
    #pragma omp simd reduction(max:m)
    for (int64_t i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    t = 0;
    while (t < n && x[t] != m)
        t++;
    sum = 0.0;
    #pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < n; i++)
        sum += (double)exp_approx(x[i] - m);
#endif
    if (!isfinite(m) || !isfinite(sum) || t == n) {
        *token = -1;
        *logprob = NAN;
        return;
    }
    *token = t;
    *logprob = (float)-log(sum);
}

/* rows: the addresses of n rows of v contiguous float32 logits each; tokens, logprobs:
 * n results */
void greedy_pick_f32(const int64_t *rows, int64_t n, int64_t v, int64_t *tokens,
                     float *logprobs)
{
    #pragma omp parallel for schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++)
        pick_row((const float *)(intptr_t)rows[r], v, tokens + r, logprobs + r);
}
