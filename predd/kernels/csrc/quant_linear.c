/* Projections computed from a GGUF checkpoint's own quantised blocks, float32 out.
 *
 * At decode's few rows a step a projection reads its whole weight for little
 * arithmetic: it is bound by memory, and a float32 copy of a Q4_1 weight is 7x the
 * bytes of the blocks it was dequantised from. These kernels read the blocks (Q4_1:
 * 32 weights as 4-bit q with a scale d and a minimum m, w = d q + m; Q8_0: 8-bit q and
 * a scale, w = d q), make each weight exactly the float32 value the loader's
 * dequantisation gives (the same multiply, then the same add: never fused), and
 * accumulate x . w in float32. Rows of x are taken eight at a time; output rows are
 * split over torch's OpenMP threads.
 *
 * Layout (predd.model.loader.QuantBlocks): q [N, K / 32, 16] bytes for Q4_1 (byte j holds
 * weight j in its low nibble and j + 16 in its high one), [N, K / 32, 32] int8 for Q8_0;
 * d and m [N, K / 32] float32 (the bfloat16 kernels: the same blocks in tiles of 16 rows,
 * quant_blocks.h). x [M, K] and y [M, N] contiguous; K a multiple of 32.
 */
#pragma GCC optimize("fp-contract=off")   /* w = d q + m rounded as numpy rounds it */

#include <stdint.h>

#include "kernels.h"
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "lanes.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 8
#endif

#include "quant_blocks.h"

#define ROWS 8                               /* rows of x per pass over a weight row */

/* Where a weight's block lies and what its weights are: `ROWS_EXACT` the layout above,
 * the weights exactly (the float32 kernels); `TILES_BF16` tiles of 16 weight rows
 * (quant_blocks.h), the weights rounded to bfloat16 (the bf16 kernels' table);
 * `LANES_EXACT` Q4_1 in lanes (quant_lanes.c), the weights exactly. */
enum { ROWS_EXACT, TILES_BF16, LANES_EXACT };
/* What x's rows are and what y takes: float32 both; bfloat16 rows (widened as they are
 * read, or by `linear_widened` before) and y their sum (+ bias) rounded to bfloat16 once,
 * stored as bfloat16 (`OUT_BF16`) or widened (`OUT_WIDE`, a head's logits) */
enum { IN_F32 = 0, IN_BF16 = 1, OUT_F32 = 0, OUT_BF16 = 2, OUT_WIDE = 4 };

static inline int64_t block_at(const int layout, int64_t n, int64_t b, int64_t blocks)
{
    return layout == ROWS_EXACT ? n * blocks + b : tile_block(n, b, blocks);
}

#ifdef VECTOR
/* The same weights in four vectors (weights 0-7, 8-15, 16-23, 24-31). */
static inline void q4_1_vectors(const uint8_t *q, float d, float m, __m256 *w)
{
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int i = 0; i < 4; i++) {
        const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        w[i] = _mm256_add_ps(_mm256_mul_ps(vd, qf), vm);
    }
}

static inline void q8_0_vectors(const int8_t *q, float d, __m256 *w)
{
    const __m256 vd = _mm256_set1_ps(d);
    for (int i = 0; i < 4; i++) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd);
    }
}

/* A Q4_1 block in lanes (quant_lanes.c): word g of weight row n's block holds weights
 * 8g + 2s in bits 4s.. and 8g + 2s + 1 in bits 16 + 4s..; made as q4_1_vectors makes them */
static inline void q4_1_lane_vectors(const uint32_t *words, float d, float m, __m256 *w)
{
    const __m256i shifts = _mm256_setr_epi32(0, 16, 4, 20, 8, 24, 12, 28);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int g = 0; g < 4; g++) {
        const __m256i q = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)words[g * 16]), shifts),
            _mm256_set1_epi32(0x0F));
        w[g] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(q)), vm);
    }
}

