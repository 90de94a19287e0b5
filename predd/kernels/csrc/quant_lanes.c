/* Q4_1 projections in bfloat16 with a tile's 16 weight rows across a vector's 16 lanes,
 * where the CPU has bf16 dot products (VDPBF16PS) and no AMX tiles.
 *
 * quant_linear.c's dot products look each block's 32 weights up as bf16(d q + m), a table
 * the block makes first: ~4 cycles of unpacking a block and weight row, on the same
 * ports as the products (two a cycle). Here a block's weights are never made: the 4-bit
 * q (0-15) is a bf16 value as it stands once its bits are placed under the exponent of
 * 128 (0x4300 | q is 128 + q, exactly), so one VPTERNLOGD (and a shift) makes 16 weight
 * rows' pairs of q + 128 from the packed nibbles, and
 *
 *     x . w = sum over blocks b of  d_b (x_b . (q_b + 128)) + (m_b - 128 d_b) sum(x_b)
 *
 * with each block's products summed in float32 lanes (one lane a weight row: no
 * horizontal sums), then scaled by its d and its m term added by two multiply-adds per
 * row of x. The weights are d q + m exactly, not rounded to bf16 as the table's are (nor
 * as the model's dense bf16 weight is): rows of bf16 times the checkpoint's own weights,
 * summed in float32, rounded to bf16 once. Each row of x is computed the same way
 * whatever other rows come with it (passes of up to 8 rows; the result's bits do not
 * depend on the batch).
 *
 * Faster than the table kernel at every row count measured (measured: docs/kernels.md,
 * "Q4_1 weights in lanes without AMX").
 *
 * Layout (predd.model.loader.QuantBlocks.in_lanes): q [tiles, K / 32, 4, 16] uint32, group g of
 * a block holding weights 8g .. 8g + 7 of each of the tile's 16 rows, row i's in lane i:
 * weight 8g + 2s in bits 4s .. 4s + 3, weight 8g + 2s + 1 in bits 16 + 4s .. 19 + 4s;
 * d and m [tiles, K / 32, 16] float32 as quant_blocks.h's tiles. x [M, K] and y [M, N]
 * bfloat16, bias float32 or NULL. */
#include <stdint.h>

#include "kernels.h"

#include "quant_blocks.h"

#if defined(__AVX512BF16__)
#define LANES 16                  /* weight rows a tile, one a lane */
#define PASS 8                    /* rows of x a pass over a tile, at most */
#define AHEAD 32                  /* blocks prefetched ahead (8 KB of q: 8 blocks, 2 KB, left
                                     1-4 rows waiting on memory, 10-15% slower) */

/* acc += w . the pair of bf16 at `pair`, broadcast to every lane (the broadcast folded
 * into the instruction, which the compiler does not do for VDPBF16PS by itself: a
 * separate broadcast a product cost ~4% at 8 rows) */
static inline __m512 dot_broadcast(__m512 acc, __m512bh w, const uint16_t *pair)
{
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0"
            : "+v"(acc) : "v"(w), "m"(*(const uint32_t *)pair));
    return acc;
}

/* out[r] = lane i: x row r . weight row i of the tile, for R (a literal, <= PASS) rows
 * of x from `x` (K apart; sx their blocks' sums, `blocks` apart), the tile's blocks at
 * q, d, m. A block's 16 products a row run in two chains (alternate pairs), so that
 * enough are in flight for the ports at 4 rows and more; at fewer rows the kernel
 * waits on memory anyway, and more chains there would sum a row in another order than
 * at 8 rows (its bits would depend on the batch). */
