/* A decoder layer's small ops in one pass each, float32 or bfloat16, for predd/model/llama.py
 * on the CPU.
 *
 * torch runs each of them as several ops (RMSNorm as six, RoPE as seven), and at
 * decode's few rows a step every op costs more in dispatch than in arithmetic. Built
 * and loaded with paged_attention.c (predd/kernels/cpu_kernels.py); rows are split over
 * torch's OpenMP threads only when there are enough of them to pay for it. In bfloat16
 * the arithmetic is float32 and results are rounded where torch's bf16 ops round
 * them (the residual sum, the normalised row before its weight, the output), or once
 * where torch would round its intermediate steps too (RoPE, SwiGLU's product).
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#include "bf16.h"
#include "exp_approx.h"

/* below this many floats (or at one row) a row loop runs serially: smaller loops do
 * not pay for the split. Down from 16,384, where an 8-call step's two norms, rope and
 * silu a layer were serial, the other thread waiting (measured: docs/kernels.md, "Row
 * loops split over threads from 1,024 floats") */
#define PARALLEL_FLOATS 1024
#define SPLIT(rows, values) ((rows) > 1 && (rows) * (values) >= PARALLEL_FLOATS)

/* The ops a row at a time, for one dtype each: `bf16` is a literal at every call, and
 * the calls sit inside the exported functions' parallel loops (OpenMP outlines a
 * parallel region before inlining, so a flag passed into one would stay a variable
 * there and keep its loops from vectorising). */

/* With delta: x += delta (the residual stream, in place). Then
 * out = x / sqrt(mean(x^2) + eps) * weight; x, delta, out rows of n values. */
static inline __attribute__((always_inline)) void add_rms_norm_row(
    const int bf16, void *x, const void *delta, const void *weight, void *out,
    int64_t at, int64_t n, float eps)
{
    if (delta) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++)
            store1(x, at + i, load1(x, at + i, bf16) + load1(delta, at + i, bf16), bf16);
    }
    float sum = 0.0f;
    #pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < n; i++) {
        const float v = load1(x, at + i, bf16);
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float v = load1(x, at + i, bf16) * inv;
        store1(out, at + i, (bf16 ? bf16_round(v) : v) * load1(weight, i, bf16), bf16);
    }
}

/* Rotary embedding in place on `heads` heads of d values back to back from x + at:
 * with c, s (d / 2 float32 each), a head's halves (a, b) become (a c - b s, b c + a s). */
static inline __attribute__((always_inline)) void rope_row(
    const int bf16, void *x, int64_t at, const float *c, const float *s, int64_t heads,
    int64_t d)
{
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t a = at + h * d, b = a + half;
        #pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float ai = load1(x, a + i, bf16), bi = load1(x, b + i, bf16);
            store1(x, a + i, ai * c[i] - bi * s[i], bf16);
            store1(x, b + i, bi * c[i] + ai * s[i], bf16);
        }
    }
}

/* SwiGLU's product: out[o + i] = silu(gu[g + i]) * gu[g + n + i], i < n; a float32
 * chunk at a time (the exponential vectorises only over plain floats). */
static inline __attribute__((always_inline)) void silu_mul_row(
    const int bf16, const void *gu, int64_t g, void *out, int64_t o, int64_t n)
{
    enum { CHUNK = 256 };
    float gate[CHUNK], up[CHUNK];
    for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
        const int64_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
        for (int64_t i = 0; i < m; i++) {
            gate[i] = load1(gu, g + i0 + i, bf16);
            up[i] = load1(gu, g + n + i0 + i, bf16);
        }
        #pragma omp simd
        for (int64_t i = 0; i < m; i++)
            gate[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
        for (int64_t i = 0; i < m; i++)
            store1(out, o + i0 + i, gate[i], bf16);
    }
}

#if defined(__AVX512BF16__)
/* The bfloat16 rows 16 values at a time where the CPU has AVX512_BF16 (the norm, RoPE
 * on heads whose halves are whole vectors, SwiGLU): the compiler's own vectorising of
 * the row loops above takes 8 lanes and spends six instructions on each rounding to
 * bf16 (three a value in add_rms_norm), where VCVTNEPS2BF16 is one: the norms, RoPE and
 * SwiGLU take less of a decode step (measured: docs/kernels.md, "bf16 norms, RoPE and
 * SwiGLU 16 lanes at a time").
 * The same roundings in the same places as above (the sum of squares in another
 * order, and where the compiler fused a multiply and an add is its choice there, so
 * float32's last bit may differ before a rounding). */
