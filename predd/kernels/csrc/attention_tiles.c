/* Paged attention for chunks (calls of several new tokens) in blocks of 16 query vectors,
 * by AMX tiles (or bf16 dot products without them: below), bfloat16 pool
 * and rows, pages of 16 entries: paged_attention.c scores each query row against every
 * entry alone (dot products), so a chunk of many rows (an agent's observation) costs
 * each row's own pass over every entry (measured: docs/kernels.md, "Attention in blocks
 * of 16 query rows"); here 16 query vectors are scored against a page's 16 entries in
 * one tile product.
 *
 * A task is one call's block of 16 query vectors (its rows x the query heads of one kv
 * head, row-major) and that kv head. Per page: the page's K, transposed into pairs of
 * dims (the tile unit's layout for the right operand), times the block's q: 16 x 16
 * scores. Softmax per query vector over the entries its row sees (causal within the
 * chunk) in float32, as paged_attention.c does (exp_approx's polynomial, on 16 lanes;
 * the same max shift). The weighted sum of V: the probabilities as three bfloat16
 * parts, p = hi + mid + lo (each the rounded rest of the one before: together
 * float32's 24 bits of p, where one bf16 keeps 8, and two left errors of 1e-6 where an
 * output cancels to near 0), each times V laid out in pairs of entries, into float32
 * tiles. So each output is the float32 computation rounded to bf16 once, as paged_attention.c's (the tests hold both
 * to the same bound). Entries past the call's last are never read: their probabilities
 * are 0 and their V is taken as 0 (a NaN there would poison 0 x NaN).
 *
 * The same blocks serve cascade attention (shared_prefix_tiles_bf16): decode rows of
 * several calls whose page tables begin with the same pages (forks of one cached
 * document) are one block's query vectors over those pages, every one seeing all of
 * them; each vector's part of the softmax (the sum of V by e^(score - best), best, the
 * total) goes to paged_attention.c, which adds each row's own entries to it.
 *
 * Without AMX (or with the tiles turned off) on a CPU with AVX-512 bf16 dot products
 * the same blocks are computed by VDPBF16PS and float32 multiply-adds: a page's K
 * transposed into pairs of dims as for the tiles, each pair loaded once for up to 16
 * vectors (each with its pair of q broadcast); the probabilities stay float32 (no
 * three-part split) and each vector's weighted sum of V is float32 multiply-adds in
 * entry order, V widened as read. The row kernel reads each entry once for a row's
 * query heads; the blocks read it once for 16 vectors, which pays from chunks of 4
 * rows (predd.kernels.library.BLOCK_LIMITS).
 *
 * Each page's K is asked for (prefetch.h) while the page before it is scored, and each
 * entry's V one page ahead of the entry being summed: pages lie anywhere in the pool.
 * Without that the blocks waited on memory at every page (measured: docs/kernels.md,
 * "Prefetching attention's next page").
 *
 * Built with the other kernels (predd/kernels/cpu_kernels.py); AMX tiles from quant_tiles.c
 * (amx.h). Returns -1 without computing anything where neither tiles nor bf16 dot
 * products are there (or attention_tiles_bf16(0) turned the blocks off), the shape is
 * not one this handles (page_size 16, head_dim a multiple of 64), or memory is short:
 * the caller then takes paged_attention.c for these rows.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "exp_approx.h"
#include "lanes.h"
#include "prefetch.h"

/* The arguments: as paged_attention.c's, with the calls instead of the rows: call c's
 * rows are rows call_row[c] .. call_row[c] + call_rows[c] - 1 of row_token / row_pages /
 * row_visible (its tokens, consecutive in q and out; row_visible rising by one a row). */
#define TILE_ARGS const void *q, int64_t q_stride, void *out, const void *kv,              \
    int64_t page_size, int64_t kv_heads, int64_t heads, int64_t head_dim,                   \
    const int32_t *indices, const int64_t *row_token, const int64_t *row_pages,           \
    const int64_t *row_visible, const int64_t *call_row, const int64_t *call_rows,        \
    int64_t calls, int64_t max_visible, float scale