/* bf16_round (bf16.h) on 8 lanes */
static inline __m256 bf16_round8(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v), top = _mm256_set1_epi32((int)0xFFFF0000);
    const __m256i even = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_and_si256(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), even), top);
    const __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)),
                                           top);
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* Weight row n's block b as four vectors, as `layout` makes them */
static inline void block_vectors(const int layout, const int kind, const uint8_t *q,
                                 const float *d, const float *m, int64_t n, int64_t b,
                                 int64_t blocks, __m256 *w)
{
    const int64_t at = block_at(layout, n, b, blocks);
    if (layout == LANES_EXACT)
        q4_1_lane_vectors((const uint32_t *)q + (((n >> 4) * blocks + b) * 4) * 16 + (n & 15),
                          d[at], m[at], w);
    else if (kind == 4)
        q4_1_vectors(q + at * 16, d[at], m[at], w);
    else
        q8_0_vectors((const int8_t *)q + at * BLOCK, d[at], w);
    if (layout == TILES_BF16)
        for (int i = 0; i < 4; i++)
            w[i] = bf16_round8(w[i]);
}

/* 8 values of x from p: float32, or bfloat16 widened */
static inline __m256 load8(const void *p, const int bf16)
{
    if (!bf16)
        return _mm256_loadu_ps(p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum(__m256 a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* y[r, n] = sum (+ bias[n]) as `io` stores it (OUT_*) */
static inline void store_sum(const int io, void *y, int64_t at, float sum)
{
    if (io & OUT_BF16)
        ((uint16_t *)y)[at] = bf16_narrow(sum);
    else if (io & OUT_WIDE)
        ((float *)y)[at] = bf16_round(sum);
    else
        ((float *)y)[at] = sum;
}

/* y[r, n] = x[r] . w_n (+ bias[n]) for the rows r < R of xs (R a constant where this
 * is inlined, so that its R accumulators stay in registers), w_n's blocks of `kind` 4
 * (Q4_1) or 8 (Q8_0) where `layout` puts them; y row r at y + r * N. Each row's sum
 * runs in the same order whatever R is. */
static inline __attribute__((always_inline)) void rows_times_weight_row(
    const int R, const int kind, const int layout, const int io, const void *xs, int64_t K,
    const uint8_t *q, const float *d, const float *m, int64_t n, const float *bias, void *y,
    int64_t N)
{
    const int64_t blocks = K / BLOCK;
    const int bf16 = io & IN_BF16;
    if (layout == ROWS_EXACT)
        prefetch_weight_row(kind, q, d, m, n + PREFETCH_ROWS, blocks, sizeof(float));
#ifdef VECTOR
    const int64_t size = bf16 ? 2 : 4;
    __m256 acc[ROWS];
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256 w[4];
        block_vectors(layout, kind, q, d, m, n, b, blocks, w);
        const char *xb = (const char *)xs + b * BLOCK * size;
        for (int r = 0; r < R; r++) {
            const char *xr = xb + r * K * size;
            __m256 a = _mm256_fmadd_ps(load8(xr, bf16), w[0], acc[r]);
            a = _mm256_fmadd_ps(load8(xr + 8 * size, bf16), w[1], a);
            a = _mm256_fmadd_ps(load8(xr + 16 * size, bf16), w[2], a);
            acc[r] = _mm256_fmadd_ps(load8(xr + 24 * size, bf16), w[3], a);
        }
    }
    for (int r = 0; r < R; r++)
        store_sum(io, y, r * N + n, hsum(acc[r]) + (bias ? bias[n] : 0.0f));
#else
    (void)layout;         /* (without AVX2 the bf16 kernels compute nothing: ROWS_EXACT) */
    float acc[ROWS] = {0};
    for (int64_t b = 0; b < blocks; b++) {
        float w[BLOCK];
        const int64_t at = n * blocks + b;
        if (kind == 4)
            q4_1_block(q + at * 16, d[at], m[at], w);
        else
            q8_0_block((const int8_t *)q + at * BLOCK, d[at], w);
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int j = 0; j < BLOCK; j++)
                s += load1(xs, r * K + b * BLOCK + j, bf16) * w[j];
            acc[r] += s;
        }
    }
    for (int r = 0; r < R; r++)
        store_sum(io, y, r * N + n, acc[r] + (bias ? bias[n] : 0.0f));
#endif
}