static inline __attribute__((always_inline)) void tile_rows(
    const int R, const uint16_t *x, int64_t K, const float *sx, const uint32_t *q,
    const float *d, const float *m, int64_t blocks, __m512 *out)
{
    const __m512i low = _mm512_set1_epi32(0x000F000F), exponent = _mm512_set1_epi32(0x43004300);
    __m512 acc[PASS];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint32_t *qb = q + b * 4 * LANES;
        for (int line = 0; line < 4; line++)
            __builtin_prefetch(qb + (AHEAD * 4 + line) * LANES);
        __builtin_prefetch(d + (b + AHEAD) * LANES);
        __builtin_prefetch(m + (b + AHEAD) * LANES);
        /* the two chains as two arrays: as part[2][PASS] indexed by s % 2, gcc stored
         * the odd chain's 8 vectors to the stack at every group (never read back), and
         * 8 rows and more took longer (measured: docs/kernels.md, "Two accumulator
         * arrays in the lanes kernel") */
        __m512 even[PASS], odd[PASS];
        for (int r = 0; r < R; r++)
            even[r] = odd[r] = _mm512_setzero_ps();
        const uint16_t *xb = x + b * BLOCK;
        for (int g = 0; g < 4; g++) {
            const __m512i nibbles = _mm512_loadu_si512(qb + g * LANES);
            for (int s = 0; s < 4; s += 2) {
                /* (nibbles >> 4s) & low | exponent: weights 8g + 2s and 8g + 2s + 1;
                 * shifted 4 more, the next pair's */
                const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(
                    _mm512_srli_epi32(nibbles, 4 * s), low, exponent, 0xEA);
                for (int r = 0; r < R; r++)
                    even[r] = dot_broadcast(even[r], w0, xb + r * K + g * 8 + 2 * s);
                const __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(
                    _mm512_srli_epi32(nibbles, 4 * s + 4), low, exponent, 0xEA);
                for (int r = 0; r < R; r++)
                    odd[r] = dot_broadcast(odd[r], w1, xb + r * K + g * 8 + 2 * s + 2);
            }
        }
        const __m512 dv = _mm512_loadu_ps(d + b * LANES);
        const __m512 mv = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), dv,
                                           _mm512_loadu_ps(m + b * LANES));
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), dv, acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[r * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        out[r] = acc[r];
}

/* sx[r * blocks + b] = the float32 sum of x row r's block b (its 32 bf16 values) */
static void block_sums(const uint16_t *x, int64_t M, int64_t K, float *sx)
{
    const int64_t blocks = K / BLOCK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const __m512i v = _mm512_loadu_si512(x + r * K + b * BLOCK);
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(
                v, _mm512_set1_epi32((int)0xFFFF0000)));
            sx[r * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
}

#define SUMS 8192                 /* blocks' sums of x held at a time (32 KB of stack) */

/* y = x w^T (+ bias), rounded to bf16 once: x's rows in chunks whose blocks' sums fit
 * SUMS (8 rows or more a chunk for K up to 32768), each chunk's tiles split
 * over the threads, a tile's rows in passes of nearly equal size (PASS at most) */
void linear_q4_1_lanes_bf16(const uint16_t *x, int64_t M, int64_t K, const uint32_t *q,
                            const float *d, const float *m, int64_t N, const float *bias,
                            uint16_t *y)
{
    const int64_t blocks = K / BLOCK, tiles = (N + LANES - 1) / LANES;
    const int64_t chunk = SUMS / blocks > 0 ? SUMS / blocks : 1;
    float sx[chunk * blocks];              /* SUMS, or one row's where K is wider */
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t rows = M - c0 < chunk ? M - c0 : chunk;
        const uint16_t *xc = x + c0 * K;
        uint16_t *yc = y + c0 * N;
        block_sums(xc, rows, K, sx);
        const int64_t passes = (rows + PASS - 1) / PASS;
        #pragma omp parallel for schedule(static) if (N * K >= 65536)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * LANES, count = N - n0 < LANES ? N - n0 : LANES;
            const __mmask16 keep = (__mmask16)((1u << count) - 1);
            const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0)
                                   : _mm512_setzero_ps();
            const uint32_t *qt = q + t * blocks * 4 * LANES;
            const float *dt = d + t * blocks * LANES, *mt = m + t * blocks * LANES;
            for (int64_t p = 0; p < passes; p++) {
                const int64_t r0 = rows * p / passes, R = rows * (p + 1) / passes - r0;
                __m512 out[PASS];
                switch (R) {
#define CASE(n) case n: tile_rows(n, xc + r0 * K, K, sx + r0 * blocks, qt, dt, mt, blocks, \
                                  out); break;
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
                }
                for (int64_t r = 0; r < R; r++)
                    _mm256_mask_storeu_epi16(yc + (r0 + r) * N + n0, keep, (__m256i)
                                             _mm512_cvtneps_pbh(_mm512_add_ps(out[r], bv)));
            }
        }
    }
}
#endif   /* (without VDPBF16PS: quant_linear.c, by float32 FMAs) */