/* shared_prefix_tiles_bf16's: the first group_pages[g] pages of group g's rows (rows
 * group_index[group_row[g] ...], group_rows[g] of them, of row_token / row_pages) are
 * the same pages, and each row sees all of them. */
#define SHARED_ARGS const void *q, int64_t q_stride, const void *kv, int64_t page_size,    \
    int64_t kv_heads, int64_t heads, int64_t head_dim, const int32_t *indices,             \
    const int64_t *row_token, const int64_t *row_pages, const int64_t *group_index,       \
    const int64_t *group_row, const int64_t *group_rows, const int64_t *group_pages,      \
    int64_t groups, float scale, float *prior

#if defined(__AVX512BF16__)
#define PAGE 16
#define ENTRY_STEP 32      /* entries per tile product of the weighted sum: two pages */

static int blocks_off;     /* attention_tiles_bf16(0): the row kernel only */

/* bt[i * 16 + e] = the i-th pair of dims (2i, 2i + 1 from `k`) of entry e, e < n; 0 for
 * e >= n. k: the page's first entry at this kv head, `stride` uint32 to the next. */
static inline void k_pairs(uint32_t *bt, const uint32_t *k, int64_t stride, int64_t n)
{
    transpose16_u32(bt, k, stride, n);
}

#if defined(AMX)
/* vb[b * 256 + i * 16 + j] (uint32) = dims d0 + 16b + j of entries 2i and 2i + 1 of the
 * 32 entries from `first` (bf16 pairs), b < blocks; entries at or past `valid` are 0.
 * entry(e): its V at this kv head. */
static inline void v_pairs(uint32_t *vb, const uint16_t *const *entry, int64_t valid,
                           int64_t d0, int blocks)
{
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                         25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                         18, 2, 17, 1, 16, 0);
    for (int i = 0; i < 16; i++) {
        const uint16_t *a = 2 * i < valid ? entry[2 * i] : NULL;
        const uint16_t *b = 2 * i + 1 < valid ? entry[2 * i + 1] : NULL;
        for (int blk = 0; blk < blocks; blk++) {
            const __m256i x = a ? _mm256_loadu_si256((const __m256i *)(a + d0 + 16 * blk))
                                : _mm256_setzero_si256();
            const __m256i y = b ? _mm256_loadu_si256((const __m256i *)(b + d0 + 16 * blk))
                                : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
            _mm512_store_si512(vb + blk * 256 + i * 16, _mm512_permutexvar_epi16(mix, both));
        }
    }
}
#endif


struct scratch {
    float *s;          /* [16][width] scores, then probabilities */
    uint16_t *hi, *mid, *lo;   /* [16][width] the probabilities' three bf16 parts */
    uint16_t *qa;      /* [16][D] the block's query vectors */
    float *o;          /* [16][64] weighted sums of one half of D */
    uint32_t *bt;      /* [D / 2][16] a page's K in pairs of dims */
    uint32_t *vb;      /* [4][16][16] 32 entries' V in pairs of entries */
    const uint16_t **entry;  /* [32] */
};

/* One task's work: up to 16 query vectors (w->qa, zero past `count`) of kv head h, all
 * reading one page table, vector i seeing its first visible[i] entries (the last vector
 * the most). Where each vector's result goes, dst[i]: `raw` 0, its D outputs (bf16, the
 * weighted sum over its probabilities' total, rounded once); `raw` 1, D + 2 float32: the
 * weighted sum of V by e^(score - best), then best and the total of those weights (a
 * prefix's part of a softmax, for paged_attention.c to finish: shared_prefix_tiles_bf16). */
struct block {
    int64_t count, h;
    int64_t visible[16];
    const int32_t *pages;
    void *dst[16];
};

/* Without AMX, a page's scores by dot products: s[i * width + j0 + e] = q_i . k_e for
 * the block's first R (a literal) vectors (w->qa, zero past its count; i < count) and
 * the page's entries (k_pairs in w->bt: D / 2 pairs of dims by 16 entries, 0 past the
 * last): each pair of dims of the 16 entries loaded once for R VDPBF16PS, each with one
 * of q's pairs broadcast */
