/* Projections by int8 dot products, float32 rows in and out: the arithmetic llama.cpp
 * uses for a quantised checkpoint on a CPU.
 *
 * quant_linear.c makes every weight the exact float32 the loader's dequantisation gives
 * and multiplies it by x in float32: on a CPU without AVX-512 that unpacking (a
 * conversion, a multiply and an add a weight) is the cost, not the memory. Here each
 * row of x is first quantised per block of 32 to int8 with a float32 scale (dx =
 * max |x| / 127, qx = x / dx rounded to nearest even), each block's 32 products of a
 * weight row are summed exactly in integers (VPMADDUBSW + VPMADDWD on AVX2, VPDPBUSD
 * where the CPU has AVX-VNNI or AVX512-VNNI: the same integers), and each block's sum is
 * scaled once into one float32 sum a result, block after block:
 *   Q4_1 (w = d q + m):  acc = fma(sum(q qx), d dx, acc); acc = fma(m, dx sum(qx), acc)
 *   Q8_0 (w = d q):      acc = fma(sum(q qx), d dx, acc)
 * then y = acc + bias. The result differs from the exact product by x's quantisation
 * (~0.4% of a block's largest value a row), as llama.cpp's does. A row's bits depend on
 * that row alone (not on the others of the call, the thread count or the pass), and the
 * portable build below makes the same operations in the same order, so every build gives
 * the same bits.
 *
 * Weight rows in groups of 8 (predd.model.loader.QuantBlocks.in_groups): a group's
 * block b holds the 8 rows' block b interleaved four bytes at a time, so one 32-byte
 * load holds four weights of each of the 8 rows, lane j row j. Times a row of x's four
 * int8 (broadcast), VPMADDUBSW + VPMADDWD give the 8 rows' partial sums in the 8 lanes:
 * a group's results are one vector, scaled by its 8 rows' d (one half-float load) and
 * stored in one store, with no sum across lanes. Against two weight rows at a time with
 * each lane a quarter of one row's block (as before), that is about half the
 * instructions a product (measured: docs/kernels.md, "int8 kernels on groups of 8
 * weight rows"). Each thread takes its groups from memory once a call and runs every 4
 * rows of x in turn over a group from L1. With AVX512-VNNI, calls of PAIR_ROWS rows or
 * more take whole groups two at a time, one in each half of a 512-bit vector: the same
 * operations lane by lane, so the same bits (fewer instructions; at fewer rows it
 * measured no faster).
 *
 * Layout: Q4_1 q [N / 8, K / 32, 4, 8, 4] bytes: at [g, b, h, j] the four bytes 4h ..
 * 4h + 3 of row 8g + j's block b (each byte weight i in its low nibble, i + 16 in its
 * high one, as the GGUF stores them); Q8_0 q [N / 8, K / 32, 8, 8, 4] int8: at
 * [g, b, h, j] weights 4h .. 4h + 3 of row 8g + j's block b; d and m [N / 8, K / 32, 8]
 * IEEE half floats, as the GGUF stores them (20 bytes a Q4_1 weight block, 34 a Q8_0 one,
 * as llama.cpp reads them). N is padded to a multiple of 8 with zero rows, whose
 * results are not stored. x [M, K], y [M, N] float32 contiguous; K a multiple of 32.
 */
#pragma GCC optimize("fp-contract=off")   /* every multiply-add below is written as one */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include <stdlib.h>

#include "quant_blocks.h"

#define GROUP 8                  /* weight rows a group: one vector of results */
#define SHORT 4                  /* rows of x run over a group's blocks together */

/* A block of a row of x, quantised: its 32 int8 and its scale */
struct xblock {
    int8_t q[BLOCK];
    float d;
};

/* Row r of x, block b: xq[r * blocks + b], and its scale times the sum of its q at
 * xs[r * blocks + b] */
static void quantize_rows(const float *x, int64_t M, int64_t K, struct xblock *xq, float *xs)
{
    const int64_t blocks = K / BLOCK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
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
            xs[r * blocks + b] = d * (float)sum;
        }
}

/* Bytes of a group's block of q */
static inline int64_t group_block_bytes(const int kind)
{
    return GROUP * (kind == 4 ? 16 : BLOCK);
}