/* y rows r0 .. r0 + rows - 1 (rows <= ROWS), weight row n */
static void weight_row_f32(int64_t rows, const int kind, const void *xs, int64_t K,
                           const uint8_t *q, const float *d, const float *m, int64_t n,
                           const float *bias, void *ys, int64_t N)
{
    switch (rows) {
#define CASE(R) case R: rows_times_weight_row(R, kind, ROWS_EXACT, IN_F32 | OUT_F32, xs, K, \
                                              q, d, m, n, bias, ys, N); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

typedef void (*weight_row_fn)(int64_t rows, int kind, const void *xs, int64_t K,
                              const uint8_t *q, const float *d, const float *m, int64_t n,
                              const float *bias, void *ys, int64_t N);

/* y = x w^T (+ bias): `per` rows of x (values of `size` bytes) per pass over the
 * weight, its rows split over the threads, each by `row` */
static void linear(weight_row_fn row, int64_t per, int64_t size, const int kind,
                   const void *x, int64_t M, int64_t K, const uint8_t *q, const float *d,
                   const float *m, int64_t N, const float *bias, void *y)
{
    for (int64_t r0 = 0; r0 < M; r0 += per) {
        const int64_t rows = M - r0 < per ? M - r0 : per;
        const void *xs = (const char *)x + r0 * K * size;
        void *ys = (char *)y + r0 * N * size;
        #pragma omp parallel for schedule(static) if (N * K >= 65536)
        for (int64_t n = 0; n < N; n++)
            row(rows, kind, xs, K, q, d, m, n, bias, ys, N);
    }
}

void linear_q4_1_f32(const float *x, int64_t M, int64_t K, const uint8_t *q,
                     const float *d, const float *m, int64_t N, const float *bias, float *y)
{
    linear(weight_row_f32, ROWS, 4, 4, x, M, K, q, d, m, N, bias, y);
}

void linear_q8_0_f32(const float *x, int64_t M, int64_t K, const int8_t *q,
                     const float *d, int64_t N, const float *bias, float *y)
{
    linear(weight_row_f32, ROWS, 4, 8, x, M, K, (const uint8_t *)q, d, NULL, N, bias, y);
}

/* bfloat16 rows where the CPU has AVX2 and FMA but no bf16 dot products (VDPBF16PS): the
 * same products as the bf16 kernels below (weights rounded to bf16 for blocks in tiles;
 * Q4_1 in lanes exactly, as quant_lanes.c), in float32 FMAs on 8 lanes. A bf16 widens to
 * a float32 exactly, and a bf16 times a bf16 fits a float32's 24 bits, so only the order
 * of the sums differs from those kernels; each row's sum runs in one order whatever
 * rows come with it. x's rows are widened once a pass into a buffer (their values
 * widened at every load cost ~2 more instructions an FMA); where memory for it is short,
 * a row a pass widened as it is read. */
#if defined(VECTOR) && !defined(__AVX512BF16__)
#define WEIGHT_ROW(name, layout, io) \
static void name(int64_t rows, const int kind, const void *xs, int64_t K, const uint8_t *q, \
                 const float *d, const float *m, int64_t n, const float *bias, void *ys, \
                 int64_t N) \
{ \
    switch (rows) { \
    case 1: rows_times_weight_row(1, kind, layout, io, xs, K, q, d, m, n, bias, ys, N); break; \
    case 2: rows_times_weight_row(2, kind, layout, io, xs, K, q, d, m, n, bias, ys, N); break; \
    case 3: rows_times_weight_row(3, kind, layout, io, xs, K, q, d, m, n, bias, ys, N); break; \
    case 4: rows_times_weight_row(4, kind, layout, io, xs, K, q, d, m, n, bias, ys, N); break; \
    case 5: rows_times_weight_row(5, kind, layout, io, xs, K, q, d, m, n, bias, ys, N); break; \
    case 6: rows_times_weight_row(6, kind, layout, io, xs, K, q, d, m, n, bias, ys, N); break; \
    case 7: rows_times_weight_row(7, kind, layout, io, xs, K, q, d, m, n, bias, ys, N); break; \
    case 8: rows_times_weight_row(8, kind, layout, io, xs, K, q, d, m, n, bias, ys, N); break; \
    } \
}
WEIGHT_ROW(tiles_row, TILES_BF16, IN_F32 | OUT_BF16)
WEIGHT_ROW(tiles_wide_row, TILES_BF16, IN_F32 | OUT_WIDE)
WEIGHT_ROW(lanes_row, LANES_EXACT, IN_F32 | OUT_BF16)
#undef WEIGHT_ROW

/* one row of bf16 x, widened as it is read */
static void widened_row(const int layout, const int out, const int kind, const uint16_t *x,
                        int64_t K, const uint8_t *q, const float *d, const float *m,
                        int64_t n, const float *bias, void *y, int64_t N)
{
    if (layout == LANES_EXACT)
        rows_times_weight_row(1, kind, LANES_EXACT, IN_BF16 | OUT_BF16, x, K, q, d, m, n,
                              bias, y, N);
    else if (out == OUT_WIDE)
        rows_times_weight_row(1, kind, TILES_BF16, IN_BF16 | OUT_WIDE, x, K, q, d, m, n,
                              bias, y, N);
    else
        rows_times_weight_row(1, kind, TILES_BF16, IN_BF16 | OUT_BF16, x, K, q, d, m, n,
                              bias, y, N);
}

/* y = x w^T (+ bias), x bfloat16, y as `out` (OUT_BF16 or OUT_WIDE) stores it */
static void linear_widened(const int layout, const int out, const int kind, const uint16_t *x,
                           int64_t M, int64_t K, const uint8_t *q, const float *d,
                           const float *m, int64_t N, const float *bias, void *y)
{
    const int64_t per = M < ROWS ? M : ROWS, ysize = out == OUT_WIDE ? 4 : 2;
    float *xs = rows_buffer((size_t)(per * K) * sizeof *xs);
    const weight_row_fn row = layout == LANES_EXACT ? lanes_row
                              : out == OUT_WIDE ? tiles_wide_row : tiles_row;
    const int64_t pass = xs ? per : 1;
    for (int64_t r0 = 0; r0 < M; r0 += pass) {
        const int64_t rows = M - r0 < pass ? M - r0 : pass;
        char *ys = (char *)y + r0 * N * ysize;
        if (xs)
            for (int64_t i = 0; i < rows * K; i++)
                xs[i] = bf16_widen(x[r0 * K + i]);
        #pragma omp parallel for schedule(static) if (N * K >= 65536)
        for (int64_t n = 0; n < N; n++) {
            if (xs)
                row(rows, kind, xs, K, q, d, m, n, bias, ys, N);
            else
                widened_row(layout, out, kind, x + r0 * K, K, q, d, m, n, bias, ys, N);
        }
    }
}
#endif

/* bfloat16 rows, where the CPU has VDPBF16PS: each block's weights made as above, then
 * rounded to bfloat16 (to nearest even: the values a bfloat16 model's packed weight
 * holds), and x . w summed by bf16 pair products into float32 lanes, one instruction
 * per row and block; y = the sum (+ bias) rounded to bfloat16 once, as torch's bf16
 * GEMM rounds. x [M, K] and y [M, N] bfloat16, bias float32; the blocks in tiles of 16
 * weight rows (quant_blocks.h), not the layout above.
 *
 * Each 16-lane sum runs over the blocks in order and a tile's 16 weight rows' sums are
 * reduced together (sum_lanes16), whichever of the two ways below computes them, so
 * both give the same bits. Without AMX the products are bound by the arithmetic ports,
 * which the unpacking of a block (a few cycles) shares with the products (two a
 * cycle): few rows multiply each block as it is unpacked, several weight rows at a time
 * so that each row of x is loaded once for all of them; more rows unpack a tile's
 * blocks once into a buffer and multiply 4 weight rows by 6 rows of x in registers.
 * Both keep VDPBF16PS busier than one weight row's products after another (measured:
 * docs/kernels.md, "Several weight rows at once in the bf16 dot products"). Each
 * block's bf16 table and indices: quant_blocks.h. */
#if defined(__AVX512BF16__)
#define TILE 16                   /* weight rows whose sums are reduced together */
#define PASS_ROWS 48              /* rows of x per pass over the weight, at most */
#define FEW_ROWS 12               /* up to this many: each block multiplied as unpacked */
#define WIDE 4                    /* weight rows multiplied at once (by up to 6 x rows) */
#define CHUNK_BLOCKS 32           /* blocks of a tile unpacked at a time (32 KB) */

/* x's rows block by block: xs[(b * R + r) * BLOCK + j] = x[r, b * BLOCK + j] */
static void rows_by_block(const uint16_t *x, int64_t R, int64_t K, uint16_t *xs)
{
    for (int64_t b = 0; b < K / BLOCK; b++)
        for (int64_t r = 0; r < R; r++)
            memcpy(xs + (b * R + r) * BLOCK, x + r * K + b * BLOCK, BLOCK * sizeof *x);
}

static inline __m512bh block_bf16(const int kind, const uint8_t *q, const float *d,
                                  const float *m, int64_t at)
{
    return kind == 4 ? q4_1_bf16(q + at * 16, d[at], m[at])
                     : q8_0_bf16((const int8_t *)q + at * BLOCK, d[at]);
}

/* lanes[r][t] = the 16-lane sums of x row r . weight row n0 + t for the R (<= FEW_ROWS)
 * rows of xs (rows_by_block), each block multiplied as it is unpacked */
static inline __attribute__((always_inline)) void few_rows_tile(
    const int R, const int W, const int kind, const uint16_t *xs, int64_t blocks,
    const uint8_t *q, const float *d, const float *m, int64_t n0, __m512 lanes[][TILE])
{
    for (int t = 0; t < TILE; t += W) {
        /* W sixteenths of the next tile's blocks a pass (quant_blocks.h) */
        for (int64_t b = t * blocks / TILE; b < (t + W) * blocks / TILE; b++)
            prefetch_tile_blocks(kind, q, d, m, tile_block(n0 + TILE, b, blocks));
        __m512 acc[WIDE][FEW_ROWS];
        for (int i = 0; i < W; i++)
            for (int r = 0; r < R; r++)
                acc[i][r] = _mm512_setzero_ps();
        const uint16_t *xb = xs;
        for (int64_t b = 0; b < blocks; b++, xb += R * BLOCK) {
            __m512bh w[WIDE];
            for (int i = 0; i < W; i++)
                w[i] = block_bf16(kind, q, d, m, tile_block(n0 + t + i, b, blocks));
            for (int r = 0; r < R; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * BLOCK);
                for (int i = 0; i < W; i++)
                    acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, w[i]);
            }
        }
        for (int i = 0; i < W; i++)
            for (int r = 0; r < R; r++)
                lanes[r][t + i] = acc[i][r];
    }
}