static inline __mmask16 lanes_left(int64_t left)
{
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

static inline __m512 widen16(const uint16_t *p, __mmask16 k)
{
    return bf16_widen16(_mm256_maskz_loadu_epi16(k, p));
}

static void add_rms_norm_row_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight,
                                  uint16_t *out, int64_t n, float eps)
{
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes_left(n - i);
        __m512 v = widen16(x + i, k);
        if (delta) {
            const __m256i r = bf16_narrow16(_mm512_add_ps(v, widen16(delta + i, k)));
            _mm256_mask_storeu_epi16(x + i, k, r);
            v = bf16_widen16(r);
        }
        sum = _mm512_add_ps(sum, _mm512_mul_ps(v, v));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes_left(n - i);
        const __m512 v = bf16_widen16(bf16_narrow16(_mm512_mul_ps(widen16(x + i, k), inv)));
        _mm256_mask_storeu_epi16(out + i, k,
                                 bf16_narrow16(_mm512_mul_ps(v, widen16(weight + i, k))));
    }
}

/* rope_row for bf16 heads of d values, d / 2 a multiple of 16 */
static void rope_row_bf16(uint16_t *x, const float *c, const float *s, int64_t heads,
                          int64_t d)
{
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *pa = x + h * d + i, *pb = pa + half;
            const __m512 a = widen16(pa, 0xFFFF), b = widen16(pb, 0xFFFF);
            _mm256_storeu_si256((__m256i *)pa, bf16_narrow16(
                _mm512_sub_ps(_mm512_mul_ps(a, cv), _mm512_mul_ps(b, sv))));
            _mm256_storeu_si256((__m256i *)pb, bf16_narrow16(
                _mm512_add_ps(_mm512_mul_ps(b, cv), _mm512_mul_ps(a, sv))));
        }
    }
}

static void silu_mul_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out,
                              int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes_left(n - i);
        const __m512 g = widen16(gate + i, k);
        const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 v = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                       widen16(up + i, k));
        _mm256_mask_storeu_epi16(out + i, k, bf16_narrow16(v));
    }
}
#endif

/* The exported ops: add_rms_norm on x, delta, out [rows, n]; rope on the first `heads`
 * heads of each row of x (row r at x + r * stride) with cos, sin [rows, d / 2];
 * silu_mul for gu [rows, 2n] -> out [rows, n]. Rows are split over the threads when
 * there are enough values to pay for it. */
void add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out,
                      int64_t rows, int64_t n, float eps)
{
    #pragma omp parallel for if (SPLIT(rows, n))
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(0, x, delta, weight, out, r * n, n, eps);
}

void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t n, float eps)
{
#if defined(__AVX512BF16__)
    #pragma omp parallel for if (SPLIT(rows, n))
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row_bf16(x + r * n, delta ? delta + r * n : 0, weight, out + r * n, n,
                              eps);
    return;
#endif
    #pragma omp parallel for if (SPLIT(rows, n))
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(1, x, delta, weight, out, r * n, n, eps);
}

void rope_f32(float *x, int64_t stride, const float *cos, const float *sin,
              int64_t rows, int64_t heads, int64_t d)
{
    #pragma omp parallel for if (SPLIT(rows, heads * d))
    for (int64_t r = 0; r < rows; r++)
        rope_row(0, x, r * stride, cos + r * d / 2, sin + r * d / 2, heads, d);
}

void rope_bf16(uint16_t *x, int64_t stride, const float *cos, const float *sin,
               int64_t rows, int64_t heads, int64_t d)
{
#if defined(__AVX512BF16__)
    if (d % 32 == 0) {
        #pragma omp parallel for if (SPLIT(rows, heads * d))
        for (int64_t r = 0; r < rows; r++)
            rope_row_bf16(x + r * stride, cos + r * d / 2, sin + r * d / 2, heads, d);
        return;
    }
#endif
    #pragma omp parallel for if (SPLIT(rows, heads * d))
    for (int64_t r = 0; r < rows; r++)
        rope_row(1, x, r * stride, cos + r * d / 2, sin + r * d / 2, heads, d);
}

void silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t n)
{
    #pragma omp parallel for if (SPLIT(rows, n))
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(0, gu, r * 2 * n, out, r * n, n);
}

void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t n)
{
#if defined(__AVX512BF16__)
    #pragma omp parallel for if (SPLIT(rows, n))
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row_bf16(gu + r * 2 * n, gu + r * 2 * n + n, out + r * n, n);
    return;
#endif
    #pragma omp parallel for if (SPLIT(rows, n))
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(1, gu, r * 2 * n, out, r * n, n);
}