/* Asks for group g's blocks (q, d and m) to be brought into cache; never faults */
static inline void prefetch_group(const int kind, const uint8_t *q, const uint16_t *d,
                                  const uint16_t *m, int64_t g, int64_t blocks)
{
    const int64_t bytes = blocks * group_block_bytes(kind), scales = blocks * GROUP;
    const char *at = (const char *)q + g * bytes;
    for (int64_t i = 0; i < bytes; i += 64)
        __builtin_prefetch(at + i);
    for (int64_t i = 0; i < scales; i += 32) {
        __builtin_prefetch(d + g * scales + i);
        if (m)
            __builtin_prefetch(m + g * scales + i);
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#if defined(__AVXVNNI__)
#define DOT_ADD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_ADD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#endif

/* x's four int8 from q[4h], broadcast to the 8 lanes (read as bytes: no int32 pointer
 * onto int8 memory) */
static inline __m256i four_of(const int8_t *q, int h)
{
    int32_t v;
    memcpy(&v, q + 4 * h, sizeof v);
    return _mm256_set1_epi32(v);
}

/* y[r, n .. n + width - 1] = x_r . w (+ bias) for the R rows of xq (xs alike) and weight
 * group `g` (width of its 8 rows stored); R and KIND constants where this is inlined. */
static inline __attribute__((always_inline)) void rows_times_group(
    const int R, const int KIND, const struct xblock *xq, const float *xs, int64_t blocks,
    const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t g, int width,
    const float *bias, float *y, int64_t N)
{
    const int64_t n = g * GROUP;
    const uint8_t *qg = q + g * blocks * group_block_bytes(KIND);
    const uint16_t *dg = d + g * blocks * GROUP, *mg = m ? m + g * blocks * GROUP : NULL;
    __m256 acc[SHORT];
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_setzero_ps();
#if !defined(DOT_ADD)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sums[SHORT];
        for (int r = 0; r < R; r++)
            sums[r] = _mm256_setzero_si256();
        if (KIND == 4) {
            /* four loads of 32 bytes: low nibbles weights 4h .. 4h + 3 of each row, high
             * ones 16 + 4h ..; weights < 16, so pairs of products summed in int16 never
             * saturate and eight such sums never overflow (8 * 2 * 15 * 127 < 2^15) */
            const __m256i nibble = _mm256_set1_epi8(0x0F);
#if !defined(DOT_ADD)
            __m256i pairs[SHORT];
            for (int r = 0; r < R; r++)
                pairs[r] = _mm256_setzero_si256();
#endif
            for (int h = 0; h < 4; h++) {
                const __m256i both = _mm256_loadu_si256((const __m256i *)(qg + b * 128 + h * 32));
                const __m256i lo = _mm256_and_si256(both, nibble),
                              hi = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
                for (int r = 0; r < R; r++) {
                    const int8_t *xv = xq[r * blocks + b].q;
                    const __m256i xl = four_of(xv, h), xh = four_of(xv, h + 4);
#if defined(DOT_ADD)
                    sums[r] = DOT_ADD(DOT_ADD(sums[r], lo, xl), hi, xh);
#else
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
#endif
                }
            }
#if !defined(DOT_ADD)
            for (int r = 0; r < R; r++)
                sums[r] = _mm256_madd_epi16(pairs[r], ones);
#endif
        } else {
            /* eight loads of 32 bytes, weights 4h .. 4h + 3 of each row: |w| (unsigned)
             * times x with w's sign; a pair of products may reach 2 * 128 * 127, so each
             * load's pairs are summed to int32 at once */
            for (int h = 0; h < 8; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(qg + b * 256 + h * 32));
                const __m256i aw = _mm256_abs_epi8(w);
                for (int r = 0; r < R; r++) {
                    const __m256i xs8 = _mm256_sign_epi8(four_of(xq[r * blocks + b].q, h), w);
#if defined(DOT_ADD)
                    sums[r] = DOT_ADD(sums[r], aw, xs8);
#else
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(aw, xs8), ones));
#endif
                }
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + b * GROUP)));
        const __m256 mw = KIND == 4
            ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mg + b * GROUP)))
            : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(&xq[r * blocks + b].d));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, acc[r]);
            if (KIND == 4)
                acc[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(&xs[r * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (width == GROUP) {
            if (bias)
                acc[r] = _mm256_add_ps(acc[r], _mm256_loadu_ps(bias + n));
            _mm256_storeu_ps(y + r * N + n, acc[r]);
            continue;
        }
        float out[GROUP];
        _mm256_storeu_ps(out, acc[r]);
        for (int j = 0; j < width; j++)
            y[r * N + n + j] = bias ? out[j] + bias[n + j] : out[j];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAIRS 1                  /* whole groups two at a time: rows_times_pair */
#define PAIR_ROWS 16             /* rows of x from which whole groups go two at a time */
/* rows_times_group for groups g and g + 1 (both whole) at once, one in each half of a
 * 512-bit vector: the same integer sums and the same float operations lane by lane */
static inline __attribute__((always_inline)) void rows_times_pair(
    const int R, const int KIND, const struct xblock *xq, const float *xs, int64_t blocks,
    const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t g, const float *bias,
    float *y, int64_t N)
{
    const int64_t n = g * GROUP, bytes = blocks * group_block_bytes(KIND);
    const uint8_t *q0 = q + g * bytes, *q1 = q0 + bytes;
    const uint16_t *d0 = d + g * blocks * GROUP, *d1 = d0 + blocks * GROUP;
    const uint16_t *m0 = m ? m + g * blocks * GROUP : NULL, *m1 = m ? m0 + blocks * GROUP : NULL;
    __m512 acc[SHORT];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sums[SHORT];
        for (int r = 0; r < R; r++)
            sums[r] = _mm512_setzero_si512();
        const int64_t bb = b * group_block_bytes(KIND);
        const int loads = KIND == 4 ? 4 : 8;
        for (int h = 0; h < loads; h++) {
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(
                _mm256_loadu_si256((const __m256i *)(q0 + bb + h * 32))),
                _mm256_loadu_si256((const __m256i *)(q1 + bb + h * 32)), 1);
            if (KIND == 4) {
                const __m512i nibble = _mm512_set1_epi8(0x0F);
                const __m512i lo = _mm512_and_si512(both, nibble),
                              hi = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
                for (int r = 0; r < R; r++) {
                    int32_t xl, xh;
                    memcpy(&xl, xq[r * blocks + b].q + 4 * h, 4);
                    memcpy(&xh, xq[r * blocks + b].q + 4 * (h + 4), 4);
                    sums[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(
                        sums[r], lo, _mm512_set1_epi32(xl)), hi, _mm512_set1_epi32(xh));
                }
            } else {
                const __m512i aw = _mm512_abs_epi8(both);
                const __mmask64 neg = _mm512_movepi8_mask(both);
                for (int r = 0; r < R; r++) {
                    int32_t xv;
                    memcpy(&xv, xq[r * blocks + b].q + 4 * h, 4);
                    const __m512i x = _mm512_set1_epi32(xv);
                    /* x with w's sign (w = 0: its product is 0 either way) */
                    const __m512i xs8 = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
                    sums[r] = _mm512_dpbusd_epi32(sums[r], aw, xs8);
                }
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(
            _mm_loadu_si128((const __m128i *)(d0 + b * GROUP))),
            _mm_loadu_si128((const __m128i *)(d1 + b * GROUP)), 1));
        const __m512 mw = KIND == 4 ? _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(m0 + b * GROUP))),
            _mm_loadu_si128((const __m128i *)(m1 + b * GROUP)), 1)) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xq[r * blocks + b].d));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, acc[r]);
            if (KIND == 4)
                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (bias)
            acc[r] = _mm512_add_ps(acc[r], _mm512_loadu_ps(bias + n));
        _mm512_storeu_ps(y + r * N + n, acc[r]);
    }
}
#endif

