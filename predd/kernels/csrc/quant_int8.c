/* Projections by int8 dot products, float32 rows in and out: the arithmetic llama.cpp
 * uses for a quantised checkpoint on a CPU.
 *
 * quant_linear.c makes every weight the exact float32 the loader's dequantisation gives
 * and multiplies it by x in float32: on a CPU without AVX-512 that unpacking (a
 * conversion, a multiply and an add a weight) is the cost, not the memory. Here each
 * row of x is first quantised per block of 32 to int8 with a float32 scale (dx =
 * max |x| / 127, qx = x / dx rounded to nearest even), each block's 32 products of a
 * weight row are summed exactly in integers (VPMADDUBSW + VPMADDWD on AVX2, VPDPBUSD
 * where the CPU has AVX-VNNI: the same integers), and the sum is scaled once:
 *   Q4_1 (w = d q + m):  d dx sum(q qx) + m dx sum(qx)
 *   Q8_0 (w = d q):      d dx sum(q qx)
 * The result differs from the exact product by x's quantisation (~0.4% of a block's
 * largest value a row), as llama.cpp's does. A row's bits depend on that row alone (not
 * on the others of the call, the thread count or the pass), and the portable build
 * below sums in the same lanes and order, so it gives the same bits.
 *
 * Each thread takes its weight rows two at a time from memory, once a call, and runs
 * every 4 rows of x in turn over them from L1 (8 sums in registers), so many rows read
 * the weight once (measured: docs/kernels.md, "int8 kernels at every row count").
 *
 * Layout as quant_linear.c reads it (predd.model.loader.QuantBlocks, by rows), but for
 * the scales: q [N, K / 32, 16] bytes for Q4_1 (byte j: weight j in its low nibble, j + 16
 * in its high one), [N, K / 32, 32] int8 for Q8_0; d and m [N, K / 32] IEEE half floats,
 * as the GGUF stores them: 20 bytes a Q4_1 block and 34 a Q8_0 one, as llama.cpp reads
 * them, where float32 scales made them 24 and 36. A thread widens the scales of the
 * weight rows it takes into a buffer on its stack, which the blocks' loop reads from L1
 * (measured: docs/kernels.md, "Half-float scales in the int8 kernels"); widened they are
 * the loader's float32 scales exactly, so the sums are the same bits. x [M, K], y [M, N]
 * float32 contiguous; K a multiple of 32.
 */
#pragma GCC optimize("fp-contract=off")   /* every multiply-add below is written as one */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include <stdlib.h>

#include "quant_blocks.h"

