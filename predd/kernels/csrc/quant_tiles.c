/* Projections from quantised blocks by AMX tiles (bf16 rows, 2 or more), for
 * quant_linear.c's bf16 entry points; elsewhere `linear_tiles_bf16` does nothing. */
#pragma GCC optimize("fp-contract=off")   /* the blocks' weights as the loader makes them */

#include <stdint.h>

#include "kernels.h"
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "lanes.h"
#include "quant_blocks.h"

#if defined(AMX)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_GROUPS 6                          /* rows of x per pass: 6 tiles of 16 */
/* one row takes the dot-product kernel: with nothing to share the unpacking with, the
 * tiles' set-up costs more than they save (measured: docs/kernels.md, "AMX tiles from
 * 2 rows") */
#define AMX_MIN_ROWS 2
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* AMX tiles multiply 16 rows of 32 bf16 by 16 pairs of columns in one instruction.
 * A 16-row tile of the weight is made block by block (quant_blocks.h; each weight row's block
 * is one 64-byte tile row: no transposing of weights) and multiplied by x's rows laid
 * out as the tile unit wants them (pairs of columns, x transposed, in groups of 16 rows:
 * made once a call), into up to six 16 x 16 float32 tiles of sums. The unpacking is
 * done once for up to 96 rows of x, and the products cost almost nothing beside it:
 * where the dot-product kernel spent one instruction per row and block, this spends
 * one per 16 x 16 x 32. A group short of 16 rows is padded with zero rows. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* 1 once the kernel has let this process use the tile registers (Linux asks each
 * process to request them), else 0 */
static int tiles_off;                /* linear_bf16_tiles(0): the dot products only */