int linear_int8_vector(void)
{
#if defined(DOT_ADD)
    return 2;
#else
    return 1;
#endif
}
#else
/* h widened (exactly) */
static float widen_half(uint16_t h)
{
    const uint32_t e = (h >> 10) & 0x1F, mant = h & 0x3FF;
    float v;
    if (e == 0)                               /* zero, subnormal */
        v = ldexpf((float)mant, -24);
    else if (e == 31) {                       /* infinity, NaN */
        const uint32_t bits = 0x7F800000u | (mant << 13);
        memcpy(&v, &bits, sizeof v);
    } else {
        const uint32_t bits = ((e + 112) << 23) | (mant << 13);
        memcpy(&v, &bits, sizeof v);
    }
    return h & 0x8000 ? -v : v;
}

/* The same operations in the same order as the vector code, a result at a time */
static void rows_times_group(const int R, const int kind, const struct xblock *xq,
                             const float *xs, int64_t blocks, const uint8_t *q,
                             const uint16_t *d, const uint16_t *m, int64_t g, int width,
                             const float *bias, float *y, int64_t N)
{
    const int64_t n = g * GROUP, bytes = group_block_bytes(kind);
    for (int j = 0; j < width; j++)
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *qb = q + (g * blocks + b) * bytes;
            const struct xblock *xb = xq + r * blocks + b;
            int32_t sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                int w;
                if (kind == 4) {     /* weight i: byte i % 16, its nibble i / 16 */
                    const int byte = i & 15;
                    w = (qb[(byte >> 2) * 32 + j * 4 + (byte & 3)] >> (i < 16 ? 0 : 4)) & 15;
                } else {
                    w = ((const int8_t *)qb)[(i >> 2) * 32 + j * 4 + (i & 3)];
                }
                sum += w * xb->q[i];
            }
            const int64_t at = (g * blocks + b) * GROUP + j;
            acc = fmaf((float)sum, widen_half(d[at]) * xb->d, acc);
            if (kind == 4)
                acc = fmaf(widen_half(m[at]), xs[r * blocks + b], acc);
        }
        y[r * N + n + j] = bias ? acc + bias[n + j] : acc;
    }
}

