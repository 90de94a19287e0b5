/* The picks of a step's tokens from float32 logits rows, in place, no copy and nothing
 * allocated. The greedy pick: each row's argmax (the first where several tie, as
 * torch.argmax) and its logprob, -log(sum_i e^(x_i - max)), in two passes over the row.
 * The sampled pick (sample_pick_f32, below): a token drawn at a temperature by the
 * inverse of the row's cumulative distribution at one uniform draw. torch needs a concatenation of the rows, a
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

/* The row's max (*most), the first index holding it (*at), the sum of e^(x_i - max) */
static void pick_row_sums(const float *x, int64_t n, float *most, int64_t *at, double *total)
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
    *most = m;
    *at = t;
    *total = sum;
}

/* pick_row_sums, and whether the row is a distribution; where it is not (a NaN, or no
 * finite logit), token -1 and logprob NaN are its results */
static int row_sums(const float *x, int64_t n, float *m, int64_t *t, double *sum,
                    int64_t *token, float *logprob)
{
    pick_row_sums(x, n, m, t, sum);
    if (isfinite(*m) && isfinite(*sum) && *t != n)
        return 1;
    *token = -1;
    *logprob = NAN;
    return 0;
}

static void pick_row(const float *x, int64_t n, int64_t *token, float *logprob)
{
    float m;
    int64_t t;
    double sum;
    if (!row_sums(x, n, &m, &t, &sum, token, logprob))
        return;
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

/* ---- the sampled pick
 *
 * A row's weights at temperature T are w_i = e^((x_i - max) / T), with no weight where
 * that exponent is below -87 (e^-87 ~ 1.6e-38; a masked -inf logit is one). They are
 * summed in blocks of LANES, each block's float sum added to a double in order; the draw
 * u in [0, 1) picks the token where the running sum first passes u * total: the walk
 * adds the same block sums in the same order, so it meets the total, and inside the
 * block that passes it the weights are added one by one. Where rounding leaves the
 * walk short of the target, the last token with a weight is taken. The logprob is at
 * temperature 1, as the greedy pick's. Three passes and a half over a row. */

#if defined(__AVX512F__)
#define LANES 16
static inline float block_weights(const float *x, float m, float inv)
{
    const __m512 z = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x), _mm512_set1_ps(m)),
                                   _mm512_set1_ps(inv));
    const __mmask16 live = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_reduce_add_ps(_mm512_maskz_mov_ps(live, exp_approx16(z)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
static inline float block_weights(const float *x, float m, float inv)
{
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_set1_ps(m)),
                                   _mm256_set1_ps(inv));
    const __m256 live = _mm256_cmp_ps(z, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m256 e = _mm256_and_ps(live, exp_approx8(z));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#else
#define LANES 1
static inline float block_weights(const float *x, float m, float inv)
{
    const float z = (x[0] - m) * inv;
    return z >= -87.0f ? exp_approx(z) : 0.0f;
}
#endif

static inline float weight(float x, float m, float inv)
{
    const float z = (x - m) * inv;
    return z >= -87.0f ? exp_approx(z) : 0.0f;
}

static void sample_row(const float *x, int64_t n, float inv, double u, int64_t *token,
                       float *logprob)
{
    float m;
    int64_t t;
    double sum;
    if (!row_sums(x, n, &m, &t, &sum, token, logprob))
        return;
    const int64_t full = n - n % LANES;
    double total = 0.0;
    for (int64_t i = 0; i < full; i += LANES)
        total += (double)block_weights(x + i, m, inv);
    for (int64_t i = full; i < n; i++)
        total += (double)weight(x[i], m, inv);
    const double target = u * total;
    double run = 0.0;
    int64_t pick = -1;
    for (int64_t i = 0; i < full; i += LANES) {
        const double block = (double)block_weights(x + i, m, inv);
        if (run + block <= target) {
            run += block;
            continue;
        }
        int64_t live = -1;               /* the block that passes the target, one by one */
        for (int64_t j = i; j < i + LANES; j++) {
            const float w = weight(x[j], m, inv);
            if (w > 0.0f) {
                live = j;
                run += (double)w;
                if (run > target) {
                    pick = j;
                    break;
                }
            }
        }
        if (pick < 0)
            pick = live;                 /* short by rounding: its last token with a weight */
        break;
    }
    for (int64_t i = full; i < n && pick < 0; i++) {
        const float w = weight(x[i], m, inv);
        run += (double)w;
        if (w > 0.0f && run > target)
            pick = i;
    }
    for (int64_t i = n - 1; i >= 0 && pick < 0; i--)   /* never passed: the last with one */
        if (weight(x[i], m, inv) > 0.0f)
            pick = i;
    if (pick < 0) {                  /* no weight at all (not at a temperature > 0) */
        *token = -1;
        *logprob = NAN;
        return;
    }
    *token = pick;
    *logprob = (float)((double)(x[pick] - m) - log(sum));
}

/* rows: the addresses of n rows of v contiguous float32 logits each; temps: each row's
 * temperature (> 0); draws: each row's uniform draw in [0, 1); tokens, logprobs: n
 * results, token -1 where the row is no distribution (a NaN, nothing finite) */
void sample_pick_f32(const int64_t *rows, int64_t n, int64_t v, const double *temps,
                     const double *draws, int64_t *tokens, float *logprobs)
{
    #pragma omp parallel for schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++)
        sample_row((const float *)(intptr_t)rows[r], v, (float)(1.0 / temps[r]), draws[r],
                   tokens + r, logprobs + r);
}