static int amx_permitted(void)
{
    static int state = -1;
    if (state < 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

int amx_ready(void)
{
    return !tiles_off && amx_permitted();
}

/* The configuration is a constant in memory, not built on the stack: GCC
 * does not count ldtilecfg as reading its operand, and, once this function was no
 * longer inlined, dropped the stores that built it (the tile unit then faults on the
 * garbage in its reserved bytes). */
static const struct tile_config amx_config __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

void amx_configure(void)
{
    _tile_loadconfig(&amx_config);
}

/* tile numbers are immediates: one case per group */
#define AMX_EACH(g, op) switch (g) { case 0: op(0); break; case 1: op(1); break; \
    case 2: op(2); break; case 3: op(3); break; case 4: op(4); break; default: op(5); }
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DOT(t) _tile_dpbf16ps(t, 6, 7)
#define AMX_STORE(t) _tile_stored(t, (float *)c, 64)

/* tiled blocks asked for this many ahead of the ones unpacked: 16 of a tile's blocks of
 * 16 rows (4 KB of Q4_1) */
#define AHEAD (16 * 16)

/* Block b of weight rows n0 .. n0 + count - 1 (n0 a multiple of 16; the blocks in tiles,
 * quant_blocks.h) unpacked to bf16 into a (16 x 32, a tile; rows past count are left as
 * they are), asking for the blocks AHEAD. */
static inline void amx_unpack(const int kind, const uint8_t *q, const float *d,
                              const float *m, int64_t n0, int64_t count, int64_t blocks,
                              int64_t b, uint16_t *a)
{
    const int64_t first = tile_block(n0, b, blocks);
    prefetch_tile_blocks(kind, q, d, m, first + AHEAD);
    for (int64_t t = 0; t < count; t++) {
        const int64_t at = first + t;
        const __m512bh w = kind == 4 ? q4_1_bf16(q + at * 16, d[at], m[at])
                                     : q8_0_bf16((const int8_t *)q + at * BLOCK, d[at]);
        _mm512_store_si512(a + t * BLOCK, (__m512i)w);
    }
}

/* rows x rows of y, columns n0 .. n0 + count - 1, from a tile of sums c (c[t * 16 + j]:
 * weight row t, x row j), plus the tile `more` where not NULL, plus bias; rounded to bf16 */
static inline void amx_write(const float *c, const float *more, int64_t rows,
                             const float *bias, int64_t n0, int64_t count, uint16_t *y,
                             int64_t N)
{
    const __mmask16 keep = (__mmask16)((1u << count) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96,
                                            80, 64, 48, 32, 16, 0);
    for (int64_t j = 0; j < rows; j++) {
        __m512 sums = _mm512_add_ps(_mm512_i32gather_ps(column, c + j, 4), bv);
        if (more)
            sums = _mm512_add_ps(sums, _mm512_i32gather_ps(column, more + j, 4));
        _mm256_mask_storeu_epi16(y + j * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(sums));
    }
}

/* y rows of `groups` groups of 16 (the last `last` rows long), weight rows n0 .. n0 +
 * count - 1; xt: x transposed in pairs, group g's block b at xt + (g * blocks + b) * 256
 * (16 pair-rows of 16 rows of x, as uint32). For 5 or 6 groups: tiles 0..5 are the sums
 * of group g (weight rows x rows of x), 6 the weight, 7 x's group. */
static inline __attribute__((always_inline)) void amx_tile(
    const int kind, const uint32_t *xt, int groups, int64_t last, int64_t K,
    const uint8_t *q, const float *d, const float *m, int64_t n0, int64_t count,
    const float *bias, uint16_t *y, int64_t N)
{
    const int64_t blocks = K / BLOCK;
    __attribute__((aligned(64))) uint16_t a[16 * BLOCK];
    __attribute__((aligned(64))) float c[16 * 16];
    for (int g = 0; g < groups; g++)
        AMX_EACH(g, AMX_ZERO)
    if (count < 16)
        memset(a, 0, sizeof a);
    for (int64_t b = 0; b < blocks; b++) {
        amx_unpack(kind, q, d, m, n0, count, blocks, b, a);
        _tile_loadd(6, a, 64);
        for (int g = 0; g < groups; g++) {
            _tile_loadd(7, xt + (g * blocks + b) * 256, 64);
            AMX_EACH(g, AMX_DOT)
        }
    }
    for (int g = 0; g < groups; g++) {
        AMX_EACH(g, AMX_STORE)
        amx_write(c, NULL, g == groups - 1 ? last : 16, bias, n0, count, y + 16 * g * N, N);
    }
}

/* one block's products for one to four groups, the weight in tile W: one group's blocks
 * alternate between sums 0 (x in 6) and sums 1 (x in 7); more groups' sums are tiles
 * 0 .. 3, their x alternating between 6 and 7 */
#define AMX_FEW_BLOCK(W) do {                                                           \
        _tile_loadd(W, a[b & 1], 64);                                                   \
        if (groups == 1) {                                                              \
            if (b & 1) {                                                                \
                _tile_loadd(7, xt + b * 256, 64);                                       \
                _tile_dpbf16ps(1, W, 7);                                                \
            } else {                                                                    \
                _tile_loadd(6, xt + b * 256, 64);                                       \
                _tile_dpbf16ps(0, W, 6);                                                \
            }                                                                           \
            break;                                                                      \
        }                                                                               \
        _tile_loadd(6, xt + b * 256, 64);                                               \
        _tile_dpbf16ps(0, W, 6);                                                        \
        _tile_loadd(7, xt + (blocks + b) * 256, 64);                                    \
        _tile_dpbf16ps(1, W, 7);                                                        \
        if (groups > 2) {                                                               \
            _tile_loadd(6, xt + (2 * blocks + b) * 256, 64);                            \
            _tile_dpbf16ps(2, W, 6);                                                    \
        }                                                                               \
        if (groups > 3) {                                                               \
            _tile_loadd(7, xt + (3 * blocks + b) * 256, 64);                            \
            _tile_dpbf16ps(3, W, 7);                                                    \
        }                                                                               \
    } while (0)

/* amx_tile for one to four groups (up to 64 rows of x: decode steps): the tile unit
 * does not rename its registers, so with one weight, one x and one sums tile each
 * product waited for the one before it (its latency is several times its throughput)
 * and each load for the product still reading that tile. Here the weight's blocks
 * alternate between two tiles (4, 5), each unpacked a block ahead of its products, x
 * between two (6, 7), and one group's blocks between two sums tiles, added at the end. */
static inline __attribute__((always_inline)) void amx_tile_few(
    const int kind, const uint32_t *xt, int groups, int64_t last, int64_t K,
    const uint8_t *q, const float *d, const float *m, int64_t n0, int64_t count,
    const float *bias, uint16_t *y, int64_t N)
{
    const int64_t blocks = K / BLOCK;
    __attribute__((aligned(64))) uint16_t a[2][16 * BLOCK];
    __attribute__((aligned(64))) float c[2][16 * 16];
    for (int g = 0; g < (groups == 1 ? 2 : groups); g++)
        AMX_EACH(g, AMX_ZERO)
    if (count < 16)
        memset(a, 0, sizeof a);
    amx_unpack(kind, q, d, m, n0, count, blocks, 0, a[0]);
    for (int64_t b = 0; b < blocks; b++) {
        if (b + 1 < blocks)
            amx_unpack(kind, q, d, m, n0, count, blocks, b + 1, a[(b + 1) & 1]);
        if (b & 1)
            AMX_FEW_BLOCK(5);
        else
            AMX_FEW_BLOCK(4);
    }
    if (groups == 1) {
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        amx_write(c[0], c[1], last, bias, n0, count, y, N);
        return;
    }
    for (int g = 0; g < groups; g++) {
        AMX_EACH(g, AMX_STORE)
        amx_write(c[0], NULL, g == groups - 1 ? last : 16, bias, n0, count, y + 16 * g * N, N);
    }
}