static inline __attribute__((always_inline)) void page_scores_dots(
    const int R, int64_t D, int64_t count, float *s, int64_t width, const struct scratch *w)
{
    const uint32_t *qp = (const uint32_t *)w->qa;
    __m512 acc[16];
    for (int i = 0; i < R; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        const __m512bh kp = (__m512bh)_mm512_load_si512(w->bt + p * 16);
        for (int i = 0; i < R; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(
                                          (int)qp[i * D / 2 + p]), kp);
    }
    for (int64_t i = 0; i < R && i < count; i++)
        _mm512_storeu_ps(s + i * width, acc[i]);
}

/* Without AMX, o[i * 64 + c] = sum over the first L entries e of p_i[e] * V_e[d0 + c]
 * for R (a literal, <= 6) vectors from i0: p in float32 (w->s), V widened as read (by
 * halves of its pairs), and each vector's 64 sums in four registers, float32 fused
 * multiply-adds in entry order */
static inline __attribute__((always_inline)) void weighted_sum_dots(
    const int R, const uint16_t *pool, const int32_t *pages, int64_t page, int64_t entry,
    int64_t h, int64_t D, int64_t d0, int64_t L, int64_t i0, int64_t width,
    const struct scratch *w)
{
    __m512 acc[6][4];
    for (int i = 0; i < R; i++)
        for (int c = 0; c < 4; c++)
            acc[i][c] = _mm512_setzero_ps();
    for (int64_t e = 0; e < L; e++) {
        const uint16_t *v = pool + pages[e / PAGE] * page + PAGE * entry
                            + (e % PAGE) * entry + h * D + d0;
        if (e + PAGE < L)            /* the same entry of the next page */
            prefetch_entries(v + (pages[e / PAGE + 1] - pages[e / PAGE]) * page, 1, 0, 128);
        __m512 x[4];                  /* in bf16_widen_pairs' order, put back below */
        bf16_widen_pairs(v, &x[0], &x[1]);
        bf16_widen_pairs(v + 32, &x[2], &x[3]);
        for (int i = 0; i < R; i++) {
            const __m512 p = _mm512_set1_ps(w->s[(i0 + i) * width + e]);
            for (int c = 0; c < 4; c++)
                acc[i][c] = _mm512_fmadd_ps(p, x[c], acc[i][c]);
        }
    }
    for (int i = 0; i < R; i++) {
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(w->o + (i0 + i) * 64 + 16 * c, acc[i][c]);
        bf16_pairs_order(w->o + (i0 + i) * 64, 0);
        bf16_pairs_order(w->o + (i0 + i) * 64 + 32, 0);
    }
}

