/* A decoder layer's small ops in one pass each, float32, for predd/model.py on the CPU.
 *
 * torch runs each of them as several ops (RMSNorm as six, RoPE as seven), and at
 * decode's few rows a step every op costs more in dispatch than in arithmetic. Built
 * and loaded with paged_attention.c (predd/cpu_kernels.py); rows are split over
 * torch's OpenMP threads only when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>

#include "exp_approx.h"

#define PARALLEL_FLOATS 65536        /* below this many floats a row loop runs serially */

/* With delta: x += delta (the residual stream, in place). Then
 * out = x / sqrt(mean(x^2) + eps) * weight, row by row; x, delta, out [rows, n]. */
void add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out,
                      int64_t rows, int64_t n, float eps)
{
    #pragma omp parallel for if (rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n, *o = out + r * n;
        if (delta) {
            const float *dr = delta + r * n;
            #pragma omp simd
            for (int64_t i = 0; i < n; i++)
                xr[i] += dr[i];
        }
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t i = 0; i < n; i++)
            sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
        #pragma omp simd
        for (int64_t i = 0; i < n; i++)
            o[i] = xr[i] * inv * weight[i];
    }
}

/* Rotary embedding in place on the first `heads` heads of each row of x (row r at
 * x + r * stride, heads of d floats back to back): with c, s = cos[r], sin[r] ([rows,
 * d / 2] each), a head's halves (a, b) become (a c - b s, b c + a s). */
void rope_f32(float *x, int64_t stride, const float *cos, const float *sin,
              int64_t rows, int64_t heads, int64_t d)
{
    const int64_t half = d / 2;
    #pragma omp parallel for if (rows * heads * d >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + r * stride + h * d, *b = a + half;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float ai = a[i], bi = b[i];
                a[i] = ai * c[i] - bi * s[i];
                b[i] = bi * c[i] + ai * s[i];
            }
        }
    }
}

/* SwiGLU's product: out[r, i] = silu(gu[r, i]) * gu[r, n + i] for gu [rows, 2n]. */
void silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t n)
{
    #pragma omp parallel for if (rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++)
            o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}
