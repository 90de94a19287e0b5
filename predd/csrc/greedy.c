/* The greedy pick of a step's generates: each float32 logits row's argmax (the first
 * where several tie, as torch.argmax) and its logprob, -log(sum_i e^(x_i - max)), in
 * two passes over the row and no copy. torch needs a concatenation of the rows, a
 * log-softmax written out in full and an argmax (~6 ms a step for 64 rows of 49,152 on
 * two cores); this reads each row twice. The sum is in double: the logprob is within
 * ~2e-7 of the exact value (e^x's own error), where torch's float32 log_softmax is
 * within ~2e-6.
 *
 * Built and loaded with paged_attention.c (predd/cpu_kernels.py); rows are split over
 * torch's OpenMP threads. A row whose max or sum is not finite (a NaN, or every logit
 * -inf) gets token -1: the caller picks it its own way.
 */
#include <math.h>
#include <stdint.h>

#include "exp_approx.h"

static void pick_row(const float *x, int64_t n, int64_t *token, float *logprob)
{
    float m = -INFINITY;
    #pragma omp simd reduction(max:m)
    for (int64_t i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    int64_t t = 0;
    while (t < n && x[t] != m)
        t++;
    double sum = 0.0;
    #pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < n; i++)
        sum += (double)exp_approx(x[i] - m);
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