#define WIDE 2                   /* weight rows multiplied at once */
#define SHORT 4                  /* by this many rows of x at most (8 sums in registers) */
#define Q8_ALONE 4               /* Q8_0 weight rows one at a time up to this many rows of x
                                    (measured: docs/kernels.md, "int8 kernels at every row
                                    count") */

/* A block of a row of x, quantised: its 32 int8 and its scale */
struct xblock {
    int8_t q[BLOCK];
    float d;
};

/* Row r of x, block b: xq[r * blocks + b], and its scale times the sum of its q at
 * xs[r * padded + b] (padded: blocks rounded up to a multiple of 8, the rest zeros) */
static void quantize_rows(const float *x, int64_t M, int64_t K, struct xblock *xq, float *xs)
{
    const int64_t blocks = K / BLOCK, padded = (blocks + 7) & ~(int64_t)7;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < padded; b++) {
            if (b >= blocks) {
                xs[r * padded + b] = 0.0f;
                continue;
            }
            const float *v = x + r * K + b * BLOCK;
            struct xblock *o = xq + r * blocks + b;
            float amax = 0.0f;
            for (int j = 0; j < BLOCK; j++) {
                const float a = fabsf(v[j]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int j = 0; j < BLOCK; j++) {
                const int q = (int)nearbyintf(v[j] * id);    /* |q| <= 127 */
                o->q[j] = (int8_t)q;
                sum += q;
            }
            o->d = d;
            xs[r * padded + b] = d * (float)sum;
        }
}

#if defined(__F16C__)
#include <immintrin.h>

/* h[0 .. count - 1] widened (exactly) into f */
static void widen_halves(const uint16_t *h, int64_t count, float *f)
{
    int64_t j = 0;
    for (; j + 8 <= count; j += 8)
        _mm256_storeu_ps(f + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    for (; j < count; j++)
        f[j] = _cvtsh_ss(h[j]);
}
#else
/* h[0 .. count - 1] widened (exactly) into f */
static void widen_halves(const uint16_t *h, int64_t count, float *f)
{
    for (int64_t j = 0; j < count; j++) {
        const uint32_t e = (h[j] >> 10) & 0x1F, m = h[j] & 0x3FF;
        float v;
        if (e == 0)                               /* zero, subnormal */
            v = ldexpf((float)m, -24);
        else if (e == 31) {                       /* infinity, NaN */
            const uint32_t bits = 0x7F800000u | (m << 13);
            memcpy(&v, &bits, sizeof v);
        } else {
            const uint32_t bits = ((e + 112) << 23) | (m << 13);
            memcpy(&v, &bits, sizeof v);
        }
        f[j] = h[j] & 0x8000 ? -v : v;
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 int32: lane i the sum of products 4i .. 4i + 3 of u (unsigned) and s (signed) */
static inline __m256i dot_u8_s8(__m256i u, __m256i s)
{
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else   /* pairs into int16 (never saturating: |sum| <= 2 * 128 * 127), then pairs of those */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum over b < blocks of m[b] * s[b] (s padded with zeros to a multiple of 8 blocks):
 * lane l sums blocks l, l + 8, ..., then the lanes as hsum sums them */
static inline float low_sum(const float *m, const float *s, int64_t blocks)
{
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(s + b), acc);
    if (b < blocks) {
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(blocks - b)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(m + b, keep), _mm256_loadu_ps(s + b), acc);
    }
    return hsum(acc);
}

/* y[r, n + i] = x[r] . w_{n+i} (+ bias) for the R rows of xq (from block 0 of row 0) and
 * the W weight rows from n, their blocks of KIND 4 (Q4_1) or 8 (Q8_0), their scales
 * widened (row i's at d + i * blocks, m alike); R, W and KIND constants where this is
 * inlined. Each row of x is loaded once for the W weight rows. */
static inline __attribute__((always_inline)) void rows_times_weight_rows(
    const int R, const int W, const int KIND, const struct xblock *xq, const float *xs,
    int64_t blocks, const uint8_t *q, const float *d, const float *m, int64_t n,
    const float *bias, float *y, int64_t N)
{
    __m256 acc[WIDE][SHORT];
    for (int i = 0; i < W; i++)
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm256_setzero_ps();
    /* a Q4_1 block's 16 bytes in both halves, the high half shifted down 4: weights 0-15
     * and 16-31 once masked (fewer instructions than unpacking the halves apart) */
    const __m256i nibble = _mm256_set1_epi8(0x0F),
                  shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i w[WIDE], sign[WIDE];
        __m256 dw[WIDE];
        for (int i = 0; i < W; i++) {
            const int64_t at = (n + i) * blocks + b;
            if (KIND == 4) {
                const __m256i both = _mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)(q + at * 16)));
                w[i] = _mm256_and_si256(_mm256_srlv_epi32(both, shift), nibble);
            } else {   /* |w| times x with w's sign: unsigned by signed */
                sign[i] = _mm256_loadu_si256((const __m256i *)(q + at * BLOCK));
                w[i] = _mm256_sign_epi8(sign[i], sign[i]);
            }
            dw[i] = _mm256_set1_ps(d[i * blocks + b]);
        }
        for (int r = 0; r < R; r++) {
            const struct xblock *xb = xq + r * blocks + b;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)xb->q);
            const __m256 dx = _mm256_broadcast_ss(&xb->d);
            for (int i = 0; i < W; i++) {
                const __m256i xi = KIND == 4 ? xv : _mm256_sign_epi8(xv, sign[i]);
                const __m256 sums = _mm256_cvtepi32_ps(dot_u8_s8(w[i], xi));
                acc[i][r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(dw[i], dx), acc[i][r]);
            }
        }
    }
    const int64_t padded = (blocks + 7) & ~(int64_t)7;
    for (int i = 0; i < W; i++)
        for (int r = 0; r < R; r++)
            y[r * N + n + i] = hsum(acc[i][r])
                + (KIND == 4 ? low_sum(m + i * blocks, xs + r * padded, blocks) : 0.0f)
                + (bias ? bias[n + i] : 0.0f);
}

int linear_int8_vector(void)
{
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    return 2;
#else
    return 1;
#endif
}
#else
static float lanes_sum(const float *acc)
{
    const float s0 = acc[0] + acc[4], s1 = acc[1] + acc[5], s2 = acc[2] + acc[6],
                s3 = acc[3] + acc[7];
    return (s0 + s2) + (s1 + s3);
}

/* The same lanes and order as the vector code: lane i of a block sums products 4i ..
 * 4i + 3 (weights 0-15 from the low nibbles, 16-31 from the high ones), each lane's
 * total a multiply-add a block, then the lanes summed as hsum sums them; Q4_1's
 * minimums likewise by blocks mod 8. */