#define MANY 6                    /* rows of x whose sums stay in registers */

/* lanes[r0 + r][t0 + i] (+)= x row r0 + r . weight row t0 + i over the `count` blocks
 * of ws (the tile's unpacked weights, ws[(b * TILE + t) * BLOCK + j]) and of xb (R
 * rows of `rows` in xs's order from the same block), i < WIDE, r < R (<= MANY) */
static inline __attribute__((always_inline)) void unpacked_sums(
    const int R, const uint16_t *ws, const uint16_t *xb, int64_t rows, int64_t count,
    int t0, int64_t r0, int first, __m512 lanes[][TILE])
{
    __m512 acc[WIDE][MANY];
    for (int i = 0; i < WIDE; i++)
        for (int r = 0; r < R; r++)
            acc[i][r] = first ? _mm512_setzero_ps() : lanes[r0 + r][t0 + i];
    ws += t0 * BLOCK;
    xb += r0 * BLOCK;
    for (int64_t b = 0; b < count; b++, ws += TILE * BLOCK, xb += rows * BLOCK) {
        __m512bh w[WIDE];
        for (int i = 0; i < WIDE; i++)
            w[i] = (__m512bh)_mm512_load_si512(ws + i * BLOCK);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * BLOCK);
            for (int i = 0; i < WIDE; i++)
                acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, w[i]);
        }
    }
    for (int i = 0; i < WIDE; i++)
        for (int r = 0; r < R; r++)
            lanes[r0 + r][t0 + i] = acc[i][r];
}