static void attend_block(const void *kv, int64_t kv_heads, int64_t head_dim, float scale,
                         int64_t width, const struct block *b, const int raw, const int tiles,
                         const struct scratch *w)
{
    const int64_t D = head_dim, h = b->h, count = b->count;
    const int64_t entry = kv_heads * D, page = 2 * PAGE * entry;   /* in values */
    const uint16_t *pool = kv;
    const int32_t *pages = b->pages;
    const int64_t L = b->visible[count - 1];       /* the block's last vector sees most */
    /* scores: a page of 16 entries at a time, 16 x 16 in tile 0 (the next page's K
     * asked for while one is read) */
    prefetch_entries(pool + pages[0] * page + h * D, L < PAGE ? L : PAGE, entry * 2, D * 2);
    for (int64_t j0 = 0; j0 < L; j0 += PAGE) {
        const int64_t n = L - j0 < PAGE ? L - j0 : PAGE;
        const uint16_t *k = pool + pages[j0 / PAGE] * page + h * D;
        if (j0 + PAGE < L)
            prefetch_entries(pool + pages[j0 / PAGE + 1] * page + h * D,
                             L - j0 - PAGE < PAGE ? L - j0 - PAGE : PAGE, entry * 2, D * 2);
        if (!tiles) {
            for (int64_t d = 0; d < D; d += 32)
                k_pairs(w->bt + d / 2 * 16, (const uint32_t *)(k + d), entry / 2, n);
            if (count > 12)
                page_scores_dots(16, D, count, w->s + j0, width, w);
            else if (count > 8)
                page_scores_dots(12, D, count, w->s + j0, width, w);
            else if (count > 4)
                page_scores_dots(8, D, count, w->s + j0, width, w);
            else
                page_scores_dots(4, D, count, w->s + j0, width, w);
            continue;
        }
#if defined(AMX)
        _tile_zero(0);
        for (int64_t d = 0; d < D; d += 32) {
            k_pairs(w->bt, (const uint32_t *)(k + d), entry / 2, n);
            _tile_loadd(4, w->qa + d, D * 2);
            _tile_loadd(6, w->bt, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, w->s + j0, width * 4);
#endif
    }
    /* the first page's V, while the softmax runs */
    prefetch_entries(pool + pages[0] * page + PAGE * entry + h * D, L < PAGE ? L : PAGE,
                     entry * 2, D * 2);
    /* softmax of each vector over what it sees, 16 entries at a time; the rest of the
     * width is 0. For the tiles the probabilities split as hi + mid + lo in bf16 (the
     * top 8 bits of each as the CPU rounds to nearest even, then the rest's, then the
     * rest's); the dot products read them as they are */
    float best[16], total[16];
    for (int64_t i = 0; i < (tiles ? 16 : count); i++) {
        const int64_t at = i * width;          /* this vector's row of s (hi, mid, lo) */
        float *row = w->s + at;
        const int64_t V = i < count ? b->visible[i] : 0;
        __m512 most = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < V; j += 16) {
            const __mmask16 in = V - j >= 16 ? 0xFFFF : (__mmask16)((1u << (V - j)) - 1);
            const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, row + j),
                                           _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(row + j, in, x);
            most = _mm512_mask_max_ps(most, in, most, x);
        }
        const float m = _mm512_reduce_max_ps(most);
        for (int64_t j = 0; j < width; j += 16) {
            const __mmask16 in = j >= V ? 0 : V - j >= 16 ? 0xFFFF
                                 : (__mmask16)((1u << (V - j)) - 1);
            const __m512 x = _mm512_maskz_mov_ps(in, exp_approx16(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(in, row + j), _mm512_set1_ps(m))));
            sum = _mm512_add_ps(sum, x);
            if (!tiles) {
                _mm512_storeu_ps(row + j, x);
                continue;
            }
            const __m256bh h = _mm512_cvtneps_pbh(x);
            const __m512 r = _mm512_sub_ps(x, _mm512_cvtpbh_ps(h));
            const __m256bh md = _mm512_cvtneps_pbh(r);
            const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(r, _mm512_cvtpbh_ps(md)));
            _mm256_store_si256((__m256i *)(w->hi + at + j), (__m256i)h);
            _mm256_store_si256((__m256i *)(w->mid + at + j), (__m256i)md);
            _mm256_store_si256((__m256i *)(w->lo + at + j), (__m256i)l);
        }
        best[i] = m;
        total[i] = _mm512_reduce_add_ps(sum);
    }
    /* the weighted sum of V, 64 dims at a time (in tiles 0..3, 32 entries a product) */
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        if (!tiles) {
            for (int64_t i0 = 0; i0 < count; i0 += 6)
                switch (count - i0 < 6 ? count - i0 : 6) {
#define SUMS(R) case R: \
                    weighted_sum_dots(R, pool, pages, page, entry, h, D, d0, L, i0, width, w); \
                    break;
                SUMS(1) SUMS(2) SUMS(3) SUMS(4) SUMS(5) SUMS(6)
#undef SUMS
                }
        }
