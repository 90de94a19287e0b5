/* Quantised GGUF blocks as the projection kernels read them (quant_linear.c, the
 * dot products; quant_tiles.c, AMX tiles): prefetching a weight row, and a block's 32
 * weights made exactly as the loader's dequantisation makes them (the multiply, then
 * the add, never fused: these files compile with fp-contract off), in float32 or rounded
 * to bfloat16. Layout: q [N, K / 32, 16] bytes for Q4_1 (byte j holds weight j in its
 * low nibble and j + 16 in its high one), [N, K / 32, 32] int8 for Q8_0; d and m
 * [N, K / 32] float32 (in tiles of 16 rows for the bfloat16 kernels: below; half floats
 * for the int8 kernels, quant_int8.c). `kind` 4
 * is Q4_1, 8 is Q8_0. */
#ifndef PREDD_QUANT_BLOCKS_H
#define PREDD_QUANT_BLOCKS_H
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 32
/* Weight row n + PREFETCH_ROWS is asked for while row n is computed: a row of a
 * decode projection is a few hundred bytes, too little for the hardware prefetcher
 * to run ahead of, and without this a pass over the model's blocks waited on memory,
 * as slow as the dense bf16 GEMM (measured: docs/kernels.md, "Prefetching weight
 * rows"). */
#define PREFETCH_ROWS 4

/* Asks for weight row n's blocks (q, d and m, `scale` bytes each: float32 4, float16 2)
 * to be brought into cache; never faults, so rows past the end are harmless. */
static inline void prefetch_weight_row(const int kind, const uint8_t *q, const void *d,
                                       const void *m, int64_t n, int64_t blocks, int64_t scale)
{
    const int64_t bytes = blocks * (kind == 4 ? 16 : BLOCK);
    const char *row = (const char *)q + n * bytes;
    for (int64_t at = 0; at < bytes; at += 64)
        __builtin_prefetch(row + at);
    __builtin_prefetch((const char *)d + n * blocks * scale);
    __builtin_prefetch((const char *)d + ((n + 1) * blocks - 1) * scale);
    if (m) {
        __builtin_prefetch((const char *)m + n * blocks * scale);
        __builtin_prefetch((const char *)m + ((n + 1) * blocks - 1) * scale);
    }
}

/* The bfloat16 kernels (quant_linear.c's dot products, quant_tiles.c's tiles) read the
 * blocks in tiles of 16 weight rows (predd.model.loader.QuantBlocks.in_tiles): block b of
 * weight row n is block tile_block(n, b) of q (16 or 32 bytes each), d and m alike, the
 * last tile padded with zero rows. A tile's blocks, as the kernels take them, are then
 * one stream of memory instead of 16 rows' streams side by side, which the hardware
 * prefetcher follows and one prefetch a cache line covers (measured: docs/kernels.md,
 * "Blocks in tiles of 16 weight rows"). */
static inline int64_t tile_block(int64_t n, int64_t b, int64_t blocks)
{
    return ((n >> 4) * blocks + b) * 16 + (n & 15);
}

/* Asks for the 16 blocks (one of each of a tile's rows) from block `at` of tiled blocks */
static inline void prefetch_tile_blocks(const int kind, const uint8_t *q, const float *d,
                                        const float *m, int64_t at)
{
    const int64_t bytes = 16 * (kind == 4 ? 16 : BLOCK);
    const char *p = (const char *)q + at * (bytes / 16);
    for (int64_t i = 0; i < bytes; i += 64)
        __builtin_prefetch(p + i);
    __builtin_prefetch(d + at);
    if (m)
        __builtin_prefetch(m + at);
}

/* The 32 weights of one block as float32, into w. */
static inline void q4_1_block(const uint8_t *q, float d, float m, float *w)
{
    for (int j = 0; j < 16; j++) {
        w[j] = d * (float)(q[j] & 0x0F) + m;
        w[j + 16] = d * (float)(q[j] >> 4) + m;
    }
}

static inline void q8_0_block(const int8_t *q, float d, float *w)
{
    for (int j = 0; j < BLOCK; j++)
        w[j] = (float)q[j] * d;
}

#if defined(__AVX512BF16__)
/* The block's 16 possible weights d q + m (multiplied, then added, as above) rounded to
 * bf16 once, and its 32 weights looked up among them by their 4-bit q: fewer and
 * cheaper instructions than widening and converting all 32. The table holds the 16
 * twice, as VPERMW reads 5 bits of each index, so the bytes need no masking: weights
 * 0-15 are indexed by the whole byte (its low nibble; bit 4, from the high one, only
 * picks the copy), 16-31 by the bytes shifted down 4 in their 16-bit pairs (the high
 * nibble; bit 4 from the next byte) (measured: docs/kernels.md, "Q4_1 weights looked
 * up from a bf16 table"). */
static inline __m512bh q4_1_bf16(const uint8_t *q, float d, float m)
{
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 values = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), iota),
                                        _mm512_set1_ps(m));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    const __m256i nibbles = _mm256_srlv_epi16(both, _mm256_set_epi16(4, 4, 4, 4, 4, 4, 4, 4,
                                                                     0, 0, 0, 0, 0, 0, 0, 0));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nibbles), table);
}

static inline __m512bh q8_0_bf16(const int8_t *q, float d)
{
    const __m512 vd = _mm512_set1_ps(d);
    const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)q))), vd);
    const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)(q + 16)))), vd);
    return _mm512_cvtne2ps_pbh(w1, w0);
}
#endif

/* The calling thread's buffer of at least `bytes` for x's rows as a kernel takes them
 * (quantised, in block order, or widened), kept from call to call (a step makes ~120
 * calls; a few hundred KB at most for SmolLM2, held until the thread ends); NULL where
 * memory is short. One buffer a file that uses it. */
static inline void *rows_buffer(size_t bytes)
{
    static __thread void *buffer;
    static __thread size_t held;
    if (bytes > held) {
        free(buffer);
        buffer = malloc(bytes);
        held = buffer ? bytes : 0;
    }
    return buffer;
}

/* quant_tiles.c, for quant_linear.c's bf16 entry points: y = x w^T (+ bias) in bf16 by
 * AMX tiles, the blocks in tiles (above); 0, or -1 where it did nothing (one row, no
 * tiles here, or memory short) */
int linear_tiles_bf16(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *q,
                      const float *d, const float *m, int64_t N, const float *bias,
                      uint16_t *y);
#endif