/* lanes[r][t] for all `rows` (<= PASS_ROWS) of xs: the tile's blocks unpacked
 * CHUNK_BLOCKS at a time into ws, then multiplied WIDE weight rows by MANY x rows */
static void many_rows_tile(const int kind, const uint16_t *xs, int64_t rows, int64_t blocks,
                           const uint8_t *q, const float *d, const float *m, int64_t n0,
                           uint16_t *ws, __m512 lanes[][TILE])
{
    for (int64_t b0 = 0; b0 < blocks; b0 += CHUNK_BLOCKS) {
        const int64_t count = blocks - b0 < CHUNK_BLOCKS ? blocks - b0 : CHUNK_BLOCKS;
        for (int64_t b = 0; b < count; b++) {
            prefetch_tile_blocks(kind, q, d, m, tile_block(n0 + TILE, b0 + b, blocks));
            for (int t = 0; t < TILE; t++) {
                const __m512bh w = block_bf16(kind, q, d, m, tile_block(n0 + t, b0 + b, blocks));
                _mm512_store_si512(ws + (b * TILE + t) * BLOCK, (__m512i)w);
            }
        }
        const uint16_t *xb = xs + b0 * rows * BLOCK;
        for (int64_t r0 = 0; r0 < rows; r0 += MANY)      /* x's 6 rows stay in L1 */
            for (int t0 = 0; t0 < TILE; t0 += WIDE)
                switch (rows - r0 < MANY ? rows - r0 : MANY) {
#define CASE(R) case R: unpacked_sums(R, ws, xb, rows, count, t0, r0, b0 == 0, lanes); break;
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
                }
    }
}