#if defined(AMX)
        else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t j0 = 0; j0 < L; j0 += ENTRY_STEP) {
                for (int e = 0; e < ENTRY_STEP && j0 + e < L; e++)
                    w->entry[e] = pool + pages[(j0 + e) / PAGE] * page + PAGE * entry
                                  + ((j0 + e) % PAGE) * entry + h * D;
                v_pairs(w->vb, w->entry, L - j0, d0, 4);
                _tile_loadd(4, w->hi + j0, width * 2);
                _tile_loadd(5, w->mid + j0, width * 2);
                _tile_loadd(7, w->lo + j0, width * 2);
#define PRODUCT(t) _tile_loadd(6, w->vb + t * 256, 64); _tile_dpbf16ps(t, 4, 6); \
                _tile_dpbf16ps(t, 5, 6); _tile_dpbf16ps(t, 7, 6);
                PRODUCT(0) PRODUCT(1) PRODUCT(2) PRODUCT(3)
#undef PRODUCT
            }
            _tile_stored(0, w->o, 256);
            _tile_stored(1, w->o + 16, 256);
            _tile_stored(2, w->o + 32, 256);
            _tile_stored(3, w->o + 48, 256);
        }
#endif
        for (int64_t i = 0; i < count; i++) {
            if (raw) {
                memcpy((float *)b->dst[i] + d0, w->o + i * 64, sizeof(float) * 64);
                continue;
            }
            uint16_t *dst = (uint16_t *)b->dst[i] + d0;
            const float inv = 1.0f / total[i];
            for (int64_t d = 0; d < 64; d++)
                dst[d] = bf16_narrow(w->o[i * 64 + d] * inv);
        }
    }
    if (raw)
        for (int64_t i = 0; i < count; i++) {
            ((float *)b->dst[i])[D] = best[i];
            ((float *)b->dst[i])[D + 1] = total[i];
        }
}

/* What a driver's tasks are: `tasks` of them, seeing at most `most` entries; `fill` sets
 * task t's block (and its query vectors in w->qa). */
struct job {
    int64_t tasks, most, kv_heads, head_dim;
    const void *kv;
    float scale;
    int raw;
    void (*fill)(const void *args, int64_t t, struct block *b, uint16_t *qa);
    const void *args;
};

/* Runs a job's tasks on the threads, each with its scratch (and tiles, where AMX runs).
 * -1 where memory is short (nothing done for sure). */
static int run_job(const struct job *j)
{
    const int64_t D = j->head_dim;
    const int64_t width = (j->most + ENTRY_STEP - 1) / ENTRY_STEP * ENTRY_STEP;
    int failed = 0;
#if defined(AMX)
    const int tiles = amx_ready();
#else
    const int tiles = 0;
#endif
    #pragma omp parallel
    {
        struct scratch w;
        w.s = aligned_alloc(64, sizeof(float) * 16 * width);
        /* the probabilities' bf16 parts and V in pairs: the tiles' alone */
        w.hi = tiles ? aligned_alloc(64, 2 * 16 * width) : NULL;
        w.mid = tiles ? aligned_alloc(64, 2 * 16 * width) : NULL;
        w.lo = tiles ? aligned_alloc(64, 2 * 16 * width) : NULL;
        w.qa = aligned_alloc(64, 2 * 16 * D);
        w.o = aligned_alloc(64, sizeof(float) * 16 * 64);
        w.bt = aligned_alloc(64, 4 * 16 * (D / 2 > 16 ? D / 2 : 16));
        w.vb = tiles ? aligned_alloc(64, 4 * 4 * 256) : NULL;
        w.entry = tiles ? malloc(sizeof(*w.entry) * ENTRY_STEP) : NULL;
        const int ok = w.s && w.qa && w.o && w.bt
                       && (!tiles || (w.hi && w.mid && w.lo && w.vb && w.entry));
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed) {
#if defined(AMX)
            if (tiles)
                amx_configure();
#endif
            #pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < j->tasks; t++) {
                struct block b;
                j->fill(j->args, t, &b, w.qa);
                attend_block(j->kv, j->kv_heads, D, j->scale, width, &b, j->raw, tiles, &w);
            }
#if defined(AMX)
            if (tiles)
                _tile_release();
#endif
        }
        free(w.s); free(w.hi); free(w.mid); free(w.lo); free(w.qa); free(w.o); free(w.bt); free(w.vb);
        free(w.entry);
    }
    return failed ? -1 : 0;
}