static void rows_times_weight_rows(const int R, const int W, const int kind,
                                   const struct xblock *xq, const float *xs, int64_t blocks,
                                   const uint8_t *q, const float *d, const float *m,
                                   int64_t n0, const float *bias, float *y, int64_t N)
{
    const int64_t padded = (blocks + 7) & ~(int64_t)7;
    for (int64_t n = n0; n < n0 + W; n++)
    for (int r = 0; r < R; r++) {
        float acc[8] = {0}, low[8] = {0};
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = n * blocks + b;
            const struct xblock *xb = xq + r * blocks + b;
            int w[BLOCK];
            for (int j = 0; j < BLOCK; j++)
                w[j] = kind == 4 ? (q[at * 16 + (j & 15)] >> (j < 16 ? 0 : 4)) & 15
                                 : ((const int8_t *)q)[at * BLOCK + j];
            const float scale = d[(n - n0) * blocks + b] * xb->d;  /* as the vector code: dw dx */
            for (int i = 0; i < 8; i++) {
                int s = 0;
                for (int j = 4 * i; j < 4 * i + 4; j++)
                    s += w[j] * xb->q[j];
                acc[i] = fmaf((float)s, scale, acc[i]);
            }
            if (kind == 4)
                low[b & 7] = fmaf(m[(n - n0) * blocks + b], xs[r * padded + b], low[b & 7]);
        }
        y[r * N + n] = lanes_sum(acc) + (kind == 4 ? lanes_sum(low) : 0.0f)
                       + (bias ? bias[n] : 0.0f);
    }
}

int linear_int8_vector(void)
{
    return 0;
}
#endif

/* y rows < rows (<= SHORT) of xq, weight rows n .. n + width - 1 (width <= WIDE) */
static void weight_rows(int64_t rows, int64_t width, const int kind, const struct xblock *xq,
                        const float *xs, int64_t blocks, const uint8_t *q, const float *d,
                        const float *m, int64_t n, const float *bias, float *y, int64_t N)
{
    switch ((rows * 4 + width) * 16 + kind) {
#define CASE(R, W, KIND) case (R * 4 + W) * 16 + KIND: \
        rows_times_weight_rows(R, W, KIND, xq, xs, blocks, q, d, m, n, bias, y, N); break;
#define ROWS_OF(W, KIND) CASE(1, W, KIND) CASE(2, W, KIND) CASE(3, W, KIND) CASE(4, W, KIND)
    ROWS_OF(1, 4) ROWS_OF(2, 4) ROWS_OF(1, 8) ROWS_OF(2, 8)
#undef ROWS_OF
#undef CASE
    }
}

/* y = x w^T (+ bias); 0, or -1 where memory for x's quantised rows is short (y untouched) */
static int linear(const int kind, const float *x, int64_t M, int64_t K, const uint8_t *q,
                  const uint16_t *d, const uint16_t *m, int64_t N, const float *bias, float *y)
{
    const int64_t blocks = K / BLOCK, padded = (blocks + 7) & ~(int64_t)7;
    if (M <= 0)
        return 0;
    const size_t quantised = (size_t)(M * blocks) * sizeof(struct xblock);
    char *buffer = rows_buffer(quantised + (size_t)(M * padded) * sizeof(float));
    if (!buffer)
        return -1;
    struct xblock *xq = (struct xblock *)buffer;
    float *xs = (float *)(buffer + quantised);
    quantize_rows(x, M, K, xq, xs);
    /* each thread's weight rows WIDE at a time, read from memory once: every SHORT rows
     * of x in turn take them from L1 (a pair of SmolLM2's widest rows is 2.3 KB). Q8_0
     * rows go one at a time for up to Q8_ALONE rows of x, where two at a time read
     * memory at half the rate; a row's sums are the same either way. */
    const int64_t wide = kind == 8 && M <= Q8_ALONE ? 1 : WIDE;
    const int64_t groups = (N + wide - 1) / wide;
    #pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n = g * wide, width = N - n < wide ? N - n : wide;
        for (int64_t i = 0; i < width; i++)
            prefetch_weight_row(kind, q, d, m, n + i + PREFETCH_ROWS, blocks, sizeof *d);
        /* d, then m (Q4_1), of rows n .. n + width - 1: 16 bytes a block of K at most
         * (14 KB at K = 28,672), on this thread's stack */
        float scales[(m ? 2 : 1) * WIDE * blocks + 1];
        widen_halves(d + n * blocks, width * blocks, scales);
        if (m)
            widen_halves(m + n * blocks, width * blocks, scales + WIDE * blocks);
        for (int64_t r0 = 0; r0 < M; r0 += SHORT)
            weight_rows(M - r0 < SHORT ? M - r0 : SHORT, width, kind, xq + r0 * blocks,
                        xs + r0 * padded, blocks, q, scales, scales + WIDE * blocks, n, bias,
                        y + r0 * N, N);
    }
    return 0;
}

int linear_q4_1_int8(const float *x, int64_t M, int64_t K, const uint8_t *q,
                     const uint16_t *d, const uint16_t *m, int64_t N, const float *bias,
                     float *y)
{
    return linear(4, x, M, K, q, d, m, N, bias, y);
}

int linear_q8_0_int8(const float *x, int64_t M, int64_t K, const int8_t *q,
                     const uint16_t *d, int64_t N, const float *bias, float *y)
{
    return linear(8, x, M, K, (const uint8_t *)q, d, NULL, N, bias, y);
}