/* a weight tile's products by the kernel for its kind and number of groups, both
 * constants there, so that the compiler drops the branches on them. The pipelined
 * kernel above is the faster one (measured: docs/kernels.md, "A pipelined AMX tile
 * kernel"). */
static void amx_tile_any(const int kind, const uint32_t *xt, int groups, int64_t last,
                         int64_t K, const uint8_t *q, const float *d, const float *m,
                         int64_t n0, int64_t count, const float *bias, uint16_t *y, int64_t N)
{
#define AMX_KIND(run, g) do {                                                           \
        if (kind == 4)                                                                  \
            run(4, xt, g, last, K, q, d, m, n0, count, bias, y, N);                     \
        else                                                                            \
            run(8, xt, g, last, K, q, d, m, n0, count, bias, y, N);                     \
    } while (0)
    if (groups == 1)
        AMX_KIND(amx_tile_few, 1);
    else if (groups == 2)
        AMX_KIND(amx_tile_few, 2);
    else if (groups == 3)
        AMX_KIND(amx_tile_few, 3);
    else if (groups == 4)
        AMX_KIND(amx_tile_few, 4);
    else if (groups == 5)
        AMX_KIND(amx_tile, 5);
    else
        AMX_KIND(amx_tile, 6);
#undef AMX_KIND
}

/* y = x w^T (+ bias) in bfloat16 by AMX tiles, 96 rows of x per pass; 0, or -1 where
 * there are too few rows, the tiles are not permitted or memory is short (nothing
 * written) */
static int linear_amx(const int kind, const uint16_t *x, int64_t M, int64_t K,
                      const uint8_t *q, const float *d, const float *m, int64_t N,
                      const float *bias, uint16_t *y)
{
    if (M < AMX_MIN_ROWS || !amx_ready())
        return -1;
    const int64_t blocks = K / BLOCK, tiles = (N + 15) / 16;
    const int64_t most = (M + 15) / 16 < AMX_GROUPS ? (M + 15) / 16 : AMX_GROUPS;
    uint32_t *xt = aligned_alloc(64, (size_t)most * blocks * 256 * 4);  /* a pass's groups */
    if (!xt)
        return -1;
    for (int64_t r0 = 0; r0 < M; r0 += 16 * AMX_GROUPS) {
        const int64_t left = M - r0 < 16 * AMX_GROUPS ? M - r0 : 16 * AMX_GROUPS;
        const int groups = (int)((left + 15) / 16);
        const int64_t last = left - 16 * (groups - 1);
        #pragma omp parallel
        {
            /* xt row i of group g's block b: pair i of each of the group's rows */
            #pragma omp for schedule(static)
            for (int64_t gb = 0; gb < groups * blocks; gb++) {
                const int64_t g = gb / blocks, b = gb % blocks;
                transpose16_u32(xt + gb * 256, (const uint32_t *)(x + (r0 + 16 * g) * K) + b * 16,
                                K / 2, g == groups - 1 ? last : 16);
            }
            amx_configure();
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++)
                amx_tile_any(
                    kind, xt, groups, last, K, q, d, m, t * 16,
                    N - t * 16 < 16 ? N - t * 16 : 16, bias, y + r0 * N, N);
            _tile_release();
        }
    }
    free(xt);
    return 0;
}
#endif

/* 1 where the bfloat16 kernels below use AMX tiles for 2 rows or more (compiled for
 * them, this process permitted them, and not turned off), else 0. `use` 0 turns them
 * off for the process (the dot-product kernel at every row count: tests run both), 1
 * back on; -1 leaves them as they are. */
int linear_bf16_tiles(int use)
{
#if defined(AMX)
    if (use >= 0)
        tiles_off = !use;
    return !tiles_off && amx_permitted();
#else
    (void)use;
    return 0;
#endif
}

int linear_tiles_bf16(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *q,
                      const float *d, const float *m, int64_t N, const float *bias,
                      uint16_t *y)
{
#if defined(AMX)
    return linear_amx(kind, x, M, K, q, d, m, N, bias, y);
#else
    (void)kind; (void)x; (void)M; (void)K; (void)q; (void)d; (void)m; (void)N; (void)bias;
    (void)y;
    return -1;
#endif
}