/* Task t of a set of groups, each `blocks[g]` blocks for each kv head: first[g] is its
 * first task. Sets *g, *h (kv head) and *b (block). */
static inline void task_of(const int64_t *first, const int64_t *blocks, int64_t t,
                           int64_t *g, int64_t *h, int64_t *b)
{
    int64_t c = 0;
    while (first[c + 1] <= t)
        c++;
    *g = c;
    *h = (t - first[c]) / blocks[c];
    *b = (t - first[c]) % blocks[c];
}

/* Block b of `blocks` over n query vectors: the first *m0 and *count of them, the blocks
 * as near equal as can be (16 at most: 24 vectors are 12 + 12, not 16 + 8, so that the
 * threads' tasks are even) */
static inline void block_span(int64_t n, int64_t blocks, int64_t b, int64_t *m0,
                              int64_t *count)
{
    *m0 = n * b / blocks;
    *count = n * (b + 1) / blocks - *m0;
}

/* a block's query vectors m0 .. m0 + count - 1 of rows x query heads (m = row * G + the
 * head of kv head h): q_of(m) is each one's D values; zero past count */
static inline void fill_q(uint16_t *qa, int64_t count, int64_t D, const uint16_t *const *q_of)
{
    for (int64_t i = 0; i < 16; i++) {
        if (i < count)
            memcpy(qa + i * D, q_of[i], (size_t)D * 2);
        else
            memset(qa + i * D, 0, (size_t)D * 2);
    }
}

struct chunks {
    const uint16_t *q;
    uint16_t *out;
    int64_t q_stride, heads, G, D;
    const int32_t *indices;
    const int64_t *row_token, *row_pages, *row_visible, *call_row, *call_rows;
    const int64_t *first, *blocks;
};

static void fill_chunk(const void *args, int64_t t, struct block *blk, uint16_t *qa)
{
    const struct chunks *a = args;
    int64_t c, h, b;
    task_of(a->first, a->blocks, t, &c, &h, &b);
    const int64_t G = a->G, D = a->D, r0 = a->call_row[c];
    int64_t m0, count;
    block_span(a->call_rows[c] * G, a->blocks[c], b, &m0, &count);
    const uint16_t *q_of[16];
    blk->count = count;
    blk->h = h;
    blk->pages = a->indices + a->row_pages[r0];
    for (int64_t i = 0; i < count; i++) {
        const int64_t m = m0 + i, r = r0 + m / G, head = h * G + m % G;
        blk->visible[i] = a->row_visible[r];
        q_of[i] = a->q + a->row_token[r] * a->q_stride + head * D;
        blk->dst[i] = a->out + (a->row_token[r] * a->heads + head) * D;
    }
    fill_q(qa, count, D, q_of);
}

/* the tasks of `n` groups of `rows[g]` rows each: kv_heads x blocks of 16 vectors a
 * group (first[n + 1], blocks[n]); 0, or -1 where memory is short */
static int count_tasks(int64_t n, const int64_t *rows, int64_t kv_heads, int64_t G,
                       int64_t **first, int64_t **blocks)
{
    *first = malloc(sizeof(int64_t) * (n + 1));
    *blocks = malloc(sizeof(int64_t) * (n ? n : 1));
    if (!*first || !*blocks) {
        free(*first);
        free(*blocks);
        return -1;
    }
    int64_t tasks = 0;
    for (int64_t g = 0; g < n; g++) {
        (*blocks)[g] = (rows[g] * G + 15) / 16;
        (*first)[g] = tasks;
        tasks += kv_heads * (*blocks)[g];
    }
    (*first)[n] = tasks;
    return 0;
}

/* 2 where the blocks run on AMX tiles, 1 where by dot products, 0 where not at all (none
 * here, or turned off); `use` 0 or 1 turns them off or on for this process, -1 asks */
int attention_tiles_bf16(int use)
{
    if (use >= 0)
        blocks_off = !use;
    if (blocks_off)
        return 0;
#if defined(AMX)
    if (amx_ready())
        return 2;
#endif
    return 1;
}