int linear_int8_vector(void)
{
    return 0;
}
#endif

/* y rows < rows (<= SHORT) of xq, weight group g */
static void group_rows(int64_t rows, const int kind, const struct xblock *xq, const float *xs,
                       int64_t blocks, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                       int64_t g, int width, const float *bias, float *y, int64_t N)
{
    switch (rows * 16 + kind) {
#define CASE(R, KIND) case R * 16 + KIND: \
        rows_times_group(R, KIND, xq, xs, blocks, q, d, m, g, width, bias, y, N); break;
    CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8)
#undef CASE
    }
}

#if defined(PAIRS)
/* y rows < rows (<= SHORT) of xq, weight groups g and g + 1, both whole */
static void pair_rows(int64_t rows, const int kind, const struct xblock *xq, const float *xs,
                      int64_t blocks, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                      int64_t g, const float *bias, float *y, int64_t N)
{
    switch (rows * 16 + kind) {
#define CASE(R, KIND) case R * 16 + KIND: \
        rows_times_pair(R, KIND, xq, xs, blocks, q, d, m, g, bias, y, N); break;
    CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8)
#undef CASE
    }
}
#endif

/* y = x w^T (+ bias); 0, or -1 where memory for x's quantised rows is short (y untouched) */
static int linear(const int kind, const float *x, int64_t M, int64_t K, const uint8_t *q,
                  const uint16_t *d, const uint16_t *m, int64_t N, const float *bias, float *y)
{
    const int64_t blocks = K / BLOCK;
    if (M <= 0)
        return 0;
    const size_t quantised = (size_t)(M * blocks) * sizeof(struct xblock);
    char *buffer = rows_buffer(quantised + (size_t)(M * blocks) * sizeof(float));
    if (!buffer)
        return -1;
    struct xblock *xq = (struct xblock *)buffer;
    float *xs = (float *)(buffer + quantised);
    quantize_rows(x, M, K, xq, xs);
    const int64_t groups = (N + GROUP - 1) / GROUP;
#if defined(PAIRS)
    /* whole groups two at a time in 512-bit vectors; a last odd or partial one alone */
    const int64_t pairs = M >= PAIR_ROWS ? (N / GROUP) / 2 : 0,
                  tasks = pairs + (groups - 2 * pairs);
#else
    const int64_t pairs = 0, tasks = groups;
#endif
    /* each thread's groups read from memory once: every SHORT rows of x in turn take a
     * group from L1 (SmolLM2's widest, K = 1536, is 6 KB of Q4_1) */
    #pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t g = t < pairs ? 2 * t : t + pairs;
#if defined(PAIRS)
        if (t < pairs) {
            prefetch_group(kind, q, d, m, g + 2, blocks);
            prefetch_group(kind, q, d, m, g + 3, blocks);
            for (int64_t r0 = 0; r0 < M; r0 += SHORT)
                pair_rows(M - r0 < SHORT ? M - r0 : SHORT, kind, xq + r0 * blocks,
                          xs + r0 * blocks, blocks, q, d, m, g, bias, y + r0 * N, N);
            continue;
        }
#endif
        prefetch_group(kind, q, d, m, g + 1, blocks);
        const int width = N - g * GROUP < GROUP ? (int)(N - g * GROUP) : GROUP;
        for (int64_t r0 = 0; r0 < M; r0 += SHORT)
            group_rows(M - r0 < SHORT ? M - r0 : SHORT, kind, xq + r0 * blocks,
                       xs + r0 * blocks, blocks, q, d, m, g, width, bias, y + r0 * N, N);
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