/* y rows < `rows` (x's, in xs's order), weight rows n0 .. n0 + count - 1; into `wide`
 * instead where it is not NULL: the same bf16 values widened to float32 */
static void weight_tile_bf16(int64_t rows, const int kind, const uint16_t *xs, int64_t K,
                             const uint8_t *q, const float *d, const float *m, int64_t n0,
                             int64_t count, const float *bias, uint16_t *y, float *wide,
                             int64_t N, uint16_t *ws)
{
    __m512 lanes[PASS_ROWS][TILE];
    const int64_t blocks = K / BLOCK;
    switch (rows) {
#define CASE(R, W) case R: few_rows_tile(R, W, kind, xs, blocks, q, d, m, n0, lanes); break;
    CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(5, 4) CASE(6, 4)      /* 24 sums at most */
    CASE(7, 2) CASE(8, 2) CASE(9, 2) CASE(10, 2) CASE(11, 2) CASE(12, 2)
#undef CASE
    default: many_rows_tile(kind, xs, rows, blocks, q, d, m, n0, ws, lanes);
    }
    const __mmask16 keep = (__mmask16)((1u << count) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const __m256i sums = (__m256i)_mm512_cvtneps_pbh(
            _mm512_add_ps(sum_lanes16(lanes[r]), b));
        if (wide)
            _mm512_mask_storeu_ps(wide + r * N + n0, keep, bf16_widen16(sums));
        else
            _mm256_mask_storeu_epi16(y + r * N + n0, keep, sums);
    }
}


/* y = x w^T (+ bias) in bfloat16: up to PASS_ROWS rows of x per pass over the weight,
 * its tiles of TILE rows split over the threads */
static void linear_bf16(const int kind, const uint16_t *x, int64_t M, int64_t K,
                        const uint8_t *q, const float *d, const float *m, int64_t N,
                        const float *bias, uint16_t *y, float *wide)
{
    const int64_t tiles = (N + TILE - 1) / TILE;
    /* 48 rows a pass, with x's rows kept in L1: faster than 32 a pass was before they
     * were, and than 64 rows in one pass, whose sums no longer stay in L1 (measured:
     * docs/kernels.md, "48 rows of x a pass over the weight") */
    const int64_t per = M < PASS_ROWS ? M : PASS_ROWS;
    uint16_t *xs = per > 1 ? rows_buffer((size_t)per * K * sizeof *xs) : NULL;
    const int64_t pass = xs ? per : 1;       /* one row is in block order as it lies */
    for (int64_t r0 = 0; r0 < M; r0 += pass) {
        const int64_t rows = M - r0 < pass ? M - r0 : pass;
        if (xs)
            rows_by_block(x + r0 * K, rows, K, xs);
        const uint16_t *xr = xs ? xs : x + r0 * K;
        #pragma omp parallel if (N * K >= 65536)
        {
            uint16_t ws[CHUNK_BLOCKS * TILE * BLOCK] __attribute__((aligned(64)));
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t n0 = t * TILE;
                weight_tile_bf16(rows, kind, xr, K, q, d, m, n0,
                                 N - n0 < TILE ? N - n0 : TILE, bias, y + r0 * N,
                                 wide ? wide + r0 * N : NULL, N, ws);
            }
        }
    }
}
#endif