int paged_attention_tiles_bf16(TILE_ARGS)
{
    if (page_size != PAGE || head_dim % 64 != 0 || heads % kv_heads != 0
            || !attention_tiles_bf16(-1))
        return -1;
    const int64_t G = heads / kv_heads;
    int64_t *first, *blocks;
    if (count_tasks(calls, call_rows, kv_heads, G, &first, &blocks) != 0)
        return -1;
    const struct chunks a = {q, out, q_stride, heads, G, head_dim, indices, row_token,
                             row_pages, row_visible, call_row, call_rows, first, blocks};
    const struct job j = {first[calls], max_visible, kv_heads, head_dim, kv, scale, 0,
                          fill_chunk, &a};
    const int status = run_job(&j);
    free(first);
    free(blocks);
    return status;
}

struct prefix_job {
    const uint16_t *q;
    float *prior;
    int64_t q_stride, heads, G, D;
    const int32_t *indices;
    const int64_t *row_token, *row_pages, *group_index, *group_row, *group_rows, *group_pages;
    const int64_t *first, *blocks;
};

static void fill_prefix(const void *args, int64_t t, struct block *blk, uint16_t *qa)
{
    const struct prefix_job *a = args;
    int64_t g, h, b;
    task_of(a->first, a->blocks, t, &g, &h, &b);
    const int64_t G = a->G, D = a->D;
    const int64_t *rows = a->group_index + a->group_row[g];
    int64_t m0, count;
    block_span(a->group_rows[g] * G, a->blocks[g], b, &m0, &count);
    const uint16_t *q_of[16];
    blk->count = count;
    blk->h = h;
    blk->pages = a->indices + a->row_pages[rows[0]];
    for (int64_t i = 0; i < count; i++) {
        const int64_t m = m0 + i, r = rows[m / G], head = h * G + m % G;
        blk->visible[i] = a->group_pages[g] * PAGE;
        q_of[i] = a->q + a->row_token[r] * a->q_stride + head * D;
        blk->dst[i] = a->prior + (r * a->heads + head) * (D + 2);
    }
    fill_q(qa, count, D, q_of);
}

int shared_prefix_tiles_bf16(SHARED_ARGS)
{
    if (page_size != PAGE || head_dim % 64 != 0 || heads % kv_heads != 0
            || !attention_tiles_bf16(-1))
        return -1;
    const int64_t G = heads / kv_heads;
    int64_t *first, *blocks, most = 0;
    if (count_tasks(groups, group_rows, kv_heads, G, &first, &blocks) != 0)
        return -1;
    for (int64_t g = 0; g < groups; g++)
        most = group_pages[g] > most ? group_pages[g] : most;
    const struct prefix_job a = {q, prior, q_stride, heads, G, head_dim, indices, row_token,
                               row_pages, group_index, group_row, group_rows, group_pages,
                               first, blocks};
    const struct job j = {first[groups], most * PAGE, kv_heads, head_dim, kv, scale, 1,
                          fill_prefix, &a};
    const int status = run_job(&j);
    free(first);
    free(blocks);
    return status;
}
#else
int attention_tiles_bf16(int use)
{
    (void)use;
    return 0;
}

int paged_attention_tiles_bf16(TILE_ARGS)
{
    (void)q; (void)q_stride; (void)out; (void)kv; (void)page_size; (void)kv_heads;
    (void)heads; (void)head_dim; (void)indices; (void)row_token; (void)row_pages;
    (void)row_visible; (void)call_row; (void)call_rows; (void)calls; (void)max_visible;
    (void)scale;
    return -1;
}

int shared_prefix_tiles_bf16(SHARED_ARGS)
{
    (void)q; (void)q_stride; (void)kv; (void)page_size; (void)kv_heads; (void)heads;
    (void)head_dim; (void)indices; (void)row_token; (void)row_pages; (void)group_index;
    (void)group_row; (void)group_rows; (void)group_pages; (void)groups; (void)scale;
    (void)prior;
    return -1;
}
#endif