/* How the bfloat16 kernels below compute: 2 by bf16 dot products (VDPBF16PS), 1 by
 * float32 FMAs (AVX2), 0 not at all (they do nothing) */
int linear_bf16_dots(void)
{
#if defined(__AVX512BF16__)
    return 2;
#elif defined(VECTOR)
    return 1;
#else
    return 0;
#endif
}

void linear_q4_1_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *q,
                      const float *d, const float *m, int64_t N, const float *bias, uint16_t *y)
{
    if (linear_tiles_bf16(4, x, M, K, q, d, m, N, bias, y) == 0)
        return;
#if defined(__AVX512BF16__)
    linear_bf16(4, x, M, K, q, d, m, N, bias, y, NULL);
#elif defined(VECTOR)
    linear_widened(TILES_BF16, OUT_BF16, 4, x, M, K, q, d, m, N, bias, y);
#else
    (void)x; (void)M; (void)K; (void)q; (void)d; (void)m; (void)N; (void)bias; (void)y;
#endif
}

void linear_q8_0_bf16(const uint16_t *x, int64_t M, int64_t K, const int8_t *q,
                      const float *d, int64_t N, const float *bias, uint16_t *y)
{
    if (linear_tiles_bf16(8, x, M, K, (const uint8_t *)q, d, NULL, N, bias, y) == 0)
        return;
#if defined(__AVX512BF16__)
    linear_bf16(8, x, M, K, (const uint8_t *)q, d, NULL, N, bias, y, NULL);
#elif defined(VECTOR)
    linear_widened(TILES_BF16, OUT_BF16, 8, x, M, K, (const uint8_t *)q, d, NULL, N, bias, y);
#else
    (void)x; (void)M; (void)K; (void)q; (void)d; (void)N; (void)bias; (void)y;
#endif
}

/* linear_q8_0_bf16's result as float32 (the same bf16 values, widened as they are
 * stored): a model's logits without a second pass over them (measured: docs/kernels.md,
 * "Logits widened as they are stored"). 0, or -1 where it did nothing (no bf16 dot
 * products or FMAs, or memory short for AMX tiles' bf16 result). */
int linear_q8_0_bf16_f32(const uint16_t *x, int64_t M, int64_t K, const int8_t *q,
                         const float *d, int64_t N, const float *bias, float *y)
{
#if defined(__AVX512BF16__)
    if (M > 1 && linear_bf16_tiles(-1)) {      /* the tiles store bf16: widened after */
        uint16_t *h = malloc((size_t)(M * N) * sizeof *h);
        if (!h)
            return -1;
        const int done = linear_tiles_bf16(8, x, M, K, (const uint8_t *)q, d, NULL, N,
                                           bias, h) == 0;
        if (done) {
            #pragma omp parallel for schedule(static) if (M * N >= 65536)
            for (int64_t i = 0; i < M * N; i++)
                y[i] = bf16_widen(h[i]);
        }
        free(h);
        if (done)
            return 0;
    }
    linear_bf16(8, x, M, K, (const uint8_t *)q, d, NULL, N, bias, NULL, y);
    return 0;
#elif defined(VECTOR)
    linear_widened(TILES_BF16, OUT_WIDE, 8, x, M, K, (const uint8_t *)q, d, NULL, N, bias, y);
    return 0;
#else
    (void)x; (void)M; (void)K; (void)q; (void)d; (void)N; (void)bias; (void)y;
    return -1;
#endif
}

#if !defined(__AVX512BF16__)
/* (quant_lanes.c, where the CPU has VDPBF16PS) */
void linear_q4_1_lanes_bf16(const uint16_t *x, int64_t M, int64_t K, const uint32_t *q,
                            const float *d, const float *m, int64_t N, const float *bias,
                            uint16_t *y)
{
#if defined(VECTOR)
    linear_widened(LANES_EXACT, OUT_BF16, 4, x, M, K, (const uint8_t *)q, d, m, N, bias, y);
#else
    (void)x; (void)M; (void)K; (void)q; (void)d; (void)m; (void)N; (void)bias; (void)y;
#endif
}
#endif
